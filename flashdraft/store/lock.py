"""One writer per store: a capture (or a transcode, or a repair) holds the store's writer lock for its whole run.

The lock is `fcntl.flock` on `files.WRITER_LOCK` inside the store, taken without waiting: a second capture into the
same store is refused at once, its error naming the holder (what it is, host, pid, start time, written into the lock
file by the holder). The kernel releases a flock when its holder dies, however it dies, so a lock file left by a dead
run is free and is taken over (and the takeover said). The lock is per run, not per process: the driver holds it, and
the shard writers it starts (Ray actors in their own processes) write while it does. Within one process the lock is
re-entrant: the command line takes it before it opens the store, the fleet again when the run starts.

`folder_lock` is the same lock on any folder, `FolderLock` saying its file's name, its error and the words of a
refusal: the store's is `STORE_WRITER` (`writer_lock`); the trainer's, on its `train.out_dir`, `trainer.run_lock`.

This is not `files.manifest_lock`, which serialises manifest rewrites for a moment each and waits for its turn.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from flashdraft.store.files import WRITER_LOCK
from flashdraft.store.format import StoreError


class StoreLockedError(StoreError):
    """Another capture is writing this store."""


@dataclass(frozen=True)
class FolderLock:
    """A folder's lock: its file's `name` in the folder, the `error` a refusal raises, and its words: "<folder>
    <busy> another <what> (<holder>; lock <path>). <advice>"."""

    name: str
    error: type[Exception]
    busy: str
    advice: str


STORE_WRITER = FolderLock(
    WRITER_LOCK,
    StoreLockedError,
    "is being written by",
    "One writer (a capture, a transcode or a repair) writes a store at a time: wait for that one to end, or write "
    "into another directory.",
)

_held: dict[Path, list] = {}  # resolved lock file path -> [open lock file, depth]: the locks this process holds


def _process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot; with the pid, it names one process), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 of stat; fields 1-2 end at the command's ")"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


def _holder_record(what: str) -> dict:
    pid = os.getpid()
    started = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    record = {"host": socket.gethostname(), "pid": pid, "started": started, "process_start": _process_start(pid)}
    return {**record, "what": what}


def holder_kind(record: dict) -> str:
    """What the lock file's holder is ("capture", "transcode", ...); a record written before it said: a capture."""
    what = record.get("what")
    return what if isinstance(what, str) and what else "capture"


def _read_record(f) -> dict:
    f.seek(0)
    text = f.read()
    try:
        record = json.loads(text) if text.strip() else {}
    except ValueError:
        record = {"unreadable": text[:200]}
    return record if isinstance(record, dict) else {"unreadable": text[:200]}


def describe_holder(record: dict) -> str:
    if not record:
        return "a writer that is just starting (it has not written its name yet)"
    if "unreadable" in record:
        return f"an unknown holder (the lock file holds {record['unreadable']!r})"
    return f"host {record.get('host')}, pid {record.get('pid')}, started {record.get('started')}"


def _same_live_process(record: dict) -> bool:
    """Whether the lock file names a process of this host that is running now (its pid not reused since)."""
    pid = record.get("pid")
    if record.get("host") != socket.gethostname() or not isinstance(pid, int) or not _alive(pid):
        return False
    return _process_start(pid) == record.get("process_start")


def _acquire(store: Path, what: str, kind: FolderLock = STORE_WRITER):
    """The open lock file, flocked and naming this process as a `what`; `kind.error` naming the holder when it is
    taken."""
    store.mkdir(parents=True, exist_ok=True)
    lock = store / kind.name
    f = os.fdopen(os.open(lock, os.O_RDWR | os.O_CREAT, 0o644), "r+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        record = _read_record(f)
        f.close()
        raise kind.error(
            f"{store} {kind.busy} another {holder_kind(record)} ({describe_holder(record)}; lock {lock}). {kind.advice}"
        ) from None
    previous = _read_record(f)
    if previous and _same_live_process(previous):
        # the flock is free but the process the file names runs: its lock file was replaced under it
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()
        held_by = holder_kind(previous)
        raise kind.error(
            f"{store}: the lock file {lock} names a running process ({describe_holder(previous)}) that does not hold "
            f"it (was the file removed and recreated?). Stop that {held_by}, or, if it is not a {held_by}, delete the "
            "lock file and rerun."
        )
    if previous:
        why = "no longer running" if previous.get("host") == socket.gethostname() else "its lock is free"
        print(
            f"{store}: took over the lock {lock} of an earlier {holder_kind(previous)} ({describe_holder(previous)}; "
            f"{why})",
            file=sys.stderr,
            flush=True,
        )
    f.seek(0)
    f.truncate()
    json.dump(_holder_record(what), f)
    f.flush()
    os.fsync(f.fileno())
    return f


def _release(f) -> None:
    """Empty the lock file (a clean end leaves no holder to take over from), then unlock it."""
    try:
        f.seek(0)
        f.truncate()
        f.flush()
    except OSError:  # a full disk cannot refuse a truncate, but a gone mount can; the flock goes with the close
        pass
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def writer_lock(store_path: str | Path, what: str = "capture"):
    """Hold the store's writer lock for the block (created with the store's folder if missing); re-entrant within a
    process. Raises StoreLockedError naming the holder when another process holds it. `what` the holder is (the
    lock file records it, so that a refused writer names it): "capture", "transcode", ..."""
    return folder_lock(store_path, what, STORE_WRITER)


@contextmanager
def folder_lock(folder: str | Path, what: str, kind: FolderLock):
    """Hold `kind`'s lock of `folder` for the block (created with the folder if missing), as a `what`; re-entrant
    within a process. Raises `kind.error` naming the holder when another process holds it."""
    folder = Path(os.path.abspath(folder))
    lock = folder / kind.name
    if lock in _held:
        _held[lock][1] += 1
        try:
            yield
        finally:
            _held[lock][1] -= 1
        return
    f = _acquire(folder, what, kind)
    _held[lock] = [f, 1]
    try:
        yield
    finally:
        del _held[lock]
        _release(f)
