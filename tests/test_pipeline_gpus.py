"""The default fleet on a machine with GPUs: one capture actor per GPU, each owning its own device. Ray accepts
declared GPUs without hardware, so a local Ray started with four declared GPUs stands in for a 4-GPU machine; the
fleet runs as `python -m pipeline` runs it (auto actors, auto GPUs an actor)."""

import pytest

from flashdraft.config import ClusterConfig
from pipeline.fleet import FleetConfig, resolve_actors, run_fleet
from pipeline.job import open_store
from pipeline.localray import local_ray
from tests.test_capture_decode import records
from tests.test_pipeline import build_tiny_target, settings_for

pytest.importorskip("ray")


def test_auto_actors_take_one_gpu_each_and_one_per_gpu():
    auto = FleetConfig(num_actors=ClusterConfig.num_actors, gpus_per_actor=ClusterConfig.gpus_per_actor)
    fleet, line = resolve_actors(auto, "auto", 8)
    assert (fleet.num_actors, fleet.gpus_per_actor) == (8, 1.0) and "8 actor(s), 1 GPU(s) each" in line
    assert (resolve_actors(auto, "cpu", 8)[0].num_actors, resolve_actors(auto, "cpu", 8)[0].gpus_per_actor) == (1, 0)
    assert resolve_actors(auto, "auto", 0)[0].num_actors == 1
    assert resolve_actors(FleetConfig(num_actors=3, gpus_per_actor="auto"), "cuda", 8)[0].num_actors == 3
    assert resolve_actors(FleetConfig(gpus_per_actor=2), "cuda", 8)[0].num_actors == 4


def test_a_ray_with_four_declared_gpus_gives_four_actors_four_distinct_devices(tmp_path):
    target = build_tiny_target(tmp_path / "target")
    settings = settings_for(target, torch_threads=1, device="auto", max_new_tokens=4)
    store = tmp_path / "s"
    writer = open_store(store, settings, sources=["test"], store_options=dict(shard_tokens=64, chunk_tokens=16))
    results = []
    ray_args = dict(include_dashboard=False, object_store_memory=100 << 20, logging_level="error", log_to_driver=False)
    with local_ray(num_cpus=4, num_gpus=4, **ray_args):
        fleet = FleetConfig(shard_size=1)  # num_actors and gpus_per_actor: auto, as cluster=local has them
        summary = run_fleet(store, records(8), settings, writer, fleet, on_result=results.append, progress=False)
    assert summary.ok, summary.lines()
    devices = {r["pid"]: r["devices"] for r in results}
    assert len(devices) == 4, devices
    assert sorted(devices.values()) == ["0", "1", "2", "3"], devices
