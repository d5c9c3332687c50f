"""The overfit gate (issue #48): a drafter trained to near-certainty on a few sequences must be served at near the
block size, in our harness, in the reference `dflash` package's loop and in llama.cpp. Nothing finds a train/serve
mismatch (a label offset, a context mask, a layer-id offset, a config key an engine reads otherwise) faster.

    make gate [ARGS="drafter.num_layers=2 gate.plant=labels+1"] [ENGINES=harness,reference,llamacpp]
    .venv/bin/python benchmarks/gate.py [hydra overrides, e.g. model=... gate.sequences=4 gate.engines=[harness]]

1. capture `gate.sequences` prompts of data.sources (the train split) with their greedy responses of
   `gate.max_new_tokens` tokens, in this process (cluster.num_actors=0), one prompt at a time, float32 by default;
2. train a drafter of the `drafter` settings on them alone, every anchor of every sequence in each step, until the
   training tau reaches `gate.train_tau` x block size (train.stop_tau) on `gate.stable_steps` steps in a row
   (train.stop_steps), at most `gate.max_steps` steps; the trainer exports it in the published format;
3. serve those prompts greedily from that folder in each engine of `gate.engines`: `harness` (our loop,
   harness/speculative.py), `reference` (`dflash.model.dflash_generate` with the package's own drafter class) and
   `llamacpp` (the folder and the target converted to f32 GGUF by llama.cpp's own converter into `gate.out_dir`/gguf,
   each prompt's tokens as text through `llama-speculative-simple --spec-type draft-dflash`, greedy; its rounds,
   drafts and committed tokens read from its debug log, benchmarks/llamacpp.py). `llamacpp` needs a cached build
   (`make llamacpp`): the gate does not build one and refuses the engine by name without it. Each engine must commit
   at least `gate.threshold` x block size tokens a round (its tau). llama.cpp's first round drafts from the prompt's
   last token and commits the first generated token (the others take it from the prefill): one round more a prompt;
   its rounds are cut at the gate's token budget as the harness's loop cuts its own.

It prints the training figures, tau per engine and, for an engine that falls short, the first round that did: the
sequence, the round, its positions, the drafted tokens against the committed ones. With harness and llamacpp both
served it sets their rounds against each other one by one (aligned by the output position of a round's first
committed token, on the stretch both outputs agree: `llamacpp.round_parity`) and prints the count of aligned rounds,
of those committing the same count and of those drafting the same tokens, with the first few that differ; then again
with llama.cpp serving each prompt with the harness's first generated token appended, so that its rounds are anchored
where ours are (`anchored_llamacpp`; as served, a near-certain drafter's llama.cpp rounds start one token before ours
throughout: docs/serving.md, "llama.cpp's rounds against ours"). Exit 0: passed; 1: failed;
2: refused (an engine or a setting it cannot run). `gate.plant` puts a known mismatch in, to see it fail:
labels+1 trains each block position on the token after its own; layers-1 serves the drafter with every target layer
id one lower than it was trained on (the embedded default still passes that one: docs/serving.md). Everything goes
to `gate.out_dir`, the report to gate.json. The gate checks the target first (its config readable, data.max_length
within its positions), then writes only into a folder it owns: a new or empty one, which it marks as its own
(`.flashdraft-gate`), or one it marked before, which it clears; any other folder is refused by name, untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from entry import compose, typed_config
from entry.ranges import check_target_lengths
from flashdraft.config import GATE_ENGINES, GATE_PLANTS, Config
from flashdraft.spec import aux_layer_ids

GATE_OVERRIDES = [  # before the user's overrides, which win
    "cluster.num_actors=0",  # capture in this process
    "model.dtype=float32",  # capture and serve alike, no near-tie flips between batch shapes
    "data.sources=[humaneval]",
    "data.batch_size=1",
    "data.store.dtype=float32",  # the features the drafter trains on are the ones it is served (bf16 storage: not)
    # every anchor of every sequence in each step: the training tau that stops training is then the tau of every
    # block the drafter will serve, not of a random few (8 anchors a sequence stopped at a lucky step's 15.72 and
    # served 13.26 on the embedded default)
    "train.num_anchors=512",
    "train.token_budget=8192",
    "train.wandb.mode=disabled",
]


class GateRefused(ValueError):
    """An engine or a setting the gate cannot run here (exit 2)."""


@dataclass
class Leg:
    """One engine's serving of the gate prompts."""

    engine: str
    rounds: list[list[int]] = field(default_factory=list)  # committed tokens a round, per sequence
    drafts: list[list[list[int]]] = field(default_factory=list)  # drafted tokens a round, per sequence
    outputs: list[list[int]] = field(default_factory=list)  # generated tokens, per sequence
    seconds: float = 0.0
    # where a sequence's first round places its block[0] (the anchor), from the first generated token: 0 where the
    # prefill gives that token (harness, reference), -1 where the first round drafts from the prompt's last (llama.cpp)
    first_anchor: int = 0

    @property
    def tau(self) -> float:
        n = sum(len(r) for r in self.rounds)
        return sum(map(sum, self.rounds)) / n if n else 0.0


