"""Tensors of one decode step on their way to the host, without stopping the device.

Staged (`data.staged_copies`; auto: on CUDA), each tensor is copied into a fresh host buffer with
`non_blocking=True`, pinned where the device is CUDA (torch's caching host allocator reuses the pinned blocks once
their copies are done), and an event is recorded after the copies: the host reads them after `wait()`, which waits for
this step's copies only, so the device can already run the steps queued after it. On a CPU a staged copy is a plain
copy into a new buffer (pinning and the event have no meaning there): the path CUDA takes, run where CI can run it.
Not staged, tensors already on the host are handed over as they are, and others copied with a blocking `.cpu()`.
"""

from __future__ import annotations

import torch


def default_staged(device: torch.device) -> bool:
    """`data.staged_copies` auto: on CUDA, where a copy can run behind the device's queue."""
    return torch.device(device).type == "cuda"


class HostCopy:
    """`HostCopy(device, staged, name=tensor, ...)`; `wait()` returns {name: host tensor}. `staged` None: auto."""

    def __init__(self, device: torch.device, staged: bool | None = None, **tensors: torch.Tensor):
        device = torch.device(device)
        self.staged = default_staged(device) if staged is None else staged
        self.pinned = self.staged and device.type == "cuda"
        self.host = {name: self._to_host(t) for name, t in tensors.items()}
        self.event = None
        if self.pinned:
            self.event = torch.cuda.Event()
            self.event.record()

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if not self.staged:
            return t.cpu()  # the tensor itself when it is on the host already
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pinned)
        buf.copy_(t, non_blocking=self.pinned)
        return buf

    def wait(self) -> dict[str, torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.host
