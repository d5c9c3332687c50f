"""A capture's batch sizes: the rows its decode holds and the tokens a prefill holds, each with the line that says why.

Each is the number a setting gives, or `auto`: on a GPU sized from the memory free once the target is loaded
(`flashdraft.target.memory`), on a CPU a fixed default. Plain arguments (a transformers config, a dtype, free bytes or
None on a CPU), no device calls.
"""

from __future__ import annotations

from flashdraft.target.memory import decode_rows, prefill_token_budget

CPU_BATCH_SIZE = 8  # data.batch_size auto on a CPU
CPU_PREFILL_TOKENS = 16384  # data.prefill_tokens auto in capture mode on a CPU
GPU_ADMIT_TOKENS = 16384  # ... in regenerate mode on a GPU: a prefill of joining prompts, small next to the KV cache


def capture_budgets(
    free: int | None,
    config,
    dtype,
    *,
    mode: str,
    batch_size: int | str,
    prefill_tokens: int | str,
    max_length: int,
    fraction: float,
    captured_layers: int,
    teacher_topk: int = 0,
) -> tuple[int, int | None, list[str]]:
    """(decode rows, prefill token budget or None for unlimited, one line each saying why) of a capture of a target
    of `config` in `dtype`. `auto` on a GPU is sized from `free`, the GPU memory free once the target is loaded
    (flashdraft.target.memory); on a CPU (`free` None) it is a fixed default: CPU_BATCH_SIZE rows; in capture mode
    CPU_PREFILL_TOKENS tokens a prefill, in regenerate mode the joining prompts prefilled together, unsplit."""
    prefill, prefill_line = prefill_budget(
        free, config, dtype, mode, prefill_tokens, max_length, fraction, captured_layers, teacher_topk
    )
    if mode == "capture":
        return 1, prefill, [prefill_line]
    if batch_size != "auto":
        return batch_size, prefill, [f"decode batch {batch_size} rows: data.batch_size", prefill_line]
    if free is None:
        return CPU_BATCH_SIZE, prefill, [f"decode batch {CPU_BATCH_SIZE} rows: auto on CPU", prefill_line]
    budget = decode_rows(
        free,
        config,
        dtype,
        max_length,
        fraction=fraction,
        prefill_tokens=prefill or 0,
        captured_layers=captured_layers,
    )
    return budget.value, prefill, [budget.line, prefill_line]


def prefill_budget(
    free, config, dtype, mode, prefill_tokens, max_length, fraction, captured_layers, teacher_topk
) -> tuple[int | None, str]:
    """(tokens a prefill holds or None for unlimited, why): data.prefill_tokens, or auto (see `capture_budgets`)."""
    if prefill_tokens != "auto":
        return prefill_tokens, f"prefill budget {prefill_tokens:,} tokens: data.prefill_tokens"
    if free is None and mode == "regenerate":
        return None, "prefill budget unlimited: auto on CPU (the prompts joining the decode prefill together)"
    if free is None or mode == "regenerate":
        n = CPU_PREFILL_TOKENS if free is None else GPU_ADMIT_TOKENS
        return n, f"prefill budget {n:,} tokens: auto on {'CPU' if free is None else 'a GPU, regenerate mode'}"
    budget = prefill_token_budget(
        free,
        config,
        dtype,
        max_length,
        captured_layers=captured_layers,
        fraction=fraction,
        teacher_topk=teacher_topk,
    )
    return budget.value, budget.line
