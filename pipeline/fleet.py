"""The capture fleet: cut prompts into shard tasks, run them on workers, commit, resume, summarise.

Workers are Ray actors (one target each; a local Ray on loopback unless an address is given) or, with
`num_actors=0`, one in-process worker. A task whose worker dies is retried on another one; a task
that fails `max_attempts` times is reported, never looped on, and one whose error would recur on any worker (a
ValueError, a target emitting NaN: `deterministic`) at its first attempt. Rerunning the same command skips
every prompt already in a committed shard (captured or rejected): nothing lost, nothing twice.
The run holds the store's writer lock (one capture a store); a full disk stops it at once, no retries.
"""

from __future__ import annotations

import sys
import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from flashdraft.prompts import PromptRecord, duplicate_reason
from flashdraft.store import (
    StoreError,
    StoreWriter,
    committed_seq_ids,
    next_shard_index,
    read_manifest,
    shard_exists,
    shard_name,
    shard_rejects,
    shards_bytes,
    write_rejects,
)
from flashdraft.store.files import shard_dir, shard_seq_ids
from flashdraft.store.lock import writer_lock
from flashdraft.store.projection import DEFAULT_CALIBRATION_TOKENS
from flashdraft.store.space import is_disk_full
from pipeline.capture import TargetNaNError
from pipeline.localray import local_ray
from pipeline.worker import CaptureSettings, CaptureWorker, Task


@dataclass
class FleetConfig:
    num_actors: int | str = "auto"  # 0: run in this process, no Ray; auto: `resolve_actors`
    cpus_per_actor: float = 1
    gpus_per_actor: float | str = "auto"  # auto: 1 where the capture runs on GPUs, else 0
    ray_address: str | None = None
    shard_size: int = 64  # prompts per task / shard
    max_attempts: int = 3
    object_store_mb: int = 256


@dataclass
class Summary:
    store: str
    sequences: int = 0  # in the store, all runs
    tokens: int = 0
    response_tokens: int = 0
    bytes: int = 0
    new_sequences: int = 0  # this run
    new_tokens: int = 0
    shards_done: int = 0
    shards_skipped: int = 0  # prompts already committed by earlier runs
    failed: list = field(default_factory=list)  # {"shard", "attempts", "error"}
    retried: list = field(default_factory=list)  # failed attempts queued again: {"shard", "attempt", "error"}
    stopped: str = ""  # why the run stopped before its last task (a full disk), else ""
    not_run: int = 0  # tasks never started because the run stopped
    left_alone: list = field(default_factory=list)  # shards found on disk, not listed, and not adopted: why
    rejects: dict = field(default_factory=dict)  # reason -> count, all runs
    wall_s: float = 0.0
    # This run's records: each one read lands in exactly one of `accounts()` (captured, already stored, ...).
    read: int = 0  # records read from the sources: kept, rejected on load, or outside the split
    split: str | None = None  # the split asked for (None: all)
    outside_split: int = 0  # records read that belong to the other split
    duplicates: int = 0  # conversations met before in this run
    rejected: dict = field(default_factory=dict)  # this run's rejects but duplicates, reason -> count
    already_stored: int = 0  # captured or rejected by an earlier run into this store
    failed_sequences: int = 0  # records of the shards in `failed`

    def accounts(self) -> dict[str, int]:
        """Where this run's records went; the values add up to `read`."""
        return {
            "captured": self.new_sequences,
            "already in the store": self.already_stored,
            "duplicates": self.duplicates,
            "rejected": sum(self.rejected.values()),
            "outside the split": self.outside_split,
            "in failed shards": self.failed_sequences,
        }

    def account_lines(self) -> list[str]:
        parts = " + ".join(f"{n} {what}" for what, n in self.accounts().items())
        out = [f"  this run: {self.read} records read = {parts}"]
        if self.rejected:
            out.append(
                "    rejected: " + ", ".join(f"{n} {r}" for r, n in sorted(self.rejected.items(), key=lambda x: -x[1]))
            )
        if self.outside_split:
            other = "heldout" if self.split == "train" else "train"
            why = " (kept for evaluation; data.split=null captures them too)" if other == "heldout" else ""
            out.append(f"    outside the split: {self.outside_split} of the {other} split, not captured{why}")
        return out

    @property
    def ok(self) -> bool:
        return not self.failed and not self.stopped

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / max(1, self.tokens)

    def lines(self) -> list[str]:
        out = [
            f"store {self.store}",
            f"  sequences {self.sequences} ({self.new_sequences} new), tokens {self.tokens} ({self.new_tokens} new), "
            f"response tokens {self.response_tokens}",
            f"  bytes on disk {self.bytes / 2**20:.1f} MiB, {self.bytes_per_token:.0f} bytes/token",
            f"  shards committed this run {self.shards_done}; wall {self.wall_s:.1f} s, "
            f"{self.new_tokens / max(self.wall_s, 1e-9):.0f} tokens/s",
            f"  rejects {sum(self.rejects.values())} (all runs)"
            + "".join(f"\n    {n:6d}  {r}" for r, n in sorted(self.rejects.items(), key=lambda x: -x[1])),
            *self.account_lines(),
        ]
        out += [f"  left alone: {why}" for why in self.left_alone]
        for r in self.retried:
            out.append(f"  retried shard {r['shard']} after attempt {r['attempt']} failed: {r['error'][:300]}")
        for f in self.failed:
            out.append(f"  FAILED shard {f['shard']} after {f['attempts']} attempt(s): {f['error']}")
        if self.stopped:
            left = f" ({self.not_run} shard(s) not started)" if self.not_run else ""
            out.append(f"  FAILED: {self.stopped}{left}")
        return out


