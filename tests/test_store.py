"""The feature store: round trip per dtype, atomic commits, lazy reads, verification."""

import json
import os
import pickle
import shutil

import numpy as np
import pytest
import torch
import zarr

from flashdraft.store import (
    ShardWriter,
    StoreError,
    StoreLayout,
    StoreReader,
    StoreWriter,
    is_store,
    verify_store,
    write_store,
)
from flashdraft.store.convert import main as convert_main
from flashdraft.store.files import MANIFEST, SHARDS, files_per_shard
from flashdraft.store.format import decode_index, encode_index, index_nbytes

LAYERS, H = [1, 4, 7], 32


def make_sequences(lengths=(5, 100, 70, 1, 300), seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        feats = torch.randn(n, len(LAYERS) * H, generator=g) * scale
        feats[:, 0] = 1000.0 * (i + 1)  # a massive activation, as real targets have
        ids = torch.randint(0, 50_000, (n,), generator=g).numpy()
        out.append(dict(seq_id=f"seq-{seed}-{i}", input_ids=ids, loss_mask=np.arange(n) >= n // 3, features=feats))
    return out


def layout_of(num_layers, dtype="bfloat16", topk=0):
    return StoreLayout(tuple(range(num_layers)), H, dtype, teacher_topk=topk)


def small(dtype="bfloat16"):
    return dict(layer_ids=LAYERS, hidden_size=H, dtype=dtype, chunk_tokens=16, shard_tokens=64)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3", "float32"])
def test_round_trip(tmp_path, dtype):
    seqs = make_sequences()
    extra = {"target": {"name": "tiny"}, "vocab_size": 50_000, "mask_token_id": 3}
    r = write_store(tmp_path / "s", seqs, manifest_extra=extra, **small(dtype))
    assert len(r) == len(seqs) and r.seq_ids == [s["seq_id"] for s in seqs]
    assert r.layer_ids == LAYERS and r.hidden_size == H
    assert list(r.lengths) == [len(s["input_ids"]) for s in seqs]
    assert r.manifest["counts"] == {
        "sequences": 5,
        "tokens": 476,
        "response_tokens": sum(int(s["loss_mask"].sum()) for s in seqs),
    }
    assert r.manifest["target"] == {"name": "tiny"} and r.manifest["mask_token_id"] == 3
    for i in np.random.default_rng(0).permutation(len(seqs)):
        s, got = seqs[i], r.read(int(i))
        assert got.seq_id == s["seq_id"]
        assert got.input_ids.dtype == np.int64 and np.array_equal(got.input_ids, s["input_ids"])
        assert got.loss_mask.dtype == np.bool_ and np.array_equal(got.loss_mask, s["loss_mask"])
        assert got.features.dtype == torch.float32 and got.features.shape == s["features"].shape
        x = s["features"]
        if dtype == "bfloat16":
            assert torch.equal(got.features, x.to(torch.bfloat16).float())
        elif dtype == "float16":
            assert torch.equal(got.features, x.to(torch.float16).float())
        elif dtype == "float32":
            assert torch.equal(got.features, x)
        else:  # e4m3: 3 mantissa bits relative to each token's own per-layer scale
            for j in range(len(LAYERS)):
                xs, gs = x[:, j * H : (j + 1) * H], got.features[:, j * H : (j + 1) * H]
                scale = xs.abs().amax(-1, keepdim=True) / 448
                assert ((gs - xs).abs() <= xs.abs() / 16 + scale * 2**-9 + 1e-6).all()
                assert not torch.equal(gs, xs)
    sub = r.read(4, layers=[7, 1])
    assert torch.equal(sub.features, torch.cat([r.read(4).features[:, 2 * H :], r.read(4).features[:, :H]], -1))
    assert verify_store(tmp_path / "s", progress=False)[0] == []


def test_bf16_is_exact_on_bf16_input(tmp_path):
    seqs = make_sequences()
    for s in seqs:
        s["features"] = s["features"].to(torch.bfloat16)
    r = write_store(tmp_path / "s", seqs, **small())
    assert all(torch.equal(r.read(i).features, s["features"].float()) for i, s in enumerate(seqs))


def test_plain_zarr_reads_the_layout(tmp_path):
    seqs = make_sequences()
    write_store(tmp_path / "s", seqs, **small())
    g = zarr.open_group(str(tmp_path / "s" / SHARDS / "shard-00000"), mode="r")
    off = g.attrs["offsets"]
    a, b = off[2], off[3]
    assert g.attrs["seq_ids"][2] == seqs[2]["seq_id"]
    bits = g["features"][a:b, H : 2 * H]  # layer 4: the second of layer_ids [1, 4, 7]
    x = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()
    assert torch.equal(x, seqs[2]["features"][:, H : 2 * H].to(torch.bfloat16).float())
    assert g["features"].shards == (480, 3 * H) and g["features"].chunks == (16, 3 * H)  # one shard, all 476 rows
    assert np.array_equal(
        zarr.open_array(str(tmp_path / "s" / SHARDS / "shard-00000" / "input_ids"))[a:b], seqs[2]["input_ids"]
    )


@pytest.mark.parametrize("dtype,topk", [("bfloat16", 0), ("float8_e4m3", 4)])
def test_one_file_per_array_per_shard(tmp_path, dtype, topk):
    """Format 3: a shard is the group's zarr.json plus, per array, its zarr.json and ONE data file, however many
    rows (here 476 rows, 30 inner chunks, 8 write blocks of shard_tokens) and layers."""
    seqs = make_sequences()
    if topk:
        for s in seqs:
            n = len(s["input_ids"])
            s["teacher"] = (torch.randint(0, 50_000, (n, topk)), -torch.rand(n, topk))
    r = write_store(tmp_path / "s", seqs, **{**small(dtype), "teacher_topk": topk})
    shard = tmp_path / "s" / SHARDS / "shard-00000"
    files = [f for _, _, fs in os.walk(shard) for f in fs]
    n_arrays = len(r.layout.array_keys())  # 3 (bf16: ids, mask, features) or 6 (+ fp8 scales, teacher top-k)
    assert len(files) == 1 + 2 * n_arrays == files_per_shard(layout_of(len(LAYERS), dtype, topk))
    assert files_per_shard(layout_of(3)) == files_per_shard(layout_of(5)) == 7
    assert files_per_shard(layout_of(5, "float8_e4m3")) == 9 and files_per_shard(layout_of(5, "float8_e4m3", 8)) == 13
    assert sum(len(ds) for _, ds, _ in os.walk(shard)) == n_arrays  # one folder per array, no chunk folders
    for i, s in enumerate(seqs):
        got = r.read(i, teacher=bool(topk))
        assert np.array_equal(got.input_ids, s["input_ids"]) and np.array_equal(got.loss_mask, s["loss_mask"])
        if dtype == "bfloat16":
            assert torch.equal(got.features, s["features"].to(torch.bfloat16).float())
        if topk:
            assert np.array_equal(got.teacher_ids, s["teacher"][0].numpy())
    assert verify_store(tmp_path / "s", progress=False)[0] == []


def as_old_format(store, version):
    """Rewrite a store in format 1 or 2: an array per layer (and an fp8 scale array per layer); format 1 also puts
    each array in a zarr shard file per shard_tokens rows (chunk folders c/<i>/0)."""
    m = json.loads((store / MANIFEST).read_text())
    layer_ids = m["layer_ids"]
    for e in m["shards"]:
        g = zarr.open_group(str(store / SHARDS / e["name"]), mode="r+")
        arrays = {k: (g[k][:], g[k].compressors, g[k].shards[0]) for k in g.array_keys()}
        feats, compressors, rows = arrays.pop("features")
        for j, i in enumerate(layer_ids):
            arrays[f"layer_{i:02d}"] = (feats[:, j * H : (j + 1) * H], compressors, rows)
        if "features_scale" in arrays:
            scales, compressors, rows = arrays.pop("features_scale")
            for j, i in enumerate(layer_ids):
                arrays[f"layer_{i:02d}_scale"] = (np.ascontiguousarray(scales[:, j]), compressors, rows)
        for key in ("features", "features_scale"):
            shutil.rmtree(store / SHARDS / e["name"] / key, ignore_errors=True)
        for key, (data, compressors, rows) in arrays.items():
            new = g.create_array(
                key,
                shape=data.shape,
                dtype=data.dtype,
                chunks=(16, *data.shape[1:]),
                shards=(64 if version == 1 else rows, *data.shape[1:]),
                compressors=compressors[:1] if version == 1 else compressors,
                fill_value=0,
                overwrite=True,
                chunk_key_encoding={"name": "default"} if version == 1 else {"name": "v2", "separator": "."},
            )
            new[:] = data
        g.attrs["format_version"] = version
    (store / MANIFEST).write_text(json.dumps({**m, "format_version": version}))


@pytest.mark.parametrize("version", [1, 2])
def test_converts_an_old_store(tmp_path, version):
    seqs = make_sequences() + make_sequences(seed=1)
    w = StoreWriter(tmp_path / "old", **small("float8_e4m3"), manifest_extra={"target": {"name": "tiny"}})
    for k in range(2):
        with w.shard(f"shard-{k:05d}") as sh:
            for s in seqs[5 * k : 5 * k + 5]:
                sh.append(**s)
            sh.reject("bad-1", "too long")
        w.register(sh.info())
    want = [StoreReader(tmp_path / "old").read(i) for i in range(10)]
    as_old_format(tmp_path / "old", version)
    old_file = "layer_04/c/7/0" if version == 1 else "layer_04/0.0"
    assert os.path.isfile(tmp_path / "old" / SHARDS / "shard-00000" / old_file)
    with pytest.raises(StoreError, match=f"format {version}"):
        StoreReader(tmp_path / "old")
    assert convert_main([str(tmp_path / "old"), str(tmp_path / "new")]) == 0
    r = StoreReader(tmp_path / "new")
    assert r.seq_ids == [s["seq_id"] for s in seqs] and r.manifest["target"] == {"name": "tiny"}
    assert r.manifest["counts"]["tokens"] == 952 and r.manifest["converted_from"]["format_version"] == version
    assert [x["seq_id"] for x in r.manifest["shards"][1]["rejects"]] == ["bad-1"]
    for i, x in enumerate(want):  # bit for bit: every layer's fp8 values and scales, and the token ids
        got = r.read(i)
        assert torch.equal(got.features, x.features) and np.array_equal(got.input_ids, x.input_ids)
    assert verify_store(tmp_path / "new", progress=False)[0] == []
    files = [f for _, _, fs in os.walk(tmp_path / "new" / SHARDS / "shard-00001") for f in fs]
    assert len(files) == files_per_shard(layout_of(3, "float8_e4m3")) == 9


@pytest.mark.parametrize("version", [1, 2])
def test_refuses_an_old_store(tmp_path, version):
    write_store(tmp_path / "s", make_sequences(), **small())
    m = json.loads((tmp_path / "s" / MANIFEST).read_text())
    (tmp_path / "s" / MANIFEST).write_text(json.dumps({**m, "format_version": version}))
    msg = rf"{tmp_path / 's'} is a feature store of format {version} \(one file per array per .*\); .*Recapture"
    for open_it in (StoreReader, lambda p: StoreWriter(p, **small())):
        with pytest.raises(StoreError, match=msg):
            open_it(tmp_path / "s")
    problems, _ = verify_store(tmp_path / "s", progress=False)
    assert len(problems) == 1 and f"format {version}" in problems[0]
    assert "python -m flashdraft.store.convert" in problems[0]


def test_bad_inputs_are_named(tmp_path):
    w = StoreWriter(tmp_path / "s", **small())
    with pytest.raises(StoreError, match="features"):
        with w.shard("shard-00000") as sh:
            sh.append("a", [1, 2, 3], [0, 1, 1], torch.zeros(3, 2 * H))
    nan = torch.zeros(3, 3 * H)
    nan[1, 5] = float("nan")
    with pytest.raises(StoreError, match="NaN"):
        with w.shard("shard-00000") as sh:
            sh.append("a", [1, 2, 3], [0, 1, 1], nan)
    with pytest.raises(StoreError, match="overflow float16"):
        w16 = StoreWriter(tmp_path / "s16", **small("float16"))
        with w16.shard("shard-00000") as sh:
            sh.append("a", [1, 2, 3], [0, 1, 1], torch.full((3, 3 * H), 1e5))
    with pytest.raises(StoreError, match="twice"):
        with w.shard("shard-00000") as sh:
            sh.append("a", [1], [1], torch.zeros(1, 3 * H))
            sh.append("a", [1], [1], torch.zeros(1, 3 * H))
    # aborted shards leave nothing behind
    assert os.listdir(tmp_path / "s" / SHARDS) == []
    with pytest.raises(StoreError, match="different capture.*dtype"):
        StoreWriter(tmp_path / "s", **small("float16"))
    with pytest.raises(StoreError, match="no feature store"):
        StoreReader(tmp_path / "nowhere")
    (tmp_path / "s" / MANIFEST).write_text("{not json")
    with pytest.raises(StoreError, match="corrupt"):
        StoreReader(tmp_path / "s")
    with pytest.raises(StoreError, match="not in this store"):
        write_store(tmp_path / "t", make_sequences(), **small()).read(0, layers=[2])


def test_crashed_shard_is_ignored_and_redone(tmp_path):
    seqs = make_sequences()
    w = StoreWriter(tmp_path / "s", **small())
    with w.shard("shard-00000") as sh:
        for s in seqs[:2]:
            sh.append(**s)
    w.register(sh.info())
    # a writer dies mid-shard: its temp dir holds chunks but was never renamed or listed
    dead = ShardWriter(tmp_path / "s", "shard-00001", w.layout)
    for s in seqs[2:]:
        dead.append(**s)
    dead._flush(final=True)
    del dead
    # and another died between rename and register: complete but unlisted
    with w.shard("shard-00002") as sh:
        sh.append(**seqs[4])
    r = StoreReader(tmp_path / "s")
    assert r.seq_ids == [s["seq_id"] for s in seqs[:2]]
    assert verify_store(tmp_path / "s", progress=False)[0] == []
    w2 = StoreWriter(tmp_path / "s", **small())
    assert w2.unlisted_shards() == ["shard-00002"]
    w2.adopt("shard-00002")
    assert [d for d in w2.remove_temp()][0].startswith(".tmp-shard-00001")
    with w2.shard("shard-00001") as sh:
        for s in seqs[2:4]:
            sh.append(**s)
    w2.register(sh.info())
    w2.register(sh.info())  # idempotent
    r = StoreReader(tmp_path / "s")
    assert sorted(r.seq_ids) == sorted(s["seq_id"] for s in seqs)
    assert r.manifest["counts"]["sequences"] == 5 and r.manifest["counts"]["tokens"] == 476
    assert sorted(os.listdir(tmp_path / "s" / SHARDS)) == ["shard-00000", "shard-00001", "shard-00002"]
    assert verify_store(tmp_path / "s", progress=False)[0] == []


def test_verify_catches_damage(tmp_path):
    write_store(tmp_path / "s", make_sequences(), **small())
    shard = tmp_path / "s" / SHARDS / "shard-00000"
    data = shard / "features" / "0.0"
    g = zarr.open_array(str(shard / "features"), mode="r")
    index = decode_index(data.read_bytes()[-index_nbytes(30) :], 30)  # 476 rows: 30 inner chunks of 16
    with open(data, "r+b") as f:  # flip a byte inside inner chunk 3 (rows 48..64): its crc32c no longer matches
        f.seek(int(index[3, 0]) + 40)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    problems, _ = verify_store(tmp_path / "s", progress=False)
    assert (
        len(problems) == 1 and "shard shard-00000: array features: chunk 3 (rows 48..64) is unreadable" in problems[0]
    )
    with pytest.raises(ValueError, match="checksum"):  # plain zarr refuses it too
        g[48:64]
    assert np.asarray(g[:48]).shape == (48, 3 * H)  # the other chunks still read
    size = os.path.getsize(shard / "loss_mask" / "0")
    with open(shard / "loss_mask" / "0", "r+b") as f:  # damage the shard index at the file's end
        f.seek(size - 10)
        f.write(b"\x00\x01")
    problems, _ = verify_store(tmp_path / "s", progress=False)
    assert any("array loss_mask: data file " in p and "index checksum mismatch" in p for p in problems), problems
    ids = shard / "input_ids" / "0"  # an index that lists chunk 5 as never written (zarr reads zeros there)
    index = decode_index(ids.read_bytes()[-index_nbytes(30) :], 30).copy()
    index[5] = 2**64 - 1
    with open(ids, "r+b") as f:
        f.seek(-index_nbytes(30), 2)
        f.write(encode_index(index))
    problems, _ = verify_store(tmp_path / "s", progress=False)
    assert "shard shard-00000: array input_ids: chunk 5 (rows 80..96) is missing from the shard index" in problems
    os.remove(shard / "features" / "0.0")
    problems, _ = verify_store(tmp_path / "s", progress=False)
    assert any("array features: data file shards/shard-00000/features/0.0 is missing" in p for p in problems)

    write_store(tmp_path / "m", make_sequences(), **small())
    m = json.loads((tmp_path / "m" / MANIFEST).read_text())
    m["shards"].append({**m["shards"][0], "name": "shard-00009"})
    (tmp_path / "m" / MANIFEST).write_text(json.dumps(m))
    problems, _ = verify_store(tmp_path / "m", progress=False)
    assert any("shard-00009 is listed in the manifest but missing" in p for p in problems)
    assert any("manifest counts" in p for p in problems)

    write_store(tmp_path / "x", make_sequences(), **small())  # a span index that no longer matches the loss mask
    group = zarr.open_group(str(tmp_path / "x" / SHARDS / "shard-00000"), mode="r+")
    spans, ids = group.attrs["response_spans"], group.attrs["seq_ids"]
    spans[1] = [spans[1][0] + 1, spans[1][1]]
    group.attrs["response_spans"] = spans
    problems, _ = verify_store(tmp_path / "x", progress=False)
    assert problems == [f"shard shard-00000: response_spans disagree with loss_mask for 1 sequences ({ids[1]})"]


def test_a_damaged_chunk_is_refused_on_read_with_its_location(tmp_path):
    write_store(tmp_path / "s", make_sequences(), **small())
    data = tmp_path / "s" / SHARDS / "shard-00000" / "features" / "0.0"
    index = decode_index(data.read_bytes()[-index_nbytes(30) :], 30)
    with open(data, "r+b") as f:  # a byte inside inner chunk 3 (rows 48..64): sequence seq-0-1 (rows 5..105)
        f.seek(int(index[3, 0]) + 40)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    r = StoreReader(tmp_path / "s")
    where = rf"{tmp_path / 's'}: shard shard-00000, array features, rows 5..105 \(sequence seq-0-1\) is unreadable"
    with pytest.raises(StoreError, match=where + ".*checksum mismatch"):
        r.read(1)
    assert [r.read(i).seq_id for i in (0, 2, 3, 4)] == ["seq-0-0", "seq-0-2", "seq-0-3", "seq-0-4"]  # the rest reads


def test_reader_is_lazy_and_picklable(tmp_path):
    w = StoreWriter(tmp_path / "s", **small())
    for k in range(3):
        with w.shard(f"shard-{k:05d}") as sh:
            for s in make_sequences(seed=k):
                sh.append(**s)
        w.register(sh.info())
    r = StoreReader(tmp_path / "s")
    assert len(r) == 15 and not r._indexes
    x = r.read(12)
    assert x.seq_id == "seq-2-2" and torch.equal(
        x.features, make_sequences(seed=2)[2]["features"].to(torch.bfloat16).float()
    )
    assert {name for name, _ in r._indexes} == {"shard-00002"}  # only what it read
    r2 = pickle.loads(pickle.dumps(r))
    assert not r2._indexes
    assert torch.equal(r2.read(12).features, x.features) and r2.index("seq-1-0") == 5
    assert StoreLayout.from_manifest(r.manifest) == w.layout


def test_teacher_topk_round_trip_and_checks(tmp_path):
    k = 4
    seqs = make_sequences(lengths=(5, 100, 70))
    g = torch.Generator().manual_seed(3)
    for s in seqs:
        n = len(s["input_ids"])
        logp = torch.log_softmax(torch.randn(n, 50, generator=g), -1).topk(k, -1)
        s["teacher"] = (logp.indices, logp.values.clone())
        s["teacher"][1][: n // 3 - 1] = -torch.inf  # prompt tokens before the last: not captured
    r = write_store(tmp_path / "s", seqs, teacher_topk=k, **small())
    assert r.teacher_topk == k and r.manifest["layout"]["teacher_topk"] == k
    for i, s in enumerate(seqs):
        got = r.read(i, teacher=True)
        assert np.array_equal(got.teacher_ids, s["teacher"][0].numpy())
        assert np.array_equal(got.teacher_logp, s["teacher"][1].to(torch.float16).float().numpy())
        assert r.read(i).teacher_ids is None  # not read unless asked
    assert verify_store(tmp_path / "s", progress=False)[0] == []
    plain = write_store(tmp_path / "plain", seqs[:1], **small())
    assert "teacher_topk" not in plain.manifest["layout"]  # stores without it keep their old layout identity
    with pytest.raises(StoreError, match="holds no teacher top-k"):
        plain.read(0, teacher=True)
    with pytest.raises(StoreError, match="top-4 next tokens, none given"):
        write_store(
            tmp_path / "none", [{k_: v for k_, v in seqs[0].items() if k_ != "teacher"}], teacher_topk=k, **small()
        )
    bad = dict(seqs[0], teacher=(seqs[0]["teacher"][0][:, :2], seqs[0]["teacher"][1][:, :2]))
    with pytest.raises(StoreError, match=r"expected \[5, 4\]"):
        write_store(tmp_path / "bad", [bad], teacher_topk=k, **small())


def test_the_mask_token_is_not_part_of_a_stores_identity(tmp_path):
    """A store written when it was (its manifest has mask_token_id) still opens and resumes under a writer without
    one, or with another."""
    write_store(tmp_path / "s", make_sequences()[:2], manifest_extra={"mask_token_id": 3}, **small())
    w = StoreWriter(tmp_path / "s", **small())
    with w.shard("shard-00001") as sh:
        sh.append(**make_sequences(seed=1)[0])
    w.register(sh.info())
    StoreWriter(tmp_path / "s", manifest_extra={"mask_token_id": 9}, **small())
    r = StoreReader(tmp_path / "s")
    assert len(r) == 3 and r.manifest["mask_token_id"] == 3
    assert "mask_token_id" not in write_store(tmp_path / "new", make_sequences()[:1], **small()).manifest
    assert is_store(tmp_path / "s") and not is_store(tmp_path / "nowhere") and not is_store(tmp_path / "s" / SHARDS)
