"""The training loop: feature stores -> a drafter, under DeepSpeed, with checkpoints, eval and metrics.

`train` reads top to bottom: the drafter spec from the stores, the run's lock, then `train_run`: the data and its
plan, the drafter and the frozen head, the engine, a resume, then step after step (batch, loss, backward, step, log,
eval, checkpoint). What the ranks share is done by small helpers: the steps' sums over ranks at each sync
(`sync_steps`; the eval's, `trainer.metrics.summed_over_ranks`), the weights gathered for rank 0's export.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import closing
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from flashdraft.config import DrafterConfig, TrainConfig
from flashdraft.model import DFlashDrafter
from flashdraft.modelcard import (
    OFFLINE_EVAL,
    offline_eval_text,
    set_card_section,
    store_facts,
    train_recipe,
    write_card,
)
from flashdraft.spec import TRAINED_THINKING_KEY, DraftSpec
from flashdraft.speculators_format import PEER_SUFFIX, to_speculators
from flashdraft.target import load_config, load_frozen_head, text_config
from trainer.checkpoint import (
    export_drafter,
    latest_tag,
    load_checkpoint,
    read_client_state,
    remove_unfinished_saves,
    resume_tag,
    save_checkpoint,
)
from trainer.data import Plan, Prefetcher, TrainingData
from trainer.drafter import (
    check_basis,
    drafter_spec,
    features_basis,
    init_weights,
    projected_config,
    stores_projection,
    trained_thinking,
)
from trainer.engine import (
    all_sum,
    build_engine,
    dtype_name,
    gathered_state_dict,
    init_distributed,
    is_rank_zero,
    setup_distributed_env,
    training_dtype,
)
from trainer.loss import default_gamma
from trainer.metrics import COUNT, LOSS, NONFINITE, MetricsLog, Tally, summarize_values, summed_over_ranks
from trainer.objective import forward_loss
from trainer.run_lock import trainer_lock
from trainer.settings import DeviceSettings, resolve_device_settings
from trainer.store_verify import MODES, verify_stores


class TrainingDiverged(RuntimeError):
    """The loss became NaN/Inf; the last good checkpoint is kept."""


@dataclass
class Process:
    """Where this process trains: its rank among `world`, its device-dependent settings, its dtype."""

    rank: int
    world: int
    settings: DeviceSettings
    dtype: torch.dtype | None = None  # known once the process group is up (`training_dtype`)

    @property
    def device(self) -> torch.device:
        return self.settings.device

    @property
    def attention(self) -> str:
        return self.settings.attention

    @property
    def cuda(self) -> bool:
        return self.settings.cuda


@dataclass
class Progress:
    """Where the run stands: the next step to take (epoch, step in it) and what was done. Saved in checkpoints."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    tokens_seen: int = 0

    def advance(self, epoch: int, t: int, num_steps: int) -> None:
        """Step t of the `num_steps` of `epoch` is done (its tokens are added when its sums reach the host)."""
        self.global_step += 1
        self.epoch, self.step_in_epoch = (epoch, t + 1) if t + 1 < num_steps else (epoch + 1, 0)


@dataclass
class StepRecord:
    """An optimizer step as the host knows it without waiting for the device, whose sums stay there until a sync."""

    epoch: int
    step: int  # the global step it was, from 1
    lr: float
    sums: Tally  # this rank's, on the device
    seq_ids: list  # this rank's sequences, named if its loss was not finite
    loader_wait_s: float


@dataclass
class Forward:
    """A micro-batch through the drafter and the loss, as this run computes them (eval: hard labels, all words)."""

    head: torch.nn.Module
    process: Process
    block_size: int
    ce_chunk: int
    soft_labels: float = 0.0
    vocab: torch.Tensor | None = None

    def __call__(self, engine, batch, *, training: bool = True):
        batch = batch.to(self.process.device, self.process.dtype)
        loss, stats = forward_loss(
            engine,
            self.head,
            batch,
            block_size=self.block_size,
            attention=self.process.attention,
            ce_chunk=self.ce_chunk,
            soft_labels=self.soft_labels if training else 0.0,
            vocab=self.vocab if training else None,
        )
        return batch, loss, stats


