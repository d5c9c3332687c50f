"""Recipe parity with a peer (speculators 0.9.0, issue 59): our trainer's recipe and the peer's DFlash recipe, the
same store, geometry, seed, steps and target tokens; each drafter measured by the same three evaluators.

    PYTHONPATH=.peer .venv/bin/python benchmarks/peer_parity.py --store runs/quick-smollm2-135m/features \\
        --name quick --recipe ours|peer [--label NAME] [--args ...] [--steps 600] [--seeds 0 1] [--no-served]
    PYTHONPATH=.peer .venv/bin/python benchmarks/peer_parity.py --table

`--recipe ours`: `python -m trainer profile=quick` (train=quick: init from the target's top layers, soft labels,
16 anchors a sequence) with `--args` as Hydra overrides. `--recipe peer`: `benchmarks/peer_train.py` (the peer's
model, loss, anchors, masks, optimizer and schedule from a thin CPU loop) on the store converted by
`benchmarks/peer_data.py`, the geometry of our run of the same seed (`--like`), packed to see as many target tokens a
step as that run did, with `--args` as its flags. A `--label` names a variant (a part swapped: issue 59 part 3).
Every drafter then gets: offline tau (our trainer's held-out evaluator on `--heldout`: the drafter as init, one step
at lr 1e-30, which leaves its weights bit for bit, then the end-of-run eval over 64 batches), served-order replay
tau, chain and tree 7x4 (`benchmarks/bench_tree.py --replay-only` on the 42 held-out responses), and served tau in
our harness (`python -m harness profile=quick`, dflash and dflash_tree, 8 prompts x 64 tokens). Rows go to
OUT/NAME-LABEL-results.json; `--table` prints every row in OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

PY = sys.executable


def run(cmd: list[str], log: Path, env: dict | None = None) -> str:
    """Run `cmd`, its output to `log`; refuse a failure naming the log."""
    print("+", " ".join(cmd), flush=True)
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    if done.returncode:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}; see {log}")
    return log.read_text()


def train_ours(args, seed: int, run_dir: Path) -> Path:
    if not (run_dir / "drafter" / "config.json").is_file():
        overrides = [f"run_dir={run_dir}", f"train.stores=[{args.store}]", f"train.eval_stores=[{args.heldout}]"]
        overrides += [f"seed={seed}", f"train.max_steps={args.steps}", "train.resume=false", *args.args]
        run([PY, "-m", "trainer", "profile=quick", *overrides], run_dir.with_suffix(".log"), {"WANDB_MODE": "offline"})
    return run_dir / "drafter"


def tokens_per_step(run_dir: Path) -> int:
    """Our run's mean context tokens a step: the peer's packed length, so both see the same target tokens."""
    rows = [json.loads(line) for line in open(run_dir / "train" / "metrics.jsonl") if '"tokens_seen"' in line]
    return round(rows[-1]["tokens_seen"] / rows[-1]["step"])


def train_peer(args, seed: int, run_dir: Path) -> Path:
    out = Path(args.out)
    data, ours = out / f"{args.name}-peer-data", out / f"{args.name}-ours-s{seed}"
    if not data.is_dir():
        run([PY, "benchmarks/peer_data.py", "--store", args.store, "--out", str(data)], data.with_suffix(".log"))
    if not (run_dir / "drafter" / "config.json").is_file():
        flags = ["--data", str(data), "--like", str(ours / "drafter"), "--steps", str(args.steps), "--seed", str(seed)]
        if "--total-seq-len" not in args.args:
            flags += ["--tokens-per-step", str(tokens_per_step(ours))]
        run([PY, "benchmarks/peer_train.py", *flags, "--out", str(run_dir), *args.args], run_dir.with_suffix(".log"))
    return run_dir / "drafter"


def offline_tau(args, drafter: Path, work: Path) -> float:
    cmd = [PY, "-m", "trainer", "profile=quick", f"run_dir={work}", f"train.init={drafter}", "train.lr=1e-30",
           "train.max_steps=1", f"train.stores=[{args.store}]", f"train.eval_stores=[{args.heldout}]",
           "train.eval_batches=64", "train.resume=false"]  # fmt: skip
    run(cmd, work.with_suffix(".log"), {"WANDB_MODE": "disabled"})
    rows = [json.loads(line) for line in open(work / "train" / "metrics.jsonl") if '"eval/tau"' in line]
    return rows[-1]["eval/tau"]


def replay_tau(args, drafter: Path, log: Path) -> dict:
    cmd = [PY, "benchmarks/bench_tree.py", "--drafter", str(drafter), "--store", args.heldout, "--sequences", "42",
           "--trees", "7x4", "--cutoffs", "0", "--lookups", "--replay-only"]  # fmt: skip
    out = run(cmd, log)
    taus = dict(re.findall(r"replayed \('(chain|tree)'.*?: tau ([0-9.]+)", out))
    return {"replay_chain": float(taus["chain"]), "replay_tree": float(taus["tree"])}


def served_tau(drafter: Path, out_dir: Path) -> dict:
    cmd = [PY, "-m", "harness", "profile=quick", f"eval.drafter={drafter}", f"eval.out_dir={out_dir}",
           "eval.methods=[dflash,dflash_tree]", "eval.resume=false"]  # fmt: skip
    run(cmd, out_dir.with_suffix(".log"))
    methods = json.loads((out_dir / "report.json").read_text())["methods"]
    return {"served_chain": methods["dflash"]["tau"], "served_tree": methods["dflash_tree"]["tau"]}


def measure(args, seed: int, drafter: Path) -> dict:
    base = Path(args.out) / "eval" / f"{args.name}-{args.label}-s{seed}"
    base.parent.mkdir(parents=True, exist_ok=True)
    row = {"store": args.name, "recipe": args.label, "seed": seed, "steps": args.steps, "args": args.args}
    row["offline"] = offline_tau(args, drafter, base.with_name(base.name + "-offline"))
    row |= replay_tau(args, drafter, base.with_name(base.name + "-replay.log"))
    if args.served:
        row |= served_tau(drafter, base.with_name(base.name + "-served"))
    return row


def table(rows: list[dict]) -> str:
    head = "| store | recipe | seed | steps | offline tau | replay chain | replay tree | served chain | served tree |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["store"], r["recipe"], r["seed"])):
        served = [f"{r[k]:.2f}" if k in r else "-" for k in ("served_chain", "served_tree")]
        lines.append(
            f"| {r['store']} | {r['recipe']} | {r['seed']} | {r['steps']} | {r['offline']:.3f} | "
            f"{r['replay_chain']:.3f} | {r['replay_tree']:.3f} | {served[0]} | {served[1]} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", help="the training store")
    ap.add_argument("--name", help="the store's name in the table and in file names")
    ap.add_argument("--recipe", choices=["ours", "peer"], default="ours")
    ap.add_argument("--label", default=None, help="the row's name in the table and its run folder (default: recipe)")
    ap.add_argument("--args", nargs="*", default=[], help="Hydra overrides for ours, flags for peer_train.py")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--heldout", default="runs/heldout-full/features", help="the 42 eval prompts' store")
    ap.add_argument("--served", action=argparse.BooleanOptionalAction, default=True, help="also the served tau")
    ap.add_argument("--out", default="runs/p59")
    ap.add_argument("--table", action="store_true", help="print the table of every row in OUT and stop")
    args = ap.parse_args()
    out = Path(args.out)
    rows = [r for f in sorted(out.glob("*-results.json")) for r in json.loads(f.read_text())]
    if args.table:
        print(table(rows))
        return
    for path in (args.store, args.heldout):
        if not path or not Path(path).is_dir():
            raise SystemExit(f"no store at {path}")
    args.label = args.label or args.recipe
    results = out / f"{args.name}-{args.label}-results.json"
    mine = json.loads(results.read_text()) if results.exists() else []
    for seed in args.seeds:
        run_dir = out / f"{args.name}-{args.label}-s{seed}"
        drafter = (train_ours if args.recipe == "ours" else train_peer)(args, seed, run_dir)
        mine = [r for r in mine if r["seed"] != seed] + [measure(args, seed, drafter)]
        results.write_text(json.dumps(mine, indent=1) + "\n")
        print(table(mine), flush=True)


if __name__ == "__main__":
    main()
