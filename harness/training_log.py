"""The trainer's metrics.jsonl as the harness sees it: its rows, and train/serve parity (the offline tau the
trainer measured on held-out store data next to the tau the served drafter reached in this eval)."""

from __future__ import annotations

import json
from pathlib import Path

PARITY_TOLERANCE = 0.10  # relative gap above which the report explains why the two taus differ
PARITY_REASONS = (
    "offline and served tau measure different things: offline tau counts 1 + the leading correct positions of "
    "blocks anchored at random response positions with teacher-forced context (every earlier token is the "
    "target's); served blocks start where the previous round stopped and are cut by max_new_tokens and the stop "
    "token. With `train.eval_stores` the trainer's held-out store holds the eval's own prompts and responses; "
    "without it, offline tau comes from other prompts (a hashed part of the training stores)."
)


def read_metrics(path) -> list[dict] | None:
    """metrics.jsonl rows in file order (train rows hold "loss", "tau", ...; eval rows "eval/loss", "eval/tau",
    ...), or None when the file is absent. A line that does not parse (a trainer killed mid-write) is skipped."""
    path = Path(path)
    if not path.is_file():
        return None
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def last_eval_tau(rows) -> tuple[int, float] | None:
    """(step, eval/tau) of the last held-out evaluation the trainer logged, or None."""
    evals = [(r.get("step"), r["eval/tau"]) for r in rows or () if r.get("eval/tau") is not None]
    return evals[-1] if evals else None


CUTOFF_REASON = (
    "The harness verified only draft prefixes (eval.draft_cutoff > 0), which caps served tau below what the whole "
    "block would reach; compare with eval.draft_cutoff=0."
)


def train_serve_parity(
    rows, served_tau: float | None, *, draft_cutoff: float = 0.0, replay: dict | None = None
) -> dict | None:
    """Offline tau (last eval/tau) vs served DFlash tau, with the relative gap (served - offline) / offline;
    None when either is missing. `replay` (harness.replay.replay_tau on the eval prompts' store) splits a
    large gap into where blocks start (offline -> replay) and everything else (replay -> served)."""
    last = last_eval_tau(rows)
    if last is None or served_tau is None:
        return None
    step, offline_tau = last
    gap = (served_tau - offline_tau) / offline_tau
    replay_tau = (replay or {}).get("tau")
    explanation = None
    if abs(gap) > PARITY_TOLERANCE:
        parts = [PARITY_REASONS] + [CUTOFF_REASON] * (draft_cutoff > 0)
        if replay_tau:
            parts.append(
                "Replaying the served rounds offline on the stored responses of the same prompts "
                f"gives tau {replay_tau:.3f}: "
                f"block starts account for {100 * (replay_tau - offline_tau) / offline_tau:+.1f}%, "
                "and serving itself (live "
                "features, responses that part from the stored ones) "
                f"for {100 * (served_tau - replay_tau) / replay_tau:+.1f}%."
            )
        explanation = " ".join(parts)
    return {
        "offline_tau": offline_tau,
        "offline_step": step,
        "served_tau": served_tau,
        "relative_gap": gap,
        "replay_tau": replay_tau,
        "replay_prompts": (replay or {}).get("prompts"),
        "explanation": explanation,
    }


def parity_line(parity: dict) -> str:
    replay = (
        ""
        if not parity.get("replay_tau")
        else f", served-order replay on the stored responses {parity['replay_tau']:.3f}"
    )
    tree = (
        ""
        if not parity.get("replay_tree_tau")
        else (
            f"; tree verification: replay {parity['replay_tree_tau']:.3f} "
            f"vs served dflash_tree tau {parity['served_tree_tau']:.3f}"
        )
    )
    return (
        f"train/serve parity: offline tau {parity['offline_tau']:.3f} (trainer's held-out eval, step "
        f"{parity['offline_step']}){replay} vs served dflash tau {parity['served_tau']:.3f}: "
        f"gap {100 * parity['relative_gap']:+.1f}%{tree}"
    )