def train(cfg: TrainConfig, drafter: DrafterConfig) -> dict:
    """Train a drafter of shape `drafter` on `cfg.stores`; returns the last step's metrics (and the last eval's)."""
    proc = start_process(cfg)
    target_config = load_config(cfg.target)
    spec = drafter_spec(cfg, drafter, target_config)
    projection = stores_projection(cfg, drafter)  # None: raw features
    init_distributed(proc.settings.dist_backend)
    with trainer_lock(cfg.out_dir):  # one trainer a run: refused here, naming the other, before anything is written
        return train_run(cfg, proc, spec, target_config, projection)


def train_run(cfg: TrainConfig, proc: Process, spec: DraftSpec, target_config, projection) -> dict:
    """The run, under its lock: data, drafter, engine, a resume, then the steps; returns what `train` does."""
    stores = [*cfg.stores, *(cfg.eval_stores or [])]
    verify_stores(stores, cfg.verify_store, fraction=cfg.verify_sample, rank=proc.rank, world=proc.world)
    data = training_data(cfg, spec, cfg.stores, heldout_fraction=cfg.heldout_fraction, teacher=cfg.soft_labels > 0)
    plans, total_steps = plan_epochs(data, cfg, proc)
    ckpt_root = Path(cfg.out_dir) / "checkpoints"
    remove_unfinished_saves(ckpt_root)  # safe under the lock: no other trainer is saving here
    tag = resume_tag(ckpt_root) if cfg.resume else None  # latest, or the newest intact checkpoint (said)
    resumed_dtype = check_resume(ckpt_root, tag, cfg, projection) if tag else None
    proc.dtype = training_dtype(cfg.dtype, proc.device, resumed=resumed_dtype)
    say_settings(cfg, proc, resumed=tag is not None)
    eval_data, heldout = heldout_plan(cfg, spec, data, proc)

    torch.manual_seed(cfg.seed)
    draft_config = projected_config(spec.draft_config(target_config), projection)
    setattr(draft_config, TRAINED_THINKING_KEY, trained_thinking(data.thinking_modes()))  # provenance for the harness
    model = DFlashDrafter(draft_config).set_attention_kernels(dense_kv_heads=proc.settings.dense_kv_heads)
    init_weights(model, cfg.init, cfg.target, target_config, projection)
    head = load_frozen_head(cfg.target, dtype=proc.dtype).to(proc.device)
    vocab = loss_vocabulary(data, cfg.loss_vocab, text_config(target_config).vocab_size, proc.device)
    forward = Forward(head, proc, spec.block_size, cfg.ce_chunk, cfg.soft_labels, vocab)
    engine, scheduler = make_engine(model, cfg, proc, total_steps)
    progress = resume(engine, ckpt_root, tag) if tag else Progress()
    last_saved = progress.global_step if tag else -1
    log = open_log(cfg, spec, proc, resume_step=progress.global_step if tag else 0)
    save = partial(save_run, engine, ckpt_root, cfg, draft_config, proc.dtype, projection, metrics_path=log.path)
    evaluate = partial(evaluate_heldout, engine, forward, eval_data, heldout, cfg.eval_batches)
    sync = partial(sync_steps, engine, proc, cfg.grad_accum, progress, ckpt_root)

    engine.train()
    bar = progress_bar(cfg, total_steps, progress.global_step)
    log_every = logged_steps(cfg)
    final, good_steps, unsynced, since = {}, 0, [], time.perf_counter()
    try:
        with closing(step_loaders(data, plans, replace(progress), total_steps, cfg, proc.settings)) as steps:
            for epoch, t, num_steps, loader in steps:
                lr, wait0 = scheduler.get_last_lr()[0], loader.wait_s
                sums, seq_ids = train_step(engine, forward, loader, cfg.grad_accum)
                progress.advance(epoch, t, num_steps)
                step, stopping = progress.global_step, False
                unsynced.append(StepRecord(epoch, step, lr, sums, seq_ids, loader.wait_s - wait0))
                bar.update(1)
                logged = every(log_every, step) or step >= total_steps
                if logged or every(cfg.eval_every, step) or every(cfg.checkpoint_every, step):
                    final = sync(unsynced, since)  # the one wait for the device (raises where a loss was not finite)
                    unsynced = []
                    good_steps = good_steps + 1 if reached_stop_tau(cfg.stop_tau, final) else 0
                    stopping = good_steps >= max(1, cfg.stop_steps)
                    bar.set_postfix(loss=f"{final['loss']:.3f}", tau=f"{final['tau']:.2f}", lr=f"{lr:.2e}")
                if logged or stopping:
                    log.log(final, step)
                if every(cfg.eval_every, step):
                    final.update(log_eval(log, evaluate(), step))
                if every(cfg.checkpoint_every, step) or step >= total_steps or stopping:
                    last_saved = save(progress)
                if stopping:
                    say_stopped(cfg, final, good_steps, step)
                    break
                if not unsynced:
                    since = time.perf_counter()  # the next steps' time starts after this one's eval and save
        if unsynced:
            final = sync(unsynced, since)
        if last_saved != progress.global_step:
            save(progress)
        if not every(cfg.eval_every, progress.global_step):
            final.update(log_eval(log, evaluate(), progress.global_step))
            refresh_offline_eval(cfg, ckpt_root, log.path)  # the last export's card: this eval came after it
    finally:
        bar.close()
        log.close()
    if is_rank_zero():
        where = cfg.drafter_dir or ckpt_root / (latest_tag(ckpt_root) or "")
        print(f"done: {progress.global_step} steps; drafter at {where}", flush=True)
    return {"global_step": progress.global_step, **final}


