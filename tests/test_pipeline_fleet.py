"""The Ray fleet: 2 actors == 1 actor; a SIGKILLed worker loses nothing and duplicates nothing."""

import os
import signal

import pytest
import torch

from flashdraft.prompts import load_prompts
from flashdraft.store import StoreReader, verify_store
from pipeline.fleet import FleetConfig, run_fleet
from pipeline.job import open_store
from tests.test_pipeline import build_tiny_target, settings_for

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_local():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        num_cpus=2, include_dashboard=False, object_store_memory=100 << 20, logging_level="error", log_to_driver=False
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="module")
def records():
    return load_prompts("humaneval", limit=10) + load_prompts("mtbench", limit=4)


def run(store, target, records, actors, on_result=None, max_attempts=3):
    settings = settings_for(target, torch_threads=1)
    writer = open_store(store, settings, sources=["test"], store_options=dict(shard_tokens=256, chunk_tokens=32))
    fleet = FleetConfig(num_actors=actors, shard_size=2, max_attempts=max_attempts)
    return run_fleet(store, records, settings, writer, fleet, on_result=on_result, progress=False)


def contents(store):
    r = StoreReader(store)
    assert len(set(r.seq_ids)) == len(r.seq_ids), "duplicated sequences"
    assert verify_store(store, progress=False)[0] == []
    return {s: r.read(r.index(s)) for s in r.seq_ids}


def same(a, b):
    """The same sequences token for token, features within the bf16 store's rounding: which prompts share a decode
    batch depends on the fleet (a worker's next task joins its decode), and rows and padding change the order of
    floating-point sums."""
    assert sorted(a) == sorted(b)
    for k in a:
        assert (a[k].input_ids == b[k].input_ids).all() and (a[k].loss_mask == b[k].loss_mask).all()
        assert torch.allclose(a[k].features.float(), b[k].features.float(), rtol=1e-2, atol=1e-3)


def test_two_actors_equal_one_and_a_killed_worker_loses_nothing(tmp_path, ray_local, target, records):
    one = run(tmp_path / "one", target, records, actors=1)
    assert one.sequences == len(records) and not one.failed
    ref = contents(tmp_path / "one")

    two = run(tmp_path / "two", target, records, actors=2)
    assert two.sequences == len(records) and not two.failed
    same(ref, contents(tmp_path / "two"))

    # SIGKILL the worker as it reports its first shard (its next task is already running):
    # with one attempt allowed the shard is reported failed, the rest of the fleet carries on...
    killed = []

    def kill_once(result):
        if not killed:
            killed.append(result["pid"])
            os.kill(result["pid"], signal.SIGKILL)

    crash = run(tmp_path / "crash", target, records, actors=1, on_result=kill_once, max_attempts=1)
    assert killed and crash.failed and 0 < crash.sequences < len(records)
    assert all("ActorDied" in f["error"] or "RayActorError" in f["error"] for f in crash.failed)
    # ...and the rerun of the same command completes it: no loss, no duplicates
    rerun = run(tmp_path / "crash", target, records, actors=1)
    assert not rerun.failed and rerun.sequences == len(records)
    same(ref, contents(tmp_path / "crash"))

    # with retries allowed, the killed worker's shard is redone on a fresh one in the same run
    killed.clear()
    retried = run(tmp_path / "retry", target, records, actors=2, on_result=kill_once)
    assert killed and not retried.failed and retried.sequences == len(records)
    same(ref, contents(tmp_path / "retry"))
