"""Host rows of the sequences a capture decode holds, in fixed-size pages that never move.

A decoding sequence's rows (its tokens, features and teacher rows so far) live in pages of `page_rows` rows. Pages
come from arenas of `arena_pages` pages each, allocated when every page is taken and never copied or resized: a
sequence takes a page when its next row needs one and gives its pages back when it ends, and the lowest free page is
always taken first, so the pages in use stay packed in the first arenas. Host memory therefore follows the rows in
flight (rounded up to a page a sequence, plus at most the free part of the arenas in use), not the longest sequence
times the batch, and growing never copies what is held. Trailing arenas left wholly free are released
(`release_idle`).

Pages are addressed by id (arena * arena_pages + page in the arena); `write` takes one row per id, vectorised within
each arena.
"""

from __future__ import annotations

import heapq

import torch

PAGE_ROWS = 64  # rows a page: a sequence wastes less than one page
ARENA_PAGES = 32  # pages an arena: the unit host memory grows and shrinks by


class RowPages:
    """`take()` a page id, `write(ids, rows, name=values)`, `read(ids, n)`, `give(ids)`."""

    def __init__(self, specs: dict[str, tuple[tuple, torch.dtype]], page_rows=PAGE_ROWS, arena_pages=ARENA_PAGES):
        """`specs`: per array, the shape of one row and its dtype."""
        if page_rows < 1 or arena_pages < 1:
            raise ValueError(f"page_rows and arena_pages must be >= 1, got {page_rows} and {arena_pages}")
        self.specs, self.page_rows, self.arena_pages = dict(specs), page_rows, arena_pages
        self.arenas: list[dict[str, torch.Tensor]] = []
        self.free: list[int] = []  # a heap: the lowest free page first

    def take(self) -> int:
        if not self.free:
            self._add_arena()
        return heapq.heappop(self.free)

    def give(self, ids: list[int]) -> None:
        for i in ids:
            heapq.heappush(self.free, i)

    def _add_arena(self) -> None:
        first = len(self.arenas) * self.arena_pages
        # empty, not zeros: only written rows are ever read; untouched pages of a fresh arena cost no resident memory
        self.arenas.append(
            {
                name: torch.empty(self.arena_pages, self.page_rows, *shape, dtype=dtype)
                for name, (shape, dtype) in self.specs.items()
            }
        )
        for i in range(first, first + self.arena_pages):
            heapq.heappush(self.free, i)

    def release_idle(self) -> None:
        """Drop trailing arenas none of whose pages is taken."""
        free = set(self.free)
        while self.arenas:
            first = (len(self.arenas) - 1) * self.arena_pages
            if not all(i in free for i in range(first, first + self.arena_pages)):
                break
            self.arenas.pop()
            free -= set(range(first, first + self.arena_pages))
        self.free = sorted(free)  # a sorted list is a heap

    def write(self, ids: torch.Tensor, rows: torch.Tensor, **values: torch.Tensor) -> None:
        """values[name][j] into row `rows[j]` of page `ids[j]`, for every j (one indexed copy an arena in use)."""
        arena, page = ids // self.arena_pages, ids % self.arena_pages
        for a in arena.unique().tolist():
            at = (arena == a).nonzero()[:, 0]
            for name, v in values.items():
                self.arenas[a][name][page[at], rows[at]] = v[at].to(self.specs[name][1])

    def read(self, ids: list[int], n: int) -> dict[str, torch.Tensor]:
        """The first `n` rows held by pages `ids` in order, each array a new tensor."""
        pages = ids[: -(-n // self.page_rows)] if n else []
        out = {}
        for name, (shape, dtype) in self.specs.items():
            parts = [self.arenas[i // self.arena_pages][name][i % self.arena_pages] for i in pages]
            out[name] = torch.cat(parts)[:n] if parts else torch.empty(0, *shape, dtype=dtype)
        return out

    def held_rows(self) -> int:
        """Rows the arenas hold (pages taken or not): what host memory grows with."""
        return len(self.arenas) * self.arena_pages * self.page_rows
