"""The decode batch's KV cache as fixed rows ("slots") that sequences come and go through, without whole-cache copies.

Each layer keeps its keys and values in one zero-initialised buffer [slots, heads, capacity, head_dim]; the cache is
the columns [start, end) of it (`keys`/`values` are views, so Hugging Face's attention reads them as a DynamicLayer's).
A decode step appends a column into spare capacity on the right. A sequence that ends leaves its slot as it is (its
mask row is cleared, `SlotCache.forget`); a joining sequence's prefilled keys and values are written into a free
slot, right-aligned to the end column (`write_rows`), and the columns before them are masked for it. Columns that no
sequence attends any more are dropped by moving `start` (`drop_left`). Only three things copy the whole cache: more
capacity on the right (amortised by `CACHE_HEADROOM`), a joining prompt longer than the cache is wide with no room
left of `start` (room is then reserved on the left too), and more slots than the batch had (`add_rows`, while it
fills up). Removing slots (`select_rows`) copies and is the caller's to schedule.

Every column of every slot always holds finite numbers (the buffers start at zero and are only written with keys and
values the target computed), so masked columns add exact zeros to attention.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from flashdraft.target.memory import CACHE_HEADROOM


class _SlotLayer(DynamicLayer):
    """One layer's slot buffers; `keys`/`values` are the views [:, :, start:end]."""

    def __init__(self, rows: int, like: torch.Tensor):
        super().__init__()
        self.lazy_initialization(like, like)
        self.start = self.end = 0
        self._k = self._v = like.new_zeros(rows, like.shape[1], 0, like.shape[3])
        self._expose()

    def _expose(self) -> None:
        self.keys, self.values = self._k[:, :, self.start : self.end], self._v[:, :, self.start : self.end]

    def _realloc(self, left_room: int, right_room: int) -> None:
        """New buffers with `left_room` free columns before the cache and `right_room` after it (a copy)."""
        width = self.end - self.start
        shape = (*self._k.shape[:2], left_room + width + right_room, self._k.shape[3])
        k, v = self._k.new_zeros(shape), self._v.new_zeros(shape)
        k[:, :, left_room : left_room + width], v[:, :, left_room : left_room + width] = self.keys, self.values
        self._k, self._v, self.start, self.end = k, v, left_room, left_room + width
        self._expose()

    def update(self, key_states, value_states, *args, **kwargs):
        n = key_states.shape[2]
        if self.end + n > self._k.shape[2]:
            width = self.end - self.start + n
            self._realloc(self.start, n + max(64, int(width * CACHE_HEADROOM)))
        self._k[:, :, self.end : self.end + n], self._v[:, :, self.end : self.end + n] = key_states, value_states
        self.end += n
        self._expose()
        return self.keys, self.values

    def widen_left(self, n: int) -> None:
        """`n` more columns before the cache (finite, masked by the caller)."""
        if n > self.start:
            self._realloc(n + int((self.end - self.start + n) * CACHE_HEADROOM), self._k.shape[2] - self.end)
        self.start -= n
        self._expose()

    def drop_left(self, n: int) -> None:
        self.start += n
        self._expose()

    def write_rows(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values [len(slots), heads, P, head_dim] into the slots' last P columns (P <= the cache's width)."""
        p = keys.shape[2]
        self._k[slots, :, self.end - p : self.end] = keys
        self._v[slots, :, self.end - p : self.end] = values

    def add_rows(self, n: int) -> None:
        pad = self._k.new_zeros(n, *self._k.shape[1:])
        self._k, self._v = torch.cat([self._k, pad]), torch.cat([self._v, pad])
        self._expose()

    def select_rows(self, keep: torch.Tensor) -> None:
        self._k, self._v = self._k[keep], self._v[keep]
        self._expose()


class SlotCache(DynamicCache):
    """A DynamicCache of `_SlotLayer`s: `rows` slots, made from the first prefilled cache whose rows join it."""

    def __init__(self, model, prefilled: DynamicCache):
        super().__init__(config=model.config)
        for layer in prefilled.layers:
            if type(layer) is not DynamicLayer:
                raise TypeError(
                    f"the capture decode keeps full-attention caches only; {type(model).__name__} has a "
                    f"{type(layer).__name__} layer"
                )
        self.layers = [_SlotLayer(0, layer.keys) for layer in prefilled.layers]

    @property
    def width(self) -> int:
        return self.layers[0].end - self.layers[0].start

    def write_rows(self, slots: torch.Tensor, prefilled: DynamicCache) -> None:
        """The prefilled rows into `slots`, right-aligned to the end column (widening on the left where needed)."""
        extra = prefilled.layers[0].keys.shape[2] - self.width
        for layer, new in zip(self.layers, prefilled.layers):
            if extra > 0:
                layer.widen_left(extra)
            layer.write_rows(slots, new.keys, new.values)

    def add_rows(self, n: int) -> None:
        for layer in self.layers:
            layer.add_rows(n)

    def select_rows(self, keep: torch.Tensor) -> None:
        for layer in self.layers:
            layer.select_rows(keep)

    def drop_left(self, n: int) -> None:
        for layer in self.layers:
            layer.drop_left(n)
