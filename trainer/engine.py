"""DeepSpeed around the drafter: process group, training dtype, ZeRO stage, torch AdamW, cosine schedule, and the
collectives the loop needs (sums over ranks, the full weights on rank 0)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch

from flashdraft.target import cpu_bf16_gemm_speedup, resolve_dtype


def torch_extensions_dir() -> str:
    """DeepSpeed builds a shared-memory comm op on CPU at first start, which takes a while; cache it for good."""
    base = os.environ.get("FLASHDRAFT_CACHE", str(Path.home() / ".cache" / "flashdraft"))
    return str(Path(base) / "torch_extensions")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_distributed_env() -> tuple[int, int, int]:
    """Fill in the torch.distributed variables for a plain one-process start (else DeepSpeed looks
    for mpi4py); launchers (torchrun, deepspeed) set them. Returns (rank, world size, local rank)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", torch_extensions_dir())
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def backend_for(device: torch.device, gpu_backend: str = "nccl") -> str:
    """The process group's backend for a run on `device` (train.dist_backend=auto): gloo on a CPU; on a GPU,
    `gpu_backend` (nccl) for CUDA tensors and gloo for CPU ones. nccl alone serves CUDA tensors only, and a few
    collectives carry CPU tensors (a CPU run's dtype broadcast, the store check's objects); with it alone they stop
    with `No backend type associated with device type cpu`. (torch's own default on a GPU machine is the same
    pair.) The loop's sums stay on the device and take nccl."""
    return f"cpu:gloo,cuda:{gpu_backend}" if device.type == "cuda" else "gloo"


def init_distributed(device_or_backend: torch.device | str, gpu_backend: str = "nccl") -> None:
    """The process group: a backend string (train.dist_backend as resolved), or the device the run trains on, which
    takes `backend_for` it. DeepSpeed's `init_distributed` hands the string to torch's `init_process_group`."""
    import deepspeed

    backend = device_or_backend
    if not isinstance(backend, str):
        backend = backend_for(backend, gpu_backend)
    deepspeed.init_distributed(dist_backend=backend)


def is_rank_zero() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """`t` summed over the ranks, in place (a no-op for one process)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def training_dtype(name: str, device: torch.device, resumed: str | None = None) -> torch.dtype:
    """The dtype a run trains in. A resumed run keeps the one its checkpoint was saved in (`resumed`). Otherwise
    `auto` is bf16 on a GPU, and on a CPU whichever of bf16 and fp32 runs a training-sized GEMM faster, timed on
    rank 0 and broadcast so that every rank builds the same engine."""
    if resumed:
        if name not in ("auto", resumed):
            raise ValueError(
                f"train.dtype={name} cannot resume a run saved in {resumed}: pass train.dtype=auto or "
                f"{resumed}, or start afresh (train.resume=false or another out_dir)"
            )
        return resolve_dtype(resumed, device)
    if name != "auto" or device.type == "cuda":
        return resolve_dtype(name, device)
    import torch.distributed as dist

    first = is_rank_zero()
    speedup = cpu_bf16_gemm_speedup() if first else 0.0  # one rank times, alone on the cores it shares
    bf16 = torch.tensor([speedup > 1.0])
    if dist.is_initialized():
        dist.broadcast(bf16, src=0)
    if first:
        print(
            f"train.dtype=auto: {'bfloat16' if bf16 else 'float32'} (bf16 GEMMs run {speedup:.2f}x as fast as "
            f"fp32 ones on this CPU)",
            flush=True,
        )
    return torch.bfloat16 if bf16 else torch.float32


def deepspeed_config(*, zero_stage: int, grad_accum: int, grad_clip: float, bf16: bool) -> dict:
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0..3, got {zero_stage}")
    return {
        "train_micro_batch_size_per_gpu": 1,  # one micro-batch = one token-budgeted Batch
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def build_engine(
    drafter,
    *,
    lr: float,
    weight_decay: float,
    betas,
    warmup_steps: int,
    total_steps: int,
    zero_stage: int,
    grad_accum: int,
    grad_clip: float,
    bf16: bool,
):
    """(engine, scheduler). torch's fused AdamW is passed in: DeepSpeed's own needs a long build of its op."""
    import deepspeed
    from transformers import get_cosine_schedule_with_warmup

    decay = [p for n, p in drafter.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in drafter.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=tuple(betas),
        fused=True,  # one kernel for all parameters: a shorter optimizer step on CPU
    )
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup_steps, max(total_steps, 1))
    engine, _, _, scheduler = deepspeed.initialize(
        model=drafter,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=deepspeed_config(zero_stage=zero_stage, grad_accum=grad_accum, grad_clip=grad_clip, bf16=bf16),
    )
    return engine, scheduler


def gathered_state_dict(engine) -> dict | None:
    """Full drafter weights on rank 0 (None elsewhere); a collective under ZeRO-3."""
    import deepspeed
    import torch.distributed as dist

    module = engine.module
    rank = dist.get_rank() if dist.is_initialized() else 0
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()} if rank == 0 else None
        return state
    return {k: v.detach().cpu() for k, v in module.state_dict().items()} if rank == 0 else None