def reject_reason_class(reason: str) -> str:
    """Group reasons that differ only in details (line numbers, lengths, the seq_id a duplicate repeats)."""
    if reason.startswith("duplicate of "):
        return "duplicate"
    return reason.split(":")[0].split(" (")[0].strip()


def plan_tasks(
    records: list[PromptRecord], done: set[str], shard_size: int, first_index: int
) -> tuple[list[Task], list[dict], int]:
    """Tasks for records not yet done, the rejects of repeated conversations among the records (load_records finds
    them as it reads; this catches records put together otherwise) and how many records were done already."""
    pending, dupes, first_of, already = [], [], {}, 0
    for r in records:
        first = first_of.get(r.conversation_key)
        if first is not None:  # the same record twice, or another with its conversation
            reason = duplicate_reason(first)
            dupes.append({"seq_id": r.seq_id, "source": r.source, "record_id": r.record_id, "reason": reason})
            continue
        first_of[r.conversation_key] = r
        if r.seq_id in done:
            already += 1
        else:
            pending.append(r)
    tasks = [
        Task(shard_name(first_index + k), tuple(pending[i : i + shard_size]))
        for k, i in enumerate(range(0, len(pending), shard_size))
    ]
    return tasks, dupes, already


def run_fleet(
    store_path: str | Path,
    records: list[PromptRecord],
    settings: CaptureSettings,
    writer: StoreWriter,
    fleet: FleetConfig,
    *,
    load_rejects: list[dict] = (),
    load_counts: dict | None = None,
    split: str | None = None,
    on_result=None,
    progress: bool = True,
) -> Summary:
    """Capture `records` into the store `writer` manages. `writer` is opened by the caller
    (it checks that an existing store holds the same capture). `load_counts` is what load_records counted
    ("read", "outside split") for `split`; without it the records and `load_rejects` are all that was read. The run
    holds the store's writer lock (StoreLockedError naming the holder when another capture has it)."""
    with writer_lock(store_path):
        return _run_locked(
            Path(store_path), records, settings, writer, fleet, load_rejects, load_counts, split, on_result, progress
        )


