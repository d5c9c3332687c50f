"""The transformers baseline: prompt-lookup decoding by `generate(prompt_lookup_num_tokens=...)`, free of any drafter.

Hooks on the target split the run like the harness loop: the first forward (the prompt, plus the
first lookup candidates that generate verifies with it) is the prefill, every later forward is a
decode round, and the cache length each forward starts from gives the tokens committed per round.
(A cache prefilled by us is not usable: generate re-feeds the whole prompt on its first step.)
"""

from __future__ import annotations

import torch

from flashdraft.sampling import check_sampling
from harness.speculative import Generation, clock


@torch.inference_mode()
def prompt_lookup_generate(
    target,
    input_ids,
    *,
    max_new_tokens: int,
    stop_token_ids=(),
    num_lookup_tokens: int = 10,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    pad_token_id: int | None = None,
) -> Generation:
    """Sampling draws from torch's global RNG (generate takes no generator)."""
    check_sampling(temperature, top_p, top_k)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = target.device
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device).view(1, -1)
    n = ids.shape[1]
    stop = list(stop_token_ids)
    committed, first_done = [], []  # cache length at the start of each forward; end time of the first

    def before(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        committed.append(cache.get_seq_length() if cache is not None else 0)

    def after(module, args, output):
        if not first_done:
            first_done.append(clock(device))

    hooks = [target.register_forward_pre_hook(before, with_kwargs=True), target.register_forward_hook(after)]
    sampling = (
        dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k or None) if temperature > 0 else {}
    )
    try:
        t0 = clock(device)
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=temperature > 0,
            prompt_lookup_num_tokens=num_lookup_tokens,
            eos_token_id=stop or None,
            pad_token_id=pad_token_id if pad_token_id is not None else (stop[0] if stop else 0),
            **sampling,
        )
        t1 = clock(device)
    finally:
        for hook in hooks:
            hook.remove()
    result = Generation(out[0, n:].tolist(), n)
    result.prefill_s, result.decode_s = first_done[0] - t0, t1 - first_done[0]
    result.stopped = bool(stop) and result.tokens[-1] in stop
    marks = committed[1:] + [n + len(result.tokens) - 1]  # the newest token's K/V are never computed
    result.acceptance_lengths = [b - a for a, b in zip(marks, marks[1:])]
    return result