def start_process(cfg: TrainConfig) -> Process:
    """The distributed environment, the device and its settings, and the settings checked before anything is read."""
    rank, world, local_rank = setup_distributed_env()
    settings = resolve_device_settings(cfg, cuda_available=torch.cuda.is_available(), local_rank=local_rank)
    if settings.cuda:
        torch.cuda.set_device(settings.device)
    if cfg.dtype not in ("auto", "bfloat16", "float32"):
        raise ValueError(f"train.dtype must be auto, bfloat16 or float32, got {cfg.dtype!r}")
    if not 0.0 <= cfg.soft_labels <= 1.0:
        raise ValueError(f"train.soft_labels must be in [0, 1], got {cfg.soft_labels}")
    if cfg.loss_vocab < 0:
        raise ValueError(
            f"train.loss_vocab must be 0 (the whole vocabulary) or a number of words, got {cfg.loss_vocab}"
        )
    if cfg.verify_store not in MODES or not 0.0 < cfg.verify_sample <= 1.0:
        raise ValueError(
            f"train.verify_store must be one of {MODES} (got {cfg.verify_store!r}) and train.verify_sample a share "
            f"in (0, 1] (got {cfg.verify_sample})"
        )
    return Process(rank, world, settings)


def say_settings(cfg: TrainConfig, proc: Process, *, resumed: bool) -> None:
    """The device-dependent settings as resolved, once (rank 0)."""
    if not is_rank_zero():
        return
    why = None
    if cfg.dtype == "auto":
        why = "auto: the checkpoint's" if resumed else ("auto: CUDA" if proc.cuda else "auto: timed, above")
    print(proc.settings.describe(proc.dtype, why), flush=True)


def logged_steps(cfg: TrainConfig) -> int:
    """train.log_every, or 1 where train.stop_tau needs every step's tau on the host (said once)."""
    if cfg.stop_tau is None or cfg.log_every == 1:
        return cfg.log_every
    if is_rank_zero():
        print(f"train.stop_tau is set: every step is logged (train.log_every={cfg.log_every} taken as 1)", flush=True)
    return 1


