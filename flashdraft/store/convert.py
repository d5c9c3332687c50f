"""Converting a store of format 1 (an array per layer, a file per `shard_tokens` rows) or 2 (an array per layer, a
file per shard) to the current format (the layers in one `features` array, a file per array per shard): the same
shards, sequences, rejects and provenance, bit for bit the same stored values.

    python -m flashdraft.store.convert OLD_STORE NEW_STORE

The old store is only read; the new one must not exist yet. Then `python -m pipeline verify NEW_STORE`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from flashdraft.store.files import is_store, read_manifest, read_rejects, read_shard_attrs, shard_dir, write_rejects
from flashdraft.store.format import FEATURE_SCALES, FEATURES, FORMAT_VERSION, StoreError, StoreLayout, layer_key
from flashdraft.store.writer import StoreWriter

CONVERTS_FROM = (1, 2)
_NOT_COPIED = ("format_version", "created", "updated", "counts", "shards", "layer_ids", "hidden_size", "dtype")


def convert_store(src: str | Path, dst: str | Path, *, progress: bool = True) -> dict:
    """Write a current-format copy of the old store `src` at `dst`; returns the new manifest."""
    from tqdm import tqdm

    src, dst = Path(src), Path(dst)
    manifest = read_manifest(src, any_format=True)
    if manifest["format_version"] not in CONVERTS_FROM:
        raise StoreError(f"{src} is of format {manifest['format_version']}; this converts {CONVERTS_FROM} only")
    if is_store(dst):
        raise StoreError(f"{dst} already holds a store; convert into a new directory")
    layout = StoreLayout.from_manifest(manifest)
    extra = {k: v for k, v in manifest.items() if k not in _NOT_COPIED and k != "layout"}
    extra["converted_from"] = {"path": str(src), "format_version": manifest["format_version"]}
    writer = StoreWriter(
        dst,
        layer_ids=layout.layer_ids,
        hidden_size=layout.hidden_size,
        dtype=layout.dtype,
        manifest_extra=extra,
        **{k: v for k, v in manifest.get("layout", {}).items()},
    )
    for entry in tqdm(manifest["shards"], desc="convert", unit="shard", disable=not progress):
        _convert_shard(shard_dir(src, entry["name"]), writer, entry["name"])
    write_rejects(dst, read_rejects(src))
    return read_manifest(dst)


def _convert_shard(old: Path, writer: StoreWriter, name: str) -> None:
    """Copy one old shard's sequences, a write block of rows at a time, into a new shard of the same name."""
    import zarr

    attrs = read_shard_attrs(old)
    arrays = {k: zarr.open_array(str(old / k), mode="r") for k in old_array_keys(writer.layout)}
    offsets, ids = attrs["offsets"], attrs["seq_ids"]
    thinking = attrs.get("thinking") or [None] * len(ids)
    with writer.shard(name) as shard:
        j = 0
        while j < len(ids):
            k = j  # sequences j..k-1 span at most a write block (or one sequence, if longer)
            while k < len(ids) and (k == j or offsets[k + 1] - offsets[j] <= writer.layout.shard_tokens):
                k += 1
            block = stacked({key: np.asarray(a[offsets[j] : offsets[k]]) for key, a in arrays.items()}, writer.layout)
            for m in range(j, k):
                a, b = offsets[m] - offsets[j], offsets[m + 1] - offsets[j]
                shard.append_stored(ids[m], {key: rows[a:b] for key, rows in block.items()}, thinking[m])
            j = k
        shard.rejects = list(attrs.get("rejects", []))
        shard.notes = list(attrs.get("notes", []))
    writer.register(shard.info())


def old_array_keys(layout: StoreLayout) -> list[str]:
    """The arrays of a shard of formats 1 and 2: one per layer (and an fp8 scale array per layer)."""
    keys = ["input_ids", "loss_mask"] + [layer_key(i) for i in layout.layer_ids]
    if layout.dtype == "float8_e4m3":
        keys += [layer_key(i) + "_scale" for i in layout.layer_ids]
    return keys + (["teacher_ids", "teacher_logp"] if layout.teacher_topk else [])


def stacked(old_rows: dict, layout: StoreLayout) -> dict:
    """Rows of the old per-layer arrays as the current arrays: the layers side by side in `features` (and their
    fp8 scales in `features_scale`), in `layer_ids` order; the other arrays as they are."""
    rows = {k: v for k, v in old_rows.items() if not k.startswith("layer_")}
    rows[FEATURES] = np.concatenate([old_rows[layer_key(i)] for i in layout.layer_ids], axis=1)
    if layout.dtype == "float8_e4m3":
        rows[FEATURE_SCALES] = np.stack([old_rows[layer_key(i) + "_scale"] for i in layout.layer_ids], axis=1)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    m = convert_store(argv[0], argv[1])
    c = m["counts"]
    print(
        f"{argv[1]}: format {FORMAT_VERSION}, {len(m['shards'])} shards, {c['sequences']} sequences, {c['tokens']} tok"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
