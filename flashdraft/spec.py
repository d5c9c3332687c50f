"""The drafter's geometry: which target layers feed it, its block size, its mask token, its depth.

A `DraftSpec` holds the geometry's defaults and is made in one way, `DraftSpec.from_settings` (the `drafter`
settings, the target layers, the mask token): by the trainer, from the layers the feature stores hold, and by the
harness for an untrained drafter, from the layers a capture would take. It is saved in the drafter's config.json in
the published format (`block_size`, `num_hidden_layers`, `dflash_config.target_layer_ids`,
`dflash_config.mask_token_id`, and `dflash_config.mask_token`, the token's string, where the tokenizer has one) and read
back from there by everything after training: the harness, the reference package, serving engines.
`export_config` adds what those readers need beyond transformers 5's own keys (`rope_theta`, `rope_scaling`,
`auto_map`, and `eagle_aux_hidden_state_layer_ids` for vLLM); docs/serving.md lists who reads what, engine by engine.

The pipeline chooses only which layers to capture (`capture_layer_ids`); nothing else derives geometry.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import Qwen3Config

from flashdraft.target.family import text_config

DEFAULT_NUM_FEATURES = 5  # how many target layers the reference formula picks
# config.json's record of the thinking mode the drafter was trained in ("on", "off", "mixed", null: not recorded),
# written by the trainer, read by the harness (which warns when it evaluates another mode); engines ignore it
TRAINED_THINKING_KEY = "flashdraft_trained_thinking"

# The remote-code entry the published z-lab drafters carry: class `DFlashDraftModel` of a `dflash.py` module. We ship
# no `dflash.py`: SGLang and vLLM dispatch on `architectures`, the `dflash` package imports its own class, and our own
# loading never trusts remote code. The key is written so that tools keyed on the published layout see the same one.
AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}


def default_layer_ids(num_target_layers: int, num_features: int = DEFAULT_NUM_FEATURES) -> list[int]:
    """The reference's layer ids: round(1 + i*(L-4)/(n-1)) for i in 0..n-1; n = 1 gives [L//2]."""
    if num_features < 1:
        raise ValueError(f"num_features must be >= 1, got {num_features}")
    if num_features == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_features - 1)) for i in range(num_features)]


def check_layer_ids(layer_ids, num_target_layers: int) -> list[int]:
    """`layer_ids` as ints, refused unless distinct, non-empty, ascending and inside the target's layers. Ascending:
    SGLang, vLLM and TensorRT-LLM concatenate the captured layers in layer order whatever order the config lists
    them in, so a drafter trained on another order would read its features permuted."""
    ids = [int(i) for i in layer_ids]
    if not ids or len(set(ids)) != len(ids):
        raise ValueError(f"target layer ids must be distinct and non-empty, got {ids}")
    if ids != sorted(ids):
        raise ValueError(
            f"target layer ids must be ascending, got {ids}: serving engines concatenate the layers in layer order"
        )
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(
            f"target layer ids {bad} outside the target's {num_target_layers} layers (0..{num_target_layers - 1})"
        )
    return ids


def capture_layer_ids(target_config, num_features: int = DEFAULT_NUM_FEATURES, override=None) -> list[int]:
    """The layers a capture stores (`drafter.layer_ids`, `drafter.num_features`): `override` if given, else the
    reference formula for this target."""
    n = text_config(target_config).num_hidden_layers
    return check_layer_ids(override if override else default_layer_ids(n, num_features), n)


