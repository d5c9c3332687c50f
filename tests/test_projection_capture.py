"""Capture into a projected store (issue #47): the driver fits the basis once on the first prompts' tokens, before any
task; every worker applies that one basis inside the layer tap (the features leave the target's device r wide), in
every feature dtype; a Ray fleet's actors all use the same basis."""

import json

import pytest
import torch

from flashdraft.prompts import load_prompts
from flashdraft.store import StoreReader, verify_store
from flashdraft.store.projection import load_projection
from flashdraft.target import load_tokenizer
from pipeline.fleet import FleetConfig, run_fleet
from pipeline.job import open_store
from tests.test_pipeline import LAYERS, settings_for, tiny

H = 64
CALIBRATION = 96


def build_tiny_qwen3(folder):
    """A tiny random Qwen3 with the SmolLM2 tokenizer, saved as an HF folder."""
    tok = load_tokenizer("smollm2-135m")
    model = tiny("qwen3", vocab=len(tok))
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        model.lm_head.weight[model.generation_config.eos_token_id] *= 6
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module")
def records():
    return load_prompts("humaneval", limit=6) + load_prompts("mtbench", limit=2)


def capture(store, target, records, *, actors=0, on_result=None, **store_options):
    settings = settings_for(target, torch_threads=1)
    options = dict(shard_tokens=256, chunk_tokens=32, **store_options)
    writer = open_store(store, settings, sources=["test"], store_options=options)
    fleet = FleetConfig(num_actors=actors, shard_size=2)
    return run_fleet(store, records, settings, writer, fleet, on_result=on_result, progress=False)


@pytest.fixture(scope="module")
def raw(tmp_path_factory, target, records):
    path = tmp_path_factory.mktemp("raw") / "store"
    assert capture(path, target, records, dtype="float32").ok
    return StoreReader(path)


TOL = {"bfloat16": 1e-2, "float16": 2e-3, "float8_e4m3": 7e-2, "float32": 1e-4}  # of each sequence's max |feature|


@pytest.mark.parametrize("dtype", list(TOL))
def test_in_process_capture_stores_the_features_projected_by_the_one_basis(tmp_path, target, records, raw, dtype):
    results = []
    store = tmp_path / "store"
    summary = capture(
        store,
        target,
        records,
        on_result=results.append,
        dtype=dtype,
        project="pca",
        project_dims="H",
        calibration_tokens=CALIBRATION,
    )
    assert summary.ok
    manifest = json.loads((store / "manifest.json").read_text())
    entry = manifest["projection"]
    assert manifest["layout"]["project_dims"] == H and entry["dims"] == H and entry["input_dims"] == len(LAYERS) * H
    assert entry["calibration_tokens"] == CALIBRATION and len(entry["sha256"]) == 64
    assert {r["projection_sha256"] for r in results} == {entry["sha256"]}  # every task applied the recorded basis
    assert verify_store(store, progress=False)[0] == []
    proj = load_projection(store)
    got = StoreReader(store)
    assert sorted(got.seq_ids) == sorted(raw.seq_ids)
    for seq_id in raw.seq_ids:
        a, b = raw.read(raw.index(seq_id)), got.read(got.index(seq_id))
        assert (a.input_ids == b.input_ids).all() and (a.loss_mask == b.loss_mask).all()  # projection changes no token
        want = a.features @ proj.projection
        assert b.features.shape == (len(a.input_ids), H)
        assert ((b.features - want).abs().max() / want.abs().max()).item() < TOL[dtype], seq_id


def test_a_resumed_capture_keeps_the_basis(tmp_path, target, records):
    store = tmp_path / "store"
    opts = dict(dtype="bfloat16", project="pca", project_dims=96, calibration_tokens=CALIBRATION)
    assert capture(store, target, records[:4], **opts).ok
    sha = json.loads((store / "manifest.json").read_text())["projection"]["sha256"]
    assert capture(store, target, records, **opts).ok
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["projection"]["sha256"] == sha and manifest["counts"]["sequences"] == len(records)


ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_local():
    ray.init(
        num_cpus=2, include_dashboard=False, object_store_memory=100 << 20, logging_level="error", log_to_driver=False
    )
    yield
    ray.shutdown()


def test_fleet_actors_share_one_basis(tmp_path, ray_local, target, records, raw):
    results = []
    store = tmp_path / "store"
    opts = dict(dtype="float8_e4m3", project="pca", project_dims="H", calibration_tokens=CALIBRATION)
    assert capture(store, target, records, actors=2, on_result=results.append, **opts).ok
    sha = json.loads((store / "manifest.json").read_text())["projection"]["sha256"]
    assert len({r["pid"] for r in results}) == 2, "both actors ran tasks"
    assert {r["projection_sha256"] for r in results} == {sha}
    assert verify_store(store, progress=False)[0] == []
    # the same basis an in-process capture fits on the same first prompts
    inline = tmp_path / "inline"
    assert capture(inline, target, records, **opts).ok
    torch.testing.assert_close(load_projection(inline).projection, load_projection(store).projection)
    proj, got = load_projection(store), StoreReader(store)
    for seq_id in raw.seq_ids:
        want = raw.read(raw.index(seq_id)).features @ proj.projection
        b = got.read(got.index(seq_id)).features
        assert ((b - want).abs().max() / want.abs().max()).item() < TOL["float8_e4m3"]
