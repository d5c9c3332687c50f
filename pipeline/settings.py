"""What a capture worker is told: its settings (`CaptureSettings`) and its tasks (`Task`: a shard's worth of prompts).

Both travel from the driver to every worker (pickled to Ray actors), so they are plain frozen values.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

from flashdraft.config import SamplingConfig
from flashdraft.prompts import PromptRecord, thinking_of


@dataclass(frozen=True)
class CaptureSettings:
    """What a capture worker does, every field given by its caller (`pipeline.__main__.settings_from`, from the
    model, data and cluster settings of flashdraft.config, where each default and its meaning is stated once)."""

    target: str
    layer_ids: tuple[int, ...]
    dtype: str  # the target's compute dtype (model.dtype)
    device: str
    mode: str  # regenerate | capture (records already carry responses)
    turns: str  # regenerate mode: all | single (data.turns)
    max_new_tokens: int
    max_length: int  # prompt + response, tokens
    max_prompt_tokens: int
    batch_size: int | str  # decode rows, or auto: from the free GPU memory (a CPU: a fixed number)
    prefill_tokens: int | str  # tokens a prefill holds (rows x longest), or auto (`flashdraft.target.budgets`)
    gpu_memory_fraction: float  # of the free GPU memory the auto sizes plan to fill
    sampling: SamplingConfig
    seed: int
    system_prompt: str | None
    enable_thinking: bool | None
    # set: each prompt's enable_thinking is drawn from its seq_id, this share on (flashdraft.prompts.thinking_of)
    thinking_share: float | None
    trust_remote_code: bool
    torch_threads: int | None
    # threads writing shards off the decode loop (0: in the decode loop), or auto (`pipeline.plan.writer_threads`)
    writer_threads: int | str = "auto"
    overlap: bool | None = None  # read each decode step while the next runs (data.overlap); None: auto (on CUDA)
    staged_copies: bool | None = None  # the decode's host copies staged (data.staged_copies); None: auto (on CUDA)

    def __post_init__(self):
        if self.mode not in ("regenerate", "capture"):
            raise ValueError(f"capture mode must be 'regenerate' or 'capture', got {self.mode!r}")
        if self.turns not in ("all", "single"):
            raise ValueError(f"data.turns must be 'all' or 'single', got {self.turns!r}")
        for key in ("batch_size", "prefill_tokens"):
            value = getattr(self, key)
            if value != "auto" and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"data.{key} must be a positive number or auto, got {value!r}")
        threads = self.writer_threads
        if threads != "auto" and not (isinstance(threads, int) and threads >= 0):
            raise ValueError(f"data.writer_threads must be 0 (in the decode loop), more, or auto, got {threads!r}")
        if self.thinking_share is not None and not 0 <= self.thinking_share <= 1:
            raise ValueError(f"data.thinking_share must be in [0, 1], got {self.thinking_share}")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"data.gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")

    def identity(self) -> dict:
        """The settings that define what a store holds (a resumed run must match them)."""
        d = asdict(self)
        # how and where the work runs, not what it computes; the target is identified by its fingerprint
        how = ("device", "batch_size", "prefill_tokens", "gpu_memory_fraction", "torch_threads", "writer_threads")
        for k in (*how, "overlap", "staged_copies"):
            d.pop(k)
        for k in ("trust_remote_code", "target"):
            d.pop(k)
        d["layer_ids"] = list(self.layer_ids)
        # single turns and unmixed thinking are written as the absence of their key, so that the stores that hold them
        # keep one identity whichever way they were asked for
        if self.turns == "single" or self.mode == "capture":
            d.pop("turns")
        if self.thinking_share is None:
            d.pop("thinking_share")
        return d

    def thinking_for(self, seq_id: str) -> bool | None:
        """The enable_thinking prompt `seq_id` is rendered with: drawn from its id in a mixed capture."""
        if self.thinking_share is None:
            return self.enable_thinking
        return thinking_of(seq_id, self.thinking_share)


@dataclass(frozen=True)
class Task:
    """A shard's worth of prompts, and how many times it was tried before."""

    name: str  # the shard this task writes
    records: tuple[PromptRecord, ...]
    attempt: int = 0


def task_seed(seed: int, name: str, batch: int) -> int:
    """The sampling seed of round `batch` of task `name` (0: its single-turn decode; 1 + turn: a conversation turn)."""
    return int(hashlib.sha256(f"{seed}:{name}:{batch}".encode()).hexdigest()[:15], 16)