def gate_config(overrides: list[str]) -> Config:
    """conf/config.yaml with the gate's defaults and `overrides`, the data and train settings the gate derives from
    `gate` filled in."""
    try:  # every numeric gate.* setting is checked with the others (entry.ranges)
        cfg = typed_config(compose([*GATE_OVERRIDES, *overrides]))
    except ValueError as e:
        raise GateRefused(str(e)) from e
    g = cfg.gate
    if g.plant is not None and g.plant not in GATE_PLANTS:
        raise GateRefused(f"gate.plant must be null or one of {list(GATE_PLANTS)}, got {g.plant!r}")
    out = Path(g.out_dir)
    cfg.features_dir = str(out / "features")
    cfg.drafter_dir = str(out / "drafter")
    cfg.data = replace(
        cfg.data, limit=g.sequences, split="train", turns="single", max_new_tokens=g.max_new_tokens, mode="regenerate"
    )
    cfg.train = replace(
        cfg.train,
        stores=[cfg.features_dir],
        eval_stores=None,
        out_dir=str(out / "train"),
        drafter_dir=cfg.drafter_dir,
        target=cfg.model.target,
        max_steps=g.max_steps,
        epochs=g.max_steps,  # one step an epoch at least: max_steps binds
        stop_tau=g.train_tau * cfg.drafter.block_size,
        stop_steps=g.stable_steps,
        heldout_fraction=0.0,
        eval_every=0,
        checkpoint_every=0,
        keep_checkpoints=1,
        resume=False,
    )
    return cfg


def check_engines(engines) -> list[str]:
    """The engines asked for, refused by name where unknown or where the gate cannot run them (llamacpp)."""
    engines = [str(e) for e in engines]
    unknown = [e for e in engines if e not in GATE_ENGINES]
    if unknown or not engines:
        raise GateRefused(f"gate.engines must name some of {list(GATE_ENGINES)}, got {engines}")
    if "llamacpp" in engines:
        from llamacpp import tool_path

        tool = tool_path("llama-speculative-simple")
        if not tool.is_file():
            raise GateRefused(
                f"engine llamacpp refused: no cached llama.cpp build ({tool} is missing) and the gate does not build "
                "it; run `make llamacpp` where a package index is reachable, or leave llamacpp out of ENGINES"
            )
    return engines


def check_target(cfg: Config) -> None:
    """Refuse, before anything is written, a target whose config cannot be read (a missing folder, an unreachable
    hub id) or whose positions data.max_length passes."""
    from pipeline.job import target_config

    try:
        config = target_config(cfg.model.target, cfg.trust_remote_code)
        check_target_lengths(cfg.data.max_length, config, cfg.model.target)
    except (OSError, ValueError) as e:
        raise GateRefused(f"model.target={cfg.model.target}: {e}") from e


OWNED_MARK = ".flashdraft-gate"  # written into the folder the gate writes into: the mark of a folder it may clear


