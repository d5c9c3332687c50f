"""The host side of a capture decode's slots (`pipeline.decode.ContinuousDecode`).

Per slot: the prompt it serves (None: ended), a version that changes when the slot is refilled, and the rows of its
sequence so far (tokens, features, teacher rows) in pages of `RowPages` listed in a page table [slots, pages], so
that a step writes every live slot's row with one indexed copy per array. A sequence takes pages as it grows and
gives them back when it ends: host memory follows the rows in flight, and nothing held is copied to make room.

A launched step's results are recorded against the slots as they were when it was launched (`snapshot`): only the
slots that held the same sequence then and still do are written. The slot layout (how many slots) must be the same
at launch and at record; the decode reads a pending step before it adds or removes slots.
"""

from __future__ import annotations

import math

import torch

from pipeline.capture import Captured, check_finite
from pipeline.rowpages import RowPages


class SlotRows:
    def __init__(self, teacher_topk: int, page_rows: int | None = None):
        self.k = teacher_topk
        self.page_rows = page_rows
        self.prompt: list[int | None] = []
        self.prompt_len: list[int] = []
        self.live = torch.zeros(0, dtype=torch.bool)
        self.version = torch.zeros(0, dtype=torch.long)
        self.wpos = torch.zeros(0, dtype=torch.long)  # rows written so far, per slot
        self.pages: list[list[int]] = []  # per slot, the ids of the pages holding its rows, in order
        self.table = torch.zeros(0, 0, dtype=torch.long)  # the same as [slots, pages] (unused entries 0)
        self.rows: RowPages | None = None  # made at the first admission, which tells the features' width and dtype

    def live_count(self) -> int:
        return int(self.live.sum())

    def dead_count(self) -> int:
        return len(self.live) - self.live_count()

    def dead_slots(self) -> list[int]:
        return (~self.live).nonzero()[:, 0].tolist()

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(live, version) of the slots when a step is launched."""
        return self.live.clone(), self.version.clone()

    def add_slots(self, n: int) -> None:
        self.prompt += [None] * n
        self.prompt_len += [0] * n
        self.pages += [[] for _ in range(n)]
        self.live, self.version, self.wpos = (
            torch.cat([x, x.new_zeros(n)]) for x in (self.live, self.version, self.wpos)
        )
        self.table = torch.cat([self.table, self.table.new_zeros(n, self.table.shape[1])])

    def keep_live(self) -> list[int]:
        """Drop the ended slots (their pages were given back when they ended); returns the slots kept, in order."""
        keep = self.live.nonzero()[:, 0].tolist()
        self.prompt = [self.prompt[s] for s in keep]
        self.prompt_len = [self.prompt_len[s] for s in keep]
        self.pages = [self.pages[s] for s in keep]
        held = (self.live, self.version, self.wpos, self.table)
        self.live, self.version, self.wpos, self.table = (x[keep] for x in held)
        if self.rows is not None:
            self.rows.release_idle()
        return keep

    def _make_rows(self, feats: torch.Tensor) -> None:
        specs = {"tokens": ((), torch.long), "feats": ((feats.shape[-1],), feats.dtype)}
        if self.k:
            specs |= {"top_ids": ((self.k,), torch.long), "top_logp": ((self.k,), torch.float32)}
        self.rows = RowPages(specs, **({"page_rows": self.page_rows} if self.page_rows else {}))

    def _grow(self, slot: int, rows: int) -> None:
        """Pages for slot `slot` to hold `rows` rows."""
        need = math.ceil(rows / self.rows.page_rows)
        while len(self.pages[slot]) < need:
            self.pages[slot].append(self.rows.take())
        if need > self.table.shape[1]:
            self.table = torch.cat([self.table, self.table.new_zeros(len(self.table), need - self.table.shape[1])], 1)
        self.table[slot, :need] = torch.as_tensor(self.pages[slot][:need])

    def _release(self, slot: int) -> None:
        self.rows.give(self.pages[slot])
        self.pages[slot] = []

    def admit(self, slots: list[int], joining: list[int], prompts: list[list[int]], host: dict) -> None:
        """Joining prompts into `slots`: their tokens, prompt features (rows of a left-padded prefill) and teacher rows
        (none before the last prompt token; the last one's top-k predicts the first response token)."""
        feats = host["feats"]
        if self.rows is None:
            self._make_rows(feats)
        width = feats.shape[1]
        for r, (s, i, p) in enumerate(zip(slots, joining, prompts)):
            n = len(p)
            self.prompt[s], self.prompt_len[s] = i, n
            self.live[s], self.wpos[s] = True, n
            self.version[s] += 1
            self._grow(s, n)
            rows = torch.arange(n)
            values = {"tokens": torch.as_tensor(p, dtype=torch.long), "feats": feats[r, width - n :]}
            if self.k:
                top_ids = torch.zeros(n, self.k, dtype=torch.long)
                top_logp = torch.full((n, self.k), -math.inf)
                top_ids[n - 1], top_logp[n - 1] = host["top_ids"][r], host["top_logp"][r]
                values |= {"top_ids": top_ids, "top_logp": top_logp}
            self.rows.write(self.table[s, rows // self.rows.page_rows], rows % self.rows.page_rows, **values)

    def record(self, rows: tuple[torch.Tensor, torch.Tensor], host: dict) -> list[tuple[int, int, Captured]]:
        """A step's results into the slots that held the same sequences when it was launched and still do; returns
        (slot, prompt index, Captured) of each sequence that ended with it (its slot is free from then on)."""
        launched_live, launched_version = rows
        if len(launched_live) != len(self.live):
            raise RuntimeError(
                f"a decode step launched over {len(launched_live)} slots is read over {len(self.live)}: the slots "
                "were added or removed while it was pending (the decode reads a pending step before that)"
            )
        write = (launched_live & self.live & (launched_version == self.version)).nonzero()[:, 0]
        if not len(write):
            return []
        at = self.wpos[write]
        page_rows = self.rows.page_rows
        for s in write[at % page_rows == 0].tolist():  # rows that start a page
            self._grow(s, int(self.wpos[s]) + 1)
        values = {"tokens": host["tok"][write], "feats": host["feats"][write]}
        if self.k:
            values |= {"top_ids": host["top_ids"][write], "top_logp": host["top_logp"][write]}
        self.rows.write(self.table[write, at // page_rows], at % page_rows, **values)
        self.wpos[write] += 1
        ended = write[host["end"][write]].tolist()
        done = [(s, self.prompt[s], self._captured(s, bool(host["stop"][s]))) for s in ended]
        for s in ended:
            self.prompt[s], self.live[s] = None, False
            self._release(s)
        return done

    def _captured(self, s: int, finished: bool) -> Captured:
        n, p = int(self.wpos[s]), self.prompt_len[s]
        held = self.rows.read(self.pages[s], n)
        check_finite(held["feats"], f"prompt {self.prompt[s]}")
        top = (held["top_ids"], held["top_logp"]) if self.k else None
        return Captured(held["tokens"], torch.arange(n) >= p, held["feats"], finished, top)
