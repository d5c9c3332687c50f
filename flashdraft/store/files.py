"""Where a store keeps what: the only module that knows the store's file and folder names.

    manifest.json                 provenance, format, counts, and the list of COMMITTED shards
    rejects.jsonl                 prompts the pipeline refused, one {"source","record_id","reason"} a line
    shards/shard-00000/           one Zarr v3 group per fleet task; attributes: seq_ids, offsets, response_spans
                                  (per sequence its loss mask's True runs, [start, end, ...]), counts
                                  every array below is a folder of two files: zarr.json and ONE data file, a zarr
                                  shard over all T rows (`0` for 1-D arrays, `0.0` for 2-D: `array_file`)
        input_ids   int32 [T]         all sequences' tokens, flat; sequence j is offsets[j]:offsets[j+1]
        loss_mask   bool  [T]         True on response tokens (generated, EOS included)
        features    [T, L*H]          the outputs of the L captured decoder layers (hidden_states[i+1]) side by
                                      side, in layer_ids order (`format`)
        features_scale float32 [T, L] fp8 only: a scale per token and layer
        teacher_ids int32 [T, k]      optional (layout teacher_topk = k > 0): row j holds the target's k most
        teacher_logp float16 [T, k]   likely next tokens after token j and their log-probabilities (soft labels
                                      for token j+1); -inf where not captured (prompt tokens before the last)
    shards/.tmp-<name>-<uid>/     a shard being written (data streams into <key>.part); renamed once complete
    damaged/<name>/               a shard `repair` dropped from the manifest, moved out of shards/ (never read)
    .lock                         serialises manifest updates
    writer.lock                   held (flock) by the one capture writing the store, naming its host, pid and start

Each shard is readable with plain `zarr.open_group(store/"shards"/name)`.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import re
import uuid
from contextlib import contextmanager
from pathlib import Path

from flashdraft.durable import fsync_dir
from flashdraft.store.format import FORMAT_NOTES, FORMAT_VERSION, StoreError, StoreLayout
from flashdraft.store.space import naming_disk_full

MANIFEST = "manifest.json"
REJECTS = "rejects.jsonl"
SHARDS = "shards"
DAMAGED = "damaged"
TMP_PREFIX = ".tmp-"
LOCK = ".lock"
WRITER_LOCK = "writer.lock"
TMP_SUFFIX = ".tmp"  # a manifest or rejects file being written
SHARD_PREFIX = "shard-"
SHARD_NAME = re.compile(r"shard-[0-9]{5,}")  # what `shard_name` makes: a manifest's names become read paths
PART_SUFFIX = ".part"
_MANIFEST_KEYS = ("format_version", "layer_ids", "hidden_size", "dtype", "shards")
_ENTRY_COUNTS = ("sequences", "tokens")  # what every shard entry of a manifest holds besides its name


def now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def shards_dir(store_path: str | Path) -> Path:
    return Path(store_path) / SHARDS


def shard_dir(store_path: str | Path, name: str) -> Path:
    return Path(store_path) / SHARDS / name


def damaged_dir(store_path: str | Path) -> Path:
    """Where `repair` moves the folders of the shards it drops: beside shards/, where no reader or capture looks."""
    return Path(store_path) / DAMAGED


def shard_name(index: int) -> str:
    """The name of the index-th shard of a store (`shard-00000`)."""
    return f"{SHARD_PREFIX}{index:05d}"


def shard_index(name: str) -> int:
    """The index in a shard name made by `shard_name`; -1 for any other name."""
    try:
        return int(name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def next_shard_index(store_path: str | Path) -> int:
    """The index of the first shard name after every shard the store's manifest lists and every shard folder on
    disk (one left unlisted, not adopted, is never written over)."""
    listed = [shard_index(e["name"]) for e in read_manifest(store_path)["shards"]]
    folders = shards_dir(store_path).iterdir() if shards_dir(store_path).is_dir() else []
    on_disk = [shard_index(d.name) for d in folders if SHARD_NAME.fullmatch(d.name)]  # not temp dirs' uids
    return 1 + max([*listed, *on_disk, -1])


def temp_shard_dir(store_path: str | Path, name: str) -> Path:
    """A fresh folder name for a shard being written (never listed, never read)."""
    return shards_dir(store_path) / f"{TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}"


def array_file(shard: Path, key: str, ndim: int) -> Path:
    """The one data file of array `key` of a shard folder: the array's only zarr shard (chunk key encoding v2,
    separator ".", so no chunk folders)."""
    return shard / key / ".".join(["0"] * ndim)


def part_file(shard: Path, key: str) -> Path:
    """Where a shard writer streams array `key`'s data file before commit moves it to `array_file`."""
    return shard / f"{key}{PART_SUFFIX}"


