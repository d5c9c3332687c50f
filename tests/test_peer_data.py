"""Our store -> the peer's offline training data (benchmarks/peer_data.py), read back by the peer's own loader, and
the peer's DFlash recipe driven on a CPU (benchmarks/peer_train.py), on a tiny Llama target and a tiny store of its
real features (issue 59)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from flashdraft.model import DFlashDrafter
from flashdraft.spec import DraftSpec
from flashdraft.store import StoreReader, write_store
from flashdraft.target import capture_features, load_config, target_fingerprint
from tests.test_speculative import one_thread  # noqa: F401 (autouse: one torch thread)
from tests.test_trainer_fixtures import MASK, VOCAB, H, tiny_target

try:
    import speculators.train.cli  # noqa: F401 (what peer_train drives: the model, optimizers, schedule, seed)
    from speculators.train.data import ArrowDataset, CollateFn
except ImportError as e:  # the peer lives beside the project, not in its dependencies
    pytest.skip(
        f"the peer `speculators` is not importable ({e}): scripts/setup.sh installs it (or PYTHONPATH=.peer)",
        allow_module_level=True,
    )

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import peer_data  # noqa: E402
import peer_train  # noqa: E402

LAYERS = [1, 3, 4]  # of the tiny target's 6


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(target folder, store, peer data folder, conversion record): 6 sequences of a tiny Llama's own features at
    LAYERS, stored in bf16, converted with the target in float32."""
    tmp = tmp_path_factory.mktemp("peer")
    target = tiny_target(tmp / "target")
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    seqs = []
    for i in range(6):
        s, p = int(rng.integers(20, 40)), int(rng.integers(3, 8))
        ids = rng.integers(0, MASK, s).astype(np.int64)
        mask = np.arange(s) >= p
        feats = capture_features(model, torch.as_tensor(ids)[None], LAYERS)[0]
        seqs.append({"seq_id": f"s{i}", "input_ids": ids, "loss_mask": mask, "features": feats})
    manifest = {"target": target_fingerprint(str(target)), "vocab_size": VOCAB}
    store = write_store(
        tmp / "store", seqs, layer_ids=LAYERS, hidden_size=H, dtype="bfloat16", manifest_extra=manifest
    ).path
    record = peer_data.convert(store, tmp / "data", dtype="float32", progress=False)
    return target, store, tmp / "data", record


def test_the_peers_loader_reads_our_tokens_masks_and_features_bit_for_bit(converted):
    target, store, data, record = converted
    reader = StoreReader(store)
    ds = ArrowDataset(max_len=256, datapath=data, on_missing="raise", train_ratio=1.0)
    assert len(ds) == len(reader) == record["sequences"] == 6
    assert ds.approx_lengths == [int(n) for n in reader.lengths]
    for i in range(len(ds)):
        item, ours = ds[i], reader.read(i, upcast=False)
        assert torch.equal(item["input_ids"], torch.from_numpy(ours.input_ids))
        assert item["loss_mask"].dtype == torch.long  # as the peer's preprocessing writes it
        assert torch.equal(item["loss_mask"].bool(), torch.from_numpy(ours.loss_mask))
        assert item["hidden_states"].dtype == ours.features.dtype == torch.bfloat16
        assert torch.equal(item["hidden_states"].view(torch.int16), ours.features.view(torch.int16))
        assert item["verifier_last_hidden_states"].shape == (len(ours.input_ids), H)
    assert (data / "hidden_states" / "hs_5.safetensors").is_file() and not data.with_name("data.tmp").exists()


def test_the_last_slot_is_the_last_layer_before_the_final_norm(converted):
    """HF's output_hidden_states ends with the final norm's output; the peer wants the state before it (its loss
    applies the verifier's norm and head itself)."""
    target, store, data, record = converted
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids = torch.from_numpy(StoreReader(store).read(0).input_ids)[None]
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    last = load_file(str(data / "hidden_states" / "hs_0.safetensors"))["hidden_states"][:, -1].float()
    post_norm = out.hidden_states[-1][0]
    assert not torch.allclose(last, post_norm, atol=1e-2)
    torch.testing.assert_close(model.model.norm(last), post_norm, atol=2e-2, rtol=1e-2)  # bf16 rounding of `last`
    head = model.lm_head(model.model.norm(last))
    assert (head.argmax(-1) == out.logits[0].argmax(-1)).float().mean() > 0.9
    assert record["last_slot"].startswith("output of decoder layer 5")
    for layer, rel in record["check"]["relative_rms_diff"].items():  # recomputed vs stored: bf16 rounding only
        assert rel < 1e-2, (layer, rel)


