"""Can the loader keep one H100 fed at the paper's shapes? Figures and ratios from one run.

    .venv/bin/python benchmarks/bench_loader.py [--dir DIR] [--sequences 64] [--workers 1 2]
        [--meta-sequences 100000] [--real-store runs/quick-smollm2-135m/features]

1. Demand: the Qwen3-8B drafter (built on the meta device from its published geometry: hidden 4096, 5 layers,
   layers [1, 9, 17, 25, 33], block 16) trained on the paper's recipe (512 anchors a sequence, bf16): FLOPs a
   sequence, counted from its parameters, and the sequences/s one H100 runs at 40% of its dense bf16 peak
   (989 TFLOP/s, SXM), so the bytes/s a loader must supply it.
2. Supply: a synthetic store at Qwen3-8B shapes (5 layers x 4096, bf16, blosc-zstd level 3, ~1,000-token
   sequences; values drawn with per-channel scales, so exponents repeat as in real activations) read through the
   trainer's own path (`TrainingData.batch`: decompress, decode, draw anchors, collate) by thread workers (the
   trainer's Prefetcher) and by process workers (torch DataLoader); where one sequence's time goes; the codecs
   (none, lz4, zstd levels) for bytes on disk against read MB/s.
3. Start-up: time to first batch on a store of `--meta-sequences` sequences (tiny features: only metadata
   matters), with anchor counts from the shards' response-span index against reading every loss mask.

Reads come from the page cache (the store was just written): this measures the loader's CPU cost, not the disk
or the network file system.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

LAYERS = (1, 9, 17, 25, 33)
HIDDEN = 4096
MASK_TOKEN = 151669  # the published Qwen3-8B drafter's
QWEN3_8B = dict(
    vocab_size=151936,
    hidden_size=HIDDEN,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
)
H100_BF16_DENSE = 989.4e12  # FLOP/s, H100 SXM, dense (no sparsity)
MFU = 0.40
ANCHORS, BLOCK, MAX_LENGTH, TOKEN_BUDGET = 512, 16, 3072, 16384  # conf/train/paper.yaml


def drafter_parts() -> dict:
    """Parameter counts of the Qwen3-8B drafter, from a meta-device instance of our model."""
    from transformers import Qwen3Config

    from flashdraft.model import DFlashDrafter
    from flashdraft.spec import DraftSpec

    config = DraftSpec(LAYERS, MASK_TOKEN, block_size=BLOCK).draft_config(Qwen3Config(**QWEN3_8B))
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    attn = drafter.layers[0].self_attn
    return {
        "total": sum(p.numel() for p in drafter.parameters()),
        "fc": drafter.fc.weight.numel(),
        "layer": sum(p.numel() for p in drafter.layers[0].parameters()),
        "kv": attn.k_proj.weight.numel() + attn.v_proj.weight.numel(),
        "layers": len(drafter.layers),
        "q_dim": attn.q_proj.weight.shape[0],
        "head": QWEN3_8B["vocab_size"] * HIDDEN,
    }


def flops_per_sequence(parts: dict, context: int, anchors: int) -> dict:
    """Training FLOPs one sequence costs (6 a parameter a token for trained weights, forward + backward; 4 for
    the frozen head, forward + input gradient; attention over the keys a block sees: its anchor's context
    (half the sequence on average) and itself)."""
    q = anchors * BLOCK
    keys = context / 2 + BLOCK
    return {
        "draft layers on the block tokens": 6 * parts["layer"] * parts["layers"] * q,
        "frozen head on the predicted tokens": 4 * parts["head"] * anchors * (BLOCK - 1),
        "fc + context k/v projections": 6 * (parts["fc"] + parts["layers"] * parts["kv"]) * context,
        "attention": 3 * 4 * parts["q_dim"] * q * keys * parts["layers"],
    }


def print_demand(mean_tokens: float) -> float:
    parts = drafter_parts()
    flops = flops_per_sequence(parts, mean_tokens, ANCHORS)
    total = sum(flops.values())
    print(
        f"== demand: the Qwen3-8B drafter ({parts['total'] / 1e9:.3f}B parameters + frozen head "
        f"{parts['head'] / 1e6:.0f}M), a {mean_tokens:.0f}-token sequence, {ANCHORS} anchors x block {BLOCK}"
    )
    for what, f in flops.items():
        print(f"  {what:40s} {f / 1e12:8.2f} TFLOP")
    rate = H100_BF16_DENSE * MFU / total
    need = rate * mean_tokens * len(LAYERS) * HIDDEN * 2
    print(f"  {'= a sequence':40s} {total / 1e12:8.2f} TFLOP")
    print(
        f"  one H100 at {MFU:.0%} MFU: {H100_BF16_DENSE * MFU / 1e12:.0f} TFLOP/s / {total / 1e12:.2f} TFLOP "
        f"= {rate:.2f} sequences/s = {need / 1e6:.0f} MB/s of bf16 features"
    )
    return rate


def synthetic_sequences(n: int, hidden: int, layers: int, seed: int = 0, lengths=(800, 1200)):
    """n sequences: ids, a loss mask on the last 75-90% (the response), features with per-channel scales."""
    rng = np.random.default_rng(seed)
    scale = torch.from_numpy(rng.lognormal(0.0, 1.0, layers * hidden).astype(np.float32))
    for i in range(n):
        s = int(rng.integers(*lengths))
        mask = np.zeros(s, bool)
        mask[int(s * rng.uniform(0.10, 0.25)) :] = True
        feats = torch.randn(s, layers * hidden, generator=torch.Generator().manual_seed(seed * 100003 + i)) * scale
        yield {"seq_id": f"s{i:07d}", "input_ids": rng.integers(0, 151936, s), "loss_mask": mask, "features": feats}


def write_synthetic(path: Path, sequences, *, shard_size: int, layer_ids, hidden: int, **layout) -> float:
    """Write `sequences` as shards of `shard_size` through the store writer; returns seconds."""
    from flashdraft.store import StoreWriter
    from flashdraft.store.files import shard_name

    shutil.rmtree(path, ignore_errors=True)
    t = time.perf_counter()
    writer = StoreWriter(path, layer_ids=layer_ids, hidden_size=hidden, **layout)
    shard, k = None, 0
    for j, seq in enumerate(sequences):
        if j % shard_size == 0:
            if shard is not None:
                writer.register(shard.commit())
            shard, k = writer.shard(shard_name(k)), k + 1
        shard.append(seq["seq_id"], seq["input_ids"], seq["loss_mask"], seq["features"])
    writer.register(shard.commit())
    return time.perf_counter() - t


def store_bytes(path: Path, prefix: str = "features") -> int:
    """Bytes on disk of the store's arrays whose names start with `prefix`."""
    return sum(f.stat().st_size for f in Path(path).glob(f"shards/*/{prefix}*/**/*") if f.is_file())


