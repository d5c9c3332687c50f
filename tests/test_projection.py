"""The projected feature store (issue #47): the basis (fit, apply, stored and verified), the store's r-dim features in
every dtype, transcode, and the drafter trained on them: exported folded in the published format (our loader and the
reference `dflash` package give the projected model's logits on raw features), lifted for warm starts, and mixed
stores refused by name."""

import json

import numpy as np
import pytest
import torch
from transformers import Qwen3Config

from flashdraft.model import DFlashDrafter, fold_projection, lift_fc
from flashdraft.spec import DraftSpec
from flashdraft.store import StoreError, StoreReader, verify_store, write_store
from flashdraft.store.projection import (
    PROJECTION_FILE,
    fit_projection,
    load_projection,
    resolve_dims,
    save_projection,
    split_store_options,
)
from flashdraft.store.transcode import transcode
from tests.test_trainer_fixtures import STORE_LAYERS, H, configs, tiny_store, tiny_target, train_here, train_kwargs
from trainer.checkpoint import export_drafter
from trainer.drafter import init_from_drafter, projected_config
from trainer.store_check import StoreMismatch
from trainer.train import train

dflash_model = pytest.importorskip("dflash.model")

L = len(STORE_LAYERS)


def structured(n: int, d: int = L * H, rank: int = 24, seed: int = 0) -> torch.Tensor:
    """Features like a residual stream's: a low-rank part shared by the layers, a little noise, and two massive
    channels (as SmolLM2 and Qwen carry)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, rank, generator=g) @ torch.randn(rank, d, generator=g) + 0.05 * torch.randn(n, d, generator=g)
    x[:, 5] *= 300.0
    x[:, H + 7] *= 120.0
    return x


def test_dims_resolve_against_the_hidden_size():
    assert resolve_dims("H", 576, 2880) == 576 and resolve_dims("2H", 576, 2880) == 1152
    assert resolve_dims("2.5H", 576, 2880) == 1440 and resolve_dims(1000, 576, 2880) == 1000
    assert resolve_dims("1000", 576, 2880) == 1000
    for bad in ("5H", "xH", 0, 2880, 1.5):
        with pytest.raises(StoreError, match="project_dims"):
            resolve_dims(bad, 576, 2880)
    layout, entry = split_store_options({"dtype": "bfloat16", "project": "pca", "project_dims": "H"}, [1, 2, 3], 64)
    assert layout == {"dtype": "bfloat16", "project_dims": 64} and entry["dims"] == 64 and entry["input_dims"] == 192
    assert split_store_options({"dtype": "bfloat16", "project": None, "project_dims": "2H"}, [1], 64) == (
        {"dtype": "bfloat16"},
        None,
    )


def test_fit_is_scaled_uncentred_pca_with_a_right_inverse():
    x = structured(3000)
    proj = fit_projection(x, 32)
    P, lift = proj.projection, proj.lift
    assert P.shape == lift.shape == (L * H, 32) and proj.meta["calibration_tokens"] == 3000
    torch.testing.assert_close(P.T.double() @ lift.double(), torch.eye(32, dtype=torch.float64), atol=1e-5, rtol=0)
    rms = x.double().pow(2).mean(0).sqrt()
    torch.testing.assert_close(proj.rms.double(), rms, rtol=1e-5, atol=0)
    # the top directions of the scaled features: rank-24 data is kept (nearly) whole by 32 directions
    assert proj.meta["explained"] > 0.99
    recon = (x @ P) @ lift.T
    assert ((recon - x).norm() / x.norm()).item() < 0.05
    # not centred: the map is linear, so a feature's projection is the sum of its parts'
    a, b = x[:5], x[5:10]
    torch.testing.assert_close(proj.apply(a + b), proj.apply(a) + proj.apply(b), atol=1e-2, rtol=1e-4)
    # deterministic (signs fixed), and applied in bf16 gives bf16 close to the float32 product
    again = fit_projection([x[:1000], x[1000:]], 32)
    torch.testing.assert_close(again.projection, P, atol=1e-5, rtol=1e-4)
    got = proj.apply(x[:4].to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), x[:4] @ P, rtol=2e-2, atol=2e-2 * (x[:4] @ P).abs().max().item())


def projected_store(path, raw_seqs, proj, dtype="float32", **extra_manifest):
    """A store of `raw_seqs` projected by `proj`, its basis saved and recorded, as a capture or transcode writes."""
    entry = save_projection(path, proj, layer_ids=STORE_LAYERS, hidden_size=H)
    seqs = [{**s, "features": s["features"] @ proj.projection} for s in raw_seqs]
    manifest = {**extra_manifest, "projection": entry}
    return write_store(
        path,
        seqs,
        layer_ids=STORE_LAYERS,
        hidden_size=H,
        dtype=dtype,
        manifest_extra=manifest,
        project_dims=proj.dims,
        chunk_tokens=16,
        shard_tokens=64,
    )


def raw_sequences(n=6, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        s = int(rng.integers(10, 40))
        out.append(
            {
                "seq_id": f"s{i}",
                "input_ids": rng.integers(0, 60, s),
                "loss_mask": np.arange(s) >= 3,
                "features": structured(s, seed=seed * 100 + i),
            }
        )
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3", "float32"])
def test_projected_store_holds_r_columns_in_every_dtype(tmp_path, dtype):
    seqs = raw_sequences()
    proj = fit_projection(torch.cat([s["features"] for s in seqs]), 40)
    reader = projected_store(tmp_path / "s", seqs, proj, dtype=dtype)
    assert reader.layout.project_dims == 40 and reader.projection_sha256 == proj_sha(tmp_path / "s")
    assert verify_store(tmp_path / "s", progress=False)[0] == []
    tol = {"bfloat16": 1e-2, "float16": 1e-3, "float8_e4m3": 7e-2, "float32": 1e-6}[dtype]
    for s in seqs:
        got = reader.read(reader.index(s["seq_id"])).features
        want = s["features"] @ proj.projection
        assert got.shape == (len(want), 40)
        assert ((got - want).abs().max() / want.abs().max()).item() < tol
    if dtype == "float8_e4m3":  # one scale a token: the basis mixes the layers
        assert reader.layout.array_specs()["features_scale"] == ("float32", (1,))
    with pytest.raises(StoreError, match="projected store"):
        reader.read(0, layers=STORE_LAYERS[:2])


def proj_sha(path):
    return json.loads((path / "manifest.json").read_text())["projection"]["sha256"]


def test_basis_is_stored_checksummed_and_a_flipped_byte_is_refused_naming_the_file(tmp_path):
    seqs = raw_sequences()
    proj = fit_projection(torch.cat([s["features"] for s in seqs]), 16)
    store = tmp_path / "s"
    projected_store(store, seqs, proj)
    assert verify_store(store, progress=False)[0] == []
    loaded = load_projection(store)
    torch.testing.assert_close(loaded.projection, proj.projection)
    f = store / PROJECTION_FILE
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    problems, _ = verify_store(store, progress=False)
    assert any(str(f) in p and "damaged" in p for p in problems), problems
    with pytest.raises(StoreError, match=f"{f}: the projection basis is damaged"):
        StoreReader(store)
    f.unlink()
    with pytest.raises(StoreError, match=f"{f}: the store's projection basis is missing"):
        StoreReader(store)


def test_transcode_rewrites_a_raw_store_and_refuses_projected_and_replay_stores(tmp_path):
    seqs = raw_sequences(8)
    raw = write_store(tmp_path / "raw", seqs, layer_ids=STORE_LAYERS, hidden_size=H, dtype="bfloat16", chunk_tokens=16)
    m = transcode(raw.path, tmp_path / "fp8", dtype="float8_e4m3", progress=False)
    assert m["dtype"] == "float8_e4m3" and "projection" not in m and m["counts"] == raw.manifest["counts"]
    m = transcode(
        raw.path,
        tmp_path / "r",
        dtype="float8_e4m3",
        project="pca",
        project_dims="H",
        calibration_tokens=100,
        progress=False,
    )
    assert m["layout"]["project_dims"] == H and m["projection"]["calibration_tokens"] == 100
    r = StoreReader(tmp_path / "r")
    proj = load_projection(tmp_path / "r")
    src = StoreReader(raw.path)
    for i in range(len(src)):
        want = src.read(i).features @ proj.projection
        got = r.read(r.index(src.seq_ids[i])).features
        assert ((got - want).abs().max() / want.abs().max()).item() < 7e-2
    assert verify_store(tmp_path / "r", progress=False)[0] == []
    # another store with the same basis: the same file, the same sha256
    m2 = transcode(raw.path, tmp_path / "r-bf16", basis=tmp_path / "r", progress=False)
    assert m2["projection"]["sha256"] == m["projection"]["sha256"] and m2["dtype"] == "bfloat16"
    with pytest.raises(StoreError, match=f"{tmp_path / 'r'} is already a projected store"):
        transcode(tmp_path / "r", tmp_path / "again", project="pca", progress=False)
    held = write_store(tmp_path / "features-heldout", seqs[:2], layer_ids=STORE_LAYERS, hidden_size=H)
    with pytest.raises(StoreError, match=f"{held.path} is a replay store"):
        transcode(held.path, tmp_path / "x", project="pca", progress=False)
    with pytest.raises(StoreError, match=f"{held.path} is a replay store"):
        transcode(held.path, tmp_path / "x", dtype="float8_e4m3", progress=False)
    # an eval copy in a training store's basis (the trainer's eval store; replay keeps the raw original)
    m3 = transcode(held.path, tmp_path / "heldout-r", basis=tmp_path / "r", progress=False)
    assert m3["projection"]["sha256"] == m["projection"]["sha256"]


# --- the drafter ------------------------------------------------------------------------------------------------


def tiny_target_config():
    return Qwen3Config(
        vocab_size=97,
        hidden_size=H,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )


def _randomize(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.05)


FOLD_TOL = 1e-4  # max |logit difference|: float32 rounding of fc' @ P^T vs (x @ P) @ fc'^T


def test_export_folds_the_basis_exactly_and_the_reference_loads_it(tmp_path):
    torch.manual_seed(0)
    x = structured(2000)
    proj = fit_projection(x, 48)
    proj = type(proj)(proj.projection, proj.lift, proj.rms, proj.meta, "ab" * 32)
    cfg = projected_config(DraftSpec(STORE_LAYERS, 96, 8, 2).draft_config(tiny_target_config()), proj)
    model = DFlashDrafter(cfg).eval()
    _randomize(model)
    assert model.fc.weight.shape == (H, 48)
    export_drafter(DFlashDrafter, cfg, model.state_dict(), tmp_path / "out", dtype=torch.float32, projection=proj)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["feature_projection"] == {
        "method": "pca",
        "dims": 48,
        "input_dims": L * H,
        "sha256": "ab" * 32,
        "folded": True,
    }
    ours = DFlashDrafter.from_pretrained(tmp_path / "out")
    ref = dflash_model.DFlashDraftModel.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    assert ours.fc.weight.shape == ref.fc.weight.shape == (H, L * H)
    torch.testing.assert_close(ours.fc.weight, fold_projection(model.fc.weight, proj.projection))

    head = torch.nn.Linear(H, 97, bias=False)
    raw = structured(2 * 19, seed=3).reshape(2, 19, L * H) / 50  # a residual stream's scale
    noise, pos = torch.randn(2, 8, H), torch.arange(19 + 8)[None].expand(2, -1)
    with torch.no_grad():
        projected = head(model(noise, raw @ proj.projection, pos))
        exported = head(ours(noise, raw, pos))
        reference = ref.compute_logits(ref(position_ids=pos, noise_embedding=noise, target_hidden=raw), head)
    assert (exported - projected).abs().max().item() < FOLD_TOL
    assert (reference - projected).abs().max().item() < FOLD_TOL

    # a warm start from the exported (raw) drafter lifts its fc back to the basis: exact for the same basis
    again = DFlashDrafter(cfg)
    init_from_drafter(again, tmp_path / "out", lift=proj.lift)
    torch.testing.assert_close(again.fc.weight, model.fc.weight, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(
        lift_fc(fold_projection(model.fc.weight, proj.projection), proj.lift), model.fc.weight, atol=1e-5, rtol=1e-4
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny target, a raw store of it and its projected copy (r = 2H, fp8), one short run on the copy."""
    tmp = tmp_path_factory.mktemp("projected-training")
    target = tiny_target(tmp / "target")
    raw = tiny_store(tmp / "raw", target, n=24)
    transcode(raw.path, tmp / "proj", dtype="float8_e4m3", project="pca", project_dims="2H", progress=False)
    kw = train_kwargs(tmp / "run", str(tmp / "proj"), target, max_steps=3, epochs=1, init="target", eval_every=0)
    train_here(kw, drafter={"num_layers": 2, "block_size": 4})
    return tmp, target, raw


