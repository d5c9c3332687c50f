"""The DeepSpeed trainer end to end on CPU (gloo): 2 ranks == 1 rank, kill + resume, NaN stop,
manifest checks, and the exported drafter in the published format."""

import re
import signal
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from flashdraft.model import DFlashDrafter
from tests.test_trainer_fixtures import (
    configs,
    metrics,
    run_training,
    tiny_store,
    tiny_target,
    train_here,
    train_kwargs,
)
from trainer.store_check import StoreMismatch
from trainer.train import train


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer")
    target = tiny_target(tmp / "target")
    store = tiny_store(tmp / "store", target, n=40)
    return tmp, target, store


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


def test_two_ranks_reach_the_parameters_of_one_rank_with_the_same_global_batch(setup, tmp_path):
    _, target, store = setup
    common = dict(epochs=1, max_steps=3, checkpoint_every=0, eval_every=0, zero_stage=2)
    train_here(train_kwargs(tmp_path / "one", store.path, target, grad_accum=2, **common))
    run_training(tmp_path / "two", train_kwargs(tmp_path / "two", store.path, target, grad_accum=1, **common), nproc=2)
    one, two = metrics(tmp_path / "one" / "run"), metrics(tmp_path / "two" / "run")
    assert [m["step"] for m in one] == [m["step"] for m in two] == [1, 2, 3]
    np.testing.assert_allclose([m["loss"] for m in one], [m["loss"] for m in two], rtol=1e-5)
    w1, w2 = weights(tmp_path / "one" / "drafter"), weights(tmp_path / "two" / "drafter")
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=2e-6, rtol=1e-4, msg=f"{k} differs between 1 and 2 ranks")
    assert one[-1]["grad_norm"] > 0


def test_kill_during_training_then_resume_repeats_the_uninterrupted_run(setup, tmp_path):
    _, target, store = setup
    common = dict(epochs=3, checkpoint_every=3, eval_every=0, zero_stage=1)
    ref = tmp_path / "ref"
    train_here(train_kwargs(ref, store.path, target, **common))
    full = metrics(ref / "run")

    crash = tmp_path / "crash"
    kw = train_kwargs(crash, store.path, target, **common)
    proc = run_training(crash, kw, wait=False)  # a process: it is killed
    log = crash / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if log.is_file() and len(log.read_text().splitlines()) >= 5:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    killed_at = len(metrics(crash / "run"))
    assert killed_at < len(full)
    assert (crash / "run" / "checkpoints" / "latest").is_file()

    out = train_here(kw)
    assert "resumed from" in out.stdout
    resumed = metrics(crash / "run")
    assert [m["step"] for m in resumed] == [m["step"] for m in full]
    np.testing.assert_allclose([m["loss"] for m in resumed], [m["loss"] for m in full], rtol=1e-6)
    np.testing.assert_allclose([m["lr"] for m in resumed], [m["lr"] for m in full], rtol=1e-9)
    w_ref, w_res = weights(ref / "drafter"), weights(crash / "drafter")
    for k in w_ref:
        torch.testing.assert_close(w_res[k], w_ref[k], atol=1e-6, rtol=1e-5)

    # the export is the published format: our loader and the reference package read it alike
    from dflash.model import DFlashDraftModel

    ours = DFlashDrafter.from_pretrained(crash / "drafter")
    theirs = DFlashDraftModel.from_pretrained(str(crash / "drafter"))
    assert ours.mask_token_id == theirs.mask_token_id == 63 and ours.target_layer_ids == [1, 3]
    for k, v in theirs.state_dict().items():
        torch.testing.assert_close(v, ours.state_dict()[k])
    ckpts = sorted(p.name for p in (crash / "run" / "checkpoints").glob("step-*"))
    assert len(ckpts) == 3 and all(
        (crash / "run" / "checkpoints" / c / "drafter" / "config.json").is_file() for c in ckpts
    )


def test_nan_loss_stops_with_a_clear_message(setup, tmp_path):
    _, target, _ = setup
    bad = tiny_store(tmp_path / "bad", target, n=12)
    # a corrupt store (written around the store's own finiteness check): Inf features -> NaN loss
    import zarr

    arr = zarr.open_array(str(tmp_path / "bad" / "shards" / "shard-00000" / "features"), mode="r+")
    arr[:] = np.full(arr.shape, np.inf, dtype=np.float32)
    proc = train_here(train_kwargs(tmp_path, bad.path, target, checkpoint_every=0), check=False)
    out = proc.stdout + proc.stderr  # the check before step 1 finds it (every sample reads some features)
    assert (
        proc.returncode != 0 and "CorruptStore" in out and re.search(r"array features rows \d+..\d+ hold NaN/Inf", out)
    )
    kwargs = train_kwargs(tmp_path, bad.path, target, checkpoint_every=0, verify_store="off")
    proc = train_here(kwargs, check=False)  # unchecked, the loss itself stops the run
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "TrainingDiverged" in out and "loss is nan" in out and "no checkpoint yet" in out
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(layers=[1, 4]), r"layer_ids \[1, 3\] are not all in the feature stores \(\S+/s: \[1, 4\]\)"),
        (dict(extra={"vocab_size": 1000}), r"vocabulary size 1000 != the target's 64"),
        (dict(extra={"target": {"name": "other", "config_sha256": "ab" * 32}}), r"config_sha256 differs"),
    ],
)
def test_manifest_mismatch_names_the_field(setup, tmp_path, monkeypatch, change, message):
    _, target, _ = setup
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555").items():
        monkeypatch.setenv(k, v)
    store = tiny_store(tmp_path / "s", target, n=4, **change)
    with pytest.raises(StoreMismatch, match=message):
        train(*configs(train_kwargs(tmp_path, store.path, target)))


