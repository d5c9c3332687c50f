"""Rewrite a store of raw features in another dtype and/or projected (`python -m pipeline transcode`).

One captured store then serves every setting of a comparison (bf16, fp8, projected r = H, 2H, ... in either): the
copy holds the same sequences, shard by shard under the same names, with the same provenance (target, template,
generation settings) and a `transcoded_from` entry. A projected copy's basis is fitted on the source's first
`calibration_tokens` tokens (as a capture fits it on its first ones), or taken from another projected store
(`basis`: its file copied byte for byte, so both stores name the same sha256 and train together).

A transcode is written as a capture is: under the copy's writer lock (a second transcode into it is refused, naming
the first), each shard committed atomically (`ShardWriter`) and only then listed. `transcoded_from` records the
source (path, creation time, counts, shards), the options, and `complete`, set once every source shard and the
rejects are written: until then the copy is partial, and `pipeline verify` and the trainer refuse it by name
(`partial_transcode_problem`). The same command run again finishes a partial copy: it removes what the stopped run
left (temporary shards, a half-written basis), keeps the shards committed and the basis recorded, and writes the
rest; a copy begun from another source, or with other options, is refused by name.

Refused by name: a source that is already projected (its layers cannot be recovered) and a replay store (the eval
prompts' store, `features-heldout`: served-order replay reads its raw features with the exported drafter), except
with `basis`: a copy projected by a training store's basis is the trainer's eval store for a drafter trained on that
basis (`train.eval_stores`: mixed kinds are refused), while the replay keeps reading the raw original.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from flashdraft.store.files import (
    LOCK,
    SHARDS,
    WRITER_LOCK,
    is_store,
    is_temp,
    listed_shard_attrs,
    read_manifest,
    read_rejects,
    shard_dir,
    shard_seq_ids,
    stale_temp_files,
    write_rejects,
)
from flashdraft.store.format import DTYPES, StoreError, StoreLayout
from flashdraft.store.lock import writer_lock
from flashdraft.store.projection import (
    DEFAULT_CALIBRATION_TOKENS,
    METHODS,
    Projection,
    copy_projection,
    fit_projection,
    load_projection,
    resolve_dims,
    save_projection,
    temp_projection_file,
)
from flashdraft.store.reader import StoreReader
from flashdraft.store.space import DiskFullError, disk_full, is_disk_full
from flashdraft.store.writer import ShardWriter, StoreWriter

PROVENANCE = ("target", "chat_template_sha256", "vocab_size", "generation", "sources")
REPLAY_STORE_NAMES = ("features-heldout",)  # conf/config.yaml eval.replay_store, the held-out capture's folder
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3", "fp32": "float32"}
NO_PROJECTION = (None, "none", "null", "")
_COMPARED_COUNTS = ("sequences", "tokens")  # what a copy must hold of its source's counts to be complete


class TranscodeStopped(StoreError):
    """A transcode stopped before it wrote every shard of its source: the copy is partial (its manifest says so) and
    the same command finishes it. (A full disk stops it with a DiskFullError instead, saying the same.)"""


@dataclass(frozen=True)
class TranscodeOptions:
    """What a transcode makes of its source, checked and resolved. Recorded in the copy's manifest, so that a rerun
    asking for anything else is refused by name."""

    dtype: str  # the copy's feature dtype (`DTYPES`)
    project: str | None  # "pca": a basis fitted on the source; None: raw features, or `basis`'s
    project_dims: int  # r, the projected dimensions; 0: raw features
    calibration_tokens: int | None  # tokens the fitted basis sees (project="pca" only)
    basis: str | None  # the projected store whose basis is copied (resolved path)

    def arguments(self) -> list[str]:
        """The command-line options that ask for these (`python -m pipeline transcode SRC DST ...`)."""
        args = [f"dtype={self.dtype}"]
        if self.basis:
            args.append(f"basis={self.basis}")
        elif self.project:
            args += [
                f"project={self.project}",
                f"project_dims={self.project_dims}",
                f"calibration_tokens={self.calibration_tokens}",
            ]
        return args


def is_replay_store(path, manifest: dict) -> bool:
    """The eval prompts' store (the served-order replay's): its folder name, or its recorded split."""
    return Path(path).name in REPLAY_STORE_NAMES or manifest.get("split") == "heldout"


def calibration_features(reader: StoreReader, tokens: int) -> torch.Tensor:
    """The raw features of the store's first `tokens` tokens, in store order (the last sequence cut)."""
    parts, n = [], 0
    for i in range(len(reader)):
        f = reader.read(i).features
        parts.append(f[: tokens - n])
        n += len(parts[-1])
        if n >= tokens:
            break
    return torch.cat(parts)


