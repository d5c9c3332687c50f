"""Exact verification: a k-token forward that gives bit for bit the logits of k one-token forwards, on any device.

Neither holds by itself on a CPU or a GPU: a GEMM over 1 row and over 16 rows may take different kernels whose
results differ in the last bit, and so does attention over 1 vs k queries, and so does a reduction over the last
dim (an RMSNorm's mean of squares): CUDA's reduce kernel picks its block shape, and with it the order in which a
row's terms are summed, by the number of rows. `make_verification_exact` therefore tiles every linear layer (a short
tile zero-padded to the rows whose kernel every longer tile shares, `exact_base_rows`, probed on the weights' own
device), runs attention one query row at a time (`rowwise_attention`), both through the same torch calls a
one-token step makes on that device, and sums each RMSNorm's squares in a fixed order (`fixed_order_sum`).

Why a fixed-order sum for the norms rather than fixed row tiles (running the device's reduce on tiles of exactly T
zero-padded rows, so that it always sees one shape): the sum is built from elementwise adds of two float32 numbers,
each correctly rounded on every device whatever the launch configuration, so a row's bits depend on nothing but
the row, by construction, and the CPU tests run the very order a GPU runs. Fixed tiles would rely on a property of
the kernel, not of this code: that it sums a row in the same order wherever the row sits in the tile (CUDA's
vectorized loads, for one, start by each row's alignment); and a prefill of n rows would run as n/T tiles, a Python
loop of launches per norm and layer. The fixed-order sum costs about log2(width) small elementwise launches a norm
call, whatever the number of rows.

Only RMSNorms of the T5 formula (`T5_RMS_NORMS`: Llama, Qwen2/3, Qwen3-MoE, Mistral, Qwen3-VL text) are rewritten;
a model holding any other normalization (Gemma's 1 + weight, LayerNorm, ...) is refused by class name rather than
left row-count dependent. (Qwen3-MoE's router and experts call F.linear on their own parameters, not nn.Linear
layers, and are not tiled.) Target logits need nothing more on the exact (greedy) path: it reduces them only by argmax,
which is exact in any order (a max, ties to the first index on every device). Used by the harness (`eval.exact`,
`resolve_exact`) and the benchmarks.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from flashdraft.target.cpu import cpu_has_bf16_tiles

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
        return [
            (e, visible[0, i, :e].nonzero()[:, 0] if h else None, False)
            for i, (e, h) in enumerate(zip(ends, hiding[0].tolist()))
        ]
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


def rowwise_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, compute_dtype=None, **kwargs
):
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
        out.append(
            F.scaled_dot_product_attention(
                query[:, :, i : i + 1],
                k,
                v,
                attn_mask=attention_mask[:, :, i : i + 1, :end] if masked else None,
                scale=scaling,
                enable_gqa=query.shape[1] != key.shape[1],
            )
        )
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
        w.scatter_(
            1,
            at,
            torch.cat([torch.full((n, pairs), big, device=device), torch.full((n, pairs), -big, device=device)], 1),
        )
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
    key (`_probe_inputs`): 1 where one kernel serves every row count (a plain step then runs unpadded), up to
    `tile` where a 1-row GEMM takes another kernel (bf16 on Intel AMX, for one)."""
    key = (
        tuple(weight.shape),
        weight.stride(),
        weight.dtype,
        weight.device.type,
        bias,
        tile,
        torch.get_num_threads(),
        linear,
    )
    if key not in _EXACT_BASE_ROWS:
        g = torch.Generator(device=weight.device).manual_seed(0)
        base = 1
        with torch.no_grad():
            for cancelling in (False, True):
                w, b, x = _probe_inputs(weight, bias, tile, cancelling, g)
                calls = {m: linear(x[:m], w, b) for m in range(base, tile + 1)}
                base = next(n for n in range(base, tile + 1) if _kernel_shared(linear, x, w, b, calls, n, tile))
        _EXACT_BASE_ROWS[key] = base
    return _EXACT_BASE_ROWS[key]


def _kernel_shared(linear, x, w, b, calls: dict, base: int, tile: int) -> bool:
    """Whether each probe row, zero-padded to `base` rows, gets the bits it gets in every call of `calls` (row
    count -> output) from `base` rows on that holds it."""
    for i in range(tile):
        alone = linear(F.pad(x[i : i + 1], (0, 0, 0, base - 1)), w, b)[0]
        if not all(torch.equal(calls[m][i], alone) for m in range(max(base, i + 1), tile + 1)):
            return False
    return True


def _base_rows(linear: nn.Linear) -> int:
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


# RMSNorm classes whose forward is T5's: x in float32, variance = mean of x^2 over the last dim,
# x * rsqrt(variance + variance_epsilon), then weight * x in the input dtype (transformers 5.x).
T5_RMS_NORMS = frozenset(
    {
        "LlamaRMSNorm",
        "MistralRMSNorm",
        "Qwen2RMSNorm",
        "Qwen3RMSNorm",
        "Qwen3MoeRMSNorm",
        "Qwen3VLTextRMSNorm",
        "Qwen3VLMoeTextRMSNorm",
    }
)