def training_data(path: Path, layer_ids=LAYERS):
    from trainer.data import TrainingData

    return TrainingData(
        [str(path)],
        layer_ids=list(layer_ids),
        block_size=BLOCK,
        num_anchors=ANCHORS,
        max_length=MAX_LENGTH,
        mask_token_id=MASK_TOKEN,
        gamma=7.0,
    )


def microbatches(data) -> list:
    plan = data.plan(0, token_budget=TOKEN_BUDGET)
    return [mb for step in plan.steps for mb in step]


def _as_is(batch):
    return batch


class _MicroBatches(torch.utils.data.Dataset):
    """Micro-batches for torch DataLoader process workers: each worker builds whole batches."""

    def __init__(self, data, mbs):
        self.data, self.mbs = data, mbs

    def __len__(self):
        return len(self.mbs)

    def __getitem__(self, k):
        return self.data.batch(self.mbs[k], 0)


def read_rate(data, mbs, kind: str, workers: int) -> tuple[float, float]:
    """(sequences/s, seconds) building every micro-batch with `workers` threads or processes."""
    from trainer.data import Prefetcher

    t = time.perf_counter()
    if kind == "threads":
        loader = Prefetcher(data, mbs, 0, workers=workers, depth=2 * workers)
    else:
        loader = torch.utils.data.DataLoader(
            _MicroBatches(data, mbs), batch_size=None, num_workers=workers, prefetch_factor=2, collate_fn=_as_is
        )
    n = sum(len(b.seq_ids) for b in loader)
    seconds = time.perf_counter() - t
    return n / seconds, seconds