# --- options -----------------------------------------------------------------------------------------------------


def check_options(
    src_layout: StoreLayout, *, dtype=None, project=None, project_dims=None, calibration_tokens=None, basis=None
) -> TranscodeOptions:
    """The options of a transcode of a store of `src_layout`, checked and resolved; a bad one is refused naming its
    key and value. `project_dims` and `calibration_tokens` apply to project=pca only (refused elsewhere, where they
    would be ignored); defaults: the source's dtype, 2H dimensions, `DEFAULT_CALIBRATION_TOKENS`."""
    dtype = _check_dtype(dtype, src_layout.dtype)
    if project not in NO_PROJECTION and project not in METHODS:
        raise StoreError(f"project must be one of {', '.join(METHODS)} (or none), got {project!r}")
    project = None if project in NO_PROJECTION else project
    given = (("project_dims", project_dims), ("calibration_tokens", calibration_tokens))
    unused = {k: v for k, v in given if v is not None}  # what a fit alone uses: refused where it would be ignored
    if basis is not None:
        if unused:
            raise StoreError(
                f"{_listing(unused)} given with basis={basis}: the basis brings its own dimensions and fit; "
                f"leave {' and '.join(unused)} out"
            )
        dims = _basis(basis, src_layout).dims
        return TranscodeOptions(dtype, None, dims, None, str(Path(basis).resolve()))
    if project is None:
        if unused:
            raise StoreError(f"{_listing(unused)} given without project=pca: {' and '.join(unused)} apply to it only")
        return TranscodeOptions(dtype, None, 0, None, None)
    input_dims = len(src_layout.layer_ids) * src_layout.hidden_size
    dims = resolve_dims(
        "2H" if project_dims is None else project_dims, src_layout.hidden_size, input_dims, "project_dims"
    )
    return TranscodeOptions(dtype, project, dims, _check_tokens(calibration_tokens), None)


def _listing(options: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in options.items())


def _check_dtype(value, source_dtype: str) -> str:
    if value is None:
        return source_dtype
    name = DTYPE_ALIASES.get(value, value)
    if name not in DTYPES:
        raise StoreError(f"dtype must be one of {', '.join(DTYPE_ALIASES)} (or {', '.join(DTYPES)}), got {value!r}")
    return name


def _check_tokens(value) -> int:
    if value is None:
        return DEFAULT_CALIBRATION_TOKENS
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StoreError(
            f"calibration_tokens must be a whole number of tokens >= 1 (default {DEFAULT_CALIBRATION_TOKENS}), got "
            f"{value!r}"
        )
    return value


def _basis(basis, src_layout: StoreLayout) -> Projection:
    """The basis of projected store `basis` (checked), refused by name where it projects other layers."""
    bmanifest = read_manifest(basis)
    proj = load_projection(basis, bmanifest)
    if proj is None:
        raise StoreError(f"basis={basis} is not a projected store: it holds no basis")
    L, H = len(src_layout.layer_ids), src_layout.hidden_size
    if proj.input_dims != L * H or list(bmanifest["layer_ids"]) != list(src_layout.layer_ids):
        raise StoreError(
            f"basis={basis} projects layers {bmanifest['layer_ids']} x {bmanifest['hidden_size']}, the source holds "
            f"{list(src_layout.layer_ids)} x {H}"
        )
    return proj


# --- what a copy holds of its source -----------------------------------------------------------------------------


def transcode_progress(manifest: dict) -> dict | None:
    """What a transcoded store holds of its source: {"complete", "shards": (written, of), "sequences": (written, of)};
    None for a store transcode did not write (a capture's). Complete when the transcode marked it so and its counts
    equal those of the source it recorded (a copy written before the mark existed: its counts alone decide)."""
    origin = manifest.get("transcoded_from")
    if not isinstance(origin, dict):
        return None
    source = origin.get("counts") or origin.get("tokens") or {}  # "tokens": the counts' key before the mark
    held = manifest.get("counts") or {}
    shards = (len(manifest["shards"]), origin.get("shards"))
    same = all(held.get(k) == source.get(k) for k in _COMPARED_COUNTS) and shards[1] in (None, shards[0])
    return {
        "complete": origin.get("complete", True) is True and same,
        "shards": shards,
        "sequences": (held.get("sequences", 0), source.get("sequences")),
    }


