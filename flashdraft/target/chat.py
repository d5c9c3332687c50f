"""The target's tokenizer as the stages use it: chat prompts, stop tokens, the template's hash, the mask token."""

from __future__ import annotations

import hashlib

from flashdraft.target.family import GENERIC, SPARE_ROW_MASK_TOKEN, ModelFamily


def chat_input_ids(tokenizer, messages: list[dict], **options) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template (`chat_text`, which takes the `options`)."""
    return tokenizer(chat_text(tokenizer, messages, **options), add_special_tokens=False)["input_ids"]


def template_takes_thinking(tokenizer) -> bool:
    """Whether the tokenizer's chat template reads `enable_thinking` (Qwen3's does; others render alike without)."""
    return "enable_thinking" in str(getattr(tokenizer, "chat_template", "") or "")


# a conversation the template's default thinking mode is read from: its generation prompt is where templates that
# take enable_thinking (Qwen3's) differ between the modes
THINKING_PROBE = [{"role": "user", "content": "Say hello."}]


def template_default_thinking(tokenizer) -> bool | None:
    """The enable_thinking a chat template renders with when none is given: True or False where the probe
    conversation rendered without the kwarg equals its rendering with exactly one of them (Qwen3's template: thinking
    on), None where the template does not take enable_thinking or the probe cannot tell (both, or neither)."""
    if not template_takes_thinking(tokenizer):
        return None

    def render(**kwargs) -> str:
        return tokenizer.apply_chat_template(THINKING_PROBE, tokenize=False, add_generation_prompt=True, **kwargs)

    try:
        default = render()
        same = [mode for mode in (True, False) if render(enable_thinking=mode) == default]
    except Exception:  # a template that refuses the probe (e.g. wants a system turn first): its default is unknown
        return None
    return same[0] if len(same) == 1 else None


def resolved_thinking(tokenizer, enable_thinking: bool | None) -> bool | None:
    """The thinking mode a prompt rendered with `enable_thinking` is in: the value given, on a template that takes it;
    for None, the template's own default (`template_default_thinking`); None for a template without thinking."""
    if not template_takes_thinking(tokenizer):
        return None
    return bool(enable_thinking) if enable_thinking is not None else template_default_thinking(tokenizer)


def chat_text(
    tokenizer,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    system_prompt: str | None = None,
) -> str:
    """`messages` rendered by the tokenizer's chat template, as text.

    `system_prompt` is prepended as a system message when the conversation has none;
    `enable_thinking` is passed to templates that know it (Qwen3) and ignored by others.
    """
    if not messages:
        raise ValueError("empty conversation")
    messages = list(messages)
    if system_prompt is not None and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    kwargs = {}
    if enable_thinking is not None and template_takes_thinking(tokenizer):
        kwargs["enable_thinking"] = enable_thinking
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def stop_token_ids(model, tokenizer) -> list[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def chat_template_hash(tokenizer) -> str:
    return hashlib.sha256(str(getattr(tokenizer, "chat_template", "") or "").encode()).hexdigest()


def choose_mask_token(tokenizer, vocab_size: int, drafter_config=None, family: ModelFamily = GENERIC) -> int:
    """Pick the id the drafter uses for masked block positions.

    1. The drafter config's `dflash_config.mask_token_id`, if any.
    2. The tokenizer's own mask token.
    3. A spare row of a padded embedding (vocab_size > len(tokenizer)): `SPARE_ROW_MASK_TOKEN` is added to the
       tokenizer and lands on the first spare row, as in the published Qwen3 drafters.
    4. Otherwise an unused special token the chat template never emits: the target family's own candidates
       (`ModelFamily.mask_tokens`) first, then any family's (a Qwen3 model may carry another family's tokenizer).
       Adding a row to the embedding instead would add a logit to a tied output head and change the target.
    """
    dcfg = getattr(drafter_config, "dflash_config", None) or {}
    if dcfg.get("mask_token_id") is not None:
        return int(dcfg["mask_token_id"])
    if getattr(tokenizer, "mask_token_id", None) is not None and tokenizer.mask_token_id < vocab_size:
        return int(tokenizer.mask_token_id)
    if len(tokenizer) < vocab_size:
        tokenizer.add_special_tokens({"mask_token": SPARE_ROW_MASK_TOKEN})
        return int(tokenizer.convert_tokens_to_ids(SPARE_ROW_MASK_TOKEN))
    template = str(getattr(tokenizer, "chat_template", "") or "")
    used = {tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token, tokenizer.unk_token}
    free = {t: i for t, i in tokenizer.get_vocab().items() if t not in template and t not in used}
    candidates = tuple(dict.fromkeys((*family.mask_tokens, *GENERIC.mask_tokens)))
    for start in candidates:
        ids = sorted(i for t, i in free.items() if t.startswith(start))
        if ids:
            return ids[0]
    raise ValueError(
        f"no mask token: the tokenizer has none, the embedding has no spare row and none of the unused special "
        f"tokens {list(candidates)} ({family.name} family's first) was found; set dflash_config.mask_token_id in "
        "the drafter config"
    )


def mask_token_string(tokenizer, mask_token_id: int) -> str | None:
    """The string of token `mask_token_id` in `tokenizer` (after `choose_mask_token`, which may have added it), or
    None where the tokenizer has no token there (a spare embedding row it never named). Written to the drafter's
    `dflash_config.mask_token`: SGLang finds the mask token by this string."""
    if mask_token_id >= len(tokenizer):
        return None
    token = tokenizer.convert_ids_to_tokens(int(mask_token_id))
    return token if isinstance(token, str) and token else None
