"""The trainer's device-dependent choices. Each is a TrainConfig setting whose `auto` resolves here, by whether the
machine has CUDA (an argument, so that a test on a CPU resolves them for CUDA too), and the run says once, at its
start, what each became and why (the dtype, which a CPU times, is resolved by `trainer.engine.training_dtype`). A
value other than auto is taken as given, so a CPU run can take the GPU side of each setting a CPU can execute."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashdraft.config import TrainConfig
from flashdraft.model import ATTENTION_KERNELS

# train.compile's and train.pin_memory's values (on/off as the data settings' switches say it)
SWITCHES = {"auto": "auto", "true": "true", "on": "true", "false": "false", "off": "false"}


@dataclass
class DeviceSettings:
    """The resolved choices; `reasons` holds, for each setting that was `auto`, why it became what it is."""

    device: torch.device
    attention: str  # flex | dense
    dense_kv_heads: str  # grouped | expanded (flashdraft.model._dense_attention)
    compile: bool  # torch.compile the drafter (DeepSpeed's engine.compile)
    dist_backend: str  # torch.distributed's backend string
    pin_memory: bool  # the loader pins micro-batches for asynchronous copies to the GPU
    reasons: dict[str, str] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def describe(self, dtype: torch.dtype, dtype_reason: str | None = None) -> str:
        """One line: every choice, and why for those that were auto."""
        reasons = {**self.reasons, **({"dtype": dtype_reason} if dtype_reason else {})}
        values = {
            "device": str(self.device),
            "dtype": str(dtype).removeprefix("torch."),
            "attention": self.attention,
            "dense_kv_heads": self.dense_kv_heads,
            "compile": str(self.compile).lower(),
            "dist_backend": self.dist_backend,
            "pin_memory": str(self.pin_memory).lower(),
        }
        parts = [f"{k}={v}" + (f" ({reasons[k]})" if k in reasons else "") for k, v in values.items()]
        return "train settings: " + "; ".join(parts)


def trains_on_cuda(device: str, cuda_available: bool) -> bool:
    """Whether train.device (auto | cpu | cuda) puts the training on CUDA, on a machine with CUDA or without."""
    device = str(device).lower()
    return device == "cuda" or (device == "auto" and cuda_available)


def resolve_device_settings(cfg: TrainConfig, *, cuda_available: bool, local_rank: int = 0) -> DeviceSettings:
    """cfg's device-dependent settings for a process whose machine has CUDA or not (`cuda_available`)."""
    checked(cfg)
    use_cuda = trains_on_cuda(cfg.device, cuda_available)
    if use_cuda and not cuda_available:
        raise ValueError("train.device=cuda, but this machine (or this torch build) has no CUDA device")
    kind, reasons = ("CUDA" if use_cuda else "CPU"), {}
    if cfg.device.lower() == "auto":
        reasons["device"] = "auto: " + ("CUDA is available" if cuda_available else "no CUDA device")

    def auto(name: str, on_cuda: str, on_cpu: str, why: str = "") -> str:
        """Setting `name` as given, or its auto resolved for this process's device (the reason noted)."""
        value = str(getattr(cfg, name)).lower()
        if value != "auto":
            return value
        reasons[name] = f"auto: {kind}" + (f", {why}" if why else "")
        return on_cuda if use_cuda else on_cpu

    why = "its kernel and block masks compiled" if use_cuda else "FlexAttention has no backward on a CPU"
    attention = auto("attention", "flex", "dense", why)
    why = "SDPA's memory-efficient kernel takes a mask but not grouped heads" if use_cuda else "SDPA's grouped call"
    dense_kv_heads = auto("dense_kv_heads", "expanded", "grouped", why)
    compile_ = SWITCHES[auto("compile", "true", "false")] == "true"
    why = "nccl for CUDA tensors, gloo for the few CPU ones" if use_cuda else ""
    dist_backend = auto("dist_backend", "cpu:gloo,cuda:nccl", "gloo", why)
    pin_memory = SWITCHES[auto("pin_memory", "true", "false")] == "true"
    if pin_memory and not cuda_available:
        raise ValueError("train.pin_memory=true needs CUDA: pinned memory only speeds up copies to a GPU")
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    return DeviceSettings(device, attention, dense_kv_heads, compile_, dist_backend, pin_memory, reasons)


def checked(cfg: TrainConfig) -> None:
    """Refuse, by name, a device-dependent setting outside its choices."""
    choices = {
        "device": ("auto", "cpu", "cuda"),
        "attention": ("auto", "flex", "dense"),
        "dense_kv_heads": ATTENTION_KERNELS["dense_kv_heads"],
        "compile": tuple(SWITCHES),
        "pin_memory": tuple(SWITCHES),
    }
    for name, allowed in choices.items():
        value = getattr(cfg, name)
        if str(value).lower() not in allowed:
            raise ValueError(f"train.{name} must be one of {list(allowed)}, got {value!r}")
