"""The peer's DFlash training recipe (`speculators` 0.9.0, vLLM's speculator library) on a CPU, from a thin loop
(issue 59: our recipe against the peer's at equal data, steps and seed).

The peer's `Trainer` moves the model to "cuda" when torch sees no accelerator, so this loop drives the peer's own
pieces in its order instead: `ArrowDataset` + its `MultipackDistributedBatchSamplerV2` (seeded packing order) +
`CollateFn` (packing into `--total-seq-len` tokens a step); `DFlashDraftModel` built by `from_training_args`
(random `post_init` weights; embedding, lm_head and final norm from the verifier, frozen) whose forward samples the
anchors, builds the mask (`draft_attn_impl` "eager": a dense float mask) and returns the loss (`get_trainer_kwargs`:
ce against the verifier's argmax, per-position weights D-PACE alpha 0.5, gamma 4, `max_anchors`);
`build_optimizers` (Muon on the 2D matrices, AdamW on the rest, the peer's CLI defaults); one linear schedule with
warmup a optimizer (`_resolve_scheduler_steps`: 1% of the steps); `torch.autocast` bf16 around the forward; grad
clip 1.0; `set_seed`. What differs from the peer's Trainer is listed in `DIFFERENCES` (and in run.json).

The drafter's geometry is ours, read from one of our exported drafters (`--like`): depth, width, heads, MLP width,
block size, target layer ids (the peer's ids are ours + 1: it counts the hidden state entering a layer, we the one
leaving it), mask token. Our trainer starts from the target's top layers (train=quick/full `init: target`); this
one starts from the peer's random init. All draft layers use full, in-block bidirectional attention, as ours and
the published z-lab drafters do; `--attention peer` takes the peer's DFlash default instead (every layer sliding
window 2048, causal inside the block), which our harness does not serve as trained.

    PYTHONPATH=.peer .venv/bin/python benchmarks/peer_train.py --data runs/peer/quick-data \\
        --like runs/quick-smollm2-135m/drafter --steps 600 --total-seq-len 1024 --out runs/peer/quick-seed0

OUT/peer is the peer's `save_pretrained` folder, OUT/drafter the same weights in our (z-lab) format, which our
harness and trainer eval load; OUT/run.json the run's record (steps, tokens, anchors, lr schedule, timings).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm import tqdm
from transformers import Qwen3Config

from flashdraft.model import DFlashDrafter
from flashdraft.spec import DraftSpec
from flashdraft.target import resolve_target

PEER_DENSITY = (512, 8192)  # the peer's default max_anchors at its default total_seq_len
GEOMETRY_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "vocab_size",
    "max_position_embeddings",
)
OUR_WEIGHTS = ("layers.", "fc.weight", "hidden_norm.weight", "norm.weight")  # what a z-lab drafter folder holds
DIFFERENCES = [
    "device: CPU (the peer's Trainer hard-codes cuda without an accelerator); torch.autocast('cpu', bfloat16) "
    "where it autocasts on the GPU with hidden_states_dtype bfloat16",
    "loss implementation 'eager' (the peer's pure-torch twin of its default 'fused' Triton kernels, which need a GPU)",
    "data loader: num_workers 0, no pin_memory (the peer: 12 spawned workers, prefetch 4, pinned memory); same "
    "sampler, seed, packing and collate",
    "train_data_ratio 1.0 (no validation split, no val epochs; the peer's default holds out 10% and validates "
    "each epoch): the parity evaluation is on our held-out store",
    "no checkpoints during the run; torch.compile off (the peer compiles its forward only where CUDA is available)",
    "model built from our drafter's geometry (--like), not the peer's defaults (5 layers, block 16, target layers "
    "[2, L/2, L-3], mask token from the tokenizer)",
    "data: our store's features and loss masks (benchmarks/peer_data.py); the verifier's last hidden state, which "
    "the peer captures with the features in vLLM, is recomputed on our target in the store's capture dtype",
    "draft layers all full attention, bidirectional in the block (ours); the peer's DFlash default is sliding "
    "window 2048 on every layer, causal in the block (--attention peer)",
]


def peer():
    """The peer's modules, or a clear error saying how to make them importable."""
    try:
        from speculators.models.dflash import DFlashDraftModel
        from speculators.train import cli, data, distributed_batch_sampler, optimizers, trainer
    except ImportError as e:
        raise SystemExit(
            f"peer_train: the peer `speculators` is not importable ({e}); run with PYTHONPATH=.peer "
            "(scripts/setup.sh installs it there)"
        ) from e
    return argparse.Namespace(
        DFlashDraftModel=DFlashDraftModel,
        cli=cli,
        data=data,
        sampler=distributed_batch_sampler,
        optimizers=optimizers,
        trainer=trainer,
    )


