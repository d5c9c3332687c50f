"""Exact verification on the device it is given: is a k-token verify the k one-token steps bit for bit, are the
norms' rows invariant across batch sizes, and what exactness costs a step and a verify.

Three copies of the target on `--device` (auto: cuda when present) in `--dtype` (auto: what the harness picks):
as loaded (plain GEMMs, SDPA, the device's reductions), exact without its norms (tiled GEMMs and row-wise attention
only: exact mode before its norms were made exact) and exact (`make_verification_exact`). Prints

- per norm of the target (hidden-state norms, Qwen3's per-head q/k norms), in the model's dtype and in float32:
  how many rows of a call over 1..16 tokens differ from the same row alone, as loaded and exact;
- per copy: for how many k in 1..16 a k-token forward over a cache gives bit for bit the logits of k one-token
  forwards (exact: every k, on every device; the others: wherever the device's kernels change with the rows);
- median one-token step and `--verify-rows`-row verify times, and their ratios.

The target: `--model` (default the embedded SmolLM2-135M, no download) or `--tiny qwen3 | llama | qwen3-8b`, random
weights built from a config on the device (qwen3-8b: Qwen3-8B's shapes, `--layers` of its 36). Context: random
token ids. `--json PATH` also writes the figures. Runs on a CPU (`--device cpu`) and on CUDA alike."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from flashdraft.target import load_target, make_norms_exact, make_verification_exact, resolve_dtype
from flashdraft.target.exact import T5_RMS_NORMS
from harness.speculative import cache_kwarg, clock

TINY = {  # name: (family, config keywords)
    "qwen3": ("qwen3", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4)),
    "llama": ("llama", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4)),
    "qwen3-8b": (
        "qwen3",
        dict(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            rope_theta=1e6,
            max_position_embeddings=40960,
        ),
    ),
}


def tiny_target(name: str, layers: int | None, dtype: torch.dtype, device: torch.device):
    """A target of random weights (seed 0) built from a config straight on `device` in `dtype`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    family, kw = TINY[name]
    kw = {"vocab_size": 1024, "num_key_value_heads": 2, "max_position_embeddings": 2048, **kw}
    if layers:
        kw["num_hidden_layers"] = layers
    config = (Qwen3Config if family == "qwen3" else LlamaConfig)(**kw)
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = (Qwen3ForCausalLM if family == "qwen3" else LlamaForCausalLM)(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.eval().requires_grad_(False)


def norms_as_loaded(model):
    """Exact mode without its norms: the RMSNorms `make_verification_exact` rewrote get their own forward back."""
    for module in model.modules():
        if type(module).__name__ in T5_RMS_NORMS:
            vars(module).pop("forward", None)
    return model


def norm_pairs(model) -> dict[str, tuple]:
    """Per distinct RMSNorm of `model` (class and width): (the module, the rows a token gives it: 1 for a hidden-state
    norm, the query heads for Qwen3's per-head q/k norms)."""
    heads = {getattr(model.config, "head_dim", None): model.config.num_attention_heads, model.config.hidden_size: 1}
    pairs = {}
    for module in model.modules():
        if type(module).__name__ in T5_RMS_NORMS:
            width = module.weight.shape[0]
            pairs.setdefault(f"{type(module).__name__}[{width}]", (module, heads.get(width, 1)))
    return pairs


def norm_rows(model, dtype: torch.dtype, tokens: int = 16) -> dict[str, dict]:
    """Per norm of `norm_pairs`, a copy as loaded and a copy made exact (`make_norms_exact`), weights in `dtype`: the
    rows of calls over the first n tokens (n = 1..`tokens`) whose output differs from the row's output alone."""
    out = {}
    g = torch.Generator(device=model.device).manual_seed(0)
    for key, (norm, per_token) in norm_pairs(model).items():
        width = norm.weight.shape[0]
        x = torch.randn(tokens, 1, per_token, width, generator=g, device=model.device).mul(3).to(dtype)
        counts = {}
        for label in ("as loaded", "exact"):
            twin = type(norm)(width, eps=norm.variance_epsilon).to(device=model.device, dtype=dtype)
            twin.weight.copy_(norm.weight)
            if label == "exact":
                make_norms_exact(twin)
            alone = torch.cat([twin(x[i : i + 1]) for i in range(tokens)])
            counts[label] = sum(int((twin(x[:n]) != alone[:n]).any(-1).sum()) for n in range(1, tokens + 1))
        out[key] = {**counts, "rows": per_token * tokens * (tokens + 1) // 2}
    return out


def exact_ks(model, context: torch.Tensor, max_rows: int = 16) -> list[int]:
    """The k in 1..`max_rows` for which a k-token forward over a cache of the context gives bit for bit the logits
    of k one-token forwards."""
    kv = {cache_kwarg(model): DynamicCache(config=model.config), "use_cache": True}
    start = context.shape[1] - max_rows
    model(context[:, :start], **kv)
    ok = []
    for k in range(1, max_rows + 1):
        block = model(context[:, start : start + k], **kv).logits[0]
        kv[cache_kwarg(model)].crop(-k)
        steps = [model(context[:, t : t + 1], **kv).logits[0, -1] for t in range(start, start + k)]
        kv[cache_kwarg(model)].crop(-k)
        if torch.equal(block, torch.stack(steps)):
            ok.append(k)
    return ok


def forward_ms(copies: dict, context: torch.Tensor, rows: int, repeats: int) -> dict[str, float]:
    """Per copy, the median ms of a `rows`-token forward over a cache of the rest of the context (cropped back after
    each). The copies take turns, forward by forward, so that a drift in the machine's load hits them alike."""
    start = context.shape[1] - rows
    caches = {}
    for name, model in copies.items():
        caches[name] = DynamicCache(config=model.config)
        model(context[:, :start], **{cache_kwarg(model): caches[name]}, use_cache=True)
    times = {name: [] for name in copies}
    for i in range(repeats + 2):  # two warm-ups
        for name, model in copies.items():
            t0 = clock(model.device)
            model(context[:, start:], **{cache_kwarg(model): caches[name]}, use_cache=True)
            if i >= 2:
                times[name].append(1000 * (clock(model.device) - t0))
            caches[name].crop(-rows)
    return {name: statistics.median(ts) for name, ts in times.items()}


class OpCount(TorchDispatchMode):
    """Counts the aten ops that compute (views left out): about the kernels a GPU launches, whose launch cost
    dominates a small verify forward there."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


def ops_per_forward(model, context: torch.Tensor, rows: int) -> int:
    """Aten ops (`OpCount`) of a `rows`-token forward over a cache of the rest of the context."""
    cache = DynamicCache(config=model.config)
    model(context[:, :-rows], **{cache_kwarg(model): cache}, use_cache=True)
    with OpCount() as count:
        model(context[:, -rows:], **{cache_kwarg(model): cache}, use_cache=True)
    return count.ops


def build_copies(args, dtype, device) -> dict:
    def build():
        if args.tiny:
            return tiny_target(args.tiny, args.layers, dtype, device)
        return load_target(args.model, dtype=dtype, device=device)[0]

    return {
        "as loaded": build(),
        "exact, norms as loaded": norms_as_loaded(make_verification_exact(build())),
        "exact": make_verification_exact(build()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, cuda:1, ...")
    ap.add_argument("--model", default="smollm2-135m", help="a target name or folder (ignored with --tiny)")
    ap.add_argument("--tiny", choices=sorted(TINY), default=None, help="random weights built from a config")
    ap.add_argument("--layers", type=int, default=None, help="--tiny: decoder layers (default the config's)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--context", type=int, default=256, help="tokens in the cache before the verified ones")
    ap.add_argument("--verify-rows", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=10, help="timed forwards per copy and kind")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = resolve_dtype(args.dtype, device)
    t0 = time.perf_counter()
    copies = build_copies(args, dtype, device)
    loaded = copies["as loaded"]
    vocab = loaded.config.vocab_size
    g = torch.Generator(device=device).manual_seed(1)
    context = torch.randint(0, vocab, (1, args.context + 16), generator=g, device=device)
    result = {
        "target": args.tiny or args.model,
        "layers": loaded.config.num_hidden_layers,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu, {torch.get_num_threads()} threads",
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "build_s": round(time.perf_counter() - t0, 1),
    }
    with torch.inference_mode():
        result["norm_rows"] = {
            str(d).removeprefix("torch."): norm_rows(loaded, d) for d in dict.fromkeys([dtype, torch.float32])
        }
        result["exact_k"] = {name: exact_ks(model, context) for name, model in copies.items()}
        steps = forward_ms(copies, context, 1, args.repeats)
        verify = forward_ms(copies, context, args.verify_rows, args.repeats)
        result["ms"] = {name: {"step": steps[name], "verify": verify[name]} for name in copies}
        result["ops"] = {
            name: {
                "step": ops_per_forward(model, context, 1),
                "verify": ops_per_forward(model, context, args.verify_rows),
            }
            for name, model in copies.items()
        }
    report(result, args.verify_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def report(result: dict, verify_rows: int) -> None:
    print(
        f"{result['target']} ({result['layers']} layers) {result['dtype']} on {result['device']}, "
        f"torch {result['torch']}"
    )
    for dtype, norms in result["norm_rows"].items():
        for key, c in norms.items():
            print(
                f"  norm rows differing from alone, inputs {dtype:8s} {key:28s} as loaded {c['as loaded']:5d}, "
                f"exact {c['exact']:5d} of {c['rows']}"
            )
    for name, ks in result["exact_k"].items():
        differ = [k for k in range(1, 17) if k not in ks]
        print(
            f"  k-token verify == k one-token steps, bit for bit: {name:24s} {len(ks):2d} of 16 k"
            + (f" (differs at k = {differ})" if differ else "")
        )
    base = result["ms"]["as loaded"]
    for name, ms in result["ms"].items():
        ops = result["ops"][name]
        print(
            f"  {name:24s} step {ms['step']:8.2f} ms ({ms['step'] / base['step']:.2f}x as loaded, {ops['step']} ops)   "
            f"{verify_rows}-row verify {ms['verify']:8.2f} ms ({ms['verify'] / base['verify']:.2f}x as loaded, "
            f"{ms['verify'] / ms['step']:.2f} steps, {ops['verify']} ops)"
        )
    exact, without = result["ms"]["exact"], result["ms"]["exact, norms as loaded"]
    ops, ops_without = result["ops"]["exact"], result["ops"]["exact, norms as loaded"]
    print(
        f"  exact norms cost, over exact mode without them: step {exact['step'] / without['step']:.2f}x time, "
        f"{ops['step'] / ops_without['step']:.2f}x ops; verify {exact['verify'] / without['verify']:.2f}x time, "
        f"{ops['verify'] / ops_without['verify']:.2f}x ops"
    )


if __name__ == "__main__":
    main()