def say_stopped(cfg: TrainConfig, final: dict, good_steps: int, step: int) -> None:
    if is_rank_zero():
        print(
            f"training tau {final['tau']:.2f}: train.stop_tau {cfg.stop_tau:g} reached on "
            f"{good_steps} steps in a row at step {step}: stopped",
            flush=True,
        )


def training_data(cfg: TrainConfig, spec: DraftSpec, stores, *, heldout_fraction: float, teacher: bool = False):
    gamma = cfg.gamma if cfg.gamma is not None else default_gamma(spec.block_size)
    return TrainingData(
        stores,
        layer_ids=list(spec.target_layer_ids),
        block_size=spec.block_size,
        num_anchors=cfg.num_anchors,
        max_length=cfg.max_length,
        mask_token_id=spec.mask_token_id,
        gamma=gamma,
        seed=cfg.seed,
        heldout_fraction=heldout_fraction,
        teacher=teacher,
    )


def heldout_plan(cfg: TrainConfig, spec: DraftSpec, data: TrainingData, proc: Process) -> tuple[TrainingData, Plan]:
    """The eval data (train.eval_stores, or the held-out part of the training stores) and this rank's plan of it;
    a plan with nothing in it is said once, here."""
    eval_data = training_data(cfg, spec, cfg.eval_stores, heldout_fraction=1.0) if cfg.eval_stores else data
    heldout = eval_data.plan(0, split="heldout", token_budget=cfg.token_budget, world_size=proc.world, rank=proc.rank)
    if not heldout.steps and is_rank_zero():
        print(no_eval_note(cfg, eval_data), flush=True)
    return eval_data, heldout


def plan_epochs(data: TrainingData, cfg: TrainConfig, proc: Process) -> tuple[list[Plan], int]:
    """Every epoch's plan for this rank, and the number of steps to train (all of them, or max_steps)."""
    plans = [
        data.plan(e, token_budget=cfg.token_budget, world_size=proc.world, rank=proc.rank, grad_accum=cfg.grad_accum)
        for e in range(cfg.epochs)
    ]
    total_steps = sum(len(p.steps) for p in plans)
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    if total_steps == 0:
        raise ValueError(
            f"nothing to train: no sequence in {cfg.stores} has a valid anchor (block size "
            f"{data.block_size}) outside the held-out part"
        )
    return plans, total_steps


def loss_vocabulary(data: TrainingData, size: int, vocab_size: int, device) -> torch.Tensor | None:
    """The training softmax's words (train.loss_vocab), or None for the whole vocabulary. `data`'s batches then carry
    their own loss words, counted on the host."""
    if 0 < size < vocab_size:
        data.loss_vocab = data.frequent_tokens(size, vocab_size)
        return torch.from_numpy(data.loss_vocab).to(device)
    return None


def make_engine(model: DFlashDrafter, cfg: TrainConfig, proc: Process, total_steps: int):
    """(engine, scheduler): DeepSpeed around the drafter, compiled where the settings say (auto: on GPU)."""
    engine, scheduler = build_engine(
        model,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        betas=cfg.betas,
        total_steps=total_steps,
        warmup_steps=math.ceil(cfg.warmup_ratio * total_steps),
        zero_stage=cfg.zero_stage,
        grad_accum=cfg.grad_accum,
        grad_clip=cfg.grad_clip,
        bf16=proc.dtype == torch.bfloat16,
    )
    if proc.settings.compile:
        engine.compile(compile_kwargs={"dynamic": True})
    return engine, scheduler


def open_log(cfg: TrainConfig, spec: DraftSpec, proc: Process, *, resume_step: int) -> MetricsLog:
    """metrics.jsonl and W&B, written by rank 0."""
    w = cfg.wandb
    config = {**asdict(cfg), "drafter": asdict(spec), "dtype": dtype_name(proc.dtype)}
    return MetricsLog(
        cfg.out_dir,
        enabled=is_rank_zero(),
        wandb_mode=w.mode,
        project=w.project,
        entity=w.entity,
        name=w.name,
        config=config,
        resume_step=resume_step,
    )


