"""A paper-shape check for one GPU: a Qwen3-8B-shaped target and its 5-layer DFlash drafter with random weights made
on the device (no download: nothing but this checkout travels), through the pipeline's, the trainer's and the
harness's own code, measured:

  capture     tokens/s of the pipeline's continuous decode in regenerate mode (`regenerate_stream`, the decode batch
              and prefill budget sized from free memory as `data.batch_size=auto` sizes them), and of capture-only
              mode (`capture`: one left-padded prefill a group, grouped by the same prefill budget)
  verify      the cost of a speculative round's verify forward (block-size rows over a cached context) and of a
              plain one-token step, as loaded and made exact (`make_verification_exact`), whether the exact copy's
              verify gives the logits of its one-token steps bit for bit, and what making it exact cost (its probes)
  train       one trainer step at paper shapes (a max-length sequence with its anchors x block size, the DeepSpeed
              engine in bf16, ZeRO-2, compiled on a GPU), FlexAttention against dense attention, step time and
              peak memory; an attention kind that runs out of memory is reported as such
Each part records its wall time and peak GPU memory (allocated, reserved) and the process's peak host memory. The JSON
(--out) is rewritten after every part, so a later failure keeps the earlier figures; a failure is recorded as
"error" and the exit status is 1.

    python jobs/gpu_paper_shapes.py --out paper.json                 # on a GPU: --scale paper
    python jobs/gpu_paper_shapes.py --scale tiny --out tiny.json     # the same code at toy sizes, on a CPU too
    python jobs/gpu_paper_shapes.py --scale paper --layers 4 ...     # any size overridden

Time on one H100, the arithmetic behind the defaults (paper scale): Qwen3-8B has 8.2B parameters, 16.4 GB in bf16,
made by a normal_ fill on the device in seconds. Regenerate: 256 prompts of 256-512 tokens, 128 new tokens each
(32,768 new tokens; a decode step of 256 rows reads the 16 GB of weights once, ~10-20 ms with HF's eager decoder)
~10 s. Capture-only: 64 sequences of 1,024-2,048 tokens (~98,000 tokens, ~16 GFLOP a token, a few seconds at a few
hundred TFLOP/s). Verify: 16-row verify and one-token steps, 10 each, as loaded and exact; making it exact probes
each linear shape on random weights (the head's probe holds ~15 GB for a moment) ~10-20 s. Train: a 1.05B-parameter
drafter (5 layers + fc) in ZeRO-2 bf16 holds ~17 GB of weights, gradients and AdamW state; one step of 3,072 context
+ 8,192 block tokens (~80 TFLOP with the 151,936-word head) ~0.3 s, the first one with torch.compile 1-2 min. The
whole check ~3-4 min, the rest of jobs/gpu_smoke.sh ~4 min: under 10 minutes together. For comparison, a patched
SGLang capture server sustains ~27,000 prefill tokens/s on one H200 for Qwen3-8B (SpecForge's published benchmark).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Qwen3-8B's published config.json (Qwen/Qwen3-8B): 36 layers, hidden 4096, 32 query and 8 KV heads of 128, MLP
# 12288, vocabulary 151936, RoPE base 1e6, RMSNorm eps 1e-6, untied head. Its drafter: 5 layers, block 16, the
# reference's layer ids [1, 9, 17, 25, 33]; the paper's recipe: 512 anchors a sequence of at most 3072 tokens.
SCALES = {
    "paper": dict(
        layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151936,
        draft_layers=5, block=16, anchors=512, max_length=3072, regen_prompts=256, prompt_len=512, new_tokens=128,
        prefill_seqs=64, prefill_len=2048, verify_context=1024, repeats=10, train_steps=5, batch=0, prefill_tokens=0,
    ),
    "tiny": dict(
        layers=8, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=1024,
        draft_layers=2, block=16, anchors=16, max_length=320, regen_prompts=12, prompt_len=48, new_tokens=16,
        prefill_seqs=8, prefill_len=128, verify_context=64, repeats=3, train_steps=2, batch=4, prefill_tokens=512,
    ),
}  # fmt: skip
# batch, prefill_tokens: 0 sizes them from the free GPU memory as the pipeline's `auto` does (flashdraft.target.memory).
ANCHOR = {"sglang_capture_prefill_tokens_per_s": 27000, "on": "one H200, Qwen3-8B", "source": "SpecForge benchmark"}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", choices=sorted(SCALES), default="paper", help="the sizes below, unless given")
    ap.add_argument("--device", default="auto", help="cuda | cpu | auto (cuda where torch sees a GPU)")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on a GPU, float32 on a CPU")
    ap.add_argument("--out", type=Path, help="the JSON (also printed)")
    ap.add_argument("--parts", default="capture,verify,train", help="which parts, comma-separated")
    ap.add_argument("--compile", default="auto", help="the drafter compiled for training (auto: on a GPU)")
    ap.add_argument(
        "--engine",
        choices=["deepspeed", "torch"],
        default="deepspeed",
        help="the trainer's DeepSpeed engine, or a bare fused AdamW (no DeepSpeed op build on a CPU)",
    )
    for name, value in SCALES["paper"].items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None)
    args = ap.parse_args(argv)
    for name, value in SCALES[args.scale].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.compile == "auto":
        args.compile = str(args.device == "cuda").lower()
    return args


# --- measuring -----------------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Part:
    """`with Part(result, name, device) as fig:` fills `fig` (a dict put at result[name]) and adds the part's wall
    time, its peak GPU memory and the process's peak host memory so far."""

    def __init__(self, result: dict, name: str, device: torch.device):
        self.fig, self.device = result.setdefault(name, {}), device

    def __enter__(self) -> dict:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        self.t0 = time.perf_counter()
        return self.fig

    def __exit__(self, *exc) -> None:
        sync(self.device)
        self.fig["wall_s"] = round(time.perf_counter() - self.t0, 2)
        if self.device.type == "cuda":
            self.fig["peak_gpu_gib"] = {
                "allocated": round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2),
                "reserved": round(torch.cuda.max_memory_reserved(self.device) / 2**30, 2),
            }
        self.fig["peak_host_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def median_ms(fn, repeats: int, device: torch.device) -> float:
    """The median wall time of `fn()` over `repeats` calls, after one untimed call, in milliseconds."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(times), 3)


# --- the target and its drafter ------------------------------------------------------------------------------------


def target_config(args):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )


def build_target(config, device: torch.device, dtype: torch.dtype):
    """Qwen3ForCausalLM with random weights made where it runs (transformers' own init, on the device)."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def draft_spec(args):
    """The drafter the trainer would make for this target: the reference's layer ids, block size, depth; the mask
    token the last row of the vocabulary (random weights: any row does)."""
    from flashdraft.spec import DraftSpec, default_layer_ids

    layer_ids = default_layer_ids(args.layers)
    return DraftSpec(layer_ids, mask_token_id=args.vocab - 1, block_size=args.block, num_draft_layers=args.draft_layers)


def random_prompts(n: int, longest: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of random tokens, between half of `longest` and `longest` long (not one length: the batch pads)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(1, longest // 2), longest + 1, n)
    return [rng.integers(0, vocab - 1, int(s)).tolist() for s in lengths]


# --- capture ---------------------------------------------------------------------------------------------------------


def budgets(model, args, device: torch.device, max_length: int, mode: str) -> tuple[int, int | None, list[str]]:
    """(decode rows, prefill token budget, the lines saying why): --batch / --prefill-tokens where given, else as the
    pipeline's worker sizes them (`flashdraft.target.budgets.capture_budgets`, `data.batch_size=auto`,
    `data.prefill_tokens=auto`): on a GPU from its free memory, on a CPU the worker's fixed defaults."""
    from flashdraft.target.budgets import capture_budgets
    from flashdraft.target.memory import DEFAULT_FRACTION

    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    return capture_budgets(
        free,
        model.config,
        model.dtype,
        mode=mode,
        batch_size=args.batch or "auto",
        prefill_tokens=args.prefill_tokens or "auto",
        max_length=max_length,
        fraction=DEFAULT_FRACTION,
        captured_layers=len(draft_spec(args).target_layer_ids),
    )


def capture_regenerate(model, args, layer_ids: list[int], fig: dict, device: torch.device) -> None:
    """The pipeline's continuous decode over random prompts (a random target never stops early: every sequence runs
    to --new-tokens), features captured and copied to the host; counted as the pipeline counts: new tokens/s."""
    from pipeline.decode import regenerate_stream

    prompts = random_prompts(args.regen_prompts, args.prompt_len, args.vocab)
    rows, prefill, lines = budgets(model, args, device, args.prompt_len + args.new_tokens, "regenerate")
    options = dict(stop_ids=[], pad_id=0, batch_size=rows, prefill_tokens=prefill)
    for _ in regenerate_stream(model, prompts[:2], layer_ids, max_new_tokens=2, **options):
        pass  # warm-up: kernels chosen, caches allocated
    sync(device)
    t0, new, total = time.perf_counter(), 0, 0
    for _, captured in regenerate_stream(model, prompts, layer_ids, max_new_tokens=args.new_tokens, **options):
        new += int(captured.loss_mask.sum())
        total += len(captured.input_ids)
    sync(device)
    seconds = time.perf_counter() - t0
    fig.update(prompts=len(prompts), batch_rows=rows, prefill_tokens=prefill, budget=lines, new_tokens=new)
    fig.update(tokens=total, seconds=round(seconds, 2), new_tokens_per_s=round(new / seconds))
    fig["tokens_per_s"] = round(total / seconds)


def capture_prefill(model, args, layer_ids: list[int], fig: dict, device: torch.device) -> None:
    """Capture-only mode: complete sequences prefilled in groups of at most the prefill budget (padding included),
    sorted by length as the worker sorts them; features copied to the host."""
    from pipeline.capture import capture, token_batches

    seqs = sorted(random_prompts(args.prefill_seqs, args.prefill_len, args.vocab, seed=1), key=len)
    masks = [[i >= len(s) // 4 for i in range(len(s))] for s in seqs]  # a prompt, then the response
    _, prefill, lines = budgets(model, args, device, args.prefill_len, "capture")
    groups = token_batches([len(s) for s in seqs], prefill)
    capture(model, seqs[:1], masks[:1], layer_ids, pad_id=0)  # warm-up
    sync(device)
    t0, tokens = time.perf_counter(), 0
    for group in groups:
        out = capture(model, [seqs[i] for i in group], [masks[i] for i in group], layer_ids, pad_id=0)
        tokens += sum(len(c.input_ids) for c in out)
    sync(device)
    seconds = time.perf_counter() - t0
    fig.update(sequences=len(seqs), prefill_tokens=prefill, budget=lines, groups=len(groups), tokens=tokens)
    fig.update(seconds=round(seconds, 2), tokens_per_s=round(tokens / seconds))


# --- verify ----------------------------------------------------------------------------------------------------------


@torch.inference_mode()
def round_costs(model, context: torch.Tensor, rows: int, repeats: int, device: torch.device) -> dict:
    """Over a cache of `context` but its last `rows` tokens: the median ms of a `rows`-token verify forward and of a
    one-token step, and whether the verify's logits equal those of `rows` one-token steps bit for bit."""
    from transformers import DynamicCache

    from harness.speculative import cache_kwarg

    n, kw = context.shape[1], cache_kwarg(model)
    cache = DynamicCache(config=model.config)
    model(context[:, : n - rows], **{kw: cache}, use_cache=True, logits_to_keep=1)

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens, **{kw: cache}, use_cache=True).logits[0]
        cache.crop(-tokens.shape[1])
        return logits

    verify_ms = median_ms(lambda: forward(context[:, n - rows :]), repeats, device)
    step_ms = median_ms(lambda: forward(context[:, n - rows : n - rows + 1]), repeats, device)
    block = forward(context[:, n - rows :])
    steps = []
    for t in range(n - rows, n):  # one token at a time, each kept in the cache for the next
        steps.append(model(context[:, t : t + 1], **{kw: cache}, use_cache=True).logits[0, -1])
    cache.crop(-rows)
    return {"verify_ms": verify_ms, "step_ms": step_ms, "verify_equals_steps": torch.equal(block, torch.stack(steps))}


def verify_costs(model, args, fig: dict, device: torch.device) -> None:
    """A speculative round's verify (block-size rows) and a plain step, as loaded, then made exact (in place)."""
    from flashdraft.target import exact_gemm_rows, make_verification_exact

    g = torch.Generator(device="cpu").manual_seed(2)
    context = torch.randint(0, args.vocab - 1, (1, args.verify_context + args.block), generator=g).to(device)
    fig["rows"], fig["context"] = args.block, args.verify_context
    fig["as_loaded"] = round_costs(model, context, args.block, args.repeats, device)
    sync(device)
    t0 = time.perf_counter()
    make_verification_exact(model)
    sync(device)
    fig["make_exact_s"] = round(time.perf_counter() - t0, 2)
    fig["exact_gemm_rows"] = exact_gemm_rows(model)
    fig["exact"] = round_costs(model, context, args.block, args.repeats, device)
    fig["exact_over_as_loaded"] = round(fig["exact"]["verify_ms"] / fig["as_loaded"]["verify_ms"], 2)


# --- train -----------------------------------------------------------------------------------------------------------


class BareEngine:
    """The calls a trainer step makes on DeepSpeed's engine, over the module and a fused AdamW (--engine torch: no
    DeepSpeed op to build, for quick CPU rehearsals)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=6e-4, betas=(0.9, 0.95), fused=True)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def compile(self, compile_kwargs: dict) -> None:
        self.module = torch.compile(self.module, **compile_kwargs)


def make_engine(drafter, args, dtype: torch.dtype, device: torch.device):
    """The trainer's engine (trainer.engine.build_engine: DeepSpeed ZeRO-2, torch's fused AdamW, bf16 on a GPU) with
    the paper recipe's optimizer settings, compiled as the trainer compiles it (train.compile)."""
    if args.engine == "torch":
        engine = BareEngine(drafter.to(device, dtype))
    else:
        from trainer.engine import build_engine, init_distributed, setup_distributed_env

        setup_distributed_env()
        init_distributed(device)
        engine, _ = build_engine(
            drafter, lr=6e-4, weight_decay=0.0, betas=(0.9, 0.95), warmup_steps=1, total_steps=1000, zero_stage=2,
            grad_accum=1, grad_clip=1.0, bf16=dtype == torch.bfloat16,
        )  # fmt: skip
    if args.compile == "true":
        engine.compile(compile_kwargs={"dynamic": True})
    return engine


def paper_batch(args, spec):
    """One micro-batch as the trainer's loader makes it (trainer.batch.collate): a --max-length sequence of random
    tokens and features, the loss on all but its first eighth (the prompt), --anchors anchors drawn as the trainer
    draws them."""
    from trainer.anchors import draw_anchors
    from trainer.batch import collate
    from trainer.loss import default_gamma

    rng = np.random.default_rng(3)
    s = args.max_length
    mask = np.arange(s) >= s // 8
    seq = SimpleNamespace(
        seq_id="paper-shapes",
        input_ids=rng.integers(0, args.vocab - 1, s),
        loss_mask=mask,
        features=torch.randn(s, len(spec.target_layer_ids) * args.hidden, generator=torch.Generator().manual_seed(3)),
    )
    anchors = draw_anchors(mask, args.block, args.anchors, seed=0, epoch=0, seq_id=seq.seq_id)
    return collate([(seq, anchors)], args.block, spec.mask_token_id, default_gamma(args.block))


def train_kind(engine, head, batch, kind: str, args, fig: dict, device: torch.device) -> None:
    """Trainer steps with `kind` attention: the first (compilation included) timed alone, then the median of
    --train-steps. Out of memory is reported in the figures, not raised."""
    from trainer.objective import forward_loss

    def step() -> None:
        loss, _ = forward_loss(engine, head, batch, block_size=args.block, attention=kind, ce_chunk=2048)
        engine.backward(loss)
        engine.step()

    try:
        t0 = time.perf_counter()
        step()
        sync(device)
        fig["first_step_s"] = round(time.perf_counter() - t0, 2)
        fig["step_ms"] = median_ms(step, args.train_steps, device)
    except torch.cuda.OutOfMemoryError as e:
        fig["error"] = f"out of memory: {str(e).splitlines()[0]}"
        return
    per_s = 1000 / fig["step_ms"]
    fig["context_tokens_per_s"] = round(batch.context_len * per_s)
    fig["block_tokens_per_s"] = round(batch.anchors.numel() * args.block * per_s)


def train_steps(head, args, result: dict, dtype: torch.dtype, device: torch.device) -> None:
    """The drafter the trainer would make for this target, one paper-shape micro-batch, flex then dense attention
    through one engine (the compiled graph recompiles for the other mask)."""
    from flashdraft.model import DFlashDrafter

    spec = draft_spec(args)
    torch.manual_seed(0)
    with torch.device(device):
        drafter = DFlashDrafter(spec.draft_config(target_config(args)))
    batch = paper_batch(args, spec).to(device, dtype)
    train = result.setdefault("train", {})
    train.update(drafter_parameters=sum(p.numel() for p in drafter.parameters()), engine=args.engine)
    train.update(compile=args.compile == "true", context_tokens=batch.context_len, anchors=batch.anchors.shape[1])
    engine = make_engine(drafter, args, dtype, device)
    for kind in ("flex", "dense"):
        if kind == "flex" and device.type == "cpu":
            train[kind] = {"skipped": "FlexAttention has no backward on a CPU (the trainer's CPU recipe is dense)"}
            continue
        with Part(train, kind, device) as fig:
            train_kind(engine, head, batch, kind, args, fig, device)
    flex, dense = train["flex"], train["dense"]
    if "step_ms" in flex and "step_ms" in dense:
        train["dense_over_flex"] = round(dense["step_ms"] / flex["step_ms"], 2)


# --- the check -------------------------------------------------------------------------------------------------------


def describe(args, device: torch.device) -> dict:
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"
    shapes = {k: getattr(args, k) for k in SCALES["paper"]}
    shapes["drafter_layer_ids"] = list(draft_spec(args).target_layer_ids)
    return {
        "device": name,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "scale": args.scale,
        "dtype": args.dtype,
        "shapes": shapes,
        "anchor": ANCHOR,
    }


def target_parts(args, result: dict, parts: set, save, dtype: torch.dtype, device: torch.device):
    """Build the target, run the parts that need all of it; return its frozen embedding and head (the rest of the
    target is freed when this returns)."""
    from flashdraft.target import frozen_head_from_model

    with Part(result, "build", device) as fig:
        model = build_target(target_config(args), device, dtype)
        fig["target_parameters"] = sum(p.numel() for p in model.parameters())
        fig["weights_gib"] = round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30, 2)
    save()
    layer_ids = list(draft_spec(args).target_layer_ids)
    if "capture" in parts:
        with Part(result, "capture_regenerate", device) as fig:
            capture_regenerate(model, args, layer_ids, fig, device)
        save()
        with Part(result, "capture_prefill", device) as fig:
            capture_prefill(model, args, layer_ids, fig, device)
        save()
    if "verify" in parts:
        with Part(result, "verify", device) as fig:
            verify_costs(model, args, fig, device)
        save()
    return frozen_head_from_model(model)


def main(argv=None) -> int:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    parts = set(args.parts.split(","))
    result = describe(args, device)
    t0 = time.perf_counter()

    def save() -> None:
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")

    try:
        head = target_parts(args, result, parts, save, dtype, device)
        gc.collect()  # the target's layers go; its embedding and head stay for the drafter
        if "train" in parts:
            train_steps(head, args, result, dtype, device)
    except Exception:  # noqa: BLE001 - recorded with the figures so far, then the exit status says so
        result["error"] = traceback.format_exc()[-4000:]
    save()
    print(json.dumps(result, indent=2))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
