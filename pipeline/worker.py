"""One capture worker: holds a target, turns a task (a shard's worth of prompts) into a committed shard.

The same class runs in-process (`num_actors: 0`) or as a Ray actor, one per GPU on a cluster. Sequences go to the
shard writer as they finish, and the writer writes every `store.shard_tokens` rows into the shard's arrays, so a
worker holds at most the `batch_size` sequences decoding plus one block of rows, whatever the task's size; the
shard still commits atomically at the end of the task.

A task's records are encoded (`pipeline.encode`), its shard opened, its sequences decoded into it
(`pipeline.taskdecode`), and the shard committed. A call may name the task the worker gets next (its lookahead): in
the shared greedy decode its prompts join the batch behind the current task's, so the batch stays full across the
boundary.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from flashdraft.store import ShardWriter, StoreLayout, read_manifest, shard_exists
from flashdraft.store.files import shard_dir
from flashdraft.store.projection import fit_store_basis
from flashdraft.store.space import check_free_space
from flashdraft.target import load_target, resolve_dtype, stop_token_ids
from pipeline.basis import calibration_features, store_basis
from pipeline.encode import PromptEncoder
from pipeline.plan import plan_worker
from pipeline.settings import CaptureSettings, Task
from pipeline.shardqueue import BackgroundShard
from pipeline.taskdecode import TaskDecoder, TaskRun


def load_capture_target(settings: CaptureSettings):
    """(model, tokenizer) of the settings' target, on its device (auto: CUDA where present) in its dtype."""
    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = resolve_dtype(settings.dtype, device)
    return load_target(settings.target, dtype, device, trust_remote_code=settings.trust_remote_code)


def shard_rows(settings: CaptureSettings, encoded, chats) -> int:
    """The most rows a task's shard can take: each record captured as it is, or each prompt plus its longest response
    (max_new_tokens, within max_length); a conversation holds at most max_length tokens."""
    if settings.mode == "capture":
        rows = sum(len(x[1]) for x in encoded)
    else:
        rows = sum(min(len(x[1]) + settings.max_new_tokens, settings.max_length) for x in encoded)
    return rows + len(chats) * settings.max_length


def say(line: str) -> None:
    print(f"capture worker {os.getpid()}: {line}", file=sys.stderr, flush=True)


