"""The target adapter: embedded default, chat template, frozen head, mask token, model families."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flashdraft.target import (
    EMBEDDED_NAME,
    GENERIC,
    chat_input_ids,
    choose_mask_token,
    family_of,
    frozen_head_from_model,
    load_frozen_head,
    load_target,
    load_tokenizer,
    stop_token_ids,
    text_config,
)


@pytest.fixture(scope="module")
def smol_tokenizer():
    return load_tokenizer(EMBEDDED_NAME)


def test_embedded_default_loads_as_plain_llama():
    model, tok = load_target(EMBEDDED_NAME)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert model.dtype == torch.float32 and not getattr(model.config, "quantization_config", None)
    assert stop_token_ids(model, tok) == [tok.convert_tokens_to_ids("<|im_end|>")]
    assert not any(p.requires_grad for p in model.parameters())


def test_batched_prefill_head_runs_on_its_rows_not_on_a_copied_weight():
    # logits_to_keep=1 hands the head hidden[:, -1:], a strided view; torch would copy the [V, H] weight per row
    from torch.profiler import ProfilerActivity, profile

    model, _ = load_target(EMBEDDED_NAME, dtype=torch.bfloat16)
    ids = torch.randint(0, 1000, (8, 40))
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out = model(input_ids=ids, logits_to_keep=1)
    biggest = max(
        (torch.Size(s).numel() for e in prof.events() if e.name == "aten::copy_" for s in e.input_shapes if s),
        default=0,
    )
    assert biggest < model.lm_head.weight.numel(), f"a copy of {biggest} elements: the head weight was expanded"
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
    assert torch.equal(out.logits, torch.nn.functional.linear(hidden[:, -1:].contiguous(), model.lm_head.weight))


def test_chat_template_system_prompt_and_generation_prompt(smol_tokenizer):
    msgs = [{"role": "user", "content": "Hi there"}]
    default = smol_tokenizer.decode(chat_input_ids(smol_tokenizer, msgs))
    assert "You are a helpful AI assistant named SmolLM" in default
    assert default.endswith("<|im_start|>assistant\n")
    custom = smol_tokenizer.decode(chat_input_ids(smol_tokenizer, msgs, system_prompt="Be brief."))
    assert "<|im_start|>system\nBe brief.<|im_end|>" in custom and "SmolLM" not in custom
    with pytest.raises(ValueError, match="empty"):
        chat_input_ids(smol_tokenizer, [])


def test_enable_thinking_reaches_templates_that_know_it(smol_tokenizer):
    tok = smol_tokenizer
    saved = tok.chat_template
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}"
        "<think>\n\n</think>\n\n{% endif %}{% endif %}"
    )
    try:
        msgs = [{"role": "user", "content": "x"}]
        off = tok.decode(chat_input_ids(tok, msgs, enable_thinking=False))
        on = tok.decode(chat_input_ids(tok, msgs, enable_thinking=True))
        assert off.endswith("<think>\n\n</think>\n\n") and not on.endswith("</think>\n\n")
    finally:
        tok.chat_template = saved


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("sharded", [False, True])
def test_frozen_head_reads_only_embed_and_head(tmp_path, tied, sharded):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path, max_shard_size="60KB" if sharded else "5GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    head = load_frozen_head(str(tmp_path))
    torch.testing.assert_close(head.embed.weight, model.get_input_embeddings().weight)
    torch.testing.assert_close(head.lm_head.weight, model.lm_head.weight)
    assert not head.embed.weight.requires_grad and not head.lm_head.weight.requires_grad
    shared = frozen_head_from_model(model)
    assert shared.embed.weight is model.get_input_embeddings().weight


def test_mask_token_choice(smol_tokenizer):
    class Cfg:
        dflash_config = {"mask_token_id": 7}

    assert choose_mask_token(smol_tokenizer, 49152, Cfg()) == 7
    # SmolLM2: no mask token and no spare embedding row -> an unused reserved special token
    mask = choose_mask_token(smol_tokenizer, 49152)
    assert smol_tokenizer.convert_ids_to_tokens(mask) == "<empty_output>"
    # a padded embedding (like Qwen3's 151936 rows for 151669 tokens): <|MASK|> lands on the first spare row
    n = len(smol_tokenizer)
    tok = load_tokenizer(EMBEDDED_NAME)
    assert choose_mask_token(tok, n + 64) == n
    assert tok.convert_ids_to_tokens(n) == "<|MASK|>"


def test_a_targets_family_comes_from_one_table_and_decides_its_mask_token_and_checkpoint_names(smol_tokenizer):
    from transformers import AutoConfig, Qwen3Config

    from flashdraft.target.family import ModelFamily

    llama, qwen3 = family_of(LlamaConfig()), family_of(Qwen3Config())
    assert (llama.name, qwen3.name) == ("llama", "qwen3") and family_of(AutoConfig.for_model("gpt2")) is GENERIC
    multimodal = AutoConfig.for_model("qwen3_vl")
    assert (
        text_config(multimodal) is multimodal.text_config and text_config(qwen3_config := Qwen3Config()) is qwen3_config
    )
    assert family_of(multimodal).decoder_prefix(["model.language_model.layers.0.mlp.up_proj.weight"]) == (
        "model.language_model."
    )
    with pytest.raises(KeyError, match="no decoder layer tensors under"):
        llama.decoder_prefix(["model.language_model.layers.0.mlp.up_proj.weight"])
    # SmolLM2 is a Llama: its family's unused specials give the mask; a family's own candidates come first, then any
    # family's (a Qwen3 model with SmolLM2's tokenizer, as the cluster tests build, still finds one)
    assert smol_tokenizer.convert_ids_to_tokens(choose_mask_token(smol_tokenizer, 49152, family=llama)) == (
        "<empty_output>"
    )
    assert smol_tokenizer.convert_ids_to_tokens(choose_mask_token(smol_tokenizer, 49152, family=qwen3)) == (
        "<empty_output>"
    )
    own = ModelFamily("own", ("own",), mask_tokens=("<jupyter_script>",))
    assert smol_tokenizer.convert_ids_to_tokens(choose_mask_token(smol_tokenizer, 49152, family=own)) == (
        "<jupyter_script>"
    )
    template_uses_all = smol_tokenizer.chat_template + "".join(
        t for t in smol_tokenizer.get_vocab() if t.startswith(GENERIC.mask_tokens)
    )
    bare = copy.copy(smol_tokenizer)
    bare.chat_template = template_uses_all
    with pytest.raises(ValueError, match=r"none of the unused special tokens .*\(bare family's first\)"):
        choose_mask_token(bare, 49152, family=ModelFamily("bare", ("bare",)))


def test_unreachable_hub_target_fails_fast():
    with pytest.raises(OSError, match="neither a local folder nor reachable"):
        load_target("Qwen/Qwen3-8B")


def test_rowwise_attention_equals_masked_sdpa_and_skips_masks_that_hide_nothing():
    from flashdraft.target.exact import _row_keys, rowwise_attention

    g = torch.Generator().manual_seed(0)
    b, heads, kv_heads, q_len, kv_len, d = 2, 4, 2, 5, 12, 8
    q = torch.randn(b, heads, q_len, d, generator=g)
    k, v = torch.randn(b, kv_heads, kv_len, d, generator=g), torch.randn(b, kv_heads, kv_len, d, generator=g)
    causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)[None, None].expand(b, 1, -1, -1)
    ends = list(range(kv_len - q_len + 1, kv_len + 1))
    assert _row_keys(None, q_len, kv_len) == [(e, None, False) for e in ends]
    assert _row_keys(causal, q_len, kv_len) == [(e, None, False) for e in ends]  # causal only: every row unmasked
    padded = causal.clone()
    padded[1, :, :, :2] = False  # the second sequence is left-padded by two tokens
    assert _row_keys(padded, q_len, kv_len) == [(e, None, True) for e in ends]
    # A tree over the last 5 positions (root, two children of the root, a child of each): rows see their ancestors.
    tree = causal[:1].clone()
    tree[0, 0, 2, kv_len - 4] = False  # node 2 (a child of the root) does not see its sibling, node 1
    tree[0, 0, 3, kv_len - 3] = False  # node 3, a child of node 1: not node 2
    tree[0, 0, 4, kv_len - 4] = tree[0, 0, 4, kv_len - 2] = False  # node 4, a child of node 2: not nodes 1, 3
    rows = _row_keys(tree, q_len, kv_len)
    assert [r[1] is None for r in rows] == [True, True, False, False, False] and not any(r[2] for r in rows)
    assert rows[4][1].tolist() == list(range(kv_len - 5)) + [kv_len - 5, kv_len - 3, kv_len - 1]
    for qs, ks, vs, mask in [
        (q, k, v, causal),
        (q, k, v, padded),
        (q, k, v, torch.where(padded, 0.0, float("-inf"))),
        (q[:1], k[:1], v[:1], tree),
    ]:
        out, _ = rowwise_attention(None, qs, ks, vs, mask, scaling=d**-0.5)
        want = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=d**-0.5, enable_gqa=True
        )
        torch.testing.assert_close(out, want.transpose(1, 2))
