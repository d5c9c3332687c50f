"""The draft model and its spec: reference layer ids, hidden-state offset, parity with the published `dflash`."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config

from flashdraft.model import DFlashDrafter, extract_context_feature
from flashdraft.spec import DraftSpec, capture_layer_ids, default_layer_ids
from flashdraft.target import capture_features

dflash_model = pytest.importorskip("dflash.model")


@pytest.mark.parametrize(
    "layers,n,expected",
    [
        (36, 5, [1, 9, 17, 25, 33]),
        (32, 5, [1, 8, 15, 22, 29]),
        (30, 5, [1, 8, 14, 20, 27]),
        (28, 1, [14]),
        (48, 3, [1, 23, 45]),
    ],
)
def test_layer_ids_formula(layers, n, expected):
    assert default_layer_ids(layers, n) == expected
    assert dflash_model.build_target_layer_ids(layers, n) == expected


def draft_config(target_config, mask_token_id, num_draft_layers=5, block_size=16, target_layer_ids=None):
    """A drafter config for `target_config`, by default over the reference's layer ids."""
    ids = target_layer_ids or capture_layer_ids(target_config)
    return DraftSpec(ids, mask_token_id, block_size, num_draft_layers).draft_config(target_config)


def test_hidden_state_offset_is_layer_output():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    outputs = {}
    hooks = [
        layer.register_forward_hook(lambda m, a, o, i=i: outputs.__setitem__(i, o[0] if isinstance(o, tuple) else o))
        for i, layer in enumerate(model.model.layers)
    ]
    ids = torch.randint(0, 50, (2, 7))
    feats = capture_features(model, ids, [0, 2, 3])
    for h in hooks:
        h.remove()
    expected = torch.cat([outputs[0], outputs[2], outputs[3]], dim=-1)
    torch.testing.assert_close(feats, expected, rtol=0, atol=0)


def _randomize(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.05)


TARGETS = {
    "llama-gqa": LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "qwen3-mha": Qwen3Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
    ),
}


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("block_size", [16, 8])
def test_parity_with_reference(tmp_path, target, block_size):
    torch.manual_seed(1)
    cfg = draft_config(TARGETS[target], mask_token_id=96, num_draft_layers=3, block_size=block_size)
    ours = DFlashDrafter(cfg)
    _randomize(ours)
    ours.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["block_size"] == block_size and saved["num_target_layers"] == TARGETS[target].num_hidden_layers
    assert saved["dflash_config"] == {"mask_token_id": 96, "target_layer_ids": cfg.dflash_config["target_layer_ids"]}
    ref = dflash_model.DFlashDraftModel.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert ref.target_layer_ids == ours.target_layer_ids and ref.block_size == block_size and ref.mask_token_id == 96

    head = torch.nn.Linear(64, 97, bias=False)
    ctx_len = 23
    ctx = torch.randn(2, ctx_len, len(ours.target_layer_ids) * 64)
    noise = torch.randn(2, block_size, 64)
    pos = torch.arange(ctx_len + block_size)[None].expand(2, -1) + 5
    with torch.no_grad():
        a = head(ours(noise, ctx, pos))
        b = ref.compute_logits(ref(position_ids=pos, noise_embedding=noise, target_hidden=ctx), head)
    assert (a - b).abs().max().item() < 1e-5


def test_cache_path_equals_full_context():
    torch.manual_seed(2)
    ours = DFlashDrafter(draft_config(TARGETS["llama-gqa"], mask_token_id=96, num_draft_layers=2, block_size=8)).eval()
    _randomize(ours)
    n_feat = len(ours.target_layer_ids) * 64
    ctx = torch.randn(1, 30, n_feat)
    noise = torch.randn(1, 8, 64)
    pos_full = torch.arange(38)[None]
    with torch.no_grad():
        full = ours(noise, ctx, pos_full)
        cache = ours.new_cache()
        ours(torch.randn(1, 8, 64), ctx[:, :20], torch.cat([torch.arange(20), torch.arange(20, 28)])[None], cache=cache)
        assert cache.length == 20  # the block's K/V did not enter the cache
        inc = ours(noise, ctx[:, 20:], torch.arange(20, 38)[None], cache=cache)
    assert cache.length == 30
    torch.testing.assert_close(inc, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("missing", ["target_layer_ids", "mask_token_id"])
def test_from_pretrained_refuses_a_config_without_geometry_naming_the_file(tmp_path, missing):
    """No formula fallback: a config.json without the layer ids (or the mask token) is refused, as the reference
    refuses it, with the file named."""
    DFlashDrafter(draft_config(TARGETS["qwen3-mha"], mask_token_id=5, num_draft_layers=1)).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["dflash_config"][missing]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=f"{tmp_path / 'config.json'}.*{missing}"):
        DFlashDrafter.from_pretrained(tmp_path)