def progress_bar(cfg: TrainConfig, total_steps: int, done: int) -> tqdm:
    quiet = not is_rank_zero() or not cfg.progress
    return tqdm(total=total_steps, initial=done, desc="train", unit="step", disable=quiet)


def saved_dtype(ckpt_root: Path, tag: str) -> str:
    """The dtype the checkpoint `tag` was trained in; a checkpoint that does not say is refused."""
    saved = (read_client_state(ckpt_root, tag) or {}).get("dtype")
    if saved is None:
        raise ValueError(
            f"checkpoint {ckpt_root / tag} does not record the dtype it was trained in (written by an older "
            f"trainer): train into another train.out_dir"
        )
    return saved


def check_resume(ckpt_root: Path, tag: str, cfg: TrainConfig, projection) -> str:
    """The dtype to resume the checkpoint `tag` in, once its feature basis is checked against the stores'
    (`check_basis`: refused by name where a store was recreated with another)."""
    check_basis(ckpt_root / tag, read_client_state(ckpt_root, tag) or {}, projection, cfg.stores)
    return saved_dtype(ckpt_root, tag)


def resume(engine, ckpt_root: Path, tag: str) -> Progress:
    """Weights, optimizer, scheduler and RNG from the checkpoint `tag`; where the run stands."""
    state = load_checkpoint(engine, ckpt_root, tag)
    progress = Progress(state["epoch"], state["step_in_epoch"], state["global_step"], state.get("tokens_seen", 0))
    if is_rank_zero():
        print(f"resumed from {ckpt_root / tag}: epoch {progress.epoch}, step {progress.global_step}", flush=True)
    return progress


def step_loaders(
    data: TrainingData, plans: list[Plan], start: Progress, total_steps: int, cfg: TrainConfig, settings: DeviceSettings
):
    """(epoch, step, steps in the epoch, loader) for the steps from `start` up to `total_steps`; one prefetching
    loader an epoch, which yields each step's `grad_accum` micro-batches in turn."""
    remaining = total_steps - start.global_step
    for epoch in range(start.epoch, len(plans)):
        steps = plans[epoch].steps
        first = start.step_in_epoch if epoch == start.epoch else 0
        last = min(len(steps), first + remaining)
        if last <= first:
            return
        loader = Prefetcher(
            data,
            [mb for s in steps[first:] for mb in s],
            epoch,
            workers=cfg.loader_workers,
            depth=cfg.prefetch,
            pin_memory=settings.pin_memory,
        )
        try:
            for t in range(first, last):
                yield epoch, t, len(steps), loader
        finally:
            loader.close()
        remaining -= last - first


def train_step(engine, forward: Forward, loader, grad_accum: int) -> tuple[Tally, list]:
    """One optimizer step over `grad_accum` micro-batches (DeepSpeed steps at the last): this rank's sums, kept on
    the device (a loss that is not finite is counted there, and found at the next sync), and its sequences."""
    tally, seq_ids = Tally(forward.block_size, forward.process.device), []
    for _ in range(grad_accum):
        batch, loss, stats = forward(engine, next(loader))
        engine.backward(loss)
        engine.step()
        tally.add(loss, batch.tokens, stats)
        seq_ids += batch.seq_ids
    return tally, seq_ids