def is_temp(shard: Path) -> bool:
    return shard.name.startswith(TMP_PREFIX)


def shard_exists(store_path: str | Path, name: str) -> bool:
    """Whether the shard `name` is in place (committed, or renamed and not yet listed in the manifest)."""
    return shard_dir(store_path, name).is_dir()


def is_store(path: str | Path) -> bool:
    """True when `path` is a folder with a store manifest (it may still be corrupt: `read_manifest` says)."""
    return (Path(path) / MANIFEST).is_file()


def read_manifest(path: str | Path, *, any_format: bool = False) -> dict:
    """The store's manifest; a store of another format version is refused unless `any_format` (a converter)."""
    path = Path(path)
    mpath = path / MANIFEST
    if not path.is_dir():
        raise StoreError(f"no feature store at {path} (not a directory)")
    if not mpath.is_file():
        raise StoreError(f"{path} is not a feature store: {MANIFEST} is missing")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, ValueError) as e:
        raise StoreError(f"{mpath} is corrupt: {e}") from e
    if not isinstance(manifest, dict):
        raise StoreError(f"{mpath} is corrupt: not a JSON object")
    missing = [k for k in _MANIFEST_KEYS if k not in manifest]
    if missing:
        raise StoreError(f"{mpath} is corrupt: missing keys {missing}")
    _check_shard_entries(mpath, manifest["shards"])
    if not any_format:
        _check_format(path, manifest["format_version"])
    return manifest


def _check_shard_entries(mpath: Path, shards) -> None:
    """Every shard a manifest lists has a name `shard_name` makes (none becomes a path out of `shards/`: `../../etc`,
    an absolute path) and its counts; a bad entry is refused by name before any of it is used."""
    if not isinstance(shards, list):
        raise StoreError(f"{mpath} is corrupt: 'shards' is not a list")
    for entry in shards:
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not SHARD_NAME.fullmatch(name):
            raise StoreError(f"{mpath} is corrupt: shard name {name!r} is not of the form shard-NNNNN; refused")
        for key in _ENTRY_COUNTS:
            if key not in entry:
                raise StoreError(f"{mpath} is corrupt: the entry of shard {name} has no {key!r}; refused")
            value = entry[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise StoreError(
                    f"{mpath} is corrupt: the entry of shard {name} has {key} {value!r}, not a count; refused"
                )


def _check_format(path: Path, version) -> None:
    """Refuse a store of another format version, saying what to do."""
    if version == FORMAT_VERSION:
        return
    what = FORMAT_NOTES.get(version, "unknown to this flashdraft")
    ours = f"format {FORMAT_VERSION} ({FORMAT_NOTES[FORMAT_VERSION]})"
    if isinstance(version, int) and version < FORMAT_VERSION:
        raise StoreError(
            f"{path} is a feature store of format {version} ({what}); this flashdraft reads only {ours}. "
            f"Recapture it into a new directory (make features / python -m pipeline with a new store path), or "
            f"convert it: python -m flashdraft.store.convert {path} <new store>"
        )
    raise StoreError(f"{path} is a feature store of format {version} ({what}); this flashdraft reads only {ours}")


def write_manifest(path: str | Path, manifest: dict) -> None:
    _write_json_atomic(Path(path) / MANIFEST, manifest)


def _write_json_atomic(path: Path, obj) -> None:
    """Write to a temporary file, fsync, rename over `path`; a failed write removes its temporary file."""
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
    try:
        with naming_disk_full(path), open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)  # the rename itself: until then a power loss can bring the old file back
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def stale_temp_files(store_path: str | Path) -> list[Path]:
    """Manifest and rejects files a crashed writer left half-written (only the writer lock's holder deletes them)."""
    root = Path(store_path)
    return [p for p in root.glob(f"*{TMP_SUFFIX}") if p.name.startswith((MANIFEST, REJECTS))] if root.is_dir() else []


