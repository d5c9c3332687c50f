"""A full disk: an error that names where and how much is free, raised before a shard is written when it would not
fit, and never worth a retry (the next attempt finds the same disk)."""

from __future__ import annotations

import errno
import shutil
from contextlib import contextmanager
from pathlib import Path

from flashdraft.store.format import StoreError, StoreLayout, bytes_per_token

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
SHARD_OVERHEAD_BYTES = 64 << 10  # a shard's zarr.json files and indexes, beyond its rows
WHAT_TO_DO = "free space or capture into another directory, then rerun the same command to resume"


class DiskFullError(StoreError):
    """The store's filesystem is full, or too full for the next shard."""


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, DiskFullError) or (isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS)


def free_bytes(path: str | Path) -> int:
    """Free bytes on the filesystem of `path` (of its nearest existing parent while it does not exist yet)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def disk_full(path: str | Path, error: OSError) -> DiskFullError:
    """The error to raise for `error` (ENOSPC or EDQUOT) met while writing `path`."""
    return DiskFullError(
        f"no space left on device writing {path}: {free_bytes(path):,} bytes free there ({error.strerror}); "
        + WHAT_TO_DO
    )


@contextmanager
def naming_disk_full(path: str | Path):
    """Turn a full disk met inside the block into a DiskFullError naming `path` and the free bytes."""
    try:
        yield
    except OSError as e:
        if e.errno in DISK_FULL_ERRNOS:
            raise disk_full(path, e) from e
        raise


def shard_bytes_estimate(layout: StoreLayout, tokens: int) -> int:
    """An upper bound of the bytes a shard of `tokens` rows takes: uncompressed rows plus its metadata."""
    per_token = bytes_per_token(len(layout.layer_ids), layout.hidden_size, layout.dtype, layout.teacher_topk)
    return tokens * per_token + SHARD_OVERHEAD_BYTES


def check_free_space(shard_path: str | Path, layout: StoreLayout, tokens: int) -> None:
    """Refuse to start a shard of at most `tokens` rows at `shard_path` that the disk may not hold."""
    need, free = shard_bytes_estimate(layout, tokens), free_bytes(shard_path)
    if need > free:
        raise DiskFullError(
            f"not enough space for shard {shard_path}: it needs up to {need:,} bytes ({tokens:,} tokens, "
            f"uncompressed), {free:,} bytes free there; " + WHAT_TO_DO
        )