def claim_out_dir(out: Path) -> None:
    """Make `out` the gate's own empty folder: a new one, an empty one, or one an earlier gate run marked (its
    contents are cleared). A folder holding anything else is refused by name and left as it is: the gate never
    deletes what it did not write."""
    if out.exists() and not out.is_dir():
        raise GateRefused(f"gate.out_dir {out} is a file, not a folder; give gate.out_dir a new or empty folder")
    entries = sorted(out.iterdir()) if out.is_dir() else []
    names = [p.name for p in entries]
    if names and OWNED_MARK not in names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise GateRefused(
            f"gate.out_dir {out} is not empty ({shown}) and was not made by the gate (no {OWNED_MARK} in it); "
            "nothing was touched. Give gate.out_dir a new or empty folder (the gate clears only its own folders)"
        )
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        elif entry.name != OWNED_MARK:
            entry.unlink()
    out.mkdir(parents=True, exist_ok=True)
    (out / OWNED_MARK).write_text(
        "written by benchmarks/gate.py (make gate): the gate clears this folder at each run\n"
    )


# --- plants --------------------------------------------------------------------------------------


@contextlib.contextmanager
def planted_labels(plant: str | None):
    """labels+1: every block position learns the token after its own (the trainer's labels shifted by one)."""
    if plant != "labels+1":
        yield
        return
    import trainer.batch as batch

    original = batch.block_labels

    def shifted(input_ids, loss_mask, anchors, block_size, gamma):
        return original(input_ids, loss_mask, anchors + 1, block_size, gamma)

    batch.block_labels = shifted
    try:
        yield
    finally:
        batch.block_labels = original


