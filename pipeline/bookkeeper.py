"""The fleet's books: what it does with a task's outcome (list a committed shard; retry a failed task, or report it),
and which committed shards a crash left unlisted that this run may adopt.

A failed task is retried on another worker unless its error would recur on any (`deterministic`) or it is out of
attempts; a full disk stops the run at once. A task whose shard is on disk after all (its worker died between commit
and reply) is listed, not run again.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from flashdraft.store import StoreError, StoreWriter, committed_seq_ids, shard_exists
from flashdraft.store.files import shard_dir, shard_seq_ids
from flashdraft.store.space import is_disk_full
from pipeline.capture import TargetNaNError
from pipeline.settings import Task
from pipeline.summary import Summary, count_rejects


class Bookkeeper:
    """What the fleet does with a task's outcome: list a committed shard, or retry / report a failed task."""

    def __init__(
        self, store_path: Path, writer: StoreWriter, max_attempts: int, summary: Summary, bar, tasks, on_result
    ):
        self.store_path, self.writer, self.max_attempts, self.summary = store_path, writer, max_attempts, summary
        self.bar, self.tasks, self.on_result, self.t0 = bar, tasks, on_result, time.time()

    @property
    def stopped(self) -> bool:
        return bool(self.summary.stopped)

    def stop(self, why: str) -> None:
        """Stop the run: start no other task. `why` points at the FAILED shard line that has the whole error."""
        if not self.summary.stopped:
            self.summary.stopped = f"the run stopped: {why}"

    def not_started(self, queue) -> None:
        """Count the tasks a stopped run leaves in its queue."""
        self.summary.not_run += len(queue)
        queue.clear()

    def committed(self, result: dict) -> None:
        info, summary = result["info"], self.summary
        try:
            self.writer.register(info)
        except StoreError as e:  # the shard is in place; the next run lists it (`adopt_unlisted`)
            summary.failed.append({"shard": info["name"], "attempts": 1, "error": f"committed, not listed: {e}"})
            if is_disk_full(e):
                self.stop(f"disk full listing shard {info['name']} (above)")
            return
        summary.shards_done += 1
        summary.new_sequences += info["sequences"]
        summary.new_tokens += info["tokens"]
        count_rejects(summary, info.get("rejects", []))
        self.bar.update(info["sequences"] + len(info.get("rejects", [])))
        rate = summary.new_tokens / (time.time() - self.t0)
        self.bar.set_postfix(shards=f"{summary.shards_done}/{self.tasks}", tok_s=f"{rate:.0f}")
        if self.on_result is not None:
            self.on_result(result)

    def failed(self, task: Task, error: BaseException, retry: bool) -> Task | None:
        """The task to queue again, or None: it did commit after all, or it is out of attempts (then reported).
        A full disk is reported at its first attempt and stops the run."""
        if shard_exists(self.store_path, task.name):  # it did commit before its worker died, or it is another's
            try:
                self.writer.adopt(task.name, [r.seq_id for r in task.records])
            except StoreError as e:
                error, retry = e, False
            else:
                self.committed({"info": self.writer.entry(task.name), "pid": None, "seconds": 0.0})
                return None
        if is_disk_full(error):
            self.stop(f"disk full at shard {task.name} (above)")
            retry = False
        attempts = task.attempt + 1
        error = f"{type(error).__name__}: {error}"[:2000]
        if retry and attempts < self.max_attempts:
            self.summary.retried.append({"shard": task.name, "attempt": attempts, "error": error})
            return replace(task, attempt=attempts)
        self.summary.failed.append(
            {"shard": task.name, "attempts": attempts, "error": error, "sequences": len(task.records)}
        )
        self.summary.failed_sequences += len(task.records)
        return None


def deterministic(error: BaseException) -> bool:
    """Whether a task's error would recur on any worker, so that a retry cannot help: a target that emits NaN, or
    a ValueError (a setting or input the task cannot take; the entry checks settings up front, entry.ranges). A
    worker that died, ran out of memory or met a transient I/O error is retried."""
    return isinstance(error, (TargetNaNError, ValueError))


def adopt_unlisted(writer: StoreWriter, run_ids: set[str]) -> list[str]:
    """List the complete shards on disk that the manifest misses (a crash between rename and manifest update) when
    they are this run's work: their sequences all among its prompts and none committed yet. Returns why each other
    one was left alone."""
    left, done = [], committed_seq_ids(writer.path)
    for name in writer.unlisted_shards():
        ids = shard_seq_ids(shard_dir(writer.path, name))
        if ids <= run_ids and not ids & done:
            writer.adopt(name)
            done |= ids
        else:
            left.append(
                f"{shard_dir(writer.path, name)} is not listed and holds {len(ids - run_ids)} sequence id(s) not "
                f"among this run's prompts, {len(ids & done)} already committed; not adopted"
            )
    return left