def finish_command(path, manifest: dict) -> str:
    """How to finish the partial copy at `path`: the command that began it, from its manifest."""
    origin = manifest["transcoded_from"]
    recorded = origin.get("options")
    if not isinstance(recorded, dict):
        return (
            f"it was begun by an older transcode that did not record its options: delete {path} and run that "
            "transcode again"
        )
    options = TranscodeOptions(**{f.name: recorded.get(f.name) for f in fields(TranscodeOptions)})
    command = ["python", "-m", "pipeline", "transcode", str(origin.get("path")), str(path), *options.arguments()]
    return f"the same command finishes it: {shlex.join(command)}"


def partial_transcode_problem(path, manifest: dict) -> str | None:
    """Why the store at `path` must not be used as it is, when it is a partial transcode (what it holds of its
    source, and the command that finishes it); None for a complete copy or a store transcode did not write."""
    state = transcode_progress(manifest)
    if state is None or state["complete"]:
        return None
    (written, of), (seqs, of_seqs) = state["shards"], state["sequences"]
    shards = f"{written} of {of} shards" if of is not None else f"{written} shards"
    return (
        f"{path} is a partial transcode of {manifest['transcoded_from'].get('path')} (the transcode stopped before "
        f"its end): {shards}, {seqs} of {of_seqs} sequences written; {finish_command(path, manifest)}"
    )


# --- the transcode -----------------------------------------------------------------------------------------------


def transcode(
    src,
    dst,
    *,
    dtype: str | None = None,
    project: str | None = None,
    project_dims=None,
    calibration_tokens=None,
    basis=None,
    progress: bool = True,
) -> dict:
    """Write `dst`, a copy of store `src` in `dtype` (default: src's), projected by a basis fitted on src
    (`project`='pca', `project_dims` (default 2H), `calibration_tokens`) or by `basis` (another projected store's);
    returns dst's manifest. A partial `dst` begun by the same command is finished (`check_options` for the
    options, the module's docstring for the rest)."""
    src, dst = Path(src), Path(dst)
    manifest = read_manifest(src)
    _check_source(src, manifest, basis)
    layout = StoreLayout.from_manifest(manifest)
    options = check_options(
        layout, dtype=dtype, project=project, project_dims=project_dims, calibration_tokens=calibration_tokens,
        basis=basis,
    )  # fmt: skip
    _check_destination(dst, src, manifest, options)
    with writer_lock(dst, what="transcode"):  # one writer a store; a killed transcode's lock is taken over
        return _transcode_locked(src, dst, manifest, options, progress)


def _check_source(src: Path, manifest: dict, basis) -> None:
    if manifest.get("layout", {}).get("project_dims") or manifest.get("projection"):
        raise StoreError(f"{src} is already a projected store: its layers cannot be recovered; transcode a raw store")
    if is_replay_store(src, manifest) and basis is None:
        raise StoreError(
            f"{src} is a replay store (the eval prompts' store): served-order replay reads its raw features with the "
            "exported drafter, which reads raw features whatever store it was trained on; keep it as it is. Only an "
            "eval copy for a drafter trained on a projected store is made of it: basis=THAT_STORE"
        )


def _check_destination(dst: Path, src: Path, manifest: dict, options: TranscodeOptions) -> None:
    """`dst` is absent, empty, a partial copy of `src` by these options (checked again under the lock), or holds only
    what a transcode killed before its manifest was written leaves (its lock files, temporary shards and files).
    Checked before the lock is taken, so that a refused command leaves `dst` as it was."""
    if is_store(dst):
        _check_resumable(dst, read_manifest(dst), src, manifest, options)
        return
    if not dst.exists():
        return
    if not dst.is_dir():
        raise StoreError(f"{dst} exists and is not a folder: transcode writes a store there")
    stale = set(stale_temp_files(dst))
    others = [p.name for p in sorted(dst.iterdir()) if not (p in stale or _leftover(p))]
    if others:
        raise StoreError(
            f"{dst} exists, is not a feature store and holds {', '.join(others[:5])}: transcode writes a new store "
            "(or finishes one it began); choose another DST"
        )


