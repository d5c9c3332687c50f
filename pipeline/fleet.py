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
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from flashdraft.prompts import PromptRecord, duplicate_reason
from flashdraft.store import StoreWriter, committed_seq_ids, next_shard_index, shard_name
from flashdraft.store.lock import writer_lock
from pipeline.basis import fit_store_projection
from pipeline.bookkeeper import Bookkeeper, adopt_unlisted, deterministic
from pipeline.localray import local_ray
from pipeline.settings import CaptureSettings, Task
from pipeline.summary import Summary, count_rejects, finish_run
from pipeline.worker import CaptureWorker


@dataclass
class FleetConfig:
    num_actors: int | str = "auto"  # 0: run in this process, no Ray; auto: `resolve_actors`
    cpus_per_actor: float = 1
    gpus_per_actor: float | str = "auto"  # auto: 1 where the capture runs on GPUs, else 0
    ray_address: str | None = None
    shard_size: int = 64  # prompts per task / shard
    max_attempts: int = 3
    object_store_mb: int = 256


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
    count_rejects(summary, [*load_rejects, *dupes])
    total = sum(len(t.records) for t in tasks)
    bar = tqdm(total=total, unit="seq", desc="capture", disable=not progress, smoothing=0.1)
    book = Bookkeeper(store_path, writer, fleet.max_attempts, summary, bar, len(tasks), on_result)
    try:
        if tasks and fleet.num_actors == 0:
            _run_inline(store_path, settings, tasks, book, records)
        elif tasks:
            _run_ray(store_path, settings, tasks, fleet, book, records)
    finally:
        bar.close()
        summary.wall_s = time.time() - t0
        finish_run(store_path, writer, summary, load_rejects, dupes)
    return summary


def _run_inline(store_path, settings, tasks, book: Bookkeeper, records=()) -> None:
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


def _run_ray(store_path, settings, tasks, fleet: FleetConfig, book: Bookkeeper, records=()) -> None:
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


def _drive_actors(store_path, settings, tasks, fleet: FleetConfig, book: Bookkeeper, records=()) -> None:
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