def _run_locked(
    store_path: Path, records, settings, writer, fleet, load_rejects, load_counts, split, on_result, progress
) -> Summary:
    t0 = time.time()
    left_alone = adopt_unlisted(writer, {r.seq_id for r in records})
    writer.remove_temp()  # safe: the writer lock keeps every other capture out
    tasks, dupes, already = plan_tasks(
        records, committed_seq_ids(store_path), fleet.shard_size, next_shard_index(store_path)
    )
    counts = load_counts or {"read": len(records) + len(load_rejects), "outside split": 0}
    summary = Summary(str(store_path), shards_skipped=len(writer.committed), split=split, already_stored=already)
    summary.left_alone = left_alone
    summary.read, summary.outside_split = counts["read"], counts["outside split"]
    _count_rejects(summary, [*load_rejects, *dupes])
    total = sum(len(t.records) for t in tasks)
    bar = tqdm(total=total, unit="seq", desc="capture", disable=not progress, smoothing=0.1)
    book = _Bookkeeper(store_path, writer, fleet, summary, bar, len(tasks), on_result)
    try:
        if tasks and fleet.num_actors == 0:
            _run_inline(store_path, settings, tasks, book, records)
        elif tasks:
            _run_ray(store_path, settings, tasks, fleet, book, records)
    finally:
        bar.close()
        summary.wall_s = time.time() - t0
        _finish(store_path, writer, summary, load_rejects, dupes)
    return summary


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


class _Bookkeeper:
    """What the fleet does with a task's outcome: list a committed shard, or retry / report a failed task."""

    def __init__(
        self, store_path: Path, writer: StoreWriter, fleet: FleetConfig, summary: Summary, bar, tasks, on_result
    ):
        self.store_path, self.writer, self.fleet, self.summary = store_path, writer, fleet, summary
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
        _count_rejects(summary, info.get("rejects", []))
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
        if retry and attempts < self.fleet.max_attempts:
            self.summary.retried.append({"shard": task.name, "attempt": attempts, "error": error})
            return replace(task, attempt=attempts)
        self.summary.failed.append(
            {"shard": task.name, "attempts": attempts, "error": error, "sequences": len(task.records)}
        )
        self.summary.failed_sequences += len(task.records)
        return None


def projection_to_fit(writer: StoreWriter) -> dict | None:
    """The manifest's `projection` entry when the store is projected and its basis is not fitted yet; else None."""
    writer.manifest = read_manifest(writer.path)
    entry = writer.manifest.get("projection")
    if not writer.layout.project_dims or (entry and entry.get("sha256")):
        return None
    return entry or {"method": "pca", "calibration_tokens": DEFAULT_CALIBRATION_TOKENS}