def _leftover(p: Path) -> bool:
    if p.name in (WRITER_LOCK, LOCK):
        return p.is_file()
    return p.name == SHARDS and p.is_dir() and all(is_temp(d) for d in p.iterdir())


def _transcode_locked(src: Path, dst: Path, manifest: dict, options: TranscodeOptions, progress: bool) -> dict:
    reader = StoreReader(src)
    writer = _open_copy(src, dst, manifest, reader.layout, options)
    _remove_leftovers(writer)
    try:
        proj = _copy_basis(writer, reader, options)
        _adopt_unlisted(writer, src, manifest)
        _copy_shards(writer, reader, src, manifest, proj, progress)
        write_rejects(dst, read_rejects(src))
        writer.update(transcoded_from={**read_manifest(dst)["transcoded_from"], "complete": True})
    except (StoreError, OSError) as e:
        raise _stopped(e, dst) from e
    return read_manifest(dst)


def _open_copy(src: Path, dst: Path, manifest: dict, layout: StoreLayout, options: TranscodeOptions) -> StoreWriter:
    """A writer of the copy: a new store, or the partial one this same transcode began (refused by name when it was
    begun from another source, from this one before it changed, or with other options)."""
    new_layout = replace(layout, dtype=options.dtype, project_dims=options.project_dims)
    extra = {k: manifest.get(k) for k in PROVENANCE if k in manifest}
    if is_store(dst):
        _check_resumable(dst, read_manifest(dst), src, manifest, options)
    else:
        extra["transcoded_from"] = {
            "path": str(src.resolve()),
            "created": manifest.get("created"),
            "dtype": layout.dtype,
            "counts": manifest["counts"],
            "shards": len(manifest["shards"]),
            "options": asdict(options),
            "complete": False,
        }
    return StoreWriter(dst, manifest_extra=extra, **asdict(new_layout))  # every layout field, as the source's


def _check_resumable(dst: Path, copy: dict, src: Path, manifest: dict, options: TranscodeOptions) -> None:
    """The existing store `dst` (manifest `copy`) is a transcode of `src` as it is now, with `options`."""
    origin = copy.get("transcoded_from")
    if not isinstance(origin, dict):
        raise StoreError(
            f"{dst} is a feature store that transcode did not write (its manifest has no transcoded_from): transcode "
            "writes a new store, or finishes one it began; choose another DST"
        )
    if origin.get("path") != str(src.resolve()):
        raise StoreError(
            f"{dst} is a transcode of {origin.get('path')}, not of {src.resolve()}: finish it from that source, or "
            "transcode into another DST"
        )
    if not isinstance(origin.get("options"), dict):
        raise StoreError(f"{dst} cannot be finished: {finish_command(dst, copy)}")
    then = _source_state(origin.get("created"), origin.get("counts") or {}, origin.get("shards"))
    now = _source_state(manifest.get("created"), manifest["counts"], len(manifest["shards"]))
    if then != now:
        raise StoreError(
            f"{src} has changed since {dst} was begun from it ({then} then, {now} now): delete {dst} and transcode "
            "again"
        )
    asked, recorded = asdict(options), origin["options"]
    differing = [k for k in asked if asked[k] != recorded.get(k)]
    if differing:
        detail = "; ".join(
            f"{k}: {dst} was begun with {recorded.get(k)!r}, this command asks {asked[k]!r}" for k in differing
        )
        raise StoreError(
            f"{dst} is a transcode of {src} with other options ({detail}): {finish_command(dst, copy)}, or transcode "
            "into another DST"
        )


def _source_state(created, counts: dict, shards) -> str:
    seqs = ", ".join(f"{counts.get(k)} {k}" for k in _COMPARED_COUNTS)
    return f"{shards} shards, {seqs}, created {created}"


