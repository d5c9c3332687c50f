"""Shared builders for the trainer tests: a tiny real target folder (model and tokenizer) and small real feature
stores."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import traceback
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from flashdraft.config import DrafterConfig, TrainConfig
from flashdraft.store import write_store
from flashdraft.target import target_fingerprint

H, VOCAB, MASK = 64, 64, 63
STORE_LAYERS = [1, 3, 4]
DRAFTER = dict(layer_ids=[1, 3], num_layers=2, block_size=4)  # the DrafterConfig of the trained drafters


def tiny_target(folder: Path) -> Path:
    """A 6-layer Llama whose tokenizer has one word fewer than its embedding: the mask token is the spare row, 63."""
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=H,
            intermediate_size=128,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
        LlamaForCausalLM(cfg).save_pretrained(folder)
        words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(MASK)}, unk_token="w0"))
        PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w1").save_pretrained(folder)
    return folder


def tiny_store(
    path: Path,
    target: Path,
    n: int = 24,
    seed: int = 0,
    *,
    lengths=(24, 48),
    layers=STORE_LAYERS,
    extra=None,
    teacher_topk: int = 0,
    thinking: bool | None = None,
):
    """Random sequences: a prompt (loss_mask False) then a response whose tokens follow a simple
    rule (next = prev + 1 mod 60), so a drafter can learn something in a few steps. With teacher_topk
    each token also gets a top-k whose first entry is the next token, as a greedy target's would; `thinking`: the
    chat-template mode every sequence records (None: none recorded)."""
    rng = np.random.default_rng(seed)
    seqs = []
    for i in range(n):
        s = int(rng.integers(*lengths))
        start = int(rng.integers(0, 60))
        ids = (start + np.arange(s)) % 60
        p = int(rng.integers(3, 8))
        ids[:p] = rng.integers(0, 60, p)
        mask = np.zeros(s, bool)
        mask[p:] = True
        feats = torch.randn(s, len(layers) * H) * 0.5
        feats[:, :H] += (
            torch.nn.functional.one_hot(torch.as_tensor(ids), H).float() * 3
        )  # the token is visible in the features
        seqs.append(
            {"seq_id": f"seq{seed}-{i}", "input_ids": ids, "loss_mask": mask, "features": feats, "thinking": thinking}
        )
        if teacher_topk:
            nxt = np.append(ids[1:], ids[-1])
            others = (nxt[:, None] + 1 + np.arange(teacher_topk - 1)[None, :] * 7) % 60
            logp = np.log(np.linspace(0.6, 0.05, teacher_topk))[None, :].repeat(s, 0)
            seqs[-1]["teacher"] = (np.concatenate([nxt[:, None], others], 1), logp)
    manifest = {"target": target_fingerprint(str(target)), "vocab_size": VOCAB, **(extra or {})}
    return write_store(
        path, seqs, layer_ids=layers, hidden_size=H, dtype="float32", manifest_extra=manifest, teacher_topk=teacher_topk
    )


def train_kwargs(tmp: Path, store, target, **over) -> dict:
    """TrainConfig fields for a small CPU run (the drafter's shape is `DRAFTER`)."""
    kw = dict(
        stores=[str(store)],
        out_dir=str(tmp / "run"),
        drafter_dir=str(tmp / "drafter"),
        target=str(target),
        num_anchors=6,
        max_length=64,
        token_budget=400,
        epochs=2,
        zero_stage=2,
        dtype="float32",
        device="cpu",
        attention="dense",
        compile="false",
        ce_chunk=64,
        checkpoint_every=4,
        eval_every=4,
        eval_batches=2,
        heldout_fraction=0.15,
        progress=False,
        loader_workers=2,
        prefetch=2,
    )
    kw.update(over)
    return kw


def configs(kwargs: dict, drafter: dict | None = None) -> tuple[TrainConfig, DrafterConfig]:
    return TrainConfig(**kwargs), DrafterConfig(**(drafter or DRAFTER))


RUNNER = textwrap.dedent("""
    import json, sys
    from flashdraft.config import DrafterConfig, TrainConfig
    from trainer.train import train
    run = json.load(open(sys.argv[1]))
    out = train(TrainConfig(**run["train"]), DrafterConfig(**run["drafter"]))
    print("RESULT " + json.dumps(out))
""")


def run_training(tmp: Path, kwargs: dict, nproc: int = 1, timeout: int = 240, env=None, wait=True, drafter=None):
    """Train in fresh processes (plain python for 1, torchrun for several) on TrainConfig(**kwargs) and
    DrafterConfig(**drafter) (default `DRAFTER`)."""
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = tmp / "train.json"
    cfg.write_text(json.dumps({"train": kwargs, "drafter": drafter or DRAFTER}))
    script = tmp / "run_train.py"
    script.write_text(RUNNER)
    if nproc == 1:
        cmd = [sys.executable, str(script), str(cfg)]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(script),
            str(cfg),
        ]
    # the code next to these tests, not whichever checkout the virtualenv's editable install points at
    path = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")) if p)
    full_env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(env or {})}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(k, None)
    if not wait:
        return subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@contextmanager
def as_a_process():
    """Inside: what a trainer does to its process's environment and threads stays inside (the environment put back
    after, one thread as OMP_NUM_THREADS=1 gives a trainer's process). The process group a run starts (one rank,
    gloo) stays for the next run in this process; nothing outside the trainer reads it."""
    threads, environ = torch.get_num_threads(), dict(os.environ)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        for key in set(os.environ) - set(environ):  # what the run set (RANK, WORLD_SIZE, MASTER_ADDR, ...)
            del os.environ[key]
        os.environ.update(environ)


def train_here(kwargs: dict, drafter=None, check: bool = True) -> subprocess.CompletedProcess:
    """`run_training`'s run in this process, for tests that are not about the process (a fresh one spends seconds on
    its imports), with stdout and stderr captured. A raise ends it as an uncaught one ends a process: returncode 1,
    the traceback in stderr (`check`: fail the test)."""
    from trainer.train import train

    out, err, code = io.StringIO(), io.StringIO(), 0
    with as_a_process(), redirect_stdout(out), redirect_stderr(err):
        try:
            train(*configs(kwargs, drafter))
        except Exception:
            traceback.print_exc()
            code = 1
    done = subprocess.CompletedProcess(["train"], code, out.getvalue(), err.getvalue())
    assert not check or code == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def metrics(run_dir: Path, kind: str = "loss") -> list[dict]:
    """Rows of metrics.jsonl that hold `kind` (training rows: "loss"; eval rows: "eval/loss")."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if kind in r]
