"""`python -m gate [hydra overrides]` (`make gate`): the overfit gate on conf/config.yaml with its `gate` node.

Exit 0: passed; 1: failed; 2: refused (an engine or a setting the gate cannot run, named on stderr)."""

from __future__ import annotations

import sys

from gate.config import GateRefused, gate_config
from gate.run import run_gate


def main(argv: list[str]) -> int:
    try:
        cfg = gate_config(argv)
        report = run_gate(cfg)
    except GateRefused as e:
        print(f"gate refused: {e}", file=sys.stderr)
        return 2
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