def _remove_leftovers(writer: StoreWriter) -> None:
    """Delete what a stopped transcode left (temporary and incomplete shards, half-written manifest, rejects and
    basis files): safe under the writer lock, which keeps every other writer out."""
    gone = writer.remove_temp()
    tmp = temp_projection_file(writer.path)
    if tmp.exists():
        tmp.unlink()
        gone.append(tmp.name)
    if gone:
        print(f"{writer.path}: removed what a stopped transcode left: {', '.join(gone)}", file=sys.stderr, flush=True)


def _copy_basis(writer: StoreWriter, reader: StoreReader, options: TranscodeOptions) -> Projection | None:
    """The copy's basis (None: raw features): the one it records (a rerun: checked, not fitted again), or fitted on
    the source's first `calibration_tokens` tokens, or copied from `basis`, then recorded."""
    if not options.project_dims:
        return None
    if writer.manifest.get("projection"):
        return load_projection(writer.path)
    if options.basis:  # the same bytes, so the same sha256: stores of one basis train together
        entry = copy_projection(options.basis, writer.path)
    else:
        layout = reader.layout
        proj = fit_projection(calibration_features(reader, options.calibration_tokens), options.project_dims)
        entry = save_projection(writer.path, proj, layer_ids=list(layout.layer_ids), hidden_size=layout.hidden_size)
    writer.update(projection=entry)
    return load_projection(writer.path)  # what the store now holds, checked


def _adopt_unlisted(writer: StoreWriter, src: Path, manifest: dict) -> None:
    """List a complete shard a killed transcode renamed into place but did not list, when it holds exactly the
    sequences of the source's shard of its name (`StoreWriter.adopt` refuses it by name otherwise)."""
    names = {e["name"] for e in manifest["shards"]}
    for name in writer.unlisted_shards():
        if name in names:
            writer.adopt(name, shard_seq_ids(shard_dir(src, name)))
        else:
            print(f"{shard_dir(writer.path, name)} is not a shard of {src}: left alone", file=sys.stderr, flush=True)


def _copy_shards(writer: StoreWriter, reader: StoreReader, src: Path, manifest: dict, proj, progress: bool) -> None:
    """Write every shard of the source the copy does not list yet, each committed then listed."""
    from tqdm import tqdm

    done = set(writer.committed)
    todo = [e["name"] for e in manifest["shards"] if e["name"] not in done]
    if done:
        print(
            f"{writer.path}: resuming a partial transcode: {len(done)} of {len(manifest['shards'])} shards already "
            f"written, {len(todo)} to go",
            file=sys.stderr,
            flush=True,
        )
    for name in tqdm(todo, desc="transcode", unit="shard", disable=not progress):
        with ShardWriter(writer.path, name, writer.layout) as shard:
            _copy_sequences(shard, reader, src, name, proj)
        writer.register(shard.info())


def _copy_sequences(shard: ShardWriter, reader: StoreReader, src: Path, name: str, proj) -> None:
    """Append the sequences, rejects and notes of the source's shard `name` to `shard`, projected by `proj`."""
    attrs = listed_shard_attrs(src, name)
    thinking = attrs.get("thinking") or [None] * len(attrs["seq_ids"])
    topk = bool(reader.layout.teacher_topk)
    for j, seq_id in enumerate(attrs["seq_ids"]):
        seq = reader.read(reader.index(seq_id), teacher=topk)
        feats = seq.features if proj is None else seq.features @ proj.projection
        teacher = (seq.teacher_ids, seq.teacher_logp) if topk else None
        shard.append(seq_id, seq.input_ids, seq.loss_mask, feats, teacher, thinking[j])
    for r in attrs.get("rejects", []):
        shard.reject(**r)
    for note in attrs.get("notes", []):
        shard.note(note["seq_id"], note["note"], **{k: v for k, v in note.items() if k not in ("seq_id", "note")})


def _stopped(error: BaseException, dst: Path) -> StoreError:
    """The error a transcode stopped by `error` raises: `error`, then what the copy holds and how to finish it."""
    try:
        note = partial_transcode_problem(dst, read_manifest(dst)) or f"{dst} is partial"
    except StoreError:
        note = f"{dst} is partial"
    if isinstance(error, OSError) and is_disk_full(error):
        error = disk_full(dst, error)
    message = str(error) if isinstance(error, StoreError) else f"{type(error).__name__}: {error}"
    return (DiskFullError if is_disk_full(error) else TranscodeStopped)(f"{message}\n{note}")