def sync_steps(
    engine, proc: Process, grad_accum: int, progress: Progress, ckpt_root: Path, steps: list[StepRecord], since: float
) -> dict:
    """The steps since the last sync brought to the host: the one wait for the device every train.log_every steps.
    Every rank calls it alike: one collective of every step's sums and the grad norm, one copy to the host. Stops
    every rank (TrainingDiverged) where a loss was not finite; else adds the steps' tokens to `progress` and returns
    the last step's metrics (the loss's summed over the ranks; time and throughput over the steps since `since`)."""
    width = steps[-1].sums.values.numel()
    sums = torch.stack([s.sums.values for s in steps]).flatten()
    norm = engine.get_global_grad_norm()  # the last step's, the same on every rank: rank 0's is summed
    on_device = isinstance(norm, torch.Tensor)
    extra = norm.detach().double().reshape(1).to(sums.device) if on_device and proc.rank == 0 else sums.new_zeros(1)
    host = all_sum(torch.cat([sums, extra])).tolist()
    rows = [host[i * width : (i + 1) * width] for i in range(len(steps))]
    grad_norm = host[-1] if on_device else (float(norm) if norm is not None else math.nan)
    for record, row in zip(steps, rows):
        if row[NONFINITE]:
            raise TrainingDiverged(
                f"loss is {row[LOSS]} at epoch {record.epoch}, step {record.step} (this rank's sequences "
                f"{record.seq_ids[:4]}...; found at step {steps[-1].step}, where the losses since the last sync reach "
                f"the host); stopped; the last good checkpoint is "
                f"{latest_tag(ckpt_root) or 'none (no checkpoint yet)'} in {ckpt_root}"
            )
    tokens = sum(row[COUNT] for row in rows)
    progress.tokens_seen += int(tokens)
    elapsed, last = time.perf_counter() - since, steps[-1]
    metrics = summarize_values(rows[-1], last.sums.block_size, grad_accum * proc.world)
    metrics.update(
        lr=last.lr,
        grad_norm=grad_norm,
        tokens_per_s=tokens / elapsed,
        step_time_s=elapsed / len(steps),
        loader_wait_s=sum(s.loader_wait_s for s in steps) / len(steps),
        epoch=last.epoch,
        tokens_seen=progress.tokens_seen,
    )
    return metrics


def evaluate_heldout(engine, forward: Forward, data: TrainingData, heldout: Plan, max_steps: int) -> dict:
    """eval/* metrics over the first `max_steps` steps of the held-out plan, summed over ranks ({} if none)."""
    if not heldout.steps:
        return {}
    engine.eval()
    tally = Tally(forward.block_size, forward.process.device)
    with torch.no_grad():
        for microbatches in heldout.steps[:max_steps]:
            for indices in microbatches:
                _, loss, stats = forward(engine, data.batch(indices, 0), training=False)
                tally.add(loss, 1, stats)
    engine.train()
    (values,) = summed_over_ranks([tally])  # one wait for the device
    return {f"eval/{k}": v for k, v in summarize_values(values, forward.block_size, int(values[COUNT])).items()}


def no_eval_note(cfg: TrainConfig, eval_data: TrainingData) -> str:
    """Why the run will log no eval/* metrics (no held-out sequence with a valid anchor), said once at the start:
    train.eval_every does nothing then."""
    usable = f"a valid anchor (block size {eval_data.block_size})"
    if cfg.eval_stores:
        why = f"train.eval_stores {list(cfg.eval_stores)} hold no sequence with {usable}"
    elif cfg.heldout_fraction <= 0:
        why = "nothing is held out (train.heldout_fraction=0 and no train.eval_stores)"
    else:
        held = int(eval_data.heldout.sum())
        why = (
            f"train.heldout_fraction={cfg.heldout_fraction} holds out {held} of the {len(eval_data)} sequences of "
            f"{list(cfg.stores)}, none with {usable}"
        )
    when = f"every {cfg.eval_every} steps" if cfg.eval_every else "at the end"
    return f"no eval/* metrics: {why}; train.eval_every={cfg.eval_every} (eval {when}) does nothing"


def log_eval(log: MetricsLog, metrics: dict, step: int) -> dict:
    if metrics:
        log.log(metrics, step)
    return metrics


def reached_stop_tau(stop_tau: float | None, metrics: dict) -> bool:
    """Whether a step's training tau (`metrics`, summed over ranks: every rank decides alike) reached train.stop_tau."""
    return stop_tau is not None and metrics.get("tau", -math.inf) >= stop_tau


