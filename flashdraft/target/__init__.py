"""The target model: loading and resolution (`load`), tokenizer and chat (`chat`), frozen embedding and head
(`head`), what differs between model families (`family`), hidden-state capture (`capture`), CPU probes and dtypes
(`cpu`), exact verification (`exact`)."""

from flashdraft.target.capture import LayerTap, capture_features
from flashdraft.target.chat import (
    chat_input_ids,
    chat_template_hash,
    chat_text,
    choose_mask_token,
    mask_token_string,
    resolved_thinking,
    stop_token_ids,
    template_default_thinking,
    template_takes_thinking,
)
from flashdraft.target.cpu import cpu_bf16_gemm_speedup, cpu_has_bf16_tiles, cpu_has_fast_bf16, resolve_dtype
from flashdraft.target.exact import (
    EXACT_ATTENTION,
    EXACT_ATTENTION_FP32,
    exact_base_rows,
    exact_gemm_rows,
    fixed_order_sum,
    make_norms_exact,
    make_verification_exact,
    needs_exact_verification,
    resolve_exact,
)
from flashdraft.target.family import FAMILIES, GENERIC, SPARE_ROW_MASK_TOKEN, ModelFamily, family_of, text_config
from flashdraft.target.head import FrozenHead, frozen_head_from_model, load_frozen_head, read_target_tensors
from flashdraft.target.load import (
    EMBEDDED_NAME,
    load_config,
    load_target,
    load_tokenizer,
    resolve_target,
    target_fingerprint,
)

__all__ = [
    "EMBEDDED_NAME",
    "EXACT_ATTENTION",
    "EXACT_ATTENTION_FP32",
    "FAMILIES",
    "GENERIC",
    "SPARE_ROW_MASK_TOKEN",
    "ModelFamily",
    "family_of",
    "text_config",
    "FrozenHead",
    "LayerTap",
    "capture_features",
    "chat_input_ids",
    "chat_template_hash",
    "chat_text",
    "template_takes_thinking",
    "template_default_thinking",
    "resolved_thinking",
    "choose_mask_token",
    "mask_token_string",
    "cpu_bf16_gemm_speedup",
    "cpu_has_bf16_tiles",
    "cpu_has_fast_bf16",
    "exact_base_rows",
    "exact_gemm_rows",
    "fixed_order_sum",
    "frozen_head_from_model",
    "load_config",
    "load_frozen_head",
    "load_target",
    "load_tokenizer",
    "make_norms_exact",
    "make_verification_exact",
    "needs_exact_verification",
    "resolve_exact",
    "read_target_tensors",
    "resolve_dtype",
    "resolve_target",
    "stop_token_ids",
    "target_fingerprint",
]