@dataclass(frozen=True)
class DraftSpec:
    """Everything that fixes a drafter's shape besides the target's own sizes."""

    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16  # the paper's
    num_draft_layers: int = 5  # the paper's
    intermediate_size: int | None = None  # None: the target's
    # The mask token's string in the target's tokenizer (None: unknown). SGLang looks the mask token up by this string
    # (`dflash_config.mask_token`, default "<|MASK|>") where its release does not read `mask_token_id`.
    mask_token: str | None = None

    @classmethod
    def from_settings(cls, drafter, target_layer_ids, mask_token_id: int, mask_token: str | None = None) -> DraftSpec:
        """The spec the `drafter` settings (flashdraft.config.DrafterConfig: block size, depth, MLP width) ask for,
        reading `target_layer_ids` with mask token `mask_token_id` (whose string is `mask_token`, if known)."""
        return cls(
            target_layer_ids=tuple(target_layer_ids),
            mask_token_id=int(mask_token_id),
            block_size=int(drafter.block_size),
            num_draft_layers=int(drafter.num_layers),
            intermediate_size=drafter.intermediate_size,
            mask_token=mask_token,
        )

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if not self.target_layer_ids or len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"target_layer_ids must be distinct and non-empty, got {list(self.target_layer_ids)}")
        if not 1 <= self.block_size <= 64:
            raise ValueError(f"block_size must be in 1..64, got {self.block_size}")
        if self.num_draft_layers < 1:
            raise ValueError(f"num_draft_layers must be >= 1, got {self.num_draft_layers}")
        if self.mask_token_id < 0:
            raise ValueError(f"mask_token_id must be a token id, got {self.mask_token_id}")
        if self.mask_token is not None and (not isinstance(self.mask_token, str) or not self.mask_token):
            raise ValueError(f"mask_token must be a non-empty string or None, got {self.mask_token!r}")

    @classmethod
    def from_draft_config(cls, config, where: str = "drafter config") -> DraftSpec:
        """Read the spec back from a drafter config (a Qwen3Config or its dict). No field is guessed: a config
        without target layer ids or a mask token is refused, as the reference refuses it."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        dcfg = get("dflash_config") or {}
        missing = [k for k in ("target_layer_ids", "mask_token_id") if dcfg.get(k) is None]
        missing += [k for k in ("block_size", "num_hidden_layers") if get(k) is None]
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)}: not a DFlash drafter config")
        return cls(
            target_layer_ids=tuple(dcfg["target_layer_ids"]),
            mask_token_id=int(dcfg["mask_token_id"]),
            block_size=int(get("block_size")),
            num_draft_layers=int(get("num_hidden_layers")),
            intermediate_size=get("intermediate_size"),
            mask_token=dcfg.get("mask_token"),
        )

    def draft_config(self, target_config) -> Qwen3Config:
        """The drafter's config in the published format, shaped like the target (hidden size, heads, RoPE)."""
        tc = text_config(target_config)
        check_layer_ids(self.target_layer_ids, tc.num_hidden_layers)
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        rope = getattr(tc, "rope_parameters", None) or {
            "rope_type": "default",
            "rope_theta": getattr(tc, "rope_theta", 10000.0),
        }
        n = self.num_draft_layers
        return Qwen3Config(
            architectures=["DFlashDraftModel"],
            vocab_size=tc.vocab_size,
            hidden_size=tc.hidden_size,
            intermediate_size=self.intermediate_size or tc.intermediate_size,
            num_hidden_layers=n,
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", tc.num_attention_heads),
            head_dim=head_dim,
            hidden_act="silu",
            max_position_embeddings=tc.max_position_embeddings,
            rms_norm_eps=tc.rms_norm_eps,
            rope_parameters=dict(rope),
            attention_bias=False,
            tie_word_embeddings=False,
            use_sliding_window=False,
            layer_types=["full_attention"] * n,
            max_window_layers=n,
            bos_token_id=getattr(tc, "bos_token_id", None),
            eos_token_id=getattr(tc, "eos_token_id", None),
            block_size=self.block_size,
            num_target_layers=tc.num_hidden_layers,
            dflash_config=self.dflash_config(),
        )

    def dflash_config(self) -> dict:
        """config.json's `dflash_config`: the mask token (id, and string where known) and the target layer ids."""
        out = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        if self.mask_token is not None:
            out["mask_token"] = self.mask_token
        return out


def legacy_rope(rope_parameters: dict | None) -> dict:
    """The transformers-4 spelling of transformers-5 `rope_parameters`: `rope_theta` plus `rope_scaling` (the
    parameters without the base; None for plain RoPE), the keys transformers 4, SGLang and vLLM read."""
    rope = dict(rope_parameters or {})
    if "rope_theta" not in rope:
        # Per-layer-type RoPE (a dict of dicts) has no single transformers-4 form: write nothing rather than a guess.
        return {}
    theta = rope.pop("rope_theta")
    scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
    return {"rope_theta": theta, "rope_scaling": scaling}


def check_rope_agrees(raw: dict, where: str = "drafter config") -> None:
    """Refuse a config.json whose `rope_theta`/`rope_scaling` disagree with its `rope_parameters`: transformers 5
    reads the latter, transformers 4 and the serving engines the former, so they would rotate differently."""
    legacy = legacy_rope(raw.get("rope_parameters"))
    bad = [k for k, v in legacy.items() if k in raw and raw[k] != v]
    if bad:
        got = {k: raw[k] for k in bad}
        want = {k: legacy[k] for k in bad}
        raise ValueError(f"{where}: {got} disagree with rope_parameters {raw['rope_parameters']} (expected {want})")


def aux_layer_ids(dflash_config: dict | None) -> dict:
    """`eagle_aux_hidden_state_layer_ids`: the target layer ids in the capture-before-layer convention of vLLM (and
    SGLang, llama.cpp): our id i is the output of layer i, which those engines capture at the input of layer i + 1.
    vLLM sizes the drafter's `fc` from this key first; releases without the DFlash fallback read nothing else and
    fall back to the target's three EAGLE-3 layers (a shape mismatch for a five-feature drafter)."""
    ids = (dflash_config or {}).get("target_layer_ids")
    return {"eagle_aux_hidden_state_layer_ids": [int(i) + 1 for i in ids]} if ids else {}


def check_derived_keys_agree(raw: dict, where: str = "drafter config") -> None:
    """Refuse a config.json whose derived keys (`rope_theta`/`rope_scaling`, `eagle_aux_hidden_state_layer_ids`)
    disagree with their sources (`rope_parameters`, `dflash_config.target_layer_ids`): the readers of each would
    differ (transformers 4 and 5; vLLM and every other engine)."""
    check_rope_agrees(raw, where)
    derived = aux_layer_ids(raw.get("dflash_config"))
    bad = {k: raw[k] for k, v in derived.items() if k in raw and list(raw[k]) != v}
    if bad:
        raise ValueError(f"{where}: {bad} disagree with dflash_config.target_layer_ids (expected {derived})")


def export_config(config) -> dict:
    """The drafter's config.json dict as exported: the config's own keys, plus what transformers 5 drops when it
    serialises (`rope_theta`, `rope_scaling`), the published drafters' `auto_map`, and vLLM's
    `eagle_aux_hidden_state_layer_ids`, so every reader agrees."""
    out = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    out.update(legacy_rope(out.get("rope_parameters")))  # derived from rope_parameters, the one source of truth
    out.update(aux_layer_ids(out.get("dflash_config")))  # derived from dflash_config.target_layer_ids
    out.setdefault("auto_map", dict(AUTO_MAP))
    return out
