"""One writer per store: a capture holds the store's writer lock for its whole run.

The lock is `fcntl.flock` on `files.WRITER_LOCK` inside the store, taken without waiting: a second capture into the
same store is refused at once, its error naming the holder (host, pid, start time, written into the lock file by the
holder). The kernel releases a flock when its holder dies, however it dies, so a lock file left by a dead run is
free and is taken over (and the takeover said). The lock is per run, not per process: the driver holds it, and the
shard writers it starts (Ray actors in their own processes) write while it does. Within one process the lock is
re-entrant: the command line takes it before it opens the store, the fleet again when the run starts.

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
from pathlib import Path

from flashdraft.store.files import WRITER_LOCK
from flashdraft.store.format import StoreError


class StoreLockedError(StoreError):
    """Another capture is writing this store."""


_held: dict[Path, list] = {}  # resolved store path -> [open lock file, depth]: the locks this process holds


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


def _holder_record() -> dict:
    pid = os.getpid()
    started = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    return {"host": socket.gethostname(), "pid": pid, "started": started, "process_start": _process_start(pid)}


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
        return "a capture that is just starting (it has not written its name yet)"
    if "unreadable" in record:
        return f"an unknown holder (the lock file holds {record['unreadable']!r})"
    return f"host {record.get('host')}, pid {record.get('pid')}, started {record.get('started')}"


def _same_live_process(record: dict) -> bool:
    """Whether the lock file names a process of this host that is running now (its pid not reused since)."""
    pid = record.get("pid")
    if record.get("host") != socket.gethostname() or not isinstance(pid, int) or not _alive(pid):
        return False
    return _process_start(pid) == record.get("process_start")


def _acquire(store: Path):
    """The open lock file, flocked and naming this process; StoreLockedError naming the holder when it is taken."""
    store.mkdir(parents=True, exist_ok=True)
    lock = store / WRITER_LOCK
    f = os.fdopen(os.open(lock, os.O_RDWR | os.O_CREAT, 0o644), "r+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = describe_holder(_read_record(f))
        f.close()
        raise StoreLockedError(
            f"{store} is being written by another capture ({holder}; lock {lock}). One capture writes a store at a "
            "time: wait for that one to end, or capture into another directory."
        ) from None
    previous = _read_record(f)
    if previous and _same_live_process(previous):
        # the flock is free but the process the file names runs: its lock file was replaced under it
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()
        raise StoreLockedError(
            f"{store}: the lock file {lock} names a running process ({describe_holder(previous)}) that does not hold "
            "it (was the file removed and recreated?). Stop that capture, or, if it is not a capture, delete the "
            "lock file and rerun."
        )
    if previous:
        why = "no longer running" if previous.get("host") == socket.gethostname() else "its lock is free"
        print(
            f"{store}: took over the lock {lock} of an earlier capture ({describe_holder(previous)}; {why})",
            file=sys.stderr,
            flush=True,
        )
    f.seek(0)
    f.truncate()
    json.dump(_holder_record(), f)
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


@contextmanager
def writer_lock(store_path: str | Path):
    """Hold the store's writer lock for the block (created with the store's folder if missing); re-entrant within a
    process. Raises StoreLockedError naming the holder when another process holds it."""
    store = Path(os.path.abspath(store_path))
    if store in _held:
        _held[store][1] += 1
        try:
            yield
        finally:
            _held[store][1] -= 1
        return
    f = _acquire(store)
    _held[store] = [f, 1]
    try:
        yield
    finally:
        del _held[store]
        _release(f)