def read_like(path: str | Path) -> dict:
    """The config.json of our exported drafter at `path`, refused by name where missing or not a DFlash drafter."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise SystemExit(f"peer_train: no drafter at {path}: {cfg} is missing")
    raw = json.loads(cfg.read_text())
    try:
        DraftSpec.from_draft_config(raw, where=str(cfg))
    except ValueError as e:
        raise SystemExit(f"peer_train: {e}") from e
    return raw


def layer_config(p, like: dict, verifier: str, attention: str) -> tuple[Qwen3Config, dict]:
    """The peer's `transformer_layer_config` (`create_transformer_layer_config` from the verifier), with every
    size our drafter has set to ours; returns it and the keys that had to change {key: [peer's, ours]}."""
    n = int(like["num_hidden_layers"])
    cfg = p.cli.create_transformer_layer_config(
        verifier_name_or_path=verifier,
        num_layers=n,
        draft_arch="qwen3",
        hidden_act=None,
        sliding_window=2048,
        full_attention_indices=list(range(n)) if attention == "full" else [],
    )
    changed = {}
    for key in GEOMETRY_KEYS:
        if key in like and getattr(cfg, key, None) != like[key]:
            changed[key] = [getattr(cfg, key, None), like[key]]
            setattr(cfg, key, like[key])
    ours = like.get("rope_parameters")
    if ours and getattr(cfg, "rope_parameters", None) != ours:
        changed["rope_parameters"] = [getattr(cfg, "rope_parameters", None), ours]
        cfg.rope_parameters = dict(ours)
    return cfg, changed


def build_model(p, like: dict, verifier: str, attention: str):
    """The peer's DFlash drafter of our geometry, as its CLI builds one (`from_training_args`), eager attention."""
    cfg, changed = layer_config(p, like, verifier, attention)
    dcfg = like["dflash_config"]
    model = p.DFlashDraftModel.from_training_args(
        verifier_config=cfg,
        draft_vocab_size=cfg.vocab_size,
        block_size=int(like["block_size"]),
        target_layer_ids=[int(i) + 1 for i in dcfg["target_layer_ids"]],
        mask_token_id=int(dcfg["mask_token_id"]),
        verifier_name_or_path=verifier,
        draft_attn_impl="eager",
    )
    return model, changed


def make_loader(p, data: str | Path, total_seq_len: int, seed: int):
    """The peer's dataset, packing sampler and collate over the converted data at `data`, in this process."""
    from torch.utils.data import DataLoader

    if not (Path(data) / "hidden_states").is_dir():
        raise SystemExit(f"peer_train: {data} is not peer data (no hidden_states/): convert with peer_data.py")
    ds = p.data.ArrowDataset(max_len=total_seq_len, datapath=str(data), on_missing="raise", train_ratio=1.0)
    first = p.data.FileTransfer(Path(data) / "hidden_states").get_cached(0)["hidden_states"]
    sampler = p.sampler.MultipackDistributedBatchSamplerV2(
        batch_max_length=total_seq_len, lengths=ds.approx_lengths, num_replicas=1, rank=0, seed=seed
    )
    collate = p.data.CollateFn(
        total_seq_len, first.shape[-1], num_target_layers=first.shape[1] - 1, dtype=ds.hidden_states_dtype
    )
    return ds, sampler, DataLoader(ds, batch_sampler=sampler, num_workers=0, collate_fn=collate)


def seq_len_for(p, lengths: list[int], tokens: int, seed: int) -> int:
    """The shortest packed length (a multiple of 16) at which the peer's packing sampler fills at least `tokens`
    tokens a step on average over its first epoch: the peer then sees as many target tokens a step as a run of ours
    that saw `tokens` a step."""
    for total in range(16 * (tokens // 16), 4 * tokens, 16):
        sampler = p.sampler.MultipackDistributedBatchSamplerV2(
            batch_max_length=total, lengths=lengths, num_replicas=1, rank=0, seed=seed
        )
        sampler.set_epoch(0)
        steps = list(iter(sampler))
        if sum(min(sum(lengths[i] for i in b), total) for b in steps) / len(steps) >= tokens:
            return total
    raise SystemExit(f"peer_train: no packed length up to {4 * tokens} fills {tokens} tokens a step")


def batches(sampler, loader, steps: int):
    """`steps` packed batches, epoch after epoch (the sampler reshuffled each epoch, as the peer's Trainer does)."""
    done, epoch = 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield epoch, batch
            done += 1
            if done == steps:
                return
        epoch += 1


def optimizers(p, model, steps: int, lr: float):
    """The peer's optimizers (Muon + AdamW at its CLI defaults) and one linear warmup schedule each."""
    from transformers import get_linear_schedule_with_warmup

    cfg = p.trainer.TrainerConfig(
        lr=lr, num_epochs=1, save_path="", optimizer="muon", muon_lr=lr, max_steps=steps, scheduler_type="linear"
    )
    opts = p.optimizers.build_optimizers(model, cfg)
    warmup, total = p.trainer._resolve_scheduler_steps(cfg, steps)
    scheds = [get_linear_schedule_with_warmup(o, num_warmup_steps=warmup, num_training_steps=total) for o in opts]
    return opts, scheds, {"warmup_steps": warmup, "total_steps": total, "type": "linear", "lr": lr, "muon_lr": lr}


MODEL_INPUTS = (
    "hidden_states",
    "input_ids",
    "loss_mask",
    "verifier_last_hidden_states",
    "document_ids",
    "position_ids",
)


def step(model, batch: dict, opts, scheds, call_kwargs: dict) -> tuple[float, dict, dict]:
    """One step as the peer's Trainer takes it: autocast forward (its loss), zero grads, backward, clip 1.0,
    optimizers then schedulers. Returns the loss, the metrics and the lr each optimizer stepped with."""
    inputs = {k: batch[k] for k in MODEL_INPUTS}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss, metrics = model(**inputs, **call_kwargs)
    for o in opts:
        o.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for o in opts:
        o.step()
    lrs = {type(o).__name__: o.param_groups[0]["lr"] for o in opts}
    for s in scheds:
        s.step()
    return float(loss.detach()), {k: float(v) for k, v in metrics.items()}, lrs


def ratio(metrics: dict, name: str) -> float:
    total = metrics.get(f"{name}_total", 0.0)
    return metrics.get(f"{name}_sum", float("nan")) / total if total else float("nan")


def valid_anchors(batch: dict, max_anchors: int, block_size: int) -> int:
    """The anchors the forward samples from this batch (`select_anchors`: loss positions outside the last block)."""
    valid = batch["loss_mask"].bool().clone()
    valid[:, -block_size:] = False
    return min(max_anchors, int(valid.sum()))


def train(p, model, loader_parts, args, call_kwargs: dict) -> dict:
    """The loop: `args.steps` steps, a log line every 25; returns the per-step record."""
    _, sampler, loader = loader_parts
    opts, scheds, schedule = optimizers(p, model, args.steps, args.lr)
    rec = {"loss": [], "tokens": [], "response_tokens": [], "anchors": [], "lr": [], "step_s": [], "epochs": 0}
    model.train()
    bar = tqdm(total=args.steps, desc="peer dflash", unit="step")
    start = t = time.perf_counter()
    for n, (epoch, batch) in enumerate(batches(sampler, loader, args.steps), 1):
        loss, metrics, lrs = step(model, batch, opts, scheds, call_kwargs)
        now = time.perf_counter()
        rec["step_s"].append(round(now - t, 4))
        t = now
        if not math.isfinite(loss):
            raise SystemExit(f"peer_train: loss {loss} at step {n}")
        rec["loss"].append(loss)
        rec["tokens"].append(int((batch["document_ids"] != -1).sum()))
        rec["response_tokens"].append(int(batch["loss_mask"].sum()))
        rec["anchors"].append(valid_anchors(batch, call_kwargs["max_anchors"], model.block_size))
        rec["lr"].append(lrs)
        rec["epochs"] = epoch + 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")
        if n % 25 == 0 or n == args.steps:
            bar.write(
                f"step {n}: loss {loss:.4f} acc {ratio(metrics, 'full_acc'):.3f} eal {ratio(metrics, 'eal'):.3f} "
                f"lr {lrs} ({rec['step_s'][-1]:.2f} s/step)"
            )
    bar.close()
    rec["wall_s"] = round(time.perf_counter() - start, 2)
    rec["schedule"] = schedule
    return rec


def export_ours(peer_dir: Path, like: dict, out: Path) -> dict:
    """The peer's saved drafter at `peer_dir` in our z-lab format at `out`, read with our cross-format reader
    (`flashdraft.speculators_format.from_speculators`: same tensor names, the verifier's embedding, heads and norm
    left out) and written with `--like`'s config (the peer's config.json drops the mask token's string), once the
    two geometries agree. A drafter our format cannot compute alike (`--attention peer`: sliding, in-block causal
    layers) is mapped by tensor name instead and the reason returned. Returns how it was exported."""
    from flashdraft.speculators_format import from_speculators

    want = DraftSpec.from_draft_config(like)
    how = {"from": "flashdraft.speculators_format.from_speculators"}
    try:
        config, state = from_speculators(peer_dir)
        got = DraftSpec.from_draft_config(config)
        if (got.target_layer_ids, got.mask_token_id, got.block_size, got.num_draft_layers) != (
            want.target_layer_ids,
            want.mask_token_id,
            want.block_size,
            want.num_draft_layers,
        ):
            raise SystemExit(f"peer_train: the peer saved geometry {got}, --like asks for {want}")
    except ValueError as e:
        state = {k: v for k, v in load_file(str(peer_dir / "model.safetensors")).items() if k.startswith(OUR_WEIGHTS)}
        how = {"from": "tensor names (layers.*, fc, hidden_norm, norm)", "not_alike": str(e)}
    ours = DFlashDrafter(Qwen3Config.from_dict({k: v for k, v in like.items() if k != "dtype"}))
    ours.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    ours.save_pretrained(out, dtype=torch.float32)
    return how


def load_init(model, folder: str) -> None:
    """Start the peer's model from the weights of the drafter at `folder` (read by our loader, which takes either
    format): every tensor of ours must land on one of the peer's, of the same shape."""
    state = DFlashDrafter.from_pretrained(folder).state_dict()
    own = model.state_dict()
    bad = [k for k, v in state.items() if k not in own or own[k].shape != v.shape]
    if bad:
        raise SystemExit(f"peer_train: --init {folder}: tensors the peer's model lacks or shapes it differs in: {bad}")
    model.load_state_dict(state, strict=False)
    print(f"init: {len(state)} tensors from {folder}")


def default_anchors(total_seq_len: int) -> int:
    """The peer's anchor density (512 at 8192 tokens a step) at `total_seq_len`."""
    return max(1, round(PEER_DENSITY[0] * total_seq_len / PEER_DENSITY[1]))


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="the peer's data (benchmarks/peer_data.py's OUT)")
    ap.add_argument("--like", required=True, help="one of our exported drafters: the geometry to train")
    ap.add_argument("--target", default=None, help="the verifier (default: the one the data was converted with)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seed", type=int, default=42, help="the peer's default 42")
    ap.add_argument("--total-seq-len", type=int, default=8192, help="packed tokens a step (the peer's default 8192)")
    ap.add_argument(
        "--tokens-per-step",
        type=int,
        default=None,
        help="instead of --total-seq-len: the packed length whose mean "
        "filled tokens a step is this (a run of ours' tokens_seen / steps)",
    )
    ap.add_argument("--max-anchors", type=int, default=None, help="default: 512 * total_seq_len / 8192, rounded")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW and Muon lr (the peer's default 1e-3)")
    ap.add_argument("--attention", choices=("full", "peer"), default="full")
    ap.add_argument(
        "--init",
        default=None,
        help="a drafter folder (ours or the peer's) whose weights start the draft layers, fc "
        "and norms instead of the peer's random init (a swap of issue 59's part 3)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--out", required=True)
    ap.add_argument("--force", action="store_true", help="replace OUT if it exists")
    return ap.parse_args(argv)


def verifier_of(args) -> str:
    """The verifier's local folder (the peer loads embed/lm_head/norm from it): --target, else the data's."""
    name = args.target
    if name is None:
        record = Path(args.data) / "peer_data.json"
        if not record.is_file():
            raise SystemExit(f"peer_train: {record} is missing: pass --target")
        name = json.loads(record.read_text())["target"]
    path = resolve_target(name)
    if not Path(path, "config.json").is_file():
        raise SystemExit(f"peer_train: the verifier {name!r} is not a local folder ({path}): pass one with --target")
    return path


def main(argv=None) -> dict:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    if out.exists() and not args.force:
        raise SystemExit(f"peer_train: {out} already exists (pass --force to replace it)")
    p, like = peer(), read_like(args.like)
    if args.tokens_per_step:
        lengths = p.data.ArrowDataset(max_len=1 << 30, datapath=str(args.data), on_missing="raise").approx_lengths
        args.total_seq_len = seq_len_for(p, lengths, args.tokens_per_step, args.seed)
        print(f"total_seq_len {args.total_seq_len}: the packing that fills {args.tokens_per_step} tokens a step")
    args.max_anchors = args.max_anchors or default_anchors(args.total_seq_len)
    print(f"max_anchors {args.max_anchors} at total_seq_len {args.total_seq_len}")
    p.cli.set_seed(args.seed)
    verifier = verifier_of(args)
    model, changed = build_model(p, like, verifier, args.attention)
    p.DFlashDraftModel.verify_training_compatible(model)
    if args.init:
        load_init(model, args.init)
    if changed:
        print(f"geometry set to ours where the peer's default differs: {changed}")
    parts = make_loader(p, args.data, args.total_seq_len, args.seed)
    call_kwargs, _ = p.DFlashDraftModel.get_trainer_kwargs(
        loss_fn="ce", loss_implementation="eager", max_anchors=args.max_anchors, per_position_loss_weight="dpace"
    )
    rec = train(p, model, parts, args, call_kwargs)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp / "peer")
    run = record(args, rec, changed, verifier, parts[0].approx_lengths)
    run["drafter_export"] = export_ours(tmp / "peer", like, tmp / "drafter")
    (tmp / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    print(
        f"{args.steps} steps in {rec['wall_s']} s ({run['seconds_per_step']:.3f} s/step), "
        f"{run['tokens_seen']} tokens seen ({run['tokens_per_step_mean']:.0f} a step); wrote {out}"
    )
    return run


def record(args, rec: dict, changed: dict, verifier: str, lengths: list[int]) -> dict:
    """run.json: the recipe, the per-step figures and their summaries."""
    later = rec["step_s"][1:] or rec["step_s"]
    return {
        "recipe": "speculators 0.9.0 DFlash (ce, dpace alpha 0.5, gamma 4, muon + adamw, linear warmup 1%, clip 1.0)",
        "data": str(Path(args.data).resolve()),
        "like": str(Path(args.like).resolve()),
        "verifier": verifier,
        "sequences": len(lengths),
        "sequences_truncated": sum(n > args.total_seq_len for n in lengths),  # the peer's sampler cuts them
        "steps": args.steps,
        "seed": args.seed,
        "total_seq_len": args.total_seq_len,
        "max_anchors": args.max_anchors,
        "attention": args.attention,
        "threads": torch.get_num_threads(),
        "geometry_changed": changed,
        "epochs_touched": rec["epochs"],
        "tokens_seen": sum(rec["tokens"]),
        "tokens_per_step_mean": statistics.fmean(rec["tokens"]),
        "response_tokens_seen": sum(rec["response_tokens"]),
        "anchors_per_step_mean": statistics.fmean(rec["anchors"]),
        "schedule": rec["schedule"],
        "wall_s": rec["wall_s"],
        "seconds_per_step": rec["wall_s"] / args.steps,
        "seconds_per_step_after_first": statistics.fmean(later),
        "final_loss": rec["loss"][-1],
        "per_step": {k: rec[k] for k in ("loss", "tokens", "response_tokens", "anchors", "lr", "step_s")},
        "differences_from_peer_trainer": DIFFERENCES,
        "init": args.init
        or "the peer's random post_init (our trainer's quick/full profiles start from the target's top layers)",
    }


if __name__ == "__main__":
    main()