def test_save_load_roundtrip(tmp_path):
    ours = DFlashDrafter(draft_config(TARGETS["qwen3-mha"], mask_token_id=5))
    ours.save_pretrained(tmp_path)
    back = DFlashDrafter.from_pretrained(tmp_path)
    for (k, v), (k2, v2) in zip(ours.state_dict().items(), back.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, v2)
    assert back.block_size == 16 and len(back.layers) == 5 and back.target_layer_ids == [1, 3, 5, 7, 9]


def test_bad_layer_ids_named():
    with pytest.raises(ValueError, match=r"\[40\]"):
        draft_config(TARGETS["qwen3-mha"], mask_token_id=1, target_layer_ids=[1, 40])
    with pytest.raises(ValueError, match="distinct"):
        DraftSpec((3, 3), 1)


def test_draft_spec_round_trips_through_the_drafter_config():
    spec = DraftSpec((2, 5, 9), mask_token_id=7, block_size=8, num_draft_layers=3, intermediate_size=48)
    config = spec.draft_config(TARGETS["qwen3-mha"])
    assert DraftSpec.from_draft_config(config) == spec
    assert DraftSpec.from_draft_config(config.to_dict()) == spec  # the dict of a saved config.json too
    assert DFlashDrafter(config).spec == spec and config.dflash_config == {
        "mask_token_id": 7,
        "target_layer_ids": [2, 5, 9],
    }
    back = DraftSpec.from_draft_config(DraftSpec((1, 3), mask_token_id=5).draft_config(TARGETS["qwen3-mha"]))
    assert back == DraftSpec((1, 3), mask_token_id=5, intermediate_size=96)  # None: the target's, written out


def test_extract_context_feature_order():
    hs = [torch.full((1, 2, 3), float(i)) for i in range(6)]
    out = extract_context_feature(hs, [3, 0])
    assert out[0, 0].tolist() == [4.0] * 3 + [1.0] * 3


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_init_from_target_copies_the_top_layers(arch, tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    kw = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    target = (
        LlamaForCausalLM(LlamaConfig(**kw)) if arch == "llama" else Qwen3ForCausalLM(Qwen3Config(head_dim=16, **kw))
    )
    with torch.no_grad():
        for name, p in target.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    target.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    config = draft_config(target.config, mask_token_id=63, num_draft_layers=2, target_layer_ids=[1, 3])
    drafter = DFlashDrafter(config)
    assert drafter.init_from_target(tensors) == [4, 5]
    own = drafter.state_dict()
    for i, j in enumerate([4, 5]):
        for name, value in own.items():
            if name.startswith(f"layers.{i}."):
                source = f"model.layers.{j}." + name.split(".", 2)[2]
                if arch == "llama" and name.endswith(("q_norm.weight", "k_norm.weight")):
                    assert source not in tensors and torch.equal(value, torch.ones_like(value))
                else:
                    assert torch.equal(value, tensors[source]), name
    assert torch.equal(own["norm.weight"], tensors["model.norm.weight"])
    assert torch.equal(own["fc.weight"][:, 64:], torch.eye(64)) and not own["fc.weight"][:, :64].any()
    mean_norm = (
        tensors["model.layers.4.input_layernorm.weight"] + tensors["model.layers.5.input_layernorm.weight"]
    ) / 2
    assert torch.allclose(own["hidden_norm.weight"], mean_norm)
    with pytest.raises(KeyError, match="lacks"):
        DFlashDrafter(config).init_from_target({k: v for k, v in tensors.items() if "layers.5.mlp" not in k})
