"""The DFlash draft model: a block-diffusion drafter conditioned on target hidden states.

Semantics follow the published reference (`dflash` on PyPI, `dflash/model.py`) exactly:

* the features of n target layers are concatenated (n*H), projected by `fc` (no bias) and
  normalised by `hidden_norm`; that one fused tensor conditions every draft layer;
* each draft layer is a Qwen3 decoder layer (q_norm/k_norm, RMSNorm, SwiGLU MLP) whose keys and
  values are `cat([proj(context), proj(block)])` along the sequence, context first, with the
  layer's own k/v projections; k_norm on all keys; RoPE with absolute positions;
* attention is not causal; queries come from the block only;
* output position k of a block `[anchor, MASK x (B-1)]` predicts the token at anchor+k.

The model has no embedding and no output head: it borrows the target's, frozen.
Checkpoints are Hugging Face folders (`config.json` + `model.safetensors`) with the same
config keys and tensor names as the published drafters, so `dflash.DFlashDraftModel` loads them; `from_pretrained`
also reads a folder in the peer's format, vLLM's `speculators` (flashdraft.speculators_format).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from flashdraft.spec import DraftSpec, check_derived_keys_agree, export_config
from flashdraft.speculators_format import from_speculators

try:  # FlexAttention: block-sparse kernels on GPU (and a compiled forward on CPU).
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - torch without FlexAttention
    BlockMask, flex_attention = None, None


def feature_dims(config) -> int:
    """The width of the features `fc` reads: n target layers x H, or, for a drafter being trained on a projected
    store (`feature_projection` not yet `folded`, `flashdraft.store.projection`), the store's r dims. An exported
    drafter is always folded: its fc reads the raw n*H features, as the published drafters' do."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    fp = get("feature_projection")
    if fp and not fp.get("folded", False):
        return int(fp["dims"])
    return len(get("dflash_config")["target_layer_ids"]) * int(get("hidden_size"))


def fold_projection(fc: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """fc' [H, r] on projected features z = x @ P -> fc [H, n*H] on raw features x: fc = fc' @ P^T (float32, then
    fc's dtype), so that x @ fc^T == (x @ P) @ fc'^T."""
    return (fc.float() @ projection.float().T.to(fc.device)).to(fc.dtype)


def lift_fc(fc: torch.Tensor, lift: torch.Tensor) -> torch.Tensor:
    """A raw fc [H, n*H] -> fc' [H, r] = fc @ lift: the inverse of `fold_projection` for a drafter folded from the
    same basis (P^T @ lift = I), else the fc' that reads the features' reconstruction from the r directions."""
    return (fc.float() @ lift.float().to(fc.device)).to(fc.dtype)


def extract_context_feature(hidden_states, layer_ids) -> torch.Tensor:
    """The output of decoder layer i is `hidden_states[i + 1]` (index 0 is the embeddings)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


ATTENTION_KERNELS = {  # DraftAttention's kernel settings and their values (`DFlashDrafter.set_attention_kernels`)
    "dense_kv_heads": ("auto", "grouped", "expanded"),
    "flex_kernel": ("auto", "compiled", "eager"),
}


@functools.cache
def _compiled_flex_attention():
    """flex_attention compiled once a process: made lazily (the first call that asks for it), cached by functools
    rather than in a module global the call assigns, so a compiled drafter's graph never writes a global (a
    guaranteed recompile)."""
    return torch.compile(flex_attention)


def _flex_attention(q, k, v, block_mask, scale, kernel: str = "auto"):
    """FlexAttention. kernel compiled: through the compiled kernel (`_compiled_flex_attention`; on CUDA the eager one
    would materialise the full score matrix) | eager: the eager kernel | auto: compiled on CUDA, eager elsewhere.
    Inside a compiled drafter dynamo compiles flex_attention with the rest of the graph, whatever `kernel` says."""
    compiled = kernel == "compiled" or (kernel == "auto" and q.is_cuda)
    if compiled and not torch.compiler.is_compiling():
        return _compiled_flex_attention()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


def _dense_attention(q, k, v, mask, scale, kv_heads: str = "auto"):
    """SDPA over the keys and values of [context | block], `mask` a boolean mask or None. kv_heads grouped: SDPA's
    `enable_gqa` pairs each key/value head with its group of query heads | expanded: each key/value head repeated
    for its group first (repeat_interleave: the pairing enable_gqa makes), a plain multi-head call | auto: expanded
    on CUDA when there is a mask, grouped otherwise.

    Why: on CUDA a mask rules out the flash kernel and grouped heads rule out the memory-efficient one, so a masked
    grouped call falls to SDPA's math kernel, which writes every head's whole score matrix (GBs a layer at the
    paper's shapes); expanded, the memory-efficient kernel takes it. Unmasked, flash takes grouped heads as they are.
    On a CPU the grouped call is the one every earlier result came from (the expanded call runs another kernel,
    equal within rounding)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and (kv_heads == "expanded" or (kv_heads == "auto" and q.is_cuda and mask is not None)):
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    grouped = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=grouped)


