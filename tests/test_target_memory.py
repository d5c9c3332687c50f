"""GPU batching by memory: the arithmetic of flashdraft.target.memory on configs built in code (no weights)."""

from transformers import LlamaConfig, Qwen3Config

from flashdraft.target.memory import (
    CACHE_HEADROOM,
    decode_rows,
    head_dim,
    kv_bytes_per_token,
    prefill_bytes_per_token,
    prefill_token_budget,
)
from pipeline.capture import token_batches

GIB = 2**30


def qwen3_8b():
    return Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    )


def llama31_8b():
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    )


def test_kv_bytes_per_token():
    assert kv_bytes_per_token(qwen3_8b(), "bfloat16") == 2 * 36 * 8 * 128 * 2 == 147_456
    assert kv_bytes_per_token(llama31_8b(), "bfloat16") == 2 * 32 * 8 * 128 * 2 == 131_072
    c = llama31_8b()
    c.head_dim = None  # configs without head_dim: hidden / heads
    assert head_dim(c) == 128 and kv_bytes_per_token(c, "float32") == 262_144


def test_decode_rows_from_free_memory():
    c, free = qwen3_8b(), 70 * GIB
    row = 147_456 * 3072 * (1 + CACHE_HEADROOM) + 151936 * 8  # KV at max_length with headroom, float32 logits x 2
    b = decode_rows(free, c, "bfloat16", 3072)
    assert b.value == int(free * 0.85 // row) == 112
    assert b.line.startswith("decode batch 112 rows: 70 GiB free x 0.85 / (144 KiB KV a token x 3072 tokens")
    prefills = 16384 * prefill_bytes_per_token(c, "bfloat16", 5, 3072)
    with_prefills = decode_rows(free, c, "bfloat16", 3072, prefill_tokens=16384)
    assert with_prefills.value == int((free * 0.85 - prefills) // row) == 106
    assert "16,384-token prefills" in with_prefills.line
    assert decode_rows(GIB, c, "bfloat16", 3072).value == 1  # too little memory: still one row
    assert decode_rows(10_000 * GIB, c, "bfloat16", 3072, cap=300).value == 300
    assert "clamped to 1..300" in decode_rows(10_000 * GIB, c, "bfloat16", 3072, cap=300).line
    llama = decode_rows(free, llama31_8b(), "bfloat16", 3072, fraction=0.5)
    assert llama.value == int(free * 0.5 // (131_072 * 3072 * (1 + CACHE_HEADROOM) + 128256 * 8)) == 74


def test_prefill_token_budget_from_free_memory():
    c, free = qwen3_8b(), 70 * GIB
    layer = 4 * 4096 + 2 * (32 + 2 * 8) * 128 + 3 * 12288  # residual + norm + attn, q/k/v + rotary, MLP
    per_token = (layer + 2 * 5 * 4096) * 2 + 3072 * 3  # + 5 captured layers and their concatenation, + the mask
    assert prefill_bytes_per_token(c, "bfloat16", 5, 3072) == per_token
    b = prefill_token_budget(free, c, "bfloat16", 3072)
    assert b.value == int(free * 0.85 // per_token) and b.line.startswith(f"prefill budget {b.value:,} tokens")
    teacher = prefill_token_budget(free, c, "bfloat16", 3072, teacher_topk=8)
    assert teacher.value == int((free * 0.85 - 3072 * 151936 * 10) // per_token)
    assert "teacher logits" in teacher.line
    assert prefill_token_budget(GIB // 4, c, "bfloat16", 3072).value == 3072  # one longest sequence always fits


def test_token_batches_keep_rows_times_longest_under_the_budget():
    lengths = [3, 4, 4, 5, 9, 20, 21]
    assert token_batches(lengths, 12) == [[0, 1, 2], [3], [4], [5], [6]]  # 20 and 21 exceed it: each alone
    assert token_batches(lengths, 42) == [[0, 1, 2, 3], [4, 5], [6]]  # 4 x 5, 2 x 20 fit; 3 x 21 does not
    assert token_batches(lengths, None) == [list(range(len(lengths)))] and token_batches([], 8) == []