class CaptureWorker:
    def __init__(self, store_path: str, settings: CaptureSettings):
        self.store_path, self.s = str(store_path), settings
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        self.layout = StoreLayout.from_manifest(read_manifest(store_path))
        self.model, tokenizer = load_capture_target(settings)
        self.encoder = PromptEncoder(tokenizer, stop_token_ids(self.model, tokenizer), settings)
        self.plan = plan_worker(settings, self.model, self.layout.teacher_topk, torch.get_num_threads())
        # 0 threads: shards written in the decode loop; 1: in each shard's own writing thread; more: a pool they share
        threads = self.plan.threads
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="shard-encode") if threads > 1 else None
        self._projection = None  # the store's basis on the model's device, once a task needs it (`projection`)
        self.decoder = TaskDecoder(
            self.model, self.encoder, settings, self.plan, self.layout.teacher_topk, self.projection
        )
        self._ahead: TaskRun | None = None  # the lookahead task opened by the last call
        for line in self.plan.lines:
            say(line)

    def pid(self) -> int:
        return os.getpid()

    # --- the store's projection -----------------------------------------------------------------

    def projection(self):
        """The store's basis (None for raw features), read from the store once its manifest records it (the file's
        sha256 checked), on the model's device: every worker of a capture applies the one basis the driver fitted."""
        if self.layout.project_dims and self._projection is None:
            device = next(self.model.parameters()).device
            self._projection = store_basis(self.store_path, self.layout.project_dims, device)
        return self._projection

    def fit_projection(self, records, tokens: int, method: str = "pca") -> dict:
        """Fit the store's basis on the raw features of the first `tokens` tokens of `records` (their prompts, or in
        capture mode their whole sequences; one prefill a `prefill_tokens` group, on the target's device) and write
        it into the store; returns the manifest's `projection` entry (the driver records it)."""
        layers = list(self.s.layer_ids)
        feats = calibration_features(self.model, self.encoder, records, tokens, layers, self.plan.prefill_tokens)
        entry, line = fit_store_basis(
            self.store_path,
            feats,
            self.layout.project_dims,
            method=method,
            layer_ids=layers,
            hidden_size=self.layout.hidden_size,
        )
        say(line)
        return entry

    # --- a task ------------------------------------------------------------------------------

    def run(self, task: Task, lookahead: Task | None = None) -> dict:
        """Capture `task` into its shard and commit it. `lookahead`: the task this worker is given next. In a greedy
        single-turn regeneration its prompts join the decode behind this task's, so the batch stays full across the
        boundary; its sequences go to its own shard, which the call that runs it finishes and commits (a call for
        another task drops it: nothing of it is committed)."""
        t0 = time.time()
        current = self._take_ahead(task)
        try:
            if current is not None:  # checked when it was opened ahead; the disk has filled since
                check_free_space(shard_dir(self.store_path, task.name), self.layout, current.space)
            current = current or self._open(task)
            if lookahead is not None and self.decoder.overlaps(current):
                self._ahead = self._open_ahead(lookahead)
            self.decoder.decode_task(current)
            self._commit(current)
        except BaseException:
            if current is not None:
                current.shard.abort()
            self._drop_ahead()
            raise
        devices = os.environ.get("CUDA_VISIBLE_DEVICES")  # as Ray set it for this actor (None: unset)
        return {
            "info": current.shard.info(),
            "pid": os.getpid(),
            "seconds": time.time() - t0,
            "devices": devices,
            **({"projection_sha256": self.projection().sha256} if self.layout.project_dims else {}),
        }

    def close(self) -> None:
        """Drop a lookahead never run (its temporary shard goes) and stop the compression threads."""
        self._drop_ahead()
        if self.pool is not None:
            self.pool.shutdown()

    def _open(self, task: Task) -> TaskRun:
        """Encode a task's records, check the disk has room for its shard, open the shard (written off the decode
        loop) with its rejects, and, in the shared greedy decode, queue its prompts."""
        if shard_exists(self.store_path, task.name):
            raise FileExistsError(f"shard {task.name} already exists in {self.store_path}")
        self.projection()  # a projected store's basis before anything is captured (refused when it is damaged)
        encoded, chats, rejects = self.encoder.encode_task(task.records)
        space = shard_rows(self.s, encoded, chats)
        check_free_space(shard_dir(self.store_path, task.name), self.layout, space)
        if self.plan.threads:
            shard = BackgroundShard(self.store_path, task.name, self.layout, pool=self.pool)
        else:
            shard = ShardWriter(self.store_path, task.name, self.layout)
        for rec, reason in rejects:
            shard.reject(rec.seq_id, reason, source=rec.source, record_id=rec.record_id)
        encoded.sort(key=lambda x: len(x[1]))  # similar lengths batch (and join the batch) with little padding
        run = TaskRun(task, shard, encoded, chats, self.encoder.recorded_thinking, space)
        self.decoder.queue(run)
        return run

    def _open_ahead(self, task: Task) -> TaskRun | None:
        """The lookahead task opened, or None where it cannot be now (its own call will say why)."""
        try:
            return self._open(task)
        except Exception:  # noqa: BLE001 - the task fails in its own call, with its own error
            return None

    def _take_ahead(self, task: Task) -> TaskRun | None:
        """The lookahead opened by the previous call when it is `task`; any other is dropped."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and (ahead.task.name, ahead.task.records) == (task.name, task.records):
            return ahead
        if ahead is not None:
            self._ahead = ahead
            self._drop_ahead()
        return None

    def _drop_ahead(self) -> None:
        """Abort the lookahead's shard and reset the shared decode (after an error, or a lookahead not run)."""
        if self._ahead is not None:
            self._ahead.shard.abort()
            self._ahead = None
        self.decoder.reset()

    def _commit(self, run: TaskRun) -> None:
        """Commit `run`'s shard. Written off the decode loop, its thread flushes, fsyncs and renames it while this one
        goes on decoding the lookahead task's sequences (into the lookahead's shard) until the commit is done."""
        if not isinstance(run.shard, BackgroundShard):
            run.shard.commit()
            return
        run.shard.start_commit()
        while run.shard.committing() and self._ahead is not None and self._ahead.outstanding:
            self.decoder.take()
        run.shard.finish_commit()
