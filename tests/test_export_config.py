"""The exported drafter config.json, read alike by every engine: transformers 5 (`rope_parameters`), transformers 4,
SGLang and vLLM (`rope_theta`, `rope_scaling`), and the published drafters' key set (`auto_map` included)."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, Qwen3Config

from flashdraft.model import DFlashDrafter
from flashdraft.spec import AUTO_MAP, DraftSpec, default_layer_ids, legacy_rope

PUBLISHED = json.loads((Path(__file__).parent / "fixtures" / "published_drafter_config_keys.json").read_text())


def _target(num_layers=36, **rope) -> Qwen3Config:
    rope_parameters = {"rope_type": "default", "rope_theta": 1e6, **rope}
    return Qwen3Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rope_parameters=rope_parameters,
    )


def _export(tmp_path, target, num_layers=36) -> dict:
    spec = DraftSpec(default_layer_ids(num_layers), mask_token_id=96, num_draft_layers=5)
    DFlashDrafter(spec.draft_config(target)).save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def test_exported_config_has_every_published_key(tmp_path):
    """Same geometry as the published Qwen3-4B drafter (36 target layers, RoPE base 1e6, block 16), so the keys
    that do not depend on sizes carry the published values too."""
    saved = _export(tmp_path, _target())
    missing = sorted(set(PUBLISHED["keys"]) - set(saved))
    assert not missing, f"exported config.json lacks published keys {missing}"
    assert set(PUBLISHED["dflash_config_keys"]) <= set(saved["dflash_config"])
    for key, value in PUBLISHED["values"].items():
        assert saved[key] == value, key
    assert saved["auto_map"] == AUTO_MAP
    assert saved["max_window_layers"] == saved["num_hidden_layers"] == len(saved["layer_types"])
    # The reference benchmark reads the drafter with AutoConfig and no trust_remote_code: auto_map names no config
    # class, so no remote code is asked for.
    assert AutoConfig.from_pretrained(tmp_path).architectures == ["DFlashDraftModel"]


@pytest.mark.parametrize("rope", [{}, YARN], ids=["default", "yarn"])
def test_transformers_4_and_5_readers_agree_on_rope(tmp_path, rope):
    target = _target(**rope)
    saved = _export(tmp_path, target)
    want = dict(target.rope_parameters)
    assert saved["rope_parameters"] == want
    # A transformers-4 reader (and SGLang, vLLM) reads the flat keys; without them it falls back to base 10000.
    assert saved["rope_theta"] == want["rope_theta"]
    assert saved["rope_scaling"] == ({k: v for k, v in want.items() if k != "rope_theta"} if rope else None)
    # transformers 5 given only the transformers-4 keys (as a transformers-4 writer leaves them) rebuilds the same
    # rope_parameters as from the transformers-5 key.
    legacy_only = {k: v for k, v in saved.items() if k != "rope_parameters"}
    assert Qwen3Config.from_dict(legacy_only).rope_parameters == want
    assert Qwen3Config.from_dict(saved).rope_parameters == want


def test_export_is_stable_through_a_reload(tmp_path):
    first = _export(tmp_path / "a", _target(**YARN))
    DFlashDrafter.from_pretrained(tmp_path / "a").save_pretrained(tmp_path / "b")
    assert json.loads((tmp_path / "b" / "config.json").read_text()) == first


def test_from_pretrained_refuses_rope_keys_that_disagree(tmp_path):
    saved = _export(tmp_path, _target())
    saved["rope_theta"] = 10000.0
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=f"{tmp_path / 'config.json'}.*rope_theta"):
        DFlashDrafter.from_pretrained(tmp_path)


def test_legacy_rope_has_no_guess_for_per_layer_type_rope():
    assert legacy_rope({"full_attention": {"rope_type": "default", "rope_theta": 1e6}}) == {}
    assert legacy_rope({"rope_type": "default", "rope_theta": 5e5}) == {"rope_theta": 5e5, "rope_scaling": None}


def test_reference_package_rotates_like_us_with_scaled_rope(tmp_path):
    """The reference `dflash` loads the exported folder with the target's scaled RoPE and rotates identically."""
    dflash_model = pytest.importorskip("dflash.model")
    _export(tmp_path, _target(**YARN))
    ours = DFlashDrafter.from_pretrained(tmp_path)
    ref = dflash_model.DFlashDraftModel.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    x = torch.zeros(1, 100, 64)
    pos = torch.arange(100)[None]
    for a, b in zip(ours.rotary_emb(x, pos), ref.rotary_emb(x, pos), strict=True):
        torch.testing.assert_close(a, b)
