"""A capture worker's plan, made once its target is loaded: the decode's rows and prefill budget
(`flashdraft.target.budgets`), the threads writing shards, and whether the decode overlaps its steps and stages its
copies; each with the line that says why (the worker prints them as it starts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.target.budgets import capture_budgets
from pipeline.decode import default_overlap
from pipeline.hostcopy import default_staged
from pipeline.settings import CaptureSettings


@dataclass(frozen=True)
class WorkerPlan:
    batch_size: int  # decode rows
    prefill_tokens: int | None  # tokens a prefill holds (rows x longest); None: the joining prompts together
    threads: int  # threads writing shards; 0: in the decode loop
    overlap: bool  # a step's results read while the next one runs (`pipeline.decode`)
    staged: bool  # the decode's device-to-host copies staged through fresh host buffers (`pipeline.hostcopy`)
    lines: tuple[str, ...]  # why each is what it is


def plan_worker(settings: CaptureSettings, model, teacher_topk: int, cpu_threads: int) -> WorkerPlan:
    """The plan of a worker holding `model` (loaded on its device) that captures `teacher_topk` teacher rows a token;
    `cpu_threads`: the worker's torch threads (cluster.cpus_per_actor)."""
    device = model.device
    rows, prefill, lines = budgets(settings, model.config, model.dtype, teacher_topk, free_gpu_memory(device))
    threads, why = writer_threads(settings.writer_threads, device, cpu_threads)
    if threads:
        lines.append(f"shard writing off the decode loop: {threads} compression thread(s): {why}")
    else:
        lines.append(f"shard writing in the decode loop: {why}")
    overlap, staged = decode_switches(settings, device, lines)
    return WorkerPlan(rows, prefill, threads, overlap, staged, tuple(lines))


def free_gpu_memory(device: torch.device) -> int | None:
    """The GPU memory free now (once the target is loaded) on `device`; None on a CPU."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def budgets(settings: CaptureSettings, config, dtype, teacher_topk: int, free: int | None):
    """(decode rows, prefill token budget or None for unlimited, one line each saying why) of `settings` for a target
    of `config` in `dtype` (`capture_budgets`); `free`: the GPU memory free once the target is loaded, None on a
    CPU."""
    s = settings
    return capture_budgets(
        free,
        config,
        dtype,
        mode=s.mode,
        batch_size=s.batch_size,
        prefill_tokens=s.prefill_tokens,
        max_length=s.max_length,
        fraction=s.gpu_memory_fraction,
        captured_layers=len(s.layer_ids),
        teacher_topk=teacher_topk,
    )


def writer_threads(setting: int | str, device: torch.device, cpu_threads: int) -> tuple[int, str]:
    """(threads writing shards, why): data.writer_threads, or auto: on a GPU every CPU thread of the worker
    (`cpu_threads`: its torch threads, cluster.cpus_per_actor) but the decode loop's, so the host's work overlaps the
    device's; on a CPU 0, shards written in the decode loop (torch's threads compute the decode on every core; a
    writing thread would compete with them)."""
    if setting != "auto":
        return setting, "data.writer_threads"
    if torch.device(device).type == "cuda":
        return max(1, cpu_threads - 1), f"auto on a GPU: the worker's {cpu_threads} CPU thread(s) but the decode loop's"
    return 0, "auto on CPU"


def decode_switches(settings: CaptureSettings, device: torch.device, lines: list[str]) -> tuple[bool, bool]:
    """(overlap, staged copies) of the decode: data.overlap and data.staged_copies, auto by the device (on CUDA,
    where the device runs ahead of the host); a line each saying which and why goes to `lines`."""
    s = settings
    overlap = default_overlap(device) if s.overlap is None else s.overlap
    staged = default_staged(device) if s.staged_copies is None else s.staged_copies
    switches = (("overlap", overlap, s.overlap), ("staged copies", staged, s.staged_copies))
    for key, value, given in switches:
        name = "data." + key.replace(" ", "_")
        why = f"{name}={'on' if given else 'off'}" if given is not None else f"{name}=auto on {device.type}"
        lines.append(f"decode {key} {'on' if value else 'off'}: {why}")
    return overlap, staged