def fit_store_projection(writer: StoreWriter, fit, records) -> None:
    """Fit a projected store's basis once, before any task is dispatched: `fit(records, tokens, method)` (a worker's
    `fit_projection`, in-process or on actor 0) writes it into the store; the driver records its sha256 in the
    manifest, and every worker reads that one basis (checked against it) when it opens a task."""
    entry = projection_to_fit(writer)
    if entry is None:
        return
    tokens = int(entry["calibration_tokens"])
    # the first prompts, enough of them for the calibration tokens (a worker takes them in order until it has those)
    first = list(records[: max(1024, tokens // 8)])
    got = fit(first, tokens, entry.get("method", "pca"))
    writer.update(projection={**entry, **got})
    print(f"projection basis {got['sha256'][:12]} recorded in {writer.path}", file=sys.stderr, flush=True)


def deterministic(error: BaseException) -> bool:
    """Whether a task's error would recur on any worker, so that a retry cannot help: a target that emits NaN, or
    a ValueError (a setting or input the task cannot take; the entry checks settings up front, entry.ranges). A
    worker that died, ran out of memory or met a transient I/O error is retried."""
    return isinstance(error, (TargetNaNError, ValueError))


def _run_inline(store_path, settings, tasks, book: _Bookkeeper, records=()) -> None:
    worker = CaptureWorker(str(store_path), settings)
    queue = deque(tasks)
    try:
        fit_store_projection(book.writer, worker.fit_projection, records)
        while queue:
            if book.stopped:
                book.not_started(queue)
                return
            task = queue.popleft()
            try:
                result = worker.run(task, lookahead=queue[0] if queue else None)
            except Exception as e:  # noqa: BLE001 - reported per shard; the fleet goes on
                again = book.failed(task, e, retry=not deterministic(e))
                if again is not None:
                    queue.append(again)
                continue
            book.committed(result)
    finally:
        worker.close()


@contextmanager
def _ray_up(fleet: FleetConfig):
    """Ray for the run: the caller's if it started one (theirs to stop), the cluster at `ray_address`, or a local
    instance on loopback that is stopped, all of it, when the run ends or the driver dies."""
    import ray

    kwargs = dict(include_dashboard=False, log_to_driver=True, logging_level="warning")
    if ray.is_initialized():
        yield
    elif fleet.ray_address:
        print(f"Ray: joining the cluster at {fleet.ray_address} (cluster.ray_address)", flush=True)
        ray.init(address=fleet.ray_address, **kwargs)
        try:
            yield
        finally:
            ray.shutdown()
    else:
        cpus = max(1, int(fleet.num_actors * max(fleet.cpus_per_actor, 1)))
        with local_ray(num_cpus=cpus, object_store_memory=fleet.object_store_mb << 20, **kwargs):
            yield


def resolve_actors(fleet: FleetConfig, device: str, gpus: float) -> tuple[FleetConfig, str]:
    """`auto` actor settings made numbers, and a line that says why. `gpus`: the GPUs the capture may use (the Ray
    cluster's). Where the capture runs on GPUs (`device` not cpu, some GPUs present): one GPU an actor and one actor
    per GPU, so every GPU of the machine (or cluster) works and each actor owns its own device; else one actor on
    the CPU."""
    on_gpus = device != "cpu" and gpus > 0
    per_actor = fleet.gpus_per_actor
    if per_actor == "auto":
        per_actor = 1 if on_gpus else 0
    actors = fleet.num_actors
    if actors == "auto":
        actors = max(1, int(gpus // per_actor)) if on_gpus and per_actor > 0 else 1
    why = f"{gpus:g} GPU(s) in Ray, device {device}"
    line = f"capture fleet: {actors} actor(s), {float(per_actor):g} GPU(s) each ({why})"
    return replace(fleet, num_actors=int(actors), gpus_per_actor=float(per_actor)), line


def _run_ray(store_path, settings, tasks, fleet: FleetConfig, book: _Bookkeeper, records=()) -> None:
    import ray

    local, _ = resolve_actors(fleet, settings.device, local_gpus(settings.device))
    with _ray_up(replace(fleet, num_actors=local.num_actors)):
        fleet, line = resolve_actors(fleet, settings.device, ray.cluster_resources().get("GPU", 0))
        print(line, file=sys.stderr, flush=True)
        _drive_actors(store_path, settings, tasks, fleet, book, records)


def local_gpus(device: str) -> int:
    """The GPUs of this machine that torch sees (a local Ray finds the same)."""
    if device == "cpu":
        return 0
    import torch

    return torch.cuda.device_count()


def capture_actor(fleet: FleetConfig):
    """The Ray actor class of a capture worker: `cpus_per_actor` CPUs and `gpus_per_actor` GPUs each (with one GPU an
    actor, Ray gives each its own device in CUDA_VISIBLE_DEVICES, so each target loads on its own `cuda:0`)."""
    import ray

    return ray.remote(num_cpus=fleet.cpus_per_actor, num_gpus=fleet.gpus_per_actor, max_restarts=0)(CaptureWorker)


def _drive_actors(store_path, settings, tasks, fleet: FleetConfig, book: _Bookkeeper, records=()) -> None:
    """Two calls in flight an actor, each naming the task of the actor's next call as its lookahead (the worker
    decodes it across the boundary): a slot's `reserved` task is the lookahead its last call was given."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    Actor = capture_actor(fleet)
    make = lambda: Actor.remote(str(store_path), settings)  # noqa: E731
    actors = [make() for _ in range(fleet.num_actors)]
    queue, inflight = deque(tasks), {}
    reserved: list[Task | None] = [None] * len(actors)

    def submit(slot: int) -> None:
        if book.stopped:
            return
        task = reserved[slot] or (queue.popleft() if queue else None)
        if task is not None:
            reserved[slot] = queue.popleft() if queue else None
            inflight[actors[slot].run.remote(task, reserved[slot])] = (task, slot, actors[slot])

    try:
        # a projected store's basis, fitted once by actor 0 before any task: every actor then reads that one
        fit = lambda recs, tokens, method: ray.get(actors[0].fit_projection.remote(recs, tokens, method))  # noqa: E731
        fit_store_projection(book.writer, fit, records)
        for _ in range(2):  # two tasks queued per actor: no idle gap between tasks
            for slot in range(len(actors)):
                submit(slot)
        while inflight:
            [ref], _ = ray.wait(list(inflight), num_returns=1)
            task, slot, actor = inflight.pop(ref)
            try:
                result = ray.get(ref)
            except RayActorError as e:  # the worker process died (killed, OOM, node lost)
                if actors[slot] is actor:
                    actors[slot] = make()
                    if reserved[slot] is not None:  # the dead actor's lookahead, never called: to the queue
                        queue.appendleft(reserved[slot])
                        reserved[slot] = None
                again = book.failed(task, e, retry=True)
            except RayTaskError as e:
                cause = e.cause if getattr(e, "cause", None) is not None else e
                again = book.failed(task, cause, retry=not deterministic(cause))
            else:
                book.committed(result)
                again = None
            if again is not None:
                queue.append(again)
            for s in range(len(actors)):  # top every actor up to two queued tasks
                if sum(1 for _, sl, _ in inflight.values() if sl == s) < 2:
                    submit(s)
        queue.extendleft(t for t in reserved if t is not None)  # a stopped run's lookaheads were never called
        book.not_started(queue)  # empty unless the run stopped
    finally:
        for a in actors:
            ray.kill(a)


def _count_rejects(summary: Summary, rejects) -> None:
    """Add this run's `rejects` to the summary's duplicates or, by reason class, to its rejected."""
    for r in rejects:
        reason = reject_reason_class(r["reason"])
        if reason == "duplicate":
            summary.duplicates += 1
        else:
            summary.rejected[reason] = summary.rejected.get(reason, 0) + 1


def _finish(store_path: Path, writer: StoreWriter, summary: Summary, load_rejects, dupes) -> None:
    """Rewrite the store's rejects (prompt-file rejects + every committed shard's) and fill the summary. A full
    disk here is the summary's FAILED line: the shards committed before it are listed and intact."""
    manifest = read_manifest(store_path)
    rejects = [*load_rejects, *dupes, *shard_rejects(manifest)]
    try:
        write_rejects(store_path, rejects)
    except StoreError as e:
        _not_recorded(summary, "rejects", e)
    c = manifest["counts"]
    summary.sequences, summary.tokens, summary.response_tokens = (
        c["sequences"],
        c["tokens"],
        c.get("response_tokens", 0),
    )
    summary.bytes = shards_bytes(store_path)
    summary.rejects = dict(Counter(reject_reason_class(r["reason"]) for r in rejects))
    last_run = {"finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "wall_s": round(summary.wall_s, 2)}
    try:
        writer.update(
            last_run={
                **last_run,
                "failed_shards": summary.failed,
                "retried": summary.retried,
                "rejects": summary.rejects,
            }
        )
    except StoreError as e:
        _not_recorded(summary, "last_run", e)


def _not_recorded(summary: Summary, what: str, error: StoreError) -> None:
    """A full disk met while the run writes its record: one more cause on the summary's FAILED line."""
    if not is_disk_full(error):
        raise error
    cause = f"the run's {what} not written: {type(error).__name__}: {error}"
    summary.stopped = f"{summary.stopped}; {cause}" if summary.stopped else cause
