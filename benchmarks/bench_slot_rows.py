"""Host memory of a capture decode's rows (`pipeline.slotrows.SlotRows`) against the buffers before it, from one run.

    .venv/bin/python benchmarks/bench_slot_rows.py [--batch 88] [--sequences 2000] [--before b43b12f]

Drives both host sides with the same schedule of a continuously batched decode, without a model: `--batch` slots,
sequences of synthetic lengths (log-normal prompt and response lengths around `--prompt-mean` and
`--response-mean` tokens, prompt + response at most `--max-length`) joining as others end, one row a live slot a
step. The classes are the real ones: this checkout's `SlotRows` (pages from arenas that never move) and the one at
git revision `--before` (one buffer [slots, capacity, ...] that grows by 1.5x with a copy). Rows are 1 feature wide
here; what a row costs at a target's shape (`--features`: L*H, `--feature-bytes`) is multiplied out, so the figures
for Qwen3-8B (5 x 4096 bf16 features) are exact for this schedule without allocating them. Prints peak rows held,
peak bytes at that shape (the copy on growth counted while both buffers live) and the ratio.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def older_slot_rows(rev: str):
    """The SlotRows class of `pipeline/decode.py` at git revision `rev`, loaded from its source."""
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:pipeline/decode.py"], capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType(f"decode_{rev}")
    exec(compile(source, f"{rev}:pipeline/decode.py", "exec"), module.__dict__)  # our own history, not untrusted
    return module.SlotRows


def lengths(n: int, mean_prompt: float, mean_response: float, max_length: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, response) lengths, log-normal (sigma 0.8) around the means, prompt + response <= max_length."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = int(torch.empty(1).log_normal_(0, 0.8, generator=g).item() * mean_prompt / 1.377) + 1
        r = int(torch.empty(1).log_normal_(0, 0.8, generator=g).item() * mean_response / 1.377) + 1
        p = min(p, max_length - 1)
        out.append((p, min(r, max_length - p)))
    return out


class Meter:
    """Peak rows held by a host side: the new one's arenas, the old one's buffers (both buffers while it grows)."""

    def __init__(self, host):
        self.host, self.peak = host, 0
        if hasattr(host, "_ensure"):  # the older class: count the copy on growth
            ensure = host._ensure

            def counted(rows, feats):
                before = self.old_rows()
                ensure(rows, feats)
                after = self.old_rows()
                self.peak = max(self.peak, before + after if after > before else after)

            host._ensure = counted

    def old_rows(self) -> int:
        b = self.host.buf.get("tokens")
        return 0 if b is None else b.numel()

    def rows(self) -> int:
        if hasattr(self.host, "rows"):
            return 0 if self.host.rows is None else self.host.rows.held_rows()
        return self.old_rows()

    def note(self) -> None:
        self.peak = max(self.peak, self.rows())


def drive(host, schedule: list[tuple[int, int]], batch: int) -> Meter:
    """Run `schedule` through `host` as ContinuousDecode would: fill free slots, one row a live slot a step, compact
    when none is waiting (refill at batch // 8 free slots)."""
    meter, waiting, step = Meter(host), list(range(len(schedule))), 0
    left: dict[int, int] = {}  # slot -> response rows still to write
    refill_at = max(1, batch // 8)
    while waiting or left:
        live = host.live_count()
        if waiting and (batch - live >= refill_at or not live):
            joining = [waiting.pop(0) for _ in range(min(batch - live, len(waiting)))]
            free = host.dead_slots()[: len(joining)]
            if len(free) < len(joining):
                first = len(host.live)
                host.add_slots(len(joining) - len(free))
                free += list(range(first, len(host.live)))
            prompts = [[1] * schedule[i][0] for i in joining]
            width = max(len(p) for p in prompts)
            host.admit(free, joining, prompts, {"feats": torch.zeros(len(joining), width, 1, dtype=torch.bfloat16)})
            left.update({s: schedule[i][1] for s, i in zip(free, joining)})
        elif not waiting and host.dead_count() >= refill_at:
            keep = host.keep_live()
            left = {new: left[old] for new, old in enumerate(keep)}
        snap = host.snapshot()
        n = len(host.live)
        end = torch.zeros(n, dtype=torch.bool)
        for s, r in left.items():
            end[s] = r <= 1
        out = {"tok": torch.ones(n, dtype=torch.long), "feats": torch.zeros(n, 1, dtype=torch.bfloat16)}
        host.record(snap, {**out, "end": end, "stop": end})
        left = {s: r - 1 for s, r in left.items() if r > 1}
        meter.note()
        step += 1
    return meter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=88, help="decode rows (Qwen3-8B on one H100, auto)")
    ap.add_argument("--sequences", type=int, default=2000)
    ap.add_argument("--prompt-mean", type=float, default=250)
    ap.add_argument("--response-mean", type=float, default=700)
    ap.add_argument("--max-length", type=int, default=3072)
    ap.add_argument("--features", type=int, default=5 * 4096, help="captured layers x hidden size")
    ap.add_argument("--feature-bytes", type=float, default=2, help="bytes a feature on the host (bf16: 2)")
    ap.add_argument("--before", default="b43b12f", help="the git revision of the older host side")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from pipeline.slotrows import SlotRows

    schedule = lengths(args.sequences, args.prompt_mean, args.response_mean, args.max_length, args.seed)
    row_bytes = args.features * args.feature_bytes + 8  # features + the token id
    total = sum(p + r for p, r in schedule)
    print(
        f"{args.sequences} sequences, {total:,} rows (mean prompt {sum(p for p, _ in schedule) / len(schedule):.0f}, "
        f"response {sum(r for _, r in schedule) / len(schedule):.0f}, longest {max(p + r for p, r in schedule)}), "
        f"batch {args.batch}; a row {row_bytes / 2**10:.1f} KiB ({args.features} features x {args.feature_bytes:g} B)"
    )
    rows = {}
    for name, host in (("before (" + args.before + ")", older_slot_rows(args.before)(0)), ("pages", SlotRows(0))):
        meter = drive(host, schedule, args.batch)
        rows[name] = meter.peak
        print(f"  {name:>20}: peak {meter.peak:>9,} rows held = {meter.peak * row_bytes / 2**30:6.2f} GiB")
    (old, new) = rows.values()
    print(f"  pages / before: {new / old:.3f}x of the peak host memory")


if __name__ == "__main__":
    main()
