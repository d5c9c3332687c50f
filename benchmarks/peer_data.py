"""Our feature store -> the offline training data of the peer `speculators` (vLLM's speculator library, issue 59).

The peer's `speculators.train.data.ArrowDataset` reads a folder holding

* a `datasets` Dataset (`save_to_disk`, torch format) with rows {input_ids int64 [S], loss_mask int64 [S],
  seq_len int64}, as its own preprocessing (`build_speculator_training_dataset`) writes them;
* `hidden_states/hs_{i}.safetensors` for row i: "hidden_states" [S, n + 1, H] and "token_ids" int64 [S]. Slots
  0..n-1 are the drafter's n target layers (the peer flattens them into its [S, n*H] features), slot n is the
  verifier's last hidden state before the final norm (the peer's `verifier_last_hidden_states`: its loss targets
  are `lm_head(norm(.))` of it).

Slots 0..n-1 are our stored features, bit for bit, in the store's dtype (bf16, fp16, fp32); an fp8 store is
dequantised to float32 with its scales (exactly what our trainer reads from it). A projected store is refused: its
features mix the layers and cannot be split into per-layer slots. Our store does not keep the last pre-norm state,
so it is recomputed by one target forward a sequence over the stored token ids, hooked at the output of the last
decoder layer (Hugging Face's `output_hidden_states` returns that position after the final norm; the hook does
not). The same forward recomputes the target layers' features; their largest difference from the stored ones is
printed as a check (the store was captured token by token while decoding, so they agree to rounding, not bits).
The loss mask is our store's (the response tokens).

    PYTHONPATH=.peer .venv/bin/python benchmarks/peer_data.py --store runs/quick-smollm2-135m/features \\
        --out runs/peer/quick-data [--target smollm2-135m] [--limit N] [--dtype auto] [--threads 1] [--force]

The output is written to OUT.tmp and renamed to OUT when whole; OUT/peer_data.json records what was converted.
The peer itself is not needed to convert (only `datasets` and `safetensors`); its loader is what reads the result.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from flashdraft.store import StoreError, StoreReader
from flashdraft.target import LayerTap, load_target, resolve_dtype
from flashdraft.target.capture import _decoder

HS_DIR = "hidden_states"
RECORD = "peer_data.json"


def open_store(path: str | Path) -> StoreReader:
    """The store at `path`, refused by name where it is missing, not a store, or projected."""
    path = Path(path)
    if not path.exists():
        raise SystemExit(f"peer_data: no feature store at {path} (the path does not exist)")
    try:
        reader = StoreReader(path)
    except StoreError as e:
        raise SystemExit(f"peer_data: {path} is not a readable feature store: {e}") from e
    if reader.projected:
        raise SystemExit(
            f"peer_data: {path} is a projected store ({reader.layout.project_dims} dims mixing layers "
            f"{reader.layer_ids}): the peer needs each layer's features apart; convert a raw store"
        )
    if len(reader) == 0:
        raise SystemExit(f"peer_data: {path} holds no committed sequences")
    return reader


def features_of(reader: StoreReader, i: int):
    """Sequence i and its features as the peer gets them: the stored dtype where torch has it, fp8 dequantised to
    float32."""
    seq = reader.read(i, upcast=False)
    return seq, seq.features


def target_of(reader: StoreReader, override: str | None) -> str:
    """The target to recompute with: `override`, else the one the store's manifest names."""
    if override:
        return override
    target = reader.manifest.get("target") or {}
    name = target.get("name") or target.get("path")
    if not name:
        raise SystemExit(f"peer_data: {reader.path}'s manifest names no target: pass --target")
    return str(name)


def compute_dtype(reader: StoreReader, name: str | None) -> torch.dtype:
    """The target's dtype for the recompute: `name`, else the dtype the store's capture ran in ('auto' resolved on
    this CPU as the capture resolved it)."""
    return resolve_dtype(name or (reader.manifest.get("generation") or {}).get("dtype", "auto"), "cpu")


@torch.no_grad()
def recompute(model, input_ids: np.ndarray, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over a sequence: (the target layers' features [S, n*H] as our capture takes them, the last
    decoder layer's output [S, H], before the final norm)."""
    last_layer = _decoder(model).layers[-1]
    kept = {}

    def hook(_module, _args, output):
        kept["last"] = output[0] if isinstance(output, tuple) else output

    handle = last_layer.register_forward_hook(hook)
    try:
        with LayerTap(model, layer_ids) as tap:
            model(input_ids=torch.as_tensor(input_ids)[None], use_cache=False, logits_to_keep=1)
            feats = tap.features()[0]
    finally:
        handle.remove()
    return feats, kept["last"][0]


def write_rows(reader: StoreReader, count: int, out: Path) -> None:
    """The Dataset of the first `count` sequences (tokens and loss masks, no features) saved at `out`, in the
    peer's torch format."""
    import datasets

    ids, masks = [], []
    for input_ids, loss_mask in islice(reader.token_sequences(), count):
        ids.append(input_ids.astype(np.int64))
        masks.append(loss_mask.astype(np.int64))
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int64")),
            "loss_mask": datasets.Sequence(datasets.Value("int64")),
            "seq_len": datasets.Value("int64"),
        }
    )
    rows = {"input_ids": ids, "loss_mask": masks, "seq_len": [len(x) for x in ids]}
    ds = datasets.Dataset.from_dict(rows, features=features)
    ds.set_format(type="torch")
    ds.save_to_disk(str(out))