def test_target_init_and_eval_on_separate_held_out_stores(setup, tmp_path):
    """init=target starts from the target's top layers; eval/* comes from eval_stores only (the
    training stores hold nothing back here, so without them there would be no eval rows)."""
    _, target, store = setup
    eval_store = tiny_store(tmp_path / "eval", target, n=6, seed=7)
    kw = train_kwargs(
        tmp_path,
        store.path,
        target,
        init="target",
        eval_stores=[str(eval_store.path)],
        heldout_fraction=0.0,
        max_steps=4,
        eval_every=4,
        checkpoint_every=0,
    )
    out = train_here(kw)
    evals = metrics(tmp_path / "run", "eval/loss")
    assert len(evals) == 1 and evals[0]["eval/tau"] >= 1.0
    assert "no eval/* metrics" not in out.stdout
    assert len(metrics(tmp_path / "run")) == 4


def test_eval_every_with_nothing_held_out_is_said_once(setup, tmp_path):
    """No held-out sequence: eval_every cannot log eval/* rows, and the run says so at the start, once."""
    _, target, store = setup
    kw = train_kwargs(tmp_path, store.path, target, heldout_fraction=0.0, epochs=1, max_steps=3, eval_every=1)
    out = train_here({**kw, "checkpoint_every": 0})
    note = (
        "no eval/* metrics: nothing is held out (train.heldout_fraction=0 and no train.eval_stores); "
        "train.eval_every=1 (eval every 1 steps) does nothing"
    )
    assert out.stdout.count(note) == 1, out.stdout[-2000:]
    assert metrics(tmp_path / "run", "eval/loss") == [] and len(metrics(tmp_path / "run")) == 3


def test_init_from_an_exported_drafter_starts_from_its_weights(setup, tmp_path):
    """train.init=<drafter folder> fine-tunes: with lr 0 the exported drafter equals the one it started from;
    a drafter of another shape is refused by name."""
    _, target, store = setup
    common = dict(epochs=1, max_steps=2, checkpoint_every=0, eval_every=0)
    train_here(train_kwargs(tmp_path / "a", store.path, target, **common))
    start = tmp_path / "a" / "drafter"
    train_here(train_kwargs(tmp_path / "b", store.path, target, init=str(start), lr=0.0, **common))
    before, after = weights(start), weights(tmp_path / "b" / "drafter")
    assert before.keys() == after.keys()
    for k in before:
        torch.testing.assert_close(after[k], before[k], atol=0, rtol=0, msg=k)

    from trainer.drafter import init_from_drafter

    other = DFlashDrafter.from_pretrained(start)
    other.config.num_hidden_layers += 1
    with pytest.raises(ValueError, match="another shape"):
        init_from_drafter(DFlashDrafter(other.config), start)
    wider = DFlashDrafter.from_pretrained(start).config
    wider.intermediate_size += 8  # same tensor names, other shapes
    with pytest.raises(ValueError, match="another shape"):
        init_from_drafter(DFlashDrafter(wider), start)
    with pytest.raises(ValueError, match="holds no config.json"):
        init_from_drafter(DFlashDrafter(other.config), tmp_path / "nowhere")


