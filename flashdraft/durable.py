"""Writes that survive a power loss: file and folder fsyncs, and an atomic swap of two folders.

A rename is durable only once the folder holding the new name is fsynced: until then a power loss can undo it even
though the renamed file's own data was fsynced. Every rename that commits data (a shard, a manifest, a checkpoint,
an exported drafter) is followed by `fsync_dir` of its parent, before anything that relies on it is written.
"""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # renameat2 flag (Linux 3.15+): swap two paths atomically, either may be a folder


def fsync_dir(path: str | Path) -> None:
    """Make the entries of folder `path` (names created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """fsync every file and folder under `root` (and `root` itself), deepest first."""
    for dirpath, _, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                fsync_file(path)
        fsync_dir(dirpath)


def replace_durably(src: str | Path, dst: str | Path) -> None:
    """`os.replace(src, dst)` and fsync of the folder(s) it changed (src's data must be fsynced already)."""
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)
    if Path(src).parent.resolve() != Path(dst).parent.resolve():
        fsync_dir(Path(src).parent)


def write_text_durably(path: str | Path, text: str) -> None:
    """Replace the file at `path` with `text` (`write_bytes_durably`)."""
    write_bytes_durably(path, text.encode())


def write_bytes_durably(path: str | Path, data: bytes) -> None:
    """Replace the file at `path` with `data`: written under a temporary name (`path` + ".tmp"), fsynced, renamed,
    folder fsynced. A crash leaves either the old file or the new one, never a part of it; a failed write leaves no
    temporary file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        replace_durably(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def exchange(a: str | Path, b: str | Path) -> bool:
    """Swap the paths `a` and `b` in one atomic step (renameat2 RENAME_EXCHANGE) and fsync their folder. False
    where the system or filesystem cannot (not Linux, an old kernel or libc, NFS): nothing was changed then."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
            return False
        raise OSError(err, f"exchanging {a} and {b}: {os.strerror(err)}")
    fsync_dir(Path(b).parent)
    if Path(a).parent.resolve() != Path(b).parent.resolve():
        fsync_dir(Path(a).parent)
    return True