def test_the_peers_collate_packs_the_converted_rows(converted):
    _, store, data, _ = converted
    ds = ArrowDataset(max_len=256, datapath=data, on_missing="raise", train_ratio=1.0)
    a, b = ds[0], ds[1]
    la, lb = len(a["input_ids"]), len(b["input_ids"])
    batch = CollateFn(la + lb + 5, H, num_target_layers=len(LAYERS))([a, b])
    assert batch["hidden_states"].shape == (1, la + lb + 5, len(LAYERS) * H)
    assert torch.equal(batch["input_ids"][0, : la + lb], torch.cat([a["input_ids"], b["input_ids"]]))
    assert torch.equal(batch["loss_mask"][0, : la + lb], torch.cat([a["loss_mask"], b["loss_mask"]]))
    assert torch.equal(batch["hidden_states"][0, la : la + lb], b["hidden_states"])
    assert batch["document_ids"][0].tolist() == [0] * la + [1] * lb + [-1] * 5


def test_convert_refuses_bad_paths_by_name(tmp_path, converted):
    with pytest.raises(SystemExit, match=str(tmp_path / "nowhere")):
        peer_data.convert(tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(SystemExit, match="already exists"):
        peer_data.convert(converted[1], converted[2])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, converted):
    """(our geometry folder, run folder, run record): 3 steps of the peer's recipe on the tiny data."""
    tmp = tmp_path_factory.mktemp("peer_run")
    target, _, data, _ = converted
    spec = DraftSpec(target_layer_ids=tuple(LAYERS), mask_token_id=MASK, block_size=4, num_draft_layers=2)
    like = DFlashDrafter(spec.draft_config(load_config(str(target)))).save_pretrained(tmp / "like")
    out = tmp / "run"
    argv = ["--data", str(data), "--like", str(like), "--steps", "3", "--total-seq-len", "96", "--out", str(out)]
    return like, out, peer_train.main(argv + ["--max-anchors", "8", "--seed", "0"])


def test_three_peer_steps_train_and_export_a_drafter_we_load(trained):
    like, out, run = trained
    assert len(run["per_step"]["loss"]) == 3 and all(np.isfinite(run["per_step"]["loss"]))
    assert run["max_anchors"] == 8 and run["geometry_changed"] == {} and "not_alike" not in run["drafter_export"]
    assert run["tokens_seen"] == sum(run["per_step"]["tokens"]) and all(0 < t <= 96 for t in run["per_step"]["tokens"])
    assert json.loads((out / "run.json").read_text())["steps"] == 3
    ours = DFlashDrafter.from_pretrained(out / "drafter")
    assert ours.spec == DraftSpec.from_draft_config(json.loads((like / "config.json").read_text()))
    peer = load_file(str(out / "peer" / "model.safetensors"))
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, peer[name].float()), name
    peer_cfg = json.loads((out / "peer" / "config.json").read_text())
    assert peer_cfg["aux_hidden_state_layer_ids"] == [i + 1 for i in LAYERS] and peer_cfg["mask_token_id"] == MASK


def test_the_exported_drafter_drafts_what_the_peer_model_drafts(trained, converted):
    """The same weights give the same block logits in both classes (float32, one anchored block): the mapping
    carries the semantics, not only the names."""
    like, out, run = trained
    p = peer_train.peer()
    model, _ = peer_train.build_model(p, json.loads((like / "config.json").read_text()), run["verifier"], "full")
    model.load_state_dict(load_file(str(out / "peer" / "model.safetensors")), strict=False)
    item = ArrowDataset(max_len=256, datapath=converted[2], on_missing="raise", train_ratio=1.0)[2]
    feats, ids, s = item["hidden_states"].float()[None], item["input_ids"][None], len(item["input_ids"])
    with torch.no_grad():
        _, logits, _, _, idx = model.eval()._backbone_forward(
            feats,
            ids,
            item["loss_mask"][None],
            item["verifier_last_hidden_states"].float()[None],
            torch.zeros(1, s, dtype=torch.long),
            max_anchors=1,
        )
        a, ours = int(idx[0]), DFlashDrafter.from_pretrained(out / "drafter")
        block = torch.full((1, ours.block_size), ours.mask_token_id)
        block[0, 0] = ids[0, a]
        hidden = ours(model.embed_tokens(block), feats[:, :a], torch.arange(a + ours.block_size)[None])
    torch.testing.assert_close(logits, model.lm_head(hidden), atol=1e-4, rtol=1e-4)