def served_drafter(drafter_dir: Path, plant: str | None, out: Path) -> Path:
    """The folder the engines serve: the exported drafter, or (layers-1) a copy whose config.json names every target
    layer one lower (an engine that reads the ids without the +1 offset of `hidden_states`)."""
    if plant != "layers-1":
        return drafter_dir
    shutil.copytree(drafter_dir, out, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    ids = config["dflash_config"]["target_layer_ids"]
    if min(ids) < 1:
        raise GateRefused(f"gate.plant=layers-1 needs every target layer id >= 1, the drafter reads {ids}")
    config["dflash_config"]["target_layer_ids"] = [i - 1 for i in ids]
    if "eagle_aux_hidden_state_layer_ids" in config:  # derived from them (vLLM's convention): kept in agreement
        config.update(aux_layer_ids(config["dflash_config"]))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


# --- the stages ----------------------------------------------------------------------------------


def capture(cfg: Config) -> list[tuple[list[int], list[int]]]:
    """The gate's store, captured in this process; (prompt, response) token lists of each sequence."""
    from flashdraft.store import StoreReader
    from pipeline.__main__ import capture_command

    if capture_command(cfg) != 0:
        raise RuntimeError(f"the gate's capture into {cfg.features_dir} failed (its summary is above)")
    pairs = []
    for ids, mask in StoreReader(cfg.features_dir).token_sequences():
        first = int(mask.argmax()) if mask.any() else len(ids)
        pairs.append((ids[:first].tolist(), ids[first:].tolist()))
    if not pairs:
        raise RuntimeError(f"the gate's capture stored no sequence in {cfg.features_dir}")
    return pairs


DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def trainer_environment():
    """The variables of the trainer's one-process start (trainer.engine.setup_distributed_env), put back after it.
    Its process group stays: DeepSpeed keeps its own handle on it, and a second gate in this process reuses it."""
    saved = {k: os.environ.get(k) for k in DIST_VARS}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def train_drafter(cfg: Config) -> dict:
    """Train on the gate's store (labels shifted where planted); the trainer's last step's metrics."""
    from trainer.train import train

    t0 = time.perf_counter()
    with trainer_environment(), planted_labels(cfg.gate.plant):
        final = train(cfg.train, cfg.drafter)
    final["train_s"] = time.perf_counter() - t0
    return final


def load_serving_target(cfg: Config):
    from flashdraft.target import load_target
    from harness.__main__ import resolve_device  # the harness's reading of `device`, as `make eval` serves

    device = resolve_device(cfg.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(cfg.model.dtype)
    if dtype is None:
        raise GateRefused(f"the gate serves in float32 or bfloat16, got model.dtype={cfg.model.dtype}")
    return load_target(cfg.model.target, dtype=dtype, device=device, trust_remote_code=cfg.trust_remote_code)


class RecordingProposer:
    """A proposer that keeps each call's greedy drafts (the harness leg's rounds, for the report)."""

    def __init__(self, inner):
        self.inner, self.drafts = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def start(self) -> None:
        self.inner.start()

    def __call__(self, block, context, start):
        logits = self.inner(block, context, start)
        self.drafts.append(logits.argmax(dim=-1).tolist())
        return logits


def serve_harness(target, drafter_dir: Path, prompts, max_new_tokens: int, stop) -> Leg:
    from flashdraft.model import DFlashDrafter
    from flashdraft.target import frozen_head_from_model
    from harness.drafter import DrafterProposer
    from harness.policies import ChainPolicy
    from harness.speculative import speculative_generate

    drafter = DFlashDrafter.from_pretrained(drafter_dir, dtype=target.dtype, device=target.device).eval()
    proposer = RecordingProposer(DrafterProposer(drafter, frozen_head_from_model(target)))
    leg, t0 = Leg("harness"), time.perf_counter()
    for prompt in prompts:
        proposer.drafts = []
        out = speculative_generate(
            target, prompt, ChainPolicy(proposer), max_new_tokens=max_new_tokens, stop_token_ids=stop
        )
        leg.rounds.append(list(out.acceptance_lengths))
        leg.drafts.append(list(proposer.drafts))
        leg.outputs.append(list(out.tokens))
    leg.seconds = time.perf_counter() - t0
    return leg


def serve_reference(target, drafter_dir: Path, prompts, max_new_tokens: int, stop) -> Leg:
    import dflash.model as ref

    drafter = ref.DFlashDraftModel.from_pretrained(str(drafter_dir), dtype=target.dtype).to(target.device).eval()
    drafts: list = []
    compute_logits = drafter.compute_logits

    def recording(hidden, head):
        logits = compute_logits(hidden, head)
        drafts.append(logits.argmax(dim=-1)[0].tolist())
        return logits

    drafter.compute_logits = recording
    saved_clock = ref._cuda_time
    if target.device.type != "cuda":
        ref._cuda_time = time.perf_counter  # the package's clock synchronises CUDA
    leg, t0 = Leg("reference"), time.perf_counter()
    try:
        for prompt in prompts:
            drafts.clear()
            ids = torch.tensor([prompt], dtype=torch.long, device=target.device)
            out = ref.dflash_generate(drafter, target, ids, max_new_tokens, list(stop) or None, return_stats=True)
            leg.rounds.append([int(n) for n in out.acceptance_lengths])
            leg.drafts.append(list(drafts))
            leg.outputs.append(out.output_ids[0, len(prompt) :].tolist())
    finally:
        ref._cuda_time = saved_clock
    leg.seconds = time.perf_counter() - t0
    return leg


def llamacpp_leg(logs: list[list[dict]], max_new_tokens: int, stop, seconds: float = 0.0) -> Leg:
    """The Leg of llama.cpp's rounds (`llamacpp.spec_rounds` of each sequence's debug log): each round's drafts and
    committed tokens, up to a stop token (`llamacpp.cut_at_stop`) and the gate's token budget. The budget cuts as the
    harness's loop does (its last round commits what is left): llama.cpp's loop stops only once past `-n` tokens.
    Its first round drafts from the prompt's last token (first_anchor -1) and commits the first generated token,
    which the harness and the reference take from the prefill: one round more, its rounds one token later."""
    from llamacpp import cut_at_stop

    leg = Leg("llamacpp", first_anchor=-1, seconds=seconds)
    for log in logs:
        rounds, drafts, output = [], [], []
        for r in cut_at_stop(log, stop):
            take = r["committed"][: max_new_tokens - len(output)]
            if not take:
                break
            rounds.append(len(take))
            drafts.append(r["drafts"])
            output += take
        leg.rounds.append(rounds)
        leg.drafts.append(drafts)
        leg.outputs.append(output)
    return leg


def serve_llamacpp(
    target, drafter_dir: Path, prompts, max_new_tokens: int, stop, *, tokenizer, target_name: str, gguf_dir: Path
) -> Leg:
    """The prompts greedily through llama.cpp's `llama-speculative-simple --spec-type draft-dflash` with the served
    drafter and the target as f32 GGUF (`llamacpp.export_gguf`, llama.cpp's own converter): each prompt's token ids as
    text (checked to tokenize back to them, here and in llama.cpp's `encoded N tokens`), its rounds, drafts and
    committed tokens from the debug log (`llamacpp.run_speculative` with `rounds_log`)."""
    import argparse

    import llamacpp

    gguf = llamacpp.export_gguf(drafter_dir, target_name, gguf_dir)  # `target` is served in torch: its name converts
    block = json.loads((Path(drafter_dir) / "config.json").read_text()).get("block_size", 16)
    tools = {"llama-speculative-simple": llamacpp.tool_path("llama-speculative-simple")}
    logs, t0 = [], time.perf_counter()
    for s, prompt in enumerate(prompts):
        text = tokenizer.decode(prompt, skip_special_tokens=False)
        if tokenizer(text, add_special_tokens=False).input_ids != list(prompt):
            raise RuntimeError(
                f"gate prompt {s} does not tokenize back to its ids from its text: llama.cpp cannot take it"
            )
        args = argparse.Namespace(
            max_new_tokens=max_new_tokens,
            threads=max(1, torch.get_num_threads()),
            ctx_size=max(2048, len(prompt) + max_new_tokens + 2 * block),
            prompt_batch=max(256, (len(prompt) + 16 + 63) // 64 * 64),  # the whole prompt in one batch
            flash_attn="on",
            draft_n_max=block - 1,
            rounds_log=True,
        )
        with tempfile.TemporaryDirectory(prefix="gate-llamacpp-") as tmp:
            prompt_file = llamacpp.write_prompt_file(Path(tmp) / "prompt.txt", text)
            run = llamacpp.run_speculative(tools, gguf, prompt_file, "draft-dflash", args, text)
        if run.get("prompt_tokens") != len(prompt):
            raise RuntimeError(
                f"llama.cpp encoded gate prompt {s} as {run.get('prompt_tokens')} tokens, the gate's has {len(prompt)}"
            )
        logs.append(run["round_log"])
    return llamacpp_leg(logs, max_new_tokens, stop, time.perf_counter() - t0)


SERVERS = {"harness": serve_harness, "reference": serve_reference, "llamacpp": serve_llamacpp}


def rounds_against_harness(harness: Leg, llama: Leg, llama_first: int = 0) -> dict:
    """llama.cpp's rounds set against the harness's one by one (`llamacpp.aligned_rounds`: rounds aligned by the output
    position of their first committed token, within the stretch both outputs agree on; `llama_first`: the output
    position of llama.cpp's first round's first token, 1 in the anchored run): per sequence and in all, aligned rounds,
    those committing the same count and those drafting the same tokens (over the positions both drafted), and each
    aligned round that differs in either, with both sides' drafts."""
    from llamacpp import aligned_rounds, common_prefix

    out = {"aligned": 0, "equal": 0, "equal_drafts": 0, "per_sequence": [], "unequal": []}
    for s, (ours, theirs) in enumerate(zip(harness.rounds, llama.rounds)):
        agree = common_prefix(harness.outputs[s], llama.outputs[s])
        pairs = aligned_rounds(ours, theirs, agree, llama_first)
        aligned, equal = len(pairs), sum(ours[r] == theirs[q] for _, r, q in pairs)
        same_drafts = 0
        for p, r, q in pairs:
            d_ours = harness.drafts[s][r] if r < len(harness.drafts[s]) else []
            d_theirs = llama.drafts[s][q] if q < len(llama.drafts[s]) else []
            n = min(len(d_ours), len(d_theirs))
            drafts_equal = d_ours[:n] == d_theirs[:n]
            same_drafts += drafts_equal
            if ours[r] == theirs[q] and drafts_equal:
                continue
            out["unequal"].append(
                {
                    "sequence": s,
                    "output_position": p,
                    "harness_round": r,
                    "llamacpp_round": q,
                    "harness_committed": ours[r],
                    "llamacpp_committed": theirs[q],
                    "harness_drafts": d_ours,
                    "llamacpp_drafts": d_theirs,
                }
            )
        out["aligned"] += aligned
        out["equal"] += equal
        out["equal_drafts"] += same_drafts
        out["per_sequence"].append({"agree": agree, "aligned": aligned, "equal": equal, "equal_drafts": same_drafts})
    return out


def anchored_llamacpp(harness: Leg, drafter_dir: Path, prompts, max_new_tokens: int, stop, **kw) -> dict:
    """llama.cpp's rounds against the harness's with llama.cpp's first round anchored where the harness's is: each
    prompt served again with the harness's first generated token appended (what the harness takes from the prefill),
    so llama.cpp's round k drafts from the same anchor, with the same context, as the harness's round k. A near-certain
    drafter otherwise commits a full block in llama.cpp's extra first round and its rounds never start where the
    harness's do. A prompt whose text with that token does not tokenize back to the same ids is left out (named)."""
    tokenizer = kw["tokenizer"]
    keep, left_out = [], []
    for s, prompt in enumerate(prompts):
        ids = list(prompt) + harness.outputs[s][:1]
        text = tokenizer.decode(ids, skip_special_tokens=False)
        ok = len(harness.outputs[s]) > 1 and tokenizer(text, add_special_tokens=False).input_ids == ids
        (keep if ok else left_out).append(s)
    if not keep:
        return {"sequences": [], "left_out": left_out}
    extended = [list(prompts[s]) + harness.outputs[s][:1] for s in keep]
    leg = serve_llamacpp(None, drafter_dir, extended, max_new_tokens - 1, stop, **kw)
    leg.outputs = [harness.outputs[s][:1] + o for s, o in zip(keep, leg.outputs)]
    ours = Leg(
        "harness",
        rounds=[harness.rounds[s] for s in keep],
        drafts=[harness.drafts[s] for s in keep],
        outputs=[harness.outputs[s] for s in keep],
    )
    parity = rounds_against_harness(ours, leg, llama_first=1)
    for d in parity["unequal"]:
        d["sequence"] = keep[d["sequence"]]
    return {**parity, "sequences": keep, "left_out": left_out, "llamacpp_rounds": leg.rounds}


# --- the verdict ---------------------------------------------------------------------------------


def first_short_round(leg: Leg, prompts, block_size: int, need: float) -> dict | None:
    """The first round committing fewer than `need` tokens, a sequence's last round left out (the token budget or a
    stop token ends it); its positions, drafts and the tokens committed there. None if there is none."""
    for s, (rounds, drafts, output) in enumerate(zip(leg.rounds, leg.drafts, leg.outputs)):
        start = len(prompts[s]) + leg.first_anchor  # the newest committed token's position: block[0] of the round
        for r, committed in enumerate(rounds):
            if committed < need and r < len(rounds) - 1:
                gen = start - len(prompts[s])  # index of block[0] among the generated tokens
                drafted = drafts[r] if r < len(drafts) else []
                truth = output[gen + 1 : gen + block_size]
                wrong = next((k for k, (d, t) in enumerate(zip(drafted, truth)) if d != t), None)
                return {
                    "sequence": s,
                    "round": r,
                    "committed": committed,
                    "block_positions": [start, start + block_size - 1],
                    "first_wrong_position": None if wrong is None else start + 1 + wrong,
                    "drafted": drafted,
                    "committed_tokens": truth,
                }
            start += committed
    return None


def describe_round(short: dict, tokenizer) -> str:
    def words(ids):
        return " ".join(repr(tokenizer.decode([t])) for t in ids)

    at = short["first_wrong_position"]
    return (
        f"  first short round: sequence {short['sequence']}, round {short['round']}: {short['committed']} tokens "
        f"committed, block at positions {short['block_positions'][0]}..{short['block_positions'][1]}, "
        f"first wrong draft at position {at}\n"
        f"    drafted   {short['drafted']}\n              {words(short['drafted'])}\n"
        f"    committed {short['committed_tokens']}\n              {words(short['committed_tokens'])}"
    )


def log_unequal(parity: dict, log, most: int = 3) -> None:
    for d in parity["unequal"][:most]:
        log(
            f"  unequal: sequence {d['sequence']} at output position {d['output_position']}: harness round "
            f"{d['harness_round']} commits {d['harness_committed']}, llama.cpp round {d['llamacpp_round']} "
            f"{d['llamacpp_committed']}\n    harness drafts   {d['harness_drafts']}\n"
            f"    llama.cpp drafts {d['llamacpp_drafts']}"
        )


def run_gate(cfg: Config, log=print) -> dict:
    """The whole gate on `cfg` (`gate_config`); the report (also written to gate.json)."""
    g = cfg.gate
    engines = check_engines(g.engines)
    check_target(cfg)
    out = Path(g.out_dir)
    claim_out_dir(out)
    block = cfg.drafter.block_size
    need = g.threshold * block
    log(
        f"gate: {g.sequences} sequences of {cfg.data.sources} x {g.max_new_tokens} new tokens, target "
        f"{cfg.model.target}, block {block}, {cfg.drafter.num_layers} draft layers, plant {g.plant}, engines {engines}"
    )
    pairs = capture(cfg)
    prompts = [p for p, _ in pairs]
    final = train_drafter(cfg)
    steps, train_tau = int(final["global_step"]), float(final["tau"])
    log(
        f"train: tau {train_tau:.2f}/{block} after {steps} steps ({final['train_s']:.0f} s; stop at "
        f"{cfg.train.stop_tau:.2f} on {g.stable_steps} steps in a row, at most {g.max_steps} steps)"
    )
    served = served_drafter(Path(cfg.drafter_dir), g.plant, out / "drafter-served")
    target, tokenizer = load_serving_target(cfg)
    from flashdraft.target import stop_token_ids

    stop = stop_token_ids(target, tokenizer)
    report = {
        "config": {"gate": asdict(g), "drafter": asdict(cfg.drafter), "target": cfg.model.target, "out_dir": str(out)},
        "train": {"steps": steps, "tau": train_tau, "seconds": final["train_s"], "stop_tau": cfg.train.stop_tau},
        "need": need,
        "engines": {},
    }
    responses = [r for _, r in pairs]
    legs_served = {}
    extra = {"tokenizer": tokenizer, "target_name": cfg.model.target, "gguf_dir": out / "gguf"}  # llama.cpp's leg
    for engine in engines:
        leg = SERVERS[engine](
            target, served, prompts, g.max_new_tokens, stop, **(extra if engine == "llamacpp" else {})
        )
        legs_served[engine] = leg
        short = first_short_round(leg, prompts, block, need)
        passed = leg.tau >= need
        same = sum(o == r for o, r in zip(leg.outputs, responses))
        report["engines"][engine] = {
            "tau": leg.tau,
            "passed": passed,
            "rounds": leg.rounds,
            "first_short_round": short,
            "outputs_equal_captured": same,
            "seconds": leg.seconds,
        }
        log(
            f"{engine}: tau {leg.tau:.2f}/{block} over {sum(map(len, leg.rounds))} rounds (need {need:.2f}): "
            f"{'pass' if passed else 'FAIL'}; outputs equal to the captured responses: {same}/{len(prompts)}"
        )
        if short and not passed:
            log(describe_round(short, tokenizer))
    legs = report["engines"]
    if {"harness", "reference"} <= set(legs):
        report["harness_reference_rounds_equal"] = legs["harness"]["rounds"] == legs["reference"]["rounds"]
        log(f"harness and reference rounds identical: {report['harness_reference_rounds_equal']}")
    if {"harness", "llamacpp"} <= set(legs):
        parity = rounds_against_harness(legs_served["harness"], legs_served["llamacpp"])
        report["llamacpp_harness_rounds"] = parity
        log(
            f"llamacpp vs harness rounds: {parity['aligned']} aligned, {parity['equal']} equal commit counts, "
            f"{parity['equal_drafts']} equal drafts (aligned by the output position of a round's first committed "
            "token, on the stretch both outputs agree)"
        )
        log_unequal(parity, log)
        anchored = anchored_llamacpp(legs_served["harness"], served, prompts, g.max_new_tokens, stop, **extra)
        report["llamacpp_harness_rounds_anchored"] = anchored
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
    report["passed"] = all(e["passed"] for e in legs.values())
    (out / "gate.json").write_text(json.dumps(report, indent=1))
    log(f"gate {'PASSED' if report['passed'] else 'FAILED'} ({out / 'gate.json'})")
    return report


def main(argv: list[str]) -> int:
    try:
        cfg = gate_config(argv)
        report = run_gate(cfg)
    except GateRefused as e:
        print(f"gate refused: {e}", file=sys.stderr)
        return 2
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
