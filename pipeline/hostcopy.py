"""Tensors of one decode step on their way to the host, without stopping the device.

On CUDA each tensor is copied into pinned host memory with `non_blocking=True` (torch's caching host allocator
reuses the pinned blocks once their copies are done) and an event is recorded after the copies: the host reads them
after `wait()`, which waits for this step's copies only, so the device can already run the steps queued after it.
On a CPU the same code path hands the tensors over as they are (they are host memory already; nothing to wait for).
"""

from __future__ import annotations

import torch


class HostCopy:
    """`HostCopy(device, name=tensor, ...)`; `wait()` returns {name: host tensor}."""

    def __init__(self, device: torch.device, **tensors: torch.Tensor):
        self.pinned = device.type == "cuda"
        self.host = {name: self._to_host(t) for name, t in tensors.items()}
        self.event = None
        if self.pinned:
            self.event = torch.cuda.Event()
            self.event.record()

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pinned)
        buf.copy_(t, non_blocking=self.pinned)
        return buf

    def wait(self) -> dict[str, torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.host
