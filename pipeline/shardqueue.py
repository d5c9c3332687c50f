"""A shard written off the decode loop: the loop hands sequences over, one thread per shard writes them.

`BackgroundShard` wraps a `ShardWriter`: `append`, `reject` and `note` go into a bounded queue (a full queue blocks
the decode loop: back-pressure, so host memory holds at most `queue_items` sequences waiting to be written) and one
thread takes them out in order, converts the features to the stored dtype and, every write block, compresses the
block's inner chunks on a shared thread pool (the `pool` of `ShardWriter`). Each shard still has exactly one
writer, and commits as before, in its own thread too: `start_commit` queues the commit (flush, fsync, rename) behind
what is queued and returns, so the decode loop can go on while the disk syncs; `commit` (or `finish_commit` after
`start_commit`) waits for it and returns the shard's manifest entry. An error in the writing thread (a full disk) is
raised in the caller at its next call, and the shard's temporary folder is deleted, as `ShardWriter` does.
"""

from __future__ import annotations

import queue
import threading

from flashdraft.store import ShardWriter

QUEUE_ITEMS = 16  # sequences waiting to be written, a shard
_DONE = object()


class BackgroundShard:
    def __init__(self, store_path, name: str, layout, pool=None, queue_items: int = QUEUE_ITEMS):
        self.writer = ShardWriter(store_path, name, layout, pool=pool)
        self.name = name
        self._queue: queue.Queue = queue.Queue(maxsize=queue_items)
        self._error: BaseException | None = None
        self._entry: dict | None = None  # the committed shard's manifest entry
        self._thread = threading.Thread(target=self._drain, name=f"shard-{name}", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while (item := self._queue.get()) is not _DONE:
            if self._error is None:  # after an error, what is still queued is dropped
                method, args, kwargs = item
                try:
                    result = getattr(self.writer, method)(*args, **kwargs)
                    if method == "commit":
                        self._entry = result
                except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
                    self._error = e

    def _put(self, method: str, *args, **kwargs) -> None:
        self._raise()
        if not self._thread.is_alive():
            raise RuntimeError(f"shard {self.name}: its writing thread has ended")
        self._queue.put((method, args, kwargs))

    def _raise(self) -> None:
        if self._error is not None:
            self.abort()
            raise self._error

    def append(self, *args, **kwargs) -> None:
        self._put("append", *args, **kwargs)

    def reject(self, *args, **kwargs) -> None:
        self._put("reject", *args, **kwargs)

    def note(self, *args, **kwargs) -> None:
        self._put("note", *args, **kwargs)

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_DONE)
            self._thread.join()

    def start_commit(self) -> None:
        """Queue the commit (`ShardWriter.commit`) behind what is queued; the writing thread ends with it."""
        self._put("commit")
        self._queue.put(_DONE)

    def committing(self) -> bool:
        """Whether the writing thread is still at work (after `start_commit`: the commit is not done)."""
        return self._thread.is_alive()

    def finish_commit(self) -> dict:
        """Wait for the commit `start_commit` queued; returns the shard's manifest entry."""
        self._thread.join()
        self._raise()
        if self._entry is None:
            raise RuntimeError(f"shard {self.name}: its writing thread ended without committing")
        return self._entry

    def commit(self) -> dict:
        """Write what is queued, then commit the shard (`ShardWriter.commit`) in the writing thread; returns its
        manifest entry."""
        self.start_commit()
        return self.finish_commit()

    def abort(self) -> None:
        """Drop what is queued, delete the temporary shard."""
        self._error = self._error or RuntimeError(f"shard {self.name} aborted")
        self._stop()
        self.writer.abort()

    def info(self) -> dict:
        return self.writer.info()

    def __enter__(self) -> BackgroundShard:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
