"""What differs between target model families, in one table (after torchtitan's ModelSpec): where a checkpoint keeps
the decoder's tensors, the output head, and which of the tokenizer's tokens may serve as the drafter's mask. The
code that reads a checkpoint or picks a mask token asks `family_of(config)`, never a family's name.

A model type not in the table gets `GENERIC`, which tries every family's choices in turn.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFamily:
    name: str
    model_types: tuple[str, ...]  # transformers' `config.model_type` of the family's checkpoints
    # where the decoder lives in a checkpoint: {prefix}embed_tokens.weight, {prefix}layers.N., {prefix}norm.weight
    decoder_prefixes: tuple[str, ...] = ("model.",)
    head_key: str = "lm_head.weight"  # the output head (absent: tied to the input embedding)
    # tokens that may serve as the mask token where the tokenizer has none and the embedding no spare row: the first
    # entry any of the vocabulary's tokens starts with wins, its lowest id (never a token the chat template emits)
    mask_tokens: tuple[str, ...] = ()

    def embed_keys(self) -> tuple[str, ...]:
        return tuple(f"{prefix}embed_tokens.weight" for prefix in self.decoder_prefixes)

    def decoder_prefix(self, names) -> str:
        """The prefix under which the checkpoint tensor `names` hold the decoder layers."""
        names = list(names)
        for prefix in self.decoder_prefixes:
            if any(n.startswith(f"{prefix}layers.") for n in names):
                return prefix
        raise KeyError(f"the target checkpoint has no decoder layer tensors under {list(self.decoder_prefixes)}")


# The mask a spare embedding row takes (the published Qwen3 drafters' id 151669).
SPARE_ROW_MASK_TOKEN = "<|MASK|>"

FAMILIES = (
    ModelFamily(
        "llama",
        ("llama",),
        # Llama 3's reserved specials; SmolLM2's (a Llama) unused StarCoder-era specials
        mask_tokens=("<|reserved_special_token_", "<empty_output>", "<jupyter_script>", "<issue_closed>"),
    ),
    ModelFamily("qwen3", ("qwen3", "qwen3_moe")),  # padded embeddings: the mask takes a spare row
    ModelFamily("qwen3-vl", ("qwen3_vl", "qwen3_vl_moe", "qwen3_vl_text"), decoder_prefixes=("model.language_model.",)),
)

GENERIC = ModelFamily(
    "generic",
    (),
    decoder_prefixes=tuple(dict.fromkeys(p for f in FAMILIES for p in f.decoder_prefixes)) + ("",),
    mask_tokens=("<|reserved", "<reserved", *dict.fromkeys(t for f in FAMILIES for t in f.mask_tokens)),
)


def text_config(config):
    """The text config of a multimodal target (transformers' `get_text_config`), else the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def family_of(config) -> ModelFamily:
    """The family of a target config (a multimodal wrapper's own model type first, then its text config's)."""
    for model_type in (getattr(config, "model_type", None), getattr(text_config(config), "model_type", None)):
        for family in FAMILIES:
            if model_type in family.model_types:
                return family
    return GENERIC