def _per_sequence_ms(fn, indices) -> float:
    t = time.perf_counter()
    for i in indices:
        fn(int(i))
    return (time.perf_counter() - t) / len(indices) * 1e3


def time_breakdown(data, indices) -> dict:
    """Milliseconds a sequence, one thread, for each stage of a read (5 layers + ids + mask)."""
    import zarr

    reader = data.readers[0]
    keys = reader.layout.array_keys()
    arrays = {(s.name, k): zarr.open_array(str(s.dir / k), mode="r") for s in reader._shards for k in keys}

    def where(i):
        shard = reader._shards[reader._shard_of[i]]
        j = reader._index_in[i]
        return shard, int(shard.offsets[j]), int(shard.offsets[j + 1])

    def plain_zarr(i):
        shard, a, b = where(i)
        for k in keys:
            arrays[(shard.name, k)][a:b]

    def chunks(i):
        shard, a, b = where(i)
        for k in keys:
            reader._rows(shard, k, a, b, "")

    return {
        "plain zarr slices (for comparison)": _per_sequence_ms(plain_zarr, indices),
        "read the inner chunks (crc32c, decompress)": _per_sequence_ms(chunks, indices),
        "read() upcast to float32": _per_sequence_ms(reader.read, indices),
        "read() in the stored bf16 (the loader's)": _per_sequence_ms(data.read, indices),
        "batch(): + anchors, labels, collate": _per_sequence_ms(lambda i: data.batch([i], 0), indices),
    }


def print_supply(path: Path, n: int, workers: list[int], demand: float) -> None:
    seqs = list(synthetic_sequences(n, HIDDEN, len(LAYERS)))
    tokens = sum(len(s["input_ids"]) for s in seqs)
    raw = tokens * len(LAYERS) * HIDDEN * 2
    seconds = write_synthetic(path, seqs, shard_size=16, layer_ids=LAYERS, hidden=HIDDEN)
    del seqs
    on_disk = store_bytes(path)
    print(
        f"\n== supply: {n} sequences, {tokens:,} tokens ({tokens / n:.0f} a sequence), features {raw / 1e9:.2f} GB "
        f"bf16 -> {on_disk / 1e9:.2f} GB on disk (blosc-zstd 3, ratio {raw / on_disk:.2f}), written in {seconds:.1f} s"
    )
    data = training_data(path)
    mbs = microbatches(data)
    per_seq = raw / n
    print("  one thread, a sequence:")
    for what, ms in time_breakdown(data, range(min(n, 16))).items():
        print(f"    {what:42s} {ms:7.1f} ms")
    print(f"  {'workers':>14s} {'seq/s':>7s} {'MB/s':>7s} {'per worker':>11s} {'x one H100':>11s}")
    for kind in ("threads", "processes"):
        for w in workers:
            rate, _ = read_rate(data, mbs, kind, w)
            print(
                f"  {w:3d} {kind:10s} {rate:7.2f} {rate * per_seq / 1e6:7.0f} {rate / w:8.2f}/s {rate / demand:10.2f}x"
            )
    print(f"  (this machine has {os.cpu_count()} cores: more workers than cores share them)")


CODECS = (("none", 0), ("blosc-lz4", 5), ("blosc-zstd", 1), ("blosc-zstd", 3), ("blosc-zstd", 6), ("zstd", 3))