def write_hidden_states(reader, indices, model, out: Path, progress: bool = True) -> dict:
    """hs_{k}.safetensors for each row k; returns the check's figures (largest |recomputed - stored| a layer)."""
    (out / HS_DIR).mkdir(parents=True, exist_ok=True)
    n, h = len(reader.layer_ids), reader.hidden_size
    worst, scale, sq_diff, sq_stored = (np.zeros(n) for _ in range(4))
    for k, i in enumerate(tqdm(indices, desc="peer data", unit="seq", disable=not progress)):
        seq, stored = features_of(reader, i)
        feats, last = recompute(model, seq.input_ids, reader.layer_ids)
        s = len(seq.input_ids)
        ref = stored.float().reshape(s, n, h)
        diff = (feats.float().reshape(s, n, h) - ref).abs()
        worst = np.maximum(worst, diff.amax(dim=(0, 2)).numpy())
        scale = np.maximum(scale, ref.abs().amax(dim=(0, 2)).numpy())
        sq_diff += diff.square().sum(dim=(0, 2)).double().numpy()
        sq_stored += ref.square().sum(dim=(0, 2)).double().numpy()
        slots = torch.cat([stored.reshape(s, n, h), last.to(stored.dtype)[:, None]], dim=1).contiguous()
        tensors = {"hidden_states": slots, "token_ids": torch.from_numpy(seq.input_ids.astype(np.int64))}
        save_file(tensors, str(out / HS_DIR / f"hs_{k}.safetensors"))
    return {
        "max_abs_diff": dict(zip(map(str, reader.layer_ids), worst.tolist())),
        "max_abs_stored": dict(zip(map(str, reader.layer_ids), scale.tolist())),
        "relative_rms_diff": dict(zip(map(str, reader.layer_ids), np.sqrt(sq_diff / sq_stored).tolist())),
    }


def prepare_out(out: Path, force: bool) -> Path:
    """OUT.tmp, emptied; OUT refused if present unless `force`."""
    if out.exists() and not force:
        raise SystemExit(f"peer_data: {out} already exists (pass --force to replace it)")
    if not out.parent.exists():
        try:
            out.parent.mkdir(parents=True)
        except OSError as e:
            raise SystemExit(f"peer_data: cannot create {out.parent}: {e}") from e
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def convert(store, out, target=None, limit=None, dtype=None, force=False, progress=True) -> dict:
    """Convert the store at `store` into the peer's data at `out` (see the module docstring); returns the record."""
    start = time.perf_counter()
    reader, out = open_store(store), Path(out)
    tmp = prepare_out(out, force)
    indices = list(range(len(reader) if limit is None else min(int(limit), len(reader))))
    name, compute = target_of(reader, target), compute_dtype(reader, dtype)
    model, _ = load_target(name, dtype=compute)
    if model.config.hidden_size != reader.hidden_size:
        raise SystemExit(
            f"peer_data: target {name} has hidden size {model.config.hidden_size}, {store} holds "
            f"{reader.hidden_size}: pass the store's target with --target"
        )
    write_rows(reader, len(indices), tmp)
    check = write_hidden_states(reader, indices, model, tmp, progress)
    record = {
        "store": str(Path(store).resolve()),
        "target": name,
        "target_dtype": str(compute).removeprefix("torch."),
        "sequences": len(indices),
        "tokens": int(sum(int(reader.lengths[i]) for i in indices)),
        "layer_ids": reader.layer_ids,
        "store_dtype": reader.dtype,
        "hidden_states_dtype": "float32" if reader.dtype == "float8_e4m3" else reader.dtype,
        "last_slot": f"output of decoder layer {model.config.num_hidden_layers - 1} (before the final norm), "
        "recomputed in one forward a sequence",
        "check": check,
        "wall_s": round(time.perf_counter() - start, 2),
    }
    (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return record


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True, help="our feature store (a folder written by python -m pipeline)")
    p.add_argument("--out", required=True, help="the peer's data folder to write")
    p.add_argument("--target", default=None, help="the target (default: the one the store's manifest names)")
    p.add_argument("--limit", type=int, default=None, help="convert only the first N sequences")
    p.add_argument("--dtype", default=None, help="the recompute's dtype (default: the store's capture dtype)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    record = convert(args.store, args.out, args.target, args.limit, args.dtype, args.force)
    print(f"wrote {record['sequences']} sequences ({record['tokens']} tokens) to {args.out} in {record['wall_s']} s")
    print(f"last slot: {record['last_slot']}, target in {record['target_dtype']}")
    for layer, d in record["check"]["max_abs_diff"].items():
        top = record["check"]["max_abs_stored"][layer]
        rel = record["check"]["relative_rms_diff"][layer]
        print(f"  layer {layer}: max |recomputed - stored| = {d:.4g} (max |stored| {top:.4g}), relative rms {rel:.2e}")
    return record


if __name__ == "__main__":
    main()