def test_soft_labels_train_and_a_one_hot_teacher_gives_the_hard_label_run(setup, tmp_path):
    """soft_labels mixes the stores' teacher top-k into the labels: a top-1 teacher (its one token is the label)
    reproduces the hard-label losses exactly; a top-3 teacher changes them; hard-label stores are refused."""
    _, target, store = setup
    common = dict(epochs=1, max_steps=3, checkpoint_every=0, eval_every=0)
    stores = {}
    for name, k in (("hard", 0), ("one", 1), ("three", 3)):
        torch.manual_seed(0)  # the same features in all three stores
        stores[name] = tiny_store(tmp_path / f"store-{name}", target, n=40, teacher_topk=k).path
    runs = {}
    for name, soft in (("hard", 0.0), ("one", 1.0), ("three", 0.5)):
        st = stores[name]
        train_here(train_kwargs(tmp_path / name, st, target, soft_labels=soft, **common))
        runs[name] = [m["loss"] for m in metrics(tmp_path / name / "run")]
    assert len(runs["hard"]) == 3
    np.testing.assert_allclose(runs["one"], runs["hard"], rtol=1e-6)
    assert np.abs(np.subtract(runs["three"], runs["hard"])).max() > 1e-4, runs  # near log(V) at the start either way
    refused = train_here(train_kwargs(tmp_path / "bad", store.path, target, soft_labels=0.5, **common), check=False)
    assert re.search(r"^ValueError: .*hold none", refused.stderr, re.M), refused.stderr[-3000:]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_auto_dtype_resume_rebuilds_the_engine_in_the_checkpoints_dtype(setup, tmp_path, dtype):
    """train.dtype=auto times bf16 against fp32 on a fresh run; resumed, it takes the dtype the checkpoint was
    saved in whatever the timing says, so the losses repeat (one of the two cases goes against this CPU's choice)."""
    import json

    _, target, store = setup
    common = dict(epochs=2, max_steps=6, checkpoint_every=3, keep_checkpoints=3, eval_every=0)
    train_here(train_kwargs(tmp_path, store.path, target, **{**common, "dtype": dtype}))
    full = metrics(tmp_path / "run")
    saved = json.loads((tmp_path / "run" / "checkpoints" / "step-00000003" / "client_state.json").read_text())
    assert saved["dtype"] == dtype and saved["global_step"] == 3

    (tmp_path / "run" / "checkpoints" / "latest").write_text("step-00000003")
    out = train_here(train_kwargs(tmp_path, store.path, target, **{**common, "dtype": "auto"}))
    assert "resumed from" in out.stdout and "train.dtype=auto" not in out.stdout  # nothing timed on a resume
    resumed = metrics(tmp_path / "run")
    assert [m["step"] for m in resumed] == list(range(1, 7))
    np.testing.assert_allclose([m["loss"] for m in resumed], [m["loss"] for m in full], rtol=1e-6)


def test_two_ranks_train_in_the_dtype_rank_0_timed(setup, tmp_path):
    """With train.dtype=auto only rank 0 times bf16 against fp32; the other rank takes its answer by broadcast
    (ranks that chose apart would build different engines), and the checkpoint records it."""
    import json

    _, target, store = setup
    kw = train_kwargs(
        tmp_path, store.path, target, dtype="auto", epochs=1, max_steps=2, checkpoint_every=2, eval_every=0
    )
    out = run_training(tmp_path, kw, nproc=2)
    chosen = [line for line in out.stdout.splitlines() if line.startswith("train.dtype=auto: ")]
    assert len(chosen) == 1, out.stdout[-2000:]
    saved = json.loads((tmp_path / "run" / "checkpoints" / "step-00000002" / "client_state.json").read_text())
    assert chosen[0].split()[1] == saved["dtype"] and [m["step"] for m in metrics(tmp_path / "run")] == [1, 2]


def test_the_gpu_recipe_trains_at_tiny_size_on_a_cpu(setup, tmp_path):
    """train=auto's recipe for CUDA (conf/train/paper.yaml) on the tiny store, with what a CPU can execute of what
    a GPU run takes: bf16, the drafter compiled by inductor (its auto is on CUDA only: forced), dense attention with
    key/value heads expanded (a GPU's dense form: forced), 512 anchors a sequence (all a tiny sequence holds), max
    length 3072, a 16,384-token budget, the loss in chunks of 2048 rows, 16 loader threads, the sampled store check,
    a row every 10 steps. Not here: FlexAttention's backward (none on a CPU; its compiled forward is
    tests/test_masks.py's), pinned memory and nccl (CUDA only)."""
    from dataclasses import asdict

    from tests.test_trainer_config import composed
    from trainer.__main__ import train_config

    _, target, store = setup
    recipe = {k: v for k, v in asdict(train_config(composed(cuda_available=True))).items() if k != "wandb"}
    assert (recipe["dtype"], recipe["num_anchors"], recipe["token_budget"], recipe["log_every"]) == (
        "bfloat16",
        512,
        16384,
        10,
    )
    kw = {**recipe, "stores": [str(store.path)], "target": str(target), "eval_stores": None, "max_steps": 3}
    kw.update(out_dir=str(tmp_path / "run"), drafter_dir=str(tmp_path / "drafter"), progress=False)
    kw.update(device="cpu", attention="dense", dense_kv_heads="expanded", compile="true", pin_memory="false")
    out = run_training(tmp_path, kw, timeout=600)
    said = "train settings: device=cpu; dtype=bfloat16; attention=dense; dense_kv_heads=expanded; compile=true"
    assert said in out.stdout, out.stdout[-2000:]
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [3] and np.isfinite(rows[0]["loss"])  # log_every=10: the last step only
    assert rows[0]["tokens_seen"] > 0 and rows[0]["grad_norm"] > 0
    assert DFlashDrafter.from_pretrained(tmp_path / "drafter").config.dtype == torch.bfloat16  # as trained