def print_codecs(root: Path, n: int) -> None:
    """Bytes on disk against single-thread read speed, per codec, on the same synthetic sequences."""
    seqs = list(synthetic_sequences(n, HIDDEN, len(LAYERS), seed=1))
    raw = sum(len(s["input_ids"]) for s in seqs) * len(LAYERS) * HIDDEN * 2
    print(f"\n== codecs: {n} sequences, {raw / 1e9:.2f} GB of bf16 features, one thread")
    print(f"  {'codec':16s} {'ratio':>6s} {'write MB/s':>11s} {'chunks MB/s':>16s} {'read MB/s':>10s}")
    for codec, level in CODECS:
        path = root / f"codec-{codec}-{level}"
        seconds = write_synthetic(path, seqs, shard_size=n, layer_ids=LAYERS, hidden=HIDDEN, codec=codec, clevel=level)
        parts = time_breakdown(training_data(path), range(n))
        ms = [list(parts.values())[k] for k in (1, 3)]  # inner chunks; the loader's read
        per_seq = raw / n / 1e6
        print(
            f"  {codec + ' ' + str(level):16s} {raw / store_bytes(path):6.2f} {raw / 1e6 / seconds:11.0f} "
            f"{per_seq / ms[0] * 1e3:16.0f} {per_seq / ms[1] * 1e3:10.0f}"
        )
        shutil.rmtree(path)


def metadata_sequences(n: int, seed: int = 2):
    """n sequences of 200-1,800 tokens with a response span each and 8-wide zero features: a store whose
    metadata has the paper's scale and whose features cost nothing."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(200, 1800, n)
    for i, s in enumerate(lengths):
        mask = np.zeros(s, bool)
        mask[int(s * rng.uniform(0.10, 0.25)) :] = True
        yield {
            "seq_id": f"m{i:07d}",
            "input_ids": np.zeros(s, np.int64),
            "loss_mask": mask,
            "features": torch.zeros(int(s), 8),
        }


def print_startup(path: Path, n: int) -> None:
    """Time to first batch on an n-sequence store: open, anchor counts, plan, first micro-batch."""
    import zarr

    from flashdraft.store import StoreReader
    from trainer.data import valid_anchor_counts, valid_anchor_counts_from_masks

    seconds = write_synthetic(path, metadata_sequences(n), shard_size=256, layer_ids=(1,), hidden=8)
    t0 = time.perf_counter()
    reader = StoreReader(path)
    opened = time.perf_counter() - t0
    t = time.perf_counter()
    from_index = valid_anchor_counts(reader, BLOCK, MAX_LENGTH)
    index_s = time.perf_counter() - t
    t = time.perf_counter()
    from_masks = valid_anchor_counts_from_masks(reader, BLOCK, MAX_LENGTH)
    masks_s = time.perf_counter() - t
    assert (from_index == from_masks).all()
    t = time.perf_counter()
    for shard in reader._shards:  # what start-up did before the index and the direct reads: plain zarr, every shard
        zarr.open_array(str(shard.dir / "loss_mask"), mode="r")[:]
    zarr_s = time.perf_counter() - t
    t = time.perf_counter()
    data = training_data(path, layer_ids=(1,))
    mbs = microbatches(data)
    data.batch(mbs[0], 0)
    first = time.perf_counter() - t
    tokens = int(reader.lengths.sum())
    print(
        f"\n== start-up: {n:,} sequences, {tokens / 1e6:.0f}M tokens, {len(reader._shards)} shards "
        f"(written in {seconds:.0f} s)"
    )
    print(f"  open the store (manifest + shard attributes)   {opened:7.2f} s")
    print(f"  anchor counts from the response-span index      {index_s:7.2f} s")
    print(f"  anchor counts from every loss mask              {masks_s:7.2f} s  ({masks_s / index_s:.0f}x the index)")
    print(f"  every loss mask read by plain zarr (before)     {zarr_s:7.2f} s  ({zarr_s / index_s:.0f}x the index)")
    before = first - index_s + zarr_s
    print(
        f"  time to first batch (TrainingData, plan, batch) {first:7.2f} s; with the loss masks read by plain "
        f"zarr instead (before): {before:.2f} s ({before / first:.0f}x)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="where the synthetic stores go (default: a temporary folder)")
    ap.add_argument("--sequences", type=int, default=64, help="sequences of the paper-shape store")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--codec-sequences", type=int, default=8)
    ap.add_argument("--meta-sequences", type=int, default=100_000)
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-loader-"))
    root.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    try:
        demand = print_demand(1000.0)
        print_supply(root / "paper-shape", args.sequences, args.workers, demand)
        shutil.rmtree(root / "paper-shape")
        print_codecs(root, args.codec_sequences)
        if args.meta_sequences:
            print_startup(root / "metadata", args.meta_sequences)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
