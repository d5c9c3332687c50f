"""Hooked capture (`LayerTap`) equals `output_hidden_states`' selection bit for bit, prefill and decode steps."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from flashdraft.model import extract_context_feature
from flashdraft.target import LayerTap, capture_features


def tiny(kind: str):
    torch.manual_seed(0)
    kw = dict(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **kw)).eval()
    return LlamaForCausalLM(LlamaConfig(**kw)).eval()


# layer 0 (first decoder output, not the embeddings), the middle, and the last layer (HF returns it final-normed)
LAYER_SETS = [[1, 3, 4], [0, 5], [5, 2, 0]]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("layers", LAYER_SETS)
def test_hooked_prefill_and_decode_equal_output_hidden_states(kind, layers):
    model = tiny(kind)
    ids = torch.randint(1, 64, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    steps = torch.randint(1, 64, (3, 4), generator=torch.Generator().manual_seed(2))

    def run(hooked: bool) -> list[torch.Tensor]:
        cache, m, feats = DynamicCache(config=model.config), mask, []
        for x in [ids, *steps.split(1, dim=1)]:
            m = m if x is ids else torch.cat([m, torch.ones_like(m[:, :1])], dim=1)
            kw = dict(input_ids=x, attention_mask=m, cache=cache, use_cache=True, logits_to_keep=1)
            with torch.no_grad():
                if hooked:
                    with LayerTap(model, layers) as tap:
                        model(**kw)
                        feats.append(tap.features())
                else:
                    feats.append(extract_context_feature(model(**kw, output_hidden_states=True).hidden_states, layers))
        return feats

    for hooked, full in zip(run(True), run(False), strict=True):
        assert hooked.dtype == full.dtype and torch.equal(hooked, full)
    ref = extract_context_feature(model(input_ids=ids, output_hidden_states=True).hidden_states, layers)
    assert torch.equal(capture_features(model, ids, layers), ref)


def test_tap_removes_its_hooks_and_keeps_only_the_chosen_layers():
    model = tiny("qwen3")
    with LayerTap(model, [1, 3], final=True) as tap:
        model(input_ids=torch.tensor([[1, 2, 3]]), logits_to_keep=1)
        assert sorted(tap.outputs) == [1, 3] and tap.final is not None
        assert tap.features().shape == (1, 3, 2 * 64) and tap.outputs == {}
    assert all(not layer._forward_hooks for layer in model.model.layers) and not model.model.norm._forward_hooks