def _on_rows(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module` (linear layers, an MLP) over x's rows as one 2-D matrix: on CPU a 3-D input with few rows takes a
    bmm that first copies the transposed weight, which makes a small draft much slower."""
    out = module(x.reshape(-1, x.shape[-1]))
    return out.view(*x.shape[:-1], out.shape[-1])


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class FloatRotaryEmbedding(Qwen3RotaryEmbedding):
    """Qwen3's rotary embedding whose frequency buffers stay float32 whatever dtype the drafter is cast to (`.to`,
    `.bfloat16()`, DeepSpeed's bf16 engine): a bf16 `inv_freq` puts the angles of position p off by p times its
    rounding error, so a drafter served in bf16 would see other rotations than it was trained with. The cos/sin it
    returns are computed in float32 and only then cast to the input's dtype, as the parent does."""

    def _apply(self, fn, recurse=True):
        before = dict(self.named_buffers(recurse=False))
        super()._apply(fn, recurse)
        for name, original in before.items():
            moved = getattr(self, name)
            if original.is_floating_point() and moved.dtype != original.dtype:
                setattr(self, name, original.to(device=moved.device))
        return self


class DraftCache:
    """Per-layer K/V of the verified context (after k_norm and RoPE). Block K/V never enter it."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[-2]

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=-2)
            v = torch.cat([self.values[layer], v], dim=-2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class DraftAttention(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=config.attention_bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.dense_kv_heads = "auto"  # `_dense_attention`'s kv_heads
        self.flex_kernel = "auto"  # `_flex_attention`'s kernel

    def _kv(self, x: torch.Tensor, cos, sin):
        b, n, _ = x.shape
        k = self.k_norm(_on_rows(self.k_proj, x).view(b, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = _on_rows(self.v_proj, x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return _apply_rope(k, cos, sin), v

    def forward(self, x, ctx, cos, sin, attention_mask=None, cache: DraftCache | None = None, layer_idx: int = 0):
        b, q_len, _ = x.shape
        c_len = ctx.shape[1]
        q = self.q_norm(_on_rows(self.q_proj, x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        q = _apply_rope(q, cos[:, c_len:], sin[:, c_len:])
        k_ctx, v_ctx = self._kv(ctx, cos[:, :c_len], sin[:, :c_len])
        k_blk, v_blk = self._kv(x, cos[:, c_len:], sin[:, c_len:])
        if cache is not None:
            k_ctx, v_ctx = cache.extend(layer_idx, k_ctx, v_ctx)
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        if BlockMask is not None and isinstance(attention_mask, BlockMask):
            out = _flex_attention(q, k, v, attention_mask, self.scaling, self.flex_kernel)
        else:
            out = _dense_attention(q, k, v, attention_mask, self.scaling, self.dense_kv_heads)
        return _on_rows(self.o_proj, out.transpose(1, 2).reshape(b, q_len, -1))


class DraftLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, attention_mask=None, cache=None, layer_idx=0):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, attention_mask, cache, layer_idx)
        return x + _on_rows(self.mlp, self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """Draft model. `forward` returns normalised hidden states of the block positions."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.spec = DraftSpec.from_draft_config(config)
        self.block_size = self.spec.block_size
        self.mask_token_id = self.spec.mask_token_id
        self.target_layer_ids = list(self.spec.target_layer_ids)
        self.layers = nn.ModuleList([DraftLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = FloatRotaryEmbedding(config)
        self.fc = nn.Linear(feature_dims(config), config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float | None = None) -> None:
        std = std if std is not None else getattr(self.config, "initializer_range", 0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, Qwen3RMSNorm):
                nn.init.ones_(module.weight)

    @torch.no_grad()
    def init_from_target(self, tensors: dict, prefix: str = "model.", lift: torch.Tensor | None = None) -> list[int]:
        """Start from the target's own top decoder layers instead of noise.

        Draft layer i takes the weights of target layer L-N+i (Llama and Qwen3 names; a target
        without q_norm/k_norm leaves them at 1), `norm` takes the target's final norm, `fc` starts
        as the identity on the deepest captured feature and `hidden_norm` as the mean input norm of
        the copied layers, so the context keys/values start as those layers' own. Returns the
        target layers copied. `tensors`: the target checkpoint's tensors by name (any superset). A drafter of a
        projected store takes that fc lifted to its r inputs (`lift_fc` with the store basis's `lift`).
        """
        num_target_layers = int(self.config.num_target_layers)
        first = num_target_layers - len(self.layers)
        if first < 0:
            raise ValueError(f"{len(self.layers)} draft layers but the target has only {num_target_layers}")
        own = self.state_dict()
        copied = {}
        for i in range(len(self.layers)):
            for name in own:
                if not name.startswith(f"layers.{i}."):
                    continue
                source = f"{prefix}layers.{first + i}." + name.split(".", 2)[2]
                if source in tensors:
                    if tensors[source].shape != own[name].shape:
                        raise ValueError(
                            f"{source} has shape {tuple(tensors[source].shape)}, draft {name} {tuple(own[name].shape)}"
                        )
                    copied[name] = tensors[source]
        missing = [
            n
            for n in own
            if n.startswith("layers.") and n not in copied and not n.endswith(("q_norm.weight", "k_norm.weight"))
        ]
        if missing:
            raise KeyError(f"the target checkpoint lacks the tensors for draft {missing[:4]}...")
        if f"{prefix}norm.weight" in tensors:
            copied["norm.weight"] = tensors[f"{prefix}norm.weight"]
        hidden = self.config.hidden_size
        fc = torch.zeros(hidden, len(self.target_layer_ids) * hidden, dtype=own["fc.weight"].dtype)
        fc[:, -hidden:] = torch.eye(hidden)
        if own["fc.weight"].shape != fc.shape:
            if lift is None:
                raise ValueError(f"fc reads {own['fc.weight'].shape[1]} projected features: give the basis's lift")
            fc = lift_fc(fc, lift)
        copied["fc.weight"] = fc
        copied["hidden_norm.weight"] = torch.stack(
            [tensors[f"{prefix}layers.{first + i}.input_layernorm.weight"] for i in range(len(self.layers))]
        ).mean(0)
        self.load_state_dict({k: v.to(own[k].dtype) for k, v in copied.items()}, strict=False)
        return list(range(first, num_target_layers))

    def set_attention_kernels(self, *, dense_kv_heads: str = "auto", flex_kernel: str = "auto") -> DFlashDrafter:
        """How every layer's attention runs (the values: `ATTENTION_KERNELS`; auto: by the device at each call):
        `dense_kv_heads` for a dense or no mask (`_dense_attention`), `flex_kernel` for a BlockMask
        (`_flex_attention`). Not saved: a setting of the process, not of the drafter."""
        for name, value in (("dense_kv_heads", dense_kv_heads), ("flex_kernel", flex_kernel)):
            if value not in ATTENTION_KERNELS[name]:
                raise ValueError(f"{name} must be one of {list(ATTENTION_KERNELS[name])}, got {value!r}")
        for layer in self.layers:
            layer.self_attn.dense_kv_heads, layer.self_attn.flex_kernel = dense_kv_heads, flex_kernel
        return self

    def new_cache(self) -> DraftCache:
        return DraftCache(len(self.layers))

    def forward(
        self,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask=None,
        cache: DraftCache | None = None,
    ) -> torch.Tensor:
        """noise_embedding [b, q, H]: embedded block tokens; target_hidden [b, c, n*H]: new
        context features; position_ids [b, c + q]: absolute positions, context then block.
        attention_mask: None (all visible), a bool mask [b|1, 1, q, cache+c+q], or a BlockMask.
        With a cache, the new context K/V are appended to it; the block's are not."""
        ctx = self.hidden_norm(_on_rows(self.fc, target_hidden))
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        x = noise_embedding
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, cos, sin, attention_mask, cache, i)
        return self.norm(x)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def save_pretrained(self, path: str | Path, dtype: torch.dtype | None = None) -> Path:
        """config.json and model.safetensors at `path`, both world-readable (0644; a folder made here 0755):
        safetensors writes its file 0600, which others on a shared cluster could not read."""
        path = Path(path)
        if not path.is_dir():
            path.mkdir(parents=True)
            path.chmod(0o755)
        state = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in self.state_dict().items()}
        config = export_config(self.config)
        config["dtype"] = str(dtype or next(self.parameters()).dtype).removeprefix("torch.")
        tmp = path / "model.safetensors.tmp"
        save_file(state, str(tmp), metadata={"format": "pt"})
        tmp.chmod(0o644)
        tmp.replace(path / "model.safetensors")
        (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (path / "config.json").chmod(0o644)
        return path

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> DFlashDrafter:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"no drafter at {path}: {cfg_file} is missing")
        raw = json.loads(cfg_file.read_text())
        if "speculators_model_type" in raw:  # the peer's format (vLLM's speculators): read as ours, or refused
            raw, state = from_speculators(path)
        else:
            state = load_file(str(path / "model.safetensors"))
        DraftSpec.from_draft_config(raw, where=str(cfg_file))  # refuse a config without geometry, naming the file
        check_derived_keys_agree(raw, where=str(cfg_file))
        model = cls(Qwen3Config.from_dict(raw))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"{path}: drafter weights do not match its config: missing {missing}, unexpected {unexpected}"
            )
        return model.to(device=device, dtype=dtype).eval()
