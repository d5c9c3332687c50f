"""What this CPU does fast, and the compute dtype a target runs in (`resolve_dtype`)."""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F


def _cpu_supports(probe_name: str) -> bool:
    probe = getattr(torch.cpu, probe_name, None)
    return bool(probe and probe())


def cpu_has_bf16_tiles() -> bool:
    """AMX bf16 tiles: there a bf16 matmul over 16 rows costs little more than over one row."""
    return _cpu_supports("_is_amx_tile_supported")


def cpu_has_fast_bf16() -> bool:
    """AMX tiles, or AVX512-BF16 dot products (AMD Zen 4, Intel Cooper Lake). Serving picks bf16 there: even where
    bf16 GEMMs are slower than fp32 ones, exact bf16 serving beats exact fp32, which pads more GEMM rows
    (docs/notebook.md). Training asks `cpu_bf16_gemm_speedup` instead."""
    return cpu_has_bf16_tiles() or _cpu_supports("_is_avx512_bf16_supported")


def cpu_bf16_gemm_speedup(rows: int = 256) -> float:
    """fp32 time / bf16 time of a training-sized GEMM on this CPU at the current thread count (> 1: bf16 is faster).
    Timed once a process: the forward and both backward products of a [rows, 576] x [576, 1536] linear, the
    dtypes interleaved, best of 3. AVX512-BF16 without AMX runs such GEMMs slower than fp32 on some CPUs and faster
    on others (docs/notebook.md), so the capability flags cannot decide."""
    return _bf16_gemm_speedup(rows, torch.get_num_threads())


@functools.cache
def _bf16_gemm_speedup(rows: int, threads: int) -> float:
    g = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(shape, generator=g) for shape in ((rows, 576), (1536, 576), (rows, 1536)))

    def seconds(dtype) -> float:
        a, b, c = x.to(dtype), w.to(dtype), dy.to(dtype)
        start = time.perf_counter()
        for _ in range(4):
            F.linear(a, b), c @ b, c.t() @ a
        return time.perf_counter() - start

    seconds(torch.bfloat16), seconds(torch.float32)  # first calls pick and warm the kernels
    best = {torch.bfloat16: float("inf"), torch.float32: float("inf")}
    for _ in range(3):
        for dtype in best:
            best[dtype] = min(best[dtype], seconds(dtype))
    return best[torch.float32] / best[torch.bfloat16]


def resolve_dtype(name: str, device) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA and on CPUs with fast bf16 (`cpu_has_fast_bf16`), else float32; other names
    as torch dtypes."""
    if name == "auto":
        on_cuda = torch.device(device).type == "cuda"
        return torch.bfloat16 if on_cuda or cpu_has_fast_bf16() else torch.float32
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}: use auto, bfloat16, float16 or float32")
    return dtype
