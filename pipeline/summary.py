"""What a capture run did (`Summary`: its counts, every record read accounted for) and its record in the store.

A run ends by rewriting the store's rejects and its `last_run` entry (`finish_run`); a full disk met there is one
more cause on the summary's FAILED line, never a lost shard.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from flashdraft.store import StoreError, StoreWriter, read_manifest, shard_rejects, shards_bytes, write_rejects
from flashdraft.store.space import is_disk_full


@dataclass
class Summary:
    store: str
    sequences: int = 0  # in the store, all runs
    tokens: int = 0
    response_tokens: int = 0
    bytes: int = 0
    new_sequences: int = 0  # this run
    new_tokens: int = 0
    shards_done: int = 0
    shards_skipped: int = 0  # prompts already committed by earlier runs
    failed: list = field(default_factory=list)  # {"shard", "attempts", "error"}
    retried: list = field(default_factory=list)  # failed attempts queued again: {"shard", "attempt", "error"}
    stopped: str = ""  # why the run stopped before its last task (a full disk), else ""
    not_run: int = 0  # tasks never started because the run stopped
    left_alone: list = field(default_factory=list)  # shards found on disk, not listed, and not adopted: why
    rejects: dict = field(default_factory=dict)  # reason -> count, all runs
    wall_s: float = 0.0
    # This run's records: each one read lands in exactly one of `accounts()` (captured, already stored, ...).
    read: int = 0  # records read from the sources: kept, rejected on load, or outside the split
    split: str | None = None  # the split asked for (None: all)
    outside_split: int = 0  # records read that belong to the other split
    duplicates: int = 0  # conversations met before in this run
    rejected: dict = field(default_factory=dict)  # this run's rejects but duplicates, reason -> count
    already_stored: int = 0  # captured or rejected by an earlier run into this store
    failed_sequences: int = 0  # records of the shards in `failed`

    def accounts(self) -> dict[str, int]:
        """Where this run's records went; the values add up to `read`."""
        return {
            "captured": self.new_sequences,
            "already in the store": self.already_stored,
            "duplicates": self.duplicates,
            "rejected": sum(self.rejected.values()),
            "outside the split": self.outside_split,
            "in failed shards": self.failed_sequences,
        }

    def account_lines(self) -> list[str]:
        parts = " + ".join(f"{n} {what}" for what, n in self.accounts().items())
        out = [f"  this run: {self.read} records read = {parts}"]
        if self.rejected:
            out.append(
                "    rejected: " + ", ".join(f"{n} {r}" for r, n in sorted(self.rejected.items(), key=lambda x: -x[1]))
            )
        if self.outside_split:
            other = "heldout" if self.split == "train" else "train"
            why = " (kept for evaluation; data.split=null captures them too)" if other == "heldout" else ""
            out.append(f"    outside the split: {self.outside_split} of the {other} split, not captured{why}")
        return out

    @property
    def ok(self) -> bool:
        return not self.failed and not self.stopped

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / max(1, self.tokens)

    def lines(self) -> list[str]:
        out = [
            f"store {self.store}",
            f"  sequences {self.sequences} ({self.new_sequences} new), tokens {self.tokens} ({self.new_tokens} new), "
            f"response tokens {self.response_tokens}",
            f"  bytes on disk {self.bytes / 2**20:.1f} MiB, {self.bytes_per_token:.0f} bytes/token",
            f"  shards committed this run {self.shards_done}; wall {self.wall_s:.1f} s, "
            f"{self.new_tokens / max(self.wall_s, 1e-9):.0f} tokens/s",
            f"  rejects {sum(self.rejects.values())} (all runs)"
            + "".join(f"\n    {n:6d}  {r}" for r, n in sorted(self.rejects.items(), key=lambda x: -x[1])),
            *self.account_lines(),
        ]
        out += [f"  left alone: {why}" for why in self.left_alone]
        for r in self.retried:
            out.append(f"  retried shard {r['shard']} after attempt {r['attempt']} failed: {r['error'][:300]}")
        for f in self.failed:
            out.append(f"  FAILED shard {f['shard']} after {f['attempts']} attempt(s): {f['error']}")
        if self.stopped:
            left = f" ({self.not_run} shard(s) not started)" if self.not_run else ""
            out.append(f"  FAILED: {self.stopped}{left}")
        return out


def reject_reason_class(reason: str) -> str:
    """Group reasons that differ only in details (line numbers, lengths, the seq_id a duplicate repeats)."""
    if reason.startswith("duplicate of "):
        return "duplicate"
    return reason.split(":")[0].split(" (")[0].strip()


def count_rejects(summary: Summary, rejects) -> None:
    """Add this run's `rejects` to the summary's duplicates or, by reason class, to its rejected."""
    for r in rejects:
        reason = reject_reason_class(r["reason"])
        if reason == "duplicate":
            summary.duplicates += 1
        else:
            summary.rejected[reason] = summary.rejected.get(reason, 0) + 1


def finish_run(store_path: Path, writer: StoreWriter, summary: Summary, load_rejects, dupes) -> None:
    """Rewrite the store's rejects (prompt-file rejects + every committed shard's) and fill the summary. A full
    disk here is the summary's FAILED line: the shards committed before it are listed and intact."""
    manifest = read_manifest(store_path)
    rejects = [*load_rejects, *dupes, *shard_rejects(manifest)]
    try:
        write_rejects(store_path, rejects)
    except StoreError as e:
        not_recorded(summary, "rejects", e)
    c = manifest["counts"]
    summary.sequences, summary.tokens, summary.response_tokens = (
        c["sequences"],
        c["tokens"],
        c.get("response_tokens", 0),
    )
    summary.bytes = shards_bytes(store_path)
    summary.rejects = dict(Counter(reject_reason_class(r["reason"]) for r in rejects))
    last_run = {"finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "wall_s": round(summary.wall_s, 2)}
    try:
        writer.update(
            last_run={
                **last_run,
                "failed_shards": summary.failed,
                "retried": summary.retried,
                "rejects": summary.rejects,
            }
        )
    except StoreError as e:
        not_recorded(summary, "last_run", e)


def not_recorded(summary: Summary, what: str, error: StoreError) -> None:
    """A full disk met while the run writes its record: one more cause on the summary's FAILED line."""
    if not is_disk_full(error):
        raise error
    cause = f"the run's {what} not written: {type(error).__name__}: {error}"
    summary.stopped = f"{summary.stopped}; {cause}" if summary.stopped else cause