def every(n: int, step: int) -> bool:
    return bool(n) and step % n == 0


def save_run(
    engine,
    ckpt_root: Path,
    cfg: TrainConfig,
    draft_config,
    dtype: torch.dtype,
    projection,
    progress: Progress,
    metrics_path: Path | None = None,
) -> int:
    """A checkpoint of the run as it stands, the drafter exported into it with its model card (all ranks; folded
    with the stores' `projection` where they are projected; the card's offline eval the newest in `metrics_path`);
    returns its step."""
    client_state = {
        **asdict(progress),
        "dtype": dtype_name(dtype),
        "features_basis": features_basis(projection),  # a resume on stores of another basis is refused
        "train_config": asdict(cfg),
    }
    verifier = cfg.target if cfg.export_speculators else None
    card = partial(drafter_card, cfg, draft_config, dtype, replace(progress), metrics_path)
    export = partial(
        export_copies, engine, draft_config, dtype, cfg.drafter_dir, projection=projection, peer=verifier, card=card
    )
    save_checkpoint(engine, ckpt_root, progress.global_step, client_state, export=export, keep=cfg.keep_checkpoints)
    return progress.global_step


def export_copies(
    engine, draft_config, dtype: torch.dtype, copy_to: str | None, path: Path, projection=None, peer=None, card=None
) -> None:
    """The drafter at `path` and at `copy_to`: every rank gathers the weights (a collective under ZeRO-3), rank 0
    writes. `peer` (the target, named as the verifier; None: not written): each also in the peer's format at
    `<folder>-speculators` beside it (train.export_speculators). `card()` (rank 0; None: no card): the function that
    writes a folder's model card (`drafter_card`)."""
    state = gathered_state_dict(engine)
    if is_rank_zero():
        write = card() if card is not None else None
        for out in [Path(path)] + ([Path(copy_to)] if copy_to else []):
            export_drafter(DFlashDrafter, draft_config, state, out, dtype=dtype, projection=projection, card=write)
            if peer is not None:
                to_speculators(out, out.with_name(out.name + PEER_SUFFIX), peer)


def drafter_card(cfg: TrainConfig, draft_config, dtype: torch.dtype, progress: Progress, metrics_path: Path | None):
    """`write_card` with this run's facts (flashdraft.modelcard): the target, the stores' counts and sources, the
    recipe as resolved, the steps trained and the newest held-out eval logged in `metrics_path`."""
    gamma = cfg.gamma if cfg.gamma is not None else default_gamma(draft_config.block_size)
    return partial(
        write_card,
        target=cfg.target,
        stores=store_facts(cfg.stores),
        eval_stores=store_facts(cfg.eval_stores),
        recipe=train_recipe(cfg, gamma, dtype_name(dtype)),
        steps=progress.global_step,
        tokens_seen=progress.tokens_seen,
        offline_eval=last_eval_row(metrics_path),
    )


def last_eval_row(metrics_path: Path | None) -> dict | None:
    """The newest eval/* row of the run's metrics.jsonl (None: none logged yet; a torn line, left by a killed run
    until its resume truncates the file, is passed over)."""
    if metrics_path is None or not Path(metrics_path).is_file():
        return None
    for line in reversed(Path(metrics_path).read_text().splitlines()):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "eval/tau" in row:
            return row
    return None


def refresh_offline_eval(cfg: TrainConfig, ckpt_root: Path, metrics_path: Path) -> None:
    """Rank 0: the offline eval of the last export's cards (in the latest checkpoint and at train.drafter_dir) made
    the newest logged, where an eval came after the export."""
    tag = latest_tag(ckpt_root)
    if not is_rank_zero() or tag is None:
        return
    text = offline_eval_text(last_eval_row(metrics_path))
    for folder in [ckpt_root / tag / "drafter"] + ([Path(cfg.drafter_dir)] if cfg.drafter_dir else []):
        set_card_section(folder, OFFLINE_EVAL, text)
