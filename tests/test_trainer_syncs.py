"""Host syncs in the training loop: at most one a logged step.

On a GPU every `.item()`, `.cpu()`, `.tolist()`, `bool(tensor)`, `nonzero`, boolean-mask indexing and `unique` of
a device tensor waits for the device to drain its queue. On a CPU none of them waits, so the test counts the calls
themselves: a tiny training runs in a fresh process with those methods of torch.Tensor wrapped in counters that
note, for each call made on the main thread (the loader threads build host batches), the first frame that calls it
from the trainer or the core (`trainer/`, `flashdraft/`: ours) or from DeepSpeed, and the optimizer step it falls in
(from the start of step k's `train_step` to the start of step k + 1's, so step k's logging counts in step k)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.test_trainer_fixtures import DRAFTER, tiny_store, tiny_target, train_kwargs

ROOT = Path(__file__).resolve().parents[1]

COUNTING_RUNNER = textwrap.dedent("""
    import json, sys, threading
    from pathlib import Path

    import torch

    import trainer.train
    from flashdraft.config import DrafterConfig, TrainConfig

    run, root, out = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
    ours = (root + "/trainer/", root + "/flashdraft/")
    events, state = [], {"step": 0}

    def caller(frame):
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(ours):
                return "ours", f"{Path(name).relative_to(root)}:{frame.f_lineno}"
            if "/deepspeed/" in name:
                return "deepspeed", f"deepspeed/{name.split('/deepspeed/', 1)[1]}:{frame.f_lineno}"
            frame = frame.f_back
        return None, None

    def note(kind):
        if threading.current_thread() is threading.main_thread():
            owner, where = caller(sys._getframe(2))
            if owner:
                events.append({"step": state["step"], "owner": owner, "kind": kind, "where": where})

    def counting(kind, original):
        def wrapper(*args, **kwargs):
            note(kind)
            return original(*args, **kwargs)
        return wrapper

    def has_bool_mask(index):
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)

    def counting_index(kind, original):
        def wrapper(self, index, *rest):
            if has_bool_mask(index):
                note(kind)
            return original(self, index, *rest)
        return wrapper

    for name in ("item", "cpu", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "nonzero",
                 "unique", "masked_select"):
        setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    for name in ("nonzero", "unique", "masked_select"):
        setattr(torch, name, counting(name, getattr(torch, name)))
    torch.Tensor.__getitem__ = counting_index("bool-mask index", torch.Tensor.__getitem__)
    torch.Tensor.__setitem__ = counting_index("bool-mask assign", torch.Tensor.__setitem__)

    train_step = trainer.train.train_step

    def marked_train_step(*args, **kwargs):
        state["step"] += 1
        return train_step(*args, **kwargs)

    trainer.train.train_step = marked_train_step
    result = trainer.train.train(TrainConfig(**run["train"]), DrafterConfig(**run["drafter"]))
    Path(out).write_text(json.dumps({"steps": result["global_step"], "events": events}))
""")


def counted_run(tmp: Path, **train) -> dict:
    """Train with the counters on; {"steps", "events"} (events of every step, setup is step 0)."""
    target = tiny_target(tmp / "target")
    store = tiny_store(tmp / "store", target, n=40)
    settings, script, out = tmp / "train.json", tmp / "count_syncs.py", tmp / "syncs.json"
    settings.write_text(json.dumps({"train": train_kwargs(tmp, store.path, target, **train), "drafter": DRAFTER}))
    script.write_text(COUNTING_RUNNER)
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    command = [sys.executable, str(script), str(settings), str(ROOT), str(out)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def per_step(record: dict, owner: str) -> dict[int, list[str]]:
    """Step -> the calls `owner` made in it ("kind at file:line"), for the steps followed by another one (the last
    step's window also holds the final checkpoint and eval)."""
    steps = {k: [] for k in range(1, record["steps"])}
    for e in record["events"]:
        if e["owner"] == owner and e["step"] in steps:
            steps[e["step"]].append(f"{e['kind']} at {e['where']}")
    return steps


@pytest.mark.parametrize("log_every, grad_accum", [(1, 1), (3, 2)])
def test_one_host_sync_per_logged_step(tmp_path, log_every, grad_accum):
    """Ours: one `.tolist()` at each logged step (the sync of the steps' sums), none at the others, none per
    micro-batch. DeepSpeed's own (printed, not asserted): its per-step grad-norm checks."""
    common = dict(epochs=3, max_steps=8, checkpoint_every=0, eval_every=0, zero_stage=2)
    record = counted_run(tmp_path, log_every=log_every, grad_accum=grad_accum, **common)
    ours, theirs = per_step(record, "ours"), per_step(record, "deepspeed")
    counts = {who: [len(v) for v in calls.values()] for who, calls in (("ours", ours), ("DeepSpeed's", theirs))}
    print(f"log_every={log_every}, grad_accum={grad_accum}: calls a step {counts}")
    assert len(ours) == 7
    for step, calls in ours.items():
        assert len(calls) == (1 if step % log_every == 0 else 0), (step, calls)
    assert sum(map(len, ours.values())) == len(ours) // log_every