@contextmanager
def manifest_lock(path: str | Path):
    """Hold the store's lock file (created with the store's folders if missing) while the manifest changes."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shards_dir(path).mkdir(exist_ok=True)
    with open(path / LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_shard_attrs(shard: Path) -> dict:
    """The shard group's attributes, read straight from its zarr.json (no Zarr machinery: fast)."""
    try:
        return json.loads((shard / "zarr.json").read_text())["attributes"]
    except (OSError, ValueError, KeyError) as e:
        raise StoreError(f"shard {shard} is unreadable: {e}") from e


def shard_is_complete(shard: Path) -> bool:
    try:
        return bool(read_shard_attrs(shard).get("complete"))
    except StoreError:
        return False


def shard_seq_ids(shard: Path) -> set[str]:
    """Every sequence id a shard folder accounts for: captured, or refused and recorded as a reject."""
    attrs = read_shard_attrs(shard)
    return set(attrs["seq_ids"]) | {r["seq_id"] for r in attrs.get("rejects", [])}


def repair_hint(store_path: str | Path) -> str:
    return (
        f"`python -m pipeline repair {store_path}` drops the entry of every listed shard that is missing, "
        "unreadable or damaged; the same capture command run again then recaptures exactly their prompts"
    )


def listed_shard_attrs(store_path: str | Path, name: str) -> dict:
    """The attributes of the shard `name` the manifest lists; one missing or unreadable on disk is refused naming
    the repair."""
    d = shard_dir(store_path, name)
    try:
        return read_shard_attrs(d)
    except StoreError as e:
        raise StoreError(f"{missing_shard_reason(store_path, name, e)}: {repair_hint(store_path)}") from e


def missing_shard_reason(store_path: str | Path, name: str, error: StoreError) -> str:
    """Why the listed shard `name` cannot be read (`error`, what reading its attributes raised)."""
    d = shard_dir(store_path, name)
    what = "is missing" if not d.exists() else f"is unreadable ({error.__cause__ or error})"
    return f"shard {name} is listed in {Path(store_path) / MANIFEST} but {d} {what}"


def committed_seq_ids(store_path: str | Path) -> set[str]:
    """Every sequence id the committed shards account for: captured, or refused and recorded as a reject."""
    done = set()
    for entry in read_manifest(store_path)["shards"]:
        attrs = listed_shard_attrs(store_path, entry["name"])
        done |= set(attrs["seq_ids"]) | {r["seq_id"] for r in attrs.get("rejects", [])}
    return done


def shard_rejects(manifest: dict) -> list[dict]:
    """The rejects every committed shard of a manifest recorded, in shard order."""
    return [r for entry in manifest["shards"] for r in entry.get("rejects", [])]


def write_rejects(store_path: str | Path, rejects) -> None:
    """Replace the store's rejects file with `rejects` (dicts), one JSON object a line."""
    final = Path(store_path) / REJECTS
    tmp = final.with_name(REJECTS + TMP_SUFFIX)
    try:
        with naming_disk_full(final), open(tmp, "w") as f:
            for r in rejects:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(final)
        fsync_dir(final.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_rejects(store_path: str | Path) -> list[dict]:
    """The store's rejects file, or [] when the pipeline has not written one."""
    path = Path(store_path) / REJECTS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def dir_bytes(root: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def shards_bytes(store_path: str | Path) -> int:
    """Bytes on disk of a store's shards (committed or not)."""
    return dir_bytes(shards_dir(store_path))


def files_per_shard(layout: StoreLayout) -> int:
    """Files one committed shard holds in this format, whatever its rows: the group's zarr.json, and per array its
    zarr.json and its one data file (bf16: 3 arrays, 7 files; fp8 adds the scales, a teacher top-k two arrays)."""
    return 1 + 2 * len(layout.array_keys())


def dirs_per_shard(layout: StoreLayout) -> int:
    """Folders a shard holds besides its own: one per array."""
    return len(layout.array_keys())
