"""python -m harness [overrides]: measure a drafter against plain decoding and prompt lookup.

    python -m harness                                   # conf/eval/quick.yaml, the model's drafter_dir
    python -m harness eval=full eval.drafter=PATH
    python -m harness eval.limit=2 eval.temperature=0.7 eval.methods=[plain,dflash]
    python -m harness eval.turns=single                 # MT-Bench first turns only (default all: both turns)
    python -m harness eval.methods=[plain,dflash,dflash_tree] eval.tree_size=15   # tree verification (greedy)
    python -m harness eval.methods=[plain,prompt_lookup,dflash_lookup] eval.lookup_ngram=2   # DFlash + lookup rounds
    python -m harness eval.methods=[plain,dflash_datastore] eval.datastore=runs/x/features   # + the training responses
Writes report.json, report.md and runs.jsonl (one line per prompt turn, as it goes) into eval.out_dir, with
acceptance.png and training.png (from eval.metrics, the trainer's metrics.jsonl) next to report.md.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from entry import register_configs, typed_config
from flashdraft.config import Config, EvalConfig, thinking_setting
from flashdraft.modelcard import CARD_FILE, SERVED_EVAL, set_card_section
from flashdraft.store import StoreReader, is_store
from flashdraft.target import (
    exact_gemm_rows,
    frozen_head_from_model,
    load_target,
    make_verification_exact,
    resolve_dtype,
    resolve_exact,
    resolved_thinking,
    stop_token_ids,
    target_fingerprint,
)
from flashdraft.vocab import frequent_tokens
from harness.datastore import Datastore
from harness.drafter import DrafterProposer, load_drafter, loop_block_size, thinking_warning
from harness.evaluate import (
    UNTRAINED_WARNING,
    build_prompts,
    environment,
    evaluate,
    finished_records,
    next_turn,
    thinking_modes,
)
from harness.methods import CHAIN, DRAFTER_METHODS, METHODS, TREE, DecodeSettings, build_policies, methods_asked
from harness.pictures import acceptance_lengths_by_source, plot_acceptance, plot_training
from harness.policies import ChainPolicy, TreePolicy
from harness.replay import replay_tau
from harness.report import TIMING_NOTE, card_eval_text, console_summary, write_report
from harness.summary import summarize
from harness.training_log import read_metrics, train_serve_parity


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class Bench:
    """What an eval runs on: the target (made exact where needed), the drafter, the prompts and the policies."""

    target: object
    tokenizer: object
    prompts: list
    settings: DecodeSettings
    policies: dict
    proposer: DrafterProposer | None = None
    untrained: bool = False
    loaded_target: object = None
    facts: dict | None = None  # what the build found, for the report: drafter, datastore, draft vocabulary


def load_targets(model, config: EvalConfig, device, trust_remote_code: bool, exact: bool):
    """(the target, made exact where `exact`; its tokenizer; the target as loaded, for plain_as_loaded, or None)."""
    dtype = resolve_dtype(model.dtype, device)
    target, tokenizer = load_target(model.target, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    loaded_target = None
    if exact:
        if any(METHODS[m].as_loaded for m in config.methods):  # a second copy, left as loaded, as a user runs it
            loaded_target = load_target(model.target, dtype=dtype, device=device, trust_remote_code=trust_remote_code)[
                0
            ]
        make_verification_exact(target)
    return target, tokenizer, loaded_target


def exact_mode(cfg: Config, config: EvalConfig) -> tuple[EvalConfig, dict]:
    """(the eval config as it runs, the report's `exact` entry): eval.exact resolved for this device and dtype; with
    exact verification off, plain already runs the target as loaded, so plain_as_loaded is left out."""
    device = resolve_device(cfg.device)
    exact, why = resolve_exact(
        config.exact, resolve_dtype(cfg.model.dtype, device), device, greedy=config.temperature == 0
    )
    loaded = [m for m in config.methods if METHODS[m].as_loaded]
    if not exact and loaded:
        print(f"exact verification off: {', '.join(loaded)} left out (plain runs the target as loaded already)")
        config = replace(config, methods=[m for m in config.methods if m not in loaded])
    return config, {"setting": config.exact, "on": exact, "why": why}


def with_draft_vocab(proposer, config: EvalConfig, prompts, vocab_size: int):
    """(proposer, report entry): the proposer scoring only the eval.draft_vocab most frequent response tokens of
    eval.draft_vocab_store (the eval prompts' own sequences left out), or as it is without a store to count them in."""
    k, store = config.draft_vocab, config.draft_vocab_store
    if proposer is None or not k:
        return proposer, None
    if not (store and is_store(store)):
        print(
            f"draft vocabulary: no feature store at {str(store)!r} (eval.draft_vocab_store) to count it in: drafts "
            "score all words (eval.draft_vocab=0 says so quietly)",
            file=sys.stderr,
        )
        return proposer, None
    sequences = StoreReader(store).token_sequences(skip=[p.seq_id for p in prompts])  # never their own responses
    words = frequent_tokens(sequences, min(k, vocab_size), vocab_size)
    print(
        f"draft vocabulary: the {len(words):,} most frequent response tokens of {store} "
        "(eval prompts' sequences left out)"
    )
    return DrafterProposer(proposer.drafter, proposer.head, draft_vocab=words), {
        "words": len(words),
        "store": str(store),
    }


def load_datastore(config: EvalConfig, prompts):
    """(datastore, report entry) for the methods that need one (greedy only), or (None, None)."""
    if not any(METHODS[m].datastore for m in config.methods) or config.temperature > 0:
        return None, None
    datastore = Datastore.from_store(
        config.datastore,
        exclude=[p.seq_id for p in prompts],  # never their own responses
        ngram=config.datastore_ngram,
        min_ngram=config.datastore_min_ngram,
        min_count=config.datastore_min_count,
    )
    info = {
        "store": str(config.datastore),
        "sequences": datastore.sequences,
        "tokens": datastore.tokens,
        "ngrams": len(datastore),
        "excluded_eval_sequences": datastore.excluded,
    }
    print(
        f"datastore: {len(datastore):,} {config.datastore_min_ngram}- to {config.datastore_ngram}-grams with a "
        f"continuation from {datastore.sequences:,} responses ({datastore.tokens:,} tokens) of {config.datastore}; "
        f"{datastore.excluded} eval prompts' sequences left out"
    )
    return datastore, info


def build(cfg: Config, exact: dict) -> Bench:
    """Target, drafter, prompts, draft vocabulary, datastore, and the policies of the methods asked for."""
    config = cfg.eval
    device = resolve_device(cfg.device)
    target, tokenizer, loaded_target = load_targets(cfg.model, config, device, cfg.trust_remote_code, exact=exact["on"])
    proposer, untrained, block_size, drafter_name = None, False, 1, None
    if any(m in DRAFTER_METHODS for m in config.methods):
        drafter, untrained = load_drafter(
            config.drafter, target, tokenizer, cfg.drafter, allow_untrained=config.allow_untrained, seed=cfg.seed
        )
        proposer = DrafterProposer(drafter, frozen_head_from_model(target))
        where = "the untrained drafter (drafter.block_size)" if untrained else f"the drafter at {config.drafter}"
        block_size = loop_block_size(config.block_size, drafter, where)
        drafter_name = "UNTRAINED (random init)" if untrained else str(config.drafter)
        if untrained:
            print(f"\n{'!' * 100}\n!!! {UNTRAINED_WARNING}\n{'!' * 100}\n", file=sys.stderr, flush=True)
    chat = cfg.model.chat
    modes = thinking_modes(
        thinking_setting(config.thinking, "eval.thinking", ("on", "off", "both")), chat.enable_thinking
    )
    # the chat default (None) compared as the mode it renders in: Qwen3's template's default is thinking on
    resolved_modes = [resolved_thinking(tokenizer, m) for m in modes]
    thinking_note = thinking_warning(drafter.config, resolved_modes) if proposer and not untrained else None
    if thinking_note:
        print(f"warning: {thinking_note}", file=sys.stderr, flush=True)
    prompts = build_prompts(
        tokenizer,
        config.prompts,
        split=config.split,
        limit=config.limit,
        system_prompt=chat.system_prompt,
        enable_thinking=chat.enable_thinking,
        turns=config.turns,
        modes=modes,
    )
    proposer, vocab_info = with_draft_vocab(proposer, config, prompts, target.config.vocab_size)
    datastore, datastore_info = load_datastore(config, prompts)
    settings = DecodeSettings.from_eval(config, block_size)
    facts = {
        "drafter": drafter_name,
        "untrained_drafter": untrained,
        "drafter_layer_ids": proposer and proposer.layer_ids,
        "datastore": datastore_info,
        "draft_vocab": vocab_info,
        "exact": exact,
        "thinking_warning": thinking_note,
    }
    policies = build_policies(config.methods, settings, proposer, datastore)
    return Bench(target, tokenizer, prompts, settings, policies, proposer, untrained, loaded_target, facts)


def run_key(
    settings: DecodeSettings,
    methods,
    drafter_name,
    drafter_dir,
    fingerprint: dict,
    dtype,
    device,
    datastore=None,
    draft_vocab=None,
    verification=None,
) -> str:
    """What a finished prompt's measurement depends on: an interrupted eval resumes only under the same key
    (`verification`: how the target was made exact, which sets every method's timing)."""
    weights = Path(drafter_dir, "model.safetensors") if drafter_dir else None
    identity = {
        "settings": asdict(settings),
        "methods": list(methods),
        "drafter": drafter_name,
        "drafter_weights": [weights.stat().st_size, weights.stat().st_mtime_ns]
        if weights and weights.is_file()
        else None,
        "target": fingerprint,
        "dtype": str(dtype),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "datastore": datastore,
        "draft_vocab": draft_vocab,
        "verification": verification,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def measure(bench: Bench, config: EvalConfig, model_target: str) -> tuple[list[dict], dict]:
    """Every method on every prompt, resuming an interrupted run with the same key; (records, run facts)."""
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "runs.jsonl"
    target = bench.target
    facts = {
        "target": str(model_target),
        "target_fingerprint": target_fingerprint(model_target),
        "device": str(bench.target.device),
        "dtype": str(bench.target.dtype).removeprefix("torch."),
        "attention": target.config._attn_implementation,
        "exact_gemm_rows": exact_gemm_rows(target),
    }
    key = run_key(
        bench.settings,
        config.methods,
        bench.facts["drafter"],
        config.drafter if bench.proposer and not bench.untrained else None,
        facts["target_fingerprint"],
        bench.target.dtype,
        bench.target.device,
        bench.facts["datastore"],
        bench.facts["draft_vocab"],
        {"attention": facts["attention"], "gemm_rows": facts["exact_gemm_rows"]},
    )
    turns = {p.key: 1 + len(p.followups) for p in bench.prompts}  # eval.turns=single: no followups
    done = {}
    if config.resume:
        done = finished_records(log_path, key, turns)
        if done:
            print(
                f"resuming: {len(done)} of {sum(turns.values())} prompt turns were finished by an interrupted run "
                f"with the same settings ({log_path}; eval.resume=false starts over)"
            )
    else:
        log_path.unlink(missing_ok=True)
    stops = stop_token_ids(target, bench.tokenizer)
    records = evaluate(
        target,
        bench.prompts,
        bench.settings,
        bench.policies,
        stop_token_ids=stops,
        log_path=log_path,
        warmup=config.warmup,
        done=done,
        run_key=key,
        loaded_target=bench.loaded_target,
        follow=partial(next_turn, bench.tokenizer, stop_token_ids=stops),
    )
    return records, {**facts, "resumed_prompts": len(done)}


def replay(bench: Bench, config: EvalConfig) -> dict | None:
    """Served-order replay of the chain (and of the tree, where dflash_tree ran) on eval.replay_store, for parity."""
    store, proposer, s = config.replay_store, bench.proposer, bench.settings
    if proposer is None or bench.untrained or s.temperature > 0 or not (store and is_store(store)):
        return None
    seq_ids = list(dict.fromkeys(p.seq_id for p in bench.prompts))  # a record evaluated in two modes: once
    result = replay_tau(ChainPolicy(proposer, cutoff=s.draft_cutoff), store, seq_ids, max_new_tokens=s.max_new_tokens)
    if TREE in bench.policies and result:
        tree = replay_tau(
            TreePolicy(proposer, s.tree_size, s.tree_branching), store, seq_ids, max_new_tokens=s.max_new_tokens
        )
        result["tree_tau"] = tree["tau"] if tree else None
    return result


def add_pictures_and_parity(
    report: dict, records: list[dict], out_dir: Path, metrics_path, block_size: int, replayed: dict | None = None
) -> None:
    """Draws acceptance.png and training.png into out_dir, and sets report["pictures"] (their names, for
    report.md) and report["train_serve_parity"] (None without trainer metrics or a trained drafter)."""
    settings = report["settings"]
    served_tau = None if settings["untrained_drafter"] else report["methods"].get(CHAIN, {}).get("tau")
    rows = read_metrics(metrics_path) if metrics_path else None
    pictures = {}
    for name in ("acceptance", "training"):
        (out_dir / f"{name}.png").unlink(missing_ok=True)  # never leave an earlier run's picture next to this report
    try:  # a plotting failure must not cost the report of a long eval
        if plot_acceptance(acceptance_lengths_by_source(records), block_size, out_dir / "acceptance.png"):
            pictures["acceptance"] = "acceptance.png"
        if rows is None:
            print(f"training.png skipped: no trainer metrics at {metrics_path} (eval.metrics)")
        elif plot_training(rows, out_dir / "training.png", served_tau=served_tau):
            pictures["training"] = "training.png"
        else:
            print(f"training.png skipped: {metrics_path} has no train or eval rows")
    except Exception as error:
        print(f"pictures incomplete ({', '.join(pictures) or 'none'} drawn): {error!r}", file=sys.stderr)
    parity = train_serve_parity(rows, served_tau, draft_cutoff=settings["draft_cutoff"], replay=replayed)
    if parity:
        parity["metrics"] = str(metrics_path)
        if (replayed or {}).get("tree_tau"):  # the tree method: its replay next to its served tau
            parity["replay_tree_tau"] = replayed["tree_tau"]
            parity["served_tree_tau"] = report["methods"][TREE]["tau"]
    report["pictures"], report["train_serve_parity"] = pictures, parity


def make_report(bench: Bench, config: EvalConfig, records: list[dict], run_facts: dict) -> dict:
    """The settings (the eval config as run, the decode settings, what the build and the run found), the
    per-method summaries and the prompts with the first method's text."""
    counts = {}
    for p in bench.prompts:
        counts[p.source] = counts.get(p.source, 0) + 1
    settings = {
        **asdict(config),
        **asdict(bench.settings),
        **bench.facts,
        **run_facts,
        "prompt_sources": list(counts),
        "prompt_counts": counts,
        "timing": TIMING_NOTE,
        **environment(),
    }
    report = {
        "settings": settings,
        "methods": summarize(
            records,
            config.methods,
            greedy=config.temperature == 0,
            block_size=bench.settings.block_size,
            exact=bench.facts["exact"]["on"],
        ),
        "prompts": [
            {
                "source": r["source"],
                "record_id": r["record_id"],
                "turn": r.get("turn", 1),
                "prompt_tokens": r["prompt_tokens"],
                **{f"{k}_new_tokens": len(v["tokens"]) for k, v in r["methods"].items()},
                "text": bench.tokenizer.decode(next(iter(r["methods"].values()))["tokens"]),
            }
            for r in records
        ],
    }
    if bench.untrained:
        report["warning"] = UNTRAINED_WARNING
    return report


def run(cfg: Config) -> dict:
    """Build (target, drafter, prompts, policies) -> evaluate every method -> report (json, markdown, pictures)."""
    cfg = replace(cfg, eval=replace(cfg.eval, methods=methods_asked(cfg.eval.methods)))
    eval_settings, exact = exact_mode(cfg, cfg.eval)
    cfg = replace(cfg, eval=eval_settings)
    config = cfg.eval
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    print(f"exact verification: {'on' if exact['on'] else 'off'} ({exact['why']})")
    bench = build(cfg, exact)
    records, run_facts = measure(bench, config, cfg.model.target)
    report = make_report(bench, config, records, run_facts)
    out_dir = Path(config.out_dir)
    add_pictures_and_parity(report, records, out_dir, config.metrics, bench.settings.block_size, replay(bench, config))
    json_path, md_path = write_report(report, out_dir)
    print(console_summary(report))
    print(f"\nwrote {json_path} and {md_path}" + "".join(f", {out_dir / p}" for p in report["pictures"].values()))
    write_card_eval(bench, config, report)
    return report


def write_card_eval(bench: Bench, config: EvalConfig, report: dict) -> None:
    """The results table into the evaluated drafter's model card (its README.md's served section, the rest kept),
    where the drafter is a trained folder that has a card."""
    if bench.proposer is None or bench.untrained or not config.drafter:
        return
    if set_card_section(config.drafter, SERVED_EVAL, card_eval_text(report)):
        print(f"wrote the results into {Path(config.drafter) / CARD_FILE}")


register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        config = typed_config(cfg)  # once, here: the harness gets typed settings (their ranges checked)
    except ValueError as e:  # a bad setting: its key and range, without a traceback
        raise SystemExit(f"error: {e}") from None
    run(config)


if __name__ == "__main__":
    main()
