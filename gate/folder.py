"""The gate's output folder: one it owns (new, empty, or marked by an earlier gate run), cleared at each run; any
other folder is refused by name and left as it is."""

from __future__ import annotations

import shutil
from pathlib import Path

from gate.config import GateRefused

OWNED_MARK = ".flashdraft-gate"  # written into the folder the gate writes into: the mark of a folder it may clear


def claim_out_dir(out: Path) -> None:
    """Make `out` the gate's own empty folder: a new one, an empty one, or one an earlier gate run marked (its
    contents are cleared). A folder holding anything else is refused by name and left as it is: the gate never
    deletes what it did not write."""
    if out.exists() and not out.is_dir():
        raise GateRefused(f"gate.out_dir {out} is a file, not a folder; give gate.out_dir a new or empty folder")
    entries = sorted(out.iterdir()) if out.is_dir() else []
    names = [p.name for p in entries]
    if names and OWNED_MARK not in names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise GateRefused(
            f"gate.out_dir {out} is not empty ({shown}) and was not made by the gate (no {OWNED_MARK} in it); "
            "nothing was touched. Give gate.out_dir a new or empty folder (the gate clears only its own folders)"
        )
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        elif entry.name != OWNED_MARK:
            entry.unlink()
    out.mkdir(parents=True, exist_ok=True)
    (out / OWNED_MARK).write_text(
        "written by the overfit gate (python -m gate, make gate): it clears this folder at each run\n"
    )
