"""The training loop: stores -> drafter, under DeepSpeed, with checkpoints, eval and metrics."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from flashdraft.model import DFlashDrafter, default_gamma, make_draft_config
from flashdraft.store import read_manifest
from flashdraft.target import (
    cpu_bf16_gemm_speedup,
    load_frozen_head,
    read_target_tensors,
    resolve_dtype,
    target_fingerprint,
)
from trainer.checkpoint import export_drafter, latest_tag, load_checkpoint, read_client_state, save_checkpoint
from trainer.data import Prefetcher, TrainingData
from trainer.engine import build_engine, gathered_state_dict, setup_distributed_env
from trainer.loss import summarize
from trainer.metrics import MetricsLog
from trainer.objective import accepted_lengths, forward_loss
from trainer.store_check import StoreMismatch, check_store


class TrainingDiverged(RuntimeError):
    """The loss became NaN/Inf; the last good checkpoint is kept."""


@dataclass
class TrainConfig:
    stores: list  # feature store paths
    out_dir: str  # checkpoints, metrics.jsonl, wandb
    drafter_dir: str | None  # a copy of the latest exported drafter, for `make eval`
    target: str
    eval_stores: list | None = None  # held-out stores for eval/* (None: a hashed held-out part of `stores`)
    layer_ids: list | None = None
    num_target_features: int = 5
    num_draft_layers: int = 5
    block_size: int = 16
    intermediate_size: int | None = None
    init: str = "random"  # random | target (draft layers start as the target's top layers) | a drafter folder
    mask_token_id: int | None = None  # None: the stores' manifest, else chosen from the tokenizer
    num_anchors: int = 512
    anchor_uniform_share: float = 1.0  # < 1: draw the rest of the anchors toward the target's uncertain tokens
    anchor_follow: float = 0.0  # > 0: that share of the anchors moves to where the drafter's next round would start
    gamma: float | None = None  # None: default_gamma(block_size)
    soft_labels: float = 0.0  # weight of the target's top-k distribution in the labels (0: the paper's hard labels)
    loss_vocab: int = 0  # > 0: the training softmax over the k most frequent response tokens (+ the batch's labels); eval uses all
    max_length: int = 3072
    token_budget: int = 16384  # padded tokens (context + blocks) per micro-batch
    grad_accum: int = 1
    epochs: int = 6
    max_steps: int | None = None
    lr: float = 6e-4
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    zero_stage: int = 2
    dtype: str = "auto"  # auto (bf16 on GPU; on a CPU the faster of bf16 and fp32, timed) | bfloat16 | float32
    device: str = "auto"
    attention: str = "auto"  # auto (flex on GPU, dense on CPU) | flex | dense
    compile: str = "auto"  # torch.compile the drafter: auto = on GPU
    ce_chunk: int = 1024
    loader_workers: int = 4
    prefetch: int = 4
    checkpoint_every: int = 1000
    keep_checkpoints: int = 3
    eval_every: int = 500
    eval_batches: int = 8
    heldout_fraction: float = 0.02
    log_every: int = 1
    seed: int = 0
    resume: bool = True
    check_target: bool = True
    wandb_mode: str = "offline"
    wandb_project: str = "flashdraft"
    wandb_entity: str | None = None
    run_name: str | None = None
    progress: bool = True


def _dist():
    import torch.distributed as dist

    return dist


def _all_sum(t: torch.Tensor) -> torch.Tensor:
    dist = _dist()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def _stats_vector(stats: dict) -> torch.Tensor:
    return torch.cat([stats["pos_correct"], stats["pos_total"], stats["accept"][None], stats["blocks"][None]]).double().cpu()


def _stats_from(vec: torch.Tensor, block_size: int) -> dict:
    b = block_size
    return {"pos_correct": vec[:b], "pos_total": vec[b : 2 * b], "accept": vec[2 * b], "blocks": vec[2 * b + 1]}


def resolve_mask_token(cfg: TrainConfig, manifests: list[dict], vocab_size: int) -> int:
    ids = {m.get("mask_token_id") for m in manifests} - {None}
    if cfg.mask_token_id is not None:
        return int(cfg.mask_token_id)
    if len(ids) > 1:
        raise StoreMismatch(f"the feature stores {cfg.stores} disagree on the mask token: {sorted(ids)}")
    if ids:
        return int(ids.pop())
    from flashdraft.target import choose_mask_token, load_tokenizer

    return choose_mask_token(load_tokenizer(cfg.target), vocab_size)


def init_from_drafter(drafter: DFlashDrafter, path) -> None:
    """Start from an exported drafter's weights (fine-tuning); it must have this run's shape."""
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"train.init must be 'random', 'target' or a drafter folder; {path!r} holds no config.json")
    source = DFlashDrafter.from_pretrained(path)
    theirs, ours = source.state_dict(), drafter.state_dict()
    wrong = [k for k in ours if k not in theirs or theirs[k].shape != ours[k].shape]
    if wrong:
        raise ValueError(f"train.init={path}: the drafter there has another shape than this run's ({len(wrong)} tensors differ, first {wrong[0]!r})")
    drafter.load_state_dict(theirs)


def _layer_prefix(tensors: dict) -> str:
    """'model.' for Llama/Qwen3 checkpoints, 'model.language_model.' for multimodal wrappers."""
    for name in tensors:
        if ".layers." in name:
            return name[: name.index("layers.")]
    raise KeyError("the target checkpoint has no decoder layer tensors")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def training_dtype(name: str, device: torch.device, resumed: str | None = None) -> torch.dtype:
    """The dtype a run trains in. A resumed run keeps the one its checkpoint was saved in (`resumed`; "legacy" for
    checkpoints from before it was saved, which `auto` chose by the CPU's flags). Otherwise `auto` is bf16 on a
    GPU, and on a CPU whichever of bf16 and fp32 runs a training-sized GEMM faster, timed on rank 0 and broadcast
    so that every rank builds the same engine."""
    if resumed == "legacy":
        return resolve_dtype(name, device)
    if resumed:
        if name not in ("auto", resumed):
            raise ValueError(f"train.dtype={name} cannot resume a run saved in {resumed}: pass train.dtype=auto or "
                             f"{resumed}, or start afresh (train.resume=false or another out_dir)")
        return resolve_dtype(resumed, device)
    if name != "auto" or device.type == "cuda":
        return resolve_dtype(name, device)
    import torch.distributed as dist

    first = not dist.is_initialized() or dist.get_rank() == 0
    speedup = cpu_bf16_gemm_speedup() if first else 0.0  # one rank times, alone on the cores it shares
    bf16 = torch.tensor([speedup > 1.0])
    if dist.is_initialized():
        dist.broadcast(bf16, src=0)
    if first:
        print(f"train.dtype=auto: {'bfloat16' if bf16 else 'float32'} (bf16 GEMMs run {speedup:.2f}x as fast as "
              f"fp32 ones on this CPU)", flush=True)
    return torch.bfloat16 if bf16 else torch.float32


def train(cfg: TrainConfig) -> dict:
    from flashdraft.target import load_config

    rank, world, local_rank = setup_distributed_env()
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if cfg.dtype not in ("auto", "bfloat16", "float32"):
        raise ValueError(f"train.dtype must be auto, bfloat16 or float32, got {cfg.dtype!r}")
    if not 0.0 <= cfg.soft_labels <= 1.0:
        raise ValueError(f"train.soft_labels must be in [0, 1], got {cfg.soft_labels}")
    if cfg.loss_vocab < 0:
        raise ValueError(f"train.loss_vocab must be 0 (the whole vocabulary) or a number of words, got {cfg.loss_vocab}")
    attention = cfg.attention if cfg.attention != "auto" else ("flex" if use_cuda else "dense")
    # --- drafter config, checked against the stores before anything trains
    stores = [cfg.stores] if isinstance(cfg.stores, str) else list(cfg.stores)
    manifests = [read_manifest(p) for p in stores]
    target_config = tc = load_config(cfg.target)
    mask_token_id = resolve_mask_token(cfg, manifests, tc.vocab_size)
    draft_config = make_draft_config(
        target_config, mask_token_id=mask_token_id, num_draft_layers=cfg.num_draft_layers, block_size=cfg.block_size,
        target_layer_ids=cfg.layer_ids, num_target_features=cfg.num_target_features, intermediate_size=cfg.intermediate_size,
    )
    layer_ids = draft_config.dflash_config["target_layer_ids"]
    fingerprint = target_fingerprint(cfg.target) if cfg.check_target else None
    for path, manifest in zip(stores, manifests):
        check_store(path, manifest, layer_ids=layer_ids, hidden_size=tc.hidden_size, vocab_size=tc.vocab_size,
                    mask_token_id=mask_token_id, target=fingerprint)
    gamma = cfg.gamma if cfg.gamma is not None else default_gamma(cfg.block_size)
    data = TrainingData(stores, layer_ids=layer_ids, block_size=cfg.block_size, num_anchors=cfg.num_anchors,
                        max_length=cfg.max_length, mask_token_id=mask_token_id, gamma=gamma, seed=cfg.seed,
                        heldout_fraction=cfg.heldout_fraction, teacher=cfg.soft_labels > 0,
                        anchor_uniform_share=cfg.anchor_uniform_share, anchor_follow=cfg.anchor_follow)
    plan_args = dict(token_budget=cfg.token_budget, world_size=world, rank=rank, grad_accum=cfg.grad_accum)
    plans = [data.plan(e, **plan_args) for e in range(cfg.epochs)]
    total_steps = sum(len(p.steps) for p in plans)
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    if total_steps == 0:
        raise ValueError(f"nothing to train: no sequence in {stores} has a valid anchor (block size {cfg.block_size}) "
                         f"outside the held-out part")
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if use_cuda else "gloo")
    out = Path(cfg.out_dir)
    ckpt_root = out / "checkpoints"
    tag = latest_tag(ckpt_root) if cfg.resume else None
    saved = (read_client_state(ckpt_root, tag) or {}).get("dtype", "legacy") if tag else None
    dtype = training_dtype(cfg.dtype, device, resumed=saved)
    bf16 = dtype == torch.bfloat16

    eval_data = data
    if cfg.eval_stores:
        eval_paths = [cfg.eval_stores] if isinstance(cfg.eval_stores, str) else list(cfg.eval_stores)
        for path in eval_paths:
            check_store(path, read_manifest(path), layer_ids=layer_ids, hidden_size=tc.hidden_size,
                        vocab_size=tc.vocab_size, mask_token_id=mask_token_id, target=fingerprint)
        eval_data = TrainingData(eval_paths, layer_ids=layer_ids, block_size=cfg.block_size, num_anchors=cfg.num_anchors,
                                 max_length=cfg.max_length, mask_token_id=mask_token_id, gamma=gamma, seed=cfg.seed,
                                 heldout_fraction=1.0)
    heldout = eval_data.plan(0, split="heldout", token_budget=cfg.token_budget, world_size=world, rank=rank)

    # --- model, frozen head, engine
    torch.manual_seed(cfg.seed)
    drafter = DFlashDrafter(draft_config)
    if cfg.init == "target":
        first = tc.num_hidden_layers - cfg.num_draft_layers
        wanted = tuple(f".layers.{j}." for j in range(first, tc.num_hidden_layers))
        tensors = read_target_tensors(cfg.target, lambda n: n.endswith("norm.weight") or any(w in n for w in wanted))
        drafter.init_from_target(tensors, prefix=_layer_prefix(tensors))
    elif cfg.init != "random":
        init_from_drafter(drafter, cfg.init)
    head = load_frozen_head(cfg.target, dtype=dtype).to(device)
    vocab = None
    if 0 < cfg.loss_vocab < tc.vocab_size:
        vocab = torch.from_numpy(data.frequent_tokens(cfg.loss_vocab, tc.vocab_size)).to(device)
    engine, scheduler = build_engine(
        drafter, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas,
        warmup_steps=math.ceil(cfg.warmup_ratio * total_steps), total_steps=total_steps,
        zero_stage=cfg.zero_stage, grad_accum=cfg.grad_accum, grad_clip=cfg.grad_clip, bf16=bf16,
    )
    if cfg.compile == "true" or cfg.compile is True or (cfg.compile == "auto" and use_cuda):
        engine.compile(compile_kwargs={"dynamic": True})

    epoch, start_step, global_step, tokens_seen, last_saved = 0, 0, 0, 0, -1
    if tag:
        state = load_checkpoint(engine, ckpt_root, tag)
        epoch, start_step, global_step = state["epoch"], state["step_in_epoch"], state["global_step"]
        tokens_seen = state.get("tokens_seen", 0)
        last_saved = global_step
        if rank == 0:
            print(f"resumed from {ckpt_root / tag}: epoch {epoch}, step {global_step}", flush=True)
    log = MetricsLog(out, enabled=rank == 0, wandb_mode=cfg.wandb_mode, project=cfg.wandb_project,
                     entity=cfg.wandb_entity, name=cfg.run_name, config={**asdict(cfg), "dtype": dtype_name(dtype)},
                     resume_step=global_step if tag else 0)

    def export(path: Path):
        state = gathered_state_dict(engine)
        if rank == 0:
            export_drafter(DFlashDrafter, draft_config, state, path, dtype=dtype)
            if cfg.drafter_dir:
                export_drafter(DFlashDrafter, draft_config, state, Path(cfg.drafter_dir), dtype=dtype)

    def checkpoint(epoch_, step_in_epoch):
        save_checkpoint(engine, ckpt_root, global_step,
                        {"epoch": epoch_, "step_in_epoch": step_in_epoch, "global_step": global_step,
                         "tokens_seen": tokens_seen, "dtype": dtype_name(dtype), "train_config": asdict(cfg)},
                        export=export, keep=cfg.keep_checkpoints)

    def evaluate() -> dict:
        if not heldout.steps:
            return {}
        engine.eval()
        loss_sum = torch.zeros(2, dtype=torch.float64)  # loss, micro-batches
        vec = torch.zeros(2 * cfg.block_size + 2, dtype=torch.float64)
        with torch.no_grad():
            for mbs in heldout.steps[: cfg.eval_batches]:
                for idx in mbs:
                    batch = eval_data.batch(idx, 0).to(device, dtype)
                    loss, stats = forward_loss(engine, head, batch, block_size=cfg.block_size, attention=attention, ce_chunk=cfg.ce_chunk)
                    loss_sum += torch.tensor([loss.item(), 1.0], dtype=torch.float64)
                    vec += _stats_vector(stats)
        engine.train()
        _all_sum(loss_sum), _all_sum(vec)
        m = summarize(_stats_from(vec, cfg.block_size), float(loss_sum[0]), int(loss_sum[1]))
        return {f"eval/{k}": v for k, v in m.items()}

    engine.train()
    bar = tqdm(total=total_steps, initial=global_step, desc="train", unit="step", disable=rank != 0 or not cfg.progress)
    final = {}
    try:
        while epoch < cfg.epochs and global_step < total_steps:
            steps = plans[epoch].steps
            loader = Prefetcher(data, [mb for s in steps[start_step:] for mb in s], epoch,
                                workers=cfg.loader_workers, depth=cfg.prefetch, pin_memory=use_cuda)
            for t in range(start_step, len(steps)):
                t0, wait0 = time.perf_counter(), loader.wait_s
                lr = scheduler.get_last_lr()[0]
                loss_sum = torch.zeros(2, dtype=torch.float64)  # loss, tokens
                vec = torch.zeros(2 * cfg.block_size + 2, dtype=torch.float64)
                moved_sum = 0.0
                for _ in range(cfg.grad_accum):
                    batch = next(loader).to(device, dtype)
                    if cfg.anchor_follow > 0:
                        accepted = accepted_lengths(engine, head, batch, block_size=cfg.block_size, attention=attention)
                        batch, moved = data.follow(batch, accepted.cpu().numpy(), epoch)
                        batch, moved_sum = batch.to(device, dtype), moved_sum + moved
                    loss, stats = forward_loss(engine, head, batch, block_size=cfg.block_size, attention=attention, ce_chunk=cfg.ce_chunk,
                                               soft_labels=cfg.soft_labels, vocab=vocab)  # fmt: skip
                    bad = _all_sum(torch.tensor([0.0 if torch.isfinite(loss).item() else 1.0]))
                    if bad.item():
                        raise TrainingDiverged(
                            f"loss is {loss.item()} at epoch {epoch}, step {global_step + 1} (sequences {batch.seq_ids[:4]}...); "
                            f"stopped; the last good checkpoint is {latest_tag(ckpt_root) or 'none (no checkpoint yet)'} in {ckpt_root}")
                    engine.backward(loss)
                    engine.step()
                    loss_sum += torch.tensor([loss.item(), batch.tokens], dtype=torch.float64)
                    vec += _stats_vector(stats)
                global_step += 1
                _all_sum(loss_sum), _all_sum(vec)
                tokens_seen += int(loss_sum[1])
                dt = time.perf_counter() - t0
                gn = engine.get_global_grad_norm()
                m = summarize(_stats_from(vec, cfg.block_size), float(loss_sum[0]), cfg.grad_accum * world)
                m.update(lr=lr, grad_norm=float(gn) if gn is not None else math.nan, tokens_per_s=float(loss_sum[1]) / dt,
                         step_time_s=dt, loader_wait_s=loader.wait_s - wait0, epoch=epoch, tokens_seen=tokens_seen)
                if cfg.anchor_follow > 0:
                    m["anchors_moved"] = moved_sum / cfg.grad_accum  # this rank's share of anchors at follow-on starts
                final = m
                if (cfg.log_every and global_step % cfg.log_every == 0) or global_step == total_steps:
                    log.log(m, global_step)
                bar.set_postfix(loss=f"{m['loss']:.3f}", tau=f"{m['tau']:.2f}", lr=f"{lr:.2e}")
                bar.update(1)
                if cfg.eval_every and global_step % cfg.eval_every == 0:
                    ev = evaluate()
                    if ev:
                        log.log(ev, global_step)
                        final.update(ev)
                done = global_step >= total_steps
                if (cfg.checkpoint_every and global_step % cfg.checkpoint_every == 0) or done:
                    next_epoch, next_step = (epoch, t + 1) if t + 1 < len(steps) else (epoch + 1, 0)
                    checkpoint(next_epoch, next_step)
                    last_saved = global_step
                if done:
                    break
            loader.close()
            if global_step >= total_steps:
                break
            epoch, start_step = epoch + 1, 0
        if last_saved != global_step:
            checkpoint(epoch, start_step)
        if not (cfg.eval_every and global_step % cfg.eval_every == 0):
            ev = evaluate()
            if ev:
                log.log(ev, global_step)
                final.update(ev)
    finally:
        bar.close()
        log.close()
    if rank == 0:
        print(f"done: {global_step} steps; drafter at {cfg.drafter_dir or ckpt_root / (latest_tag(ckpt_root) or '')}", flush=True)
    return {"global_step": global_step, **final}
