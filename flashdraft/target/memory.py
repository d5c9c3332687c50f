"""How much work fits in a GPU's free memory: the rows a batched decode holds, the tokens a prefill holds.

Plain arguments (a transformers config, a dtype, free bytes), no device calls: the caller measures free memory
(`torch.cuda.mem_get_info()` once the target is loaded) and passes the number. Each function returns a `Budget`:
the number and one line with the arithmetic behind it, for the log.

What is counted, a token or a row, in the target's compute dtype unless said:
- KV cache: 2 (keys, values) x layers x KV heads x head dim, a token of every row, for the whole `max_length`
  (a row may grow that long), plus the spare capacity the decode's cache appends into (`CACHE_HEADROOM`).
- Decode step, a row: the last position's logits (`logits_to_keep=1`), float32 once the sampler or the teacher's
  log-softmax reads them, twice (logits and their softmax); the one-token hidden states are negligible.
- Prefill without a cache (`use_cache=False`), a token: one layer's working set at a time (the residual and its
  norm, the attention output and o_proj output: 4 x hidden; queries, keys, values and their rotary copies:
  2 x (heads + 2 x KV heads) x head dim; the MLP's gate, up and their product: 3 x intermediate), the captured
  layers' outputs held to the end of the forward and their concatenation (2 x captured layers x hidden), and the
  attention's padding mask over `max_length` keys, a boolean and the additive bias SDPA makes of it (its
  memory-efficient kernel builds no score matrix).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.target.family import text_config

CACHE_HEADROOM = 0.25  # the decode cache's spare capacity, a share of its length (pipeline.slotcache)
DEFAULT_FRACTION = 0.85  # of the free memory; the rest absorbs allocator fragmentation and what is not counted
MAX_DECODE_ROWS = 512  # beyond this a decode step is bound by reading the cache, not the weights: no gain


@dataclass(frozen=True)
class Budget:
    value: int
    line: str  # the arithmetic, for a human

    def __str__(self) -> str:
        return self.line


def dtype_bytes(dtype) -> int:
    """Bytes of one element of `dtype` (a torch.dtype or its name: "bfloat16", "float32", ...)."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype.itemsize


def head_dim(config) -> int:
    c = text_config(config)
    return int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)


def kv_bytes_per_token(config, dtype) -> int:
    """Keys and values of one token in every layer: 2 x layers x KV heads x head dim x dtype bytes."""
    c = text_config(config)
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim(c) * dtype_bytes(dtype)


def logits_bytes_per_row(config) -> int:
    """One decode step's last-position logits of a row, float32, and their softmax: vocab x 4 x 2."""
    return text_config(config).vocab_size * 4 * 2


def prefill_bytes_per_token(config, dtype, captured_layers: int, max_length: int) -> int:
    """The activations one token of a cache-free prefill holds at its peak (see the module's note)."""
    c = text_config(config)
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    layer = 4 * c.hidden_size + 2 * (c.num_attention_heads + 2 * kv_heads) * head_dim(c) + 3 * c.intermediate_size
    captured = 2 * captured_layers * c.hidden_size
    mask = max_length * (1 + dtype_bytes(dtype))  # a boolean a key, and SDPA's additive bias made from it
    return (layer + captured) * dtype_bytes(dtype) + mask


def teacher_bytes(config, dtype, max_length: int) -> int:
    """Capture with a teacher top-k: one sequence's [S, vocab] logits at a time, in the dtype then float32 twice."""
    return max_length * text_config(config).vocab_size * (dtype_bytes(dtype) + 8)


def size(n: float) -> str:
    """Bytes as the largest binary unit that keeps the number >= 1: 144 KiB, 61.2 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            x = n / scale
            return f"{x:.0f} {unit}" if x == int(x) else f"{x:.1f} {unit}"
    return f"{n:.0f} B"


def decode_rows(
    free_bytes: int,
    config,
    dtype,
    max_length: int,
    *,
    fraction: float = DEFAULT_FRACTION,
    prefill_tokens: int = 0,
    captured_layers: int = 5,
    cap: int = MAX_DECODE_ROWS,
) -> Budget:
    """Rows a continuously batched decode can hold: each keeps `max_length` tokens of KV cache (with the cache's
    spare capacity) and one step's logits; `prefill_tokens` of cache-free prefill activations (the prefills that
    admit new rows) are set aside first. At least 1, at most `cap`."""
    kv = kv_bytes_per_token(config, dtype)
    row = kv * max_length * (1 + CACHE_HEADROOM) + logits_bytes_per_row(config)
    usable = free_bytes * fraction
    prefill = prefill_tokens * prefill_bytes_per_token(config, dtype, captured_layers, max_length)
    rows = int(max(0.0, usable - prefill) // row)
    clamped = min(max(rows, 1), cap)
    why = f"{size(free_bytes)} free x {fraction:g}"
    if prefill:
        why = f"({why} - {size(prefill)} for {prefill_tokens:,}-token prefills)"
    why += (
        f" / ({size(kv)} KV a token x {max_length} tokens x {1 + CACHE_HEADROOM:g} cache headroom"
        f" + {size(logits_bytes_per_row(config))} logits a row)"
    )
    bound = "" if clamped == rows else f" (formula {rows}, clamped to 1..{cap})"
    return Budget(clamped, f"decode batch {clamped} rows{bound}: {why}")


def prefill_token_budget(
    free_bytes: int,
    config,
    dtype,
    max_length: int,
    *,
    captured_layers: int = 5,
    fraction: float = DEFAULT_FRACTION,
    teacher_topk: int = 0,
) -> Budget:
    """Tokens (rows x longest row, padding included) one cache-free prefill can hold; never below `max_length`,
    so a sequence of any allowed length fits alone (if that overflows the memory, nothing smaller would help)."""
    per_token = prefill_bytes_per_token(config, dtype, captured_layers, max_length)
    reserve = teacher_bytes(config, dtype, max_length) if teacher_topk else 0
    tokens = int(max(0.0, free_bytes * fraction - reserve) // per_token)
    clamped = max(tokens, max_length)
    why = f"{size(free_bytes)} free x {fraction:g}"
    if reserve:
        why = f"({why} - {size(reserve)} for one sequence's teacher logits)"
    why += f" / {size(per_token)} activations a token"
    bound = "" if clamped == tokens else f" (formula {tokens:,}, raised to max_length)"
    return Budget(clamped, f"prefill budget {clamped:,} tokens{bound}: {why}")