def test_training_on_a_projected_store_exports_the_published_format_with_its_provenance(trained):
    tmp, _, _ = trained
    out = tmp / "run" / "drafter"
    saved = json.loads((out / "config.json").read_text())
    sha = proj_sha(tmp / "proj")
    assert saved["feature_projection"]["sha256"] == sha and saved["feature_projection"]["folded"] is True
    assert saved["feature_projection"]["dims"] == 2 * H
    ours = DFlashDrafter.from_pretrained(out)
    ref = dflash_model.DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32).eval()
    assert ours.fc.weight.shape == (H, L * H) and ours.target_layer_ids == STORE_LAYERS
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(v, ours.state_dict()[k])
    # the folded fc lies in the basis's span: lifting it and folding again gives it back
    proj = load_projection(tmp / "proj")
    torch.testing.assert_close(
        fold_projection(lift_fc(ours.fc.weight, proj.lift), proj.projection), ours.fc.weight, atol=1e-5, rtol=1e-4
    )


def _env(monkeypatch):
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29556").items():
        monkeypatch.setenv(k, v)


def test_mixed_bases_and_raw_with_projected_are_refused_by_name(trained, tmp_path, monkeypatch):
    tmp, target, raw = trained
    _env(monkeypatch)
    other = tmp_path / "other"
    transcode(raw.path, other, project="pca", project_dims="2H", calibration_tokens=200, progress=False)
    assert proj_sha(other) != proj_sha(tmp / "proj")
    drafter = {"num_layers": 2, "block_size": 4}
    kw = train_kwargs(tmp_path, str(tmp / "proj"), target, stores=[str(tmp / "proj"), str(other)])
    with pytest.raises(
        StoreMismatch, match=rf"projected by different bases \({tmp / 'proj'}: basis {proj_sha(tmp / 'proj')[:12]}"
    ):
        train(*configs(kw, drafter))
    kw = train_kwargs(tmp_path, str(raw.path), target, stores=[str(raw.path), str(tmp / "proj")])
    with pytest.raises(StoreMismatch, match=rf"raw and projected feature stores mixed: raw \['{raw.path}'\]"):
        train(*configs(kw, drafter))
    kw = train_kwargs(tmp_path, str(tmp / "proj"), target, eval_stores=[str(raw.path)])
    with pytest.raises(StoreMismatch, match="raw and projected"):
        train(*configs(kw, drafter))
    kw = train_kwargs(tmp_path, str(tmp / "proj"), target)
    with pytest.raises(StoreMismatch, match=r"drafter.layer_ids \[1, 3\] cannot be read"):
        train(*configs(kw, {**drafter, "layer_ids": [1, 3]}))


def test_transcode_command_line(tmp_path, capsys):
    from pipeline.__main__ import transcode_command

    raw = write_store(tmp_path / "raw", raw_sequences(3), layer_ids=STORE_LAYERS, hidden_size=H, chunk_tokens=16)
    assert transcode_command([str(raw.path), str(tmp_path / "x"), "colour=red"]) == 2
    dst = tmp_path / "r"
    args = [str(raw.path), str(dst), "dtype=fp8", "project=pca", "project_dims=H", "calibration_tokens=50"]
    assert transcode_command(args) == 0
    assert f"{dst}: 3 sequences" in capsys.readouterr().out and StoreReader(dst).dtype == "float8_e4m3"
    assert transcode_command([str(dst), str(tmp_path / "y"), "dtype=fp8"]) == 1
    assert f"{dst} is already a projected store" in capsys.readouterr().err