def fixed_order_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum over the last dim (kept, size 1) in one fixed order on every device and for any number of rows:
    zero-padded to a power of two, then halved: the first half plus the second, elementwise, until one column is
    left. Each step is an elementwise add, which every device rounds alike whatever its launch shape; the device's
    reduce kernel would pick the order of a row's terms by the number of rows (CUDA's block shape)."""
    size = 1 << (x.shape[-1] - 1).bit_length()
    if size != x.shape[-1]:
        x = F.pad(x, (0, size - x.shape[-1]))  # +0.0 terms change no sum
    while size > 1:
        size //= 2
        x = x[..., :size] + x[..., size:]
    return x


def _exact_rms_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """T5's RMSNorm (`T5_RMS_NORMS`) with the mean of squares summed by `fixed_order_sum`: a row's output does not
    depend on how many rows share the call."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = fixed_order_sum(hidden_states.pow(2)) / hidden_states.shape[-1]
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


def _is_normalization(module: nn.Module) -> bool:
    """A module that reduces over its input's rows to normalize them: torch's own norms, or a class named so."""
    torch_norms = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase)
    return isinstance(module, torch_norms) or "norm" in type(module).__name__.lower()


def make_norms_exact(model) -> int:
    """Give every RMSNorm of `model` the fixed-order forward (`_exact_rms_norm`); returns how many. Any other
    normalization is refused by name: its reduction would keep an order that depends on the row count."""
    norms = []
    for name, module in model.named_modules():
        if type(module).__name__ in T5_RMS_NORMS and hasattr(module, "variance_epsilon"):
            norms.append(module)
        elif _is_normalization(module):
            raise ValueError(
                f"exact verification cannot make {name or 'the model'} ({type(module).__name__}) row-count "
                f"invariant: only T5-style RMSNorms ({', '.join(sorted(T5_RMS_NORMS))}) are rewritten with a "
                "fixed-order sum; this norm would keep the device's reduction, whose order depends on the rows"
            )
    for module in norms:
        module.forward = _exact_rms_norm.__get__(module)
    return len(norms)


def make_verification_exact(model, rows: int = 16, fp32_attention: bool | None = None):
    """Make a k-token forward (any k) give bit for bit the logits of k one-token forwards.

    Every linear layer runs on tiles of at most `rows` rows, a short one zero-padded to the fewest rows whose
    kernel every longer tile shares (`exact_base_rows`, probed per shape), attention goes row by row
    (`rowwise_attention`) and every RMSNorm sums its squares in a fixed order (`make_norms_exact`; a model with
    another kind of norm is refused before anything is changed). Longer inputs (prefills) run tile by tile, so they
    are exact too: transformers' prompt lookup verifies its first candidates inside the prefill.

    `fp32_attention` (None: `upcasts_attention`) runs a low-precision model's row-wise attention in float32: on CPUs
    without AMX, bf16 SDPA costs several times a float32 call for one query row, and a verify forward makes one call
    per row and layer."""
    make_norms_exact(model)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.exact_rows = rows
            module.forward = _row_exact_linear.__get__(module)
            module._exact_base = torch.get_num_threads(), _base_rows(module)
    if fp32_attention is None:
        fp32_attention = upcasts_attention(model.device)
    upcast = fp32_attention and model.dtype != torch.float32
    model.config._attn_implementation = EXACT_ATTENTION_FP32 if upcast else EXACT_ATTENTION
    return model


def upcasts_attention(device) -> bool:
    """Whether row-wise attention runs in float32 by default on `device`: on CPUs without AMX bf16 tiles (there
    float32 SDPA is the faster one for one query row); never on a GPU, whose bf16 kernels are the fast ones."""
    return torch.device(device).type == "cpu" and not cpu_has_bf16_tiles()


def exact_gemm_rows(model) -> dict[str, int]:
    """Per linear shape ("in->out") of a model made exact, the rows a shorter tile is padded to (`exact_base_rows`)."""
    return {
        f"{m.weight.shape[1]}->{m.weight.shape[0]}": m._exact_base[1]
        for m in model.modules()
        if hasattr(m, "_exact_base")
    }


EXACT_SETTINGS = ("auto", "on", "off")


def needs_exact_verification(dtype: torch.dtype, device) -> bool:
    """Whether greedy speculative output needs `make_verification_exact` to equal plain greedy decoding token for
    token on `device` in `dtype`. Every device and dtype do: on a CPU, bf16 SDPA and eager attention flip argmaxes
    after a few hundred tokens and some CPUs' float32 GEMMs give a row other bits next to other rows than alone; on
    CUDA a one-token step and a k-token verify take other GEMM tiles (cuBLAS picks them by row count) and other
    attention kernels (flash/memory-efficient SDPA by query count), which in bf16 part greedy outputs after near-ties
    and in float32 reorder sums as well."""
    torch.device(device)  # a bad device name fails here, by name
    return True


def resolve_exact(setting: str, dtype: torch.dtype, device, *, greedy: bool) -> tuple[bool, str]:
    """(exact verification on?, why) for `eval.exact` = auto | on | off. auto: on where greedy decoding is compared
    token for token with plain decoding and the device needs it (`needs_exact_verification`: every device and dtype
    today); off when sampling, where outputs are compared in distribution, never token for token, so the target's own
    kernels decode as a user's would. on/off: as set (off: every method runs the target's own kernels, the speed a
    user gets; greedy outputs may then part from plain decoding's at a near-tie)."""
    setting = str(setting).lower()
    if setting not in EXACT_SETTINGS:
        raise ValueError(f"eval.exact must be one of {', '.join(EXACT_SETTINGS)}, got {setting!r}")
    if setting != "auto":
        return setting == "on", f"eval.exact={setting}"
    device = torch.device(device)
    if not greedy:
        return False, "auto: sampling (outputs compared in distribution, not token for token)"
    exact = needs_exact_verification(dtype, device)
    return exact, f"auto: greedy on {device.type} in {str(dtype).removeprefix('torch.')}"
