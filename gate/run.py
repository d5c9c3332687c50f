"""The gate from start to verdict: check, capture, train, serve in each engine, compare their rounds, write
gate.json."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from flashdraft.config import Config
from gate.config import check_engines, check_target
from gate.engines import SERVERS, load_serving_target
from gate.folder import claim_out_dir
from gate.leg import Leg
from gate.parity import anchored_llamacpp, log_unequal, rounds_against_harness
from gate.plants import served_drafter
from gate.stages import capture, train_drafter
from gate.verdict import describe_round, first_short_round


def engine_report(leg: Leg, prompts, responses, block: int, need: float) -> dict:
    """One engine's entry in gate.json: its tau against the gate's need, its rounds and its first short round."""
    return {
        "tau": leg.tau,
        "passed": leg.tau >= need,
        "rounds": leg.rounds,
        "first_short_round": first_short_round(leg, prompts, block, need),
        "outputs_equal_captured": sum(o == r for o, r in zip(leg.outputs, responses)),
        "seconds": leg.seconds,
    }


def serve_engines(engines, cfg: Config, target, tokenizer, served: Path, pairs, stop, extra: dict, log):
    """Each engine's Leg over the captured prompts and its entry in gate.json, logged as it is served."""
    g, block = cfg.gate, cfg.drafter.block_size
    need = g.threshold * block
    prompts, responses = [p for p, _ in pairs], [r for _, r in pairs]
    legs, entries = {}, {}
    for engine in engines:
        leg = SERVERS[engine](
            target, served, prompts, g.max_new_tokens, stop, **(extra if engine == "llamacpp" else {})
        )
        legs[engine] = leg
        entry = entries[engine] = engine_report(leg, prompts, responses, block, need)
        log(
            f"{engine}: tau {leg.tau:.2f}/{block} over {sum(map(len, leg.rounds))} rounds (need {need:.2f}): "
            f"{'pass' if entry['passed'] else 'FAIL'}; outputs equal to the captured responses: "
            f"{entry['outputs_equal_captured']}/{len(prompts)}"
        )
        if entry["first_short_round"] and not entry["passed"]:
            log(describe_round(entry["first_short_round"], tokenizer))
    return legs, entries


def compare_llamacpp(legs: dict[str, Leg], served: Path, prompts, max_new_tokens: int, stop, extra, log) -> dict:
    """llama.cpp's rounds against the harness's, as served and anchored where the harness's are (gate/parity.py)."""
    parity = rounds_against_harness(legs["harness"], legs["llamacpp"])
    log(
        f"llamacpp vs harness rounds: {parity['aligned']} aligned, {parity['equal']} equal commit counts, "
        f"{parity['equal_drafts']} equal drafts (aligned by the output position of a round's first committed "
        "token, on the stretch both outputs agree)"
    )
    log_unequal(parity, log)
    anchored = anchored_llamacpp(legs["harness"], served, prompts, max_new_tokens, stop, **extra)
    if anchored["sequences"]:
        log(
            f"llamacpp vs harness rounds, llama.cpp's prompt ending with the harness's first token (its rounds "
            f"anchored where ours are): {anchored['aligned']} aligned, {anchored['equal']} equal commit counts, "
            f"{anchored['equal_drafts']} equal drafts"
            + (f"; sequences left out {anchored['left_out']}" if anchored["left_out"] else "")
        )
        log_unequal(anchored, log)
    else:
        log(f"llamacpp vs harness rounds, anchored: no sequence could be served so ({anchored['left_out']})")
    return {"llamacpp_harness_rounds": parity, "llamacpp_harness_rounds_anchored": anchored}


def compare_engines(legs: dict[str, Leg], served: Path, prompts, max_new_tokens: int, stop, extra, log) -> dict:
    """The report's comparisons between engines: harness against reference (identical rounds) and against llama.cpp
    (round parity), where both were served."""
    out = {}
    if {"harness", "reference"} <= set(legs):
        out["harness_reference_rounds_equal"] = legs["harness"].rounds == legs["reference"].rounds
        log(f"harness and reference rounds identical: {out['harness_reference_rounds_equal']}")
    if {"harness", "llamacpp"} <= set(legs):
        out.update(compare_llamacpp(legs, served, prompts, max_new_tokens, stop, extra, log))
    return out


def run_gate(cfg: Config, log=print) -> dict:
    """The whole gate on `cfg` (`gate.config.gate_config`); the report (also written to gate.json)."""
    from flashdraft.target import stop_token_ids

    g = cfg.gate
    engines = check_engines(g.engines)
    check_target(cfg)
    out = Path(g.out_dir)
    claim_out_dir(out)
    block = cfg.drafter.block_size
    log(
        f"gate: {g.sequences} sequences of {cfg.data.sources} x {g.max_new_tokens} new tokens, target "
        f"{cfg.model.target}, block {block}, {cfg.drafter.num_layers} draft layers, plant {g.plant}, engines {engines}"
    )
    pairs = capture(cfg)
    final = train_drafter(cfg)
    steps, train_tau = int(final["global_step"]), float(final["tau"])
    log(
        f"train: tau {train_tau:.2f}/{block} after {steps} steps ({final['train_s']:.0f} s; stop at "
        f"{cfg.train.stop_tau:.2f} on {g.stable_steps} steps in a row, at most {g.max_steps} steps)"
    )
    served = served_drafter(Path(cfg.drafter_dir), g.plant, out / "drafter-served")
    target, tokenizer = load_serving_target(cfg)
    stop = stop_token_ids(target, tokenizer)
    extra = {"tokenizer": tokenizer, "target_name": cfg.model.target, "gguf_dir": out / "gguf"}  # llama.cpp's leg
    legs, entries = serve_engines(engines, cfg, target, tokenizer, served, pairs, stop, extra, log)
    report = {
        "config": {"gate": asdict(g), "drafter": asdict(cfg.drafter), "target": cfg.model.target, "out_dir": str(out)},
        "train": {"steps": steps, "tau": train_tau, "seconds": final["train_s"], "stop_tau": cfg.train.stop_tau},
        "need": g.threshold * block,
        "engines": entries,
    }
    prompts = [p for p, _ in pairs]
    report.update(compare_engines(legs, served, prompts, g.max_new_tokens, stop, extra, log))
    report["passed"] = all(e["passed"] for e in entries.values())
    (out / "gate.json").write_text(json.dumps(report, indent=1))
    log(f"gate {'PASSED' if report['passed'] else 'FAILED'} ({out / 'gate.json'})")
    return report
