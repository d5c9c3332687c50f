"""One capture worker: holds a target, turns a task (a shard's worth of prompts) into a committed shard.

The same class runs in-process (`num_actors: 0`) or as a Ray actor, one per GPU on a cluster. Sequences go to the
shard writer as they finish, and the writer writes every `store.shard_tokens` rows into the shard's arrays, so a
worker holds at most the `batch_size` sequences decoding plus one block of rows, whatever the task's size; the
shard still commits atomically at the end of the task.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

from flashdraft.config import SamplingConfig
from flashdraft.prompts import PromptRecord, thinking_of
from flashdraft.store import ShardWriter, StoreLayout, read_manifest, shard_exists
from flashdraft.store.files import shard_dir
from flashdraft.store.projection import fit_projection, load_projection, save_projection
from flashdraft.store.space import check_free_space
from flashdraft.target import (
    chat_text,
    load_target,
    resolve_dtype,
    stop_token_ids,
    template_default_thinking,
    template_takes_thinking,
)
from flashdraft.target.memory import decode_rows, prefill_token_budget
from pipeline.capture import Captured, capture, regenerate_stream, token_batches
from pipeline.decode import ContinuousDecode, default_overlap
from pipeline.hostcopy import default_staged
from pipeline.shardqueue import BackgroundShard
from pipeline.turns import Conversation, regenerate_conversations, user_turns

CPU_BATCH_SIZE = 8  # data.batch_size auto on a CPU
CPU_PREFILL_TOKENS = 16384  # data.prefill_tokens auto in capture mode on a CPU
GPU_ADMIT_TOKENS = 16384  # ... in regenerate mode on a GPU: a prefill of joining prompts, small next to the KV cache


@dataclass(frozen=True)
class CaptureSettings:
    """What a capture worker does, every field given by its caller (`pipeline.__main__.settings_from`, from the
    model, data and cluster settings of flashdraft.config, where each default and its meaning is stated once)."""

    target: str
    layer_ids: tuple[int, ...]
    dtype: str  # the target's compute dtype (model.dtype)
    device: str
    mode: str  # regenerate | capture (records already carry responses)
    turns: str  # regenerate mode: all | single (data.turns)
    max_new_tokens: int
    max_length: int  # prompt + response, tokens
    max_prompt_tokens: int
    batch_size: int | str  # decode rows, or auto: from the free GPU memory (CPU: CPU_BATCH_SIZE)
    prefill_tokens: int | str  # tokens a prefill holds (rows x longest), or auto (`capture_budgets`)
    gpu_memory_fraction: float  # of the free GPU memory the auto sizes plan to fill
    sampling: SamplingConfig
    seed: int
    system_prompt: str | None
    enable_thinking: bool | None
    # set: each prompt's enable_thinking is drawn from its seq_id, this share on (flashdraft.prompts.thinking_of)
    thinking_share: float | None
    trust_remote_code: bool
    torch_threads: int | None
    # threads writing shards off the decode loop (0: in the decode loop), or auto (`CaptureWorker.writer_threads`)
    writer_threads: int | str = "auto"
    overlap: bool | None = None  # read each decode step while the next runs (data.overlap); None: auto (on CUDA)
    staged_copies: bool | None = None  # the decode's host copies staged (data.staged_copies); None: auto (on CUDA)

    def __post_init__(self):
        if self.mode not in ("regenerate", "capture"):
            raise ValueError(f"capture mode must be 'regenerate' or 'capture', got {self.mode!r}")
        if self.turns not in ("all", "single"):
            raise ValueError(f"data.turns must be 'all' or 'single', got {self.turns!r}")
        for key in ("batch_size", "prefill_tokens"):
            value = getattr(self, key)
            if value != "auto" and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"data.{key} must be a positive number or auto, got {value!r}")
        threads = self.writer_threads
        if threads != "auto" and not (isinstance(threads, int) and threads >= 0):
            raise ValueError(f"data.writer_threads must be 0 (in the decode loop), more, or auto, got {threads!r}")
        if self.thinking_share is not None and not 0 <= self.thinking_share <= 1:
            raise ValueError(f"data.thinking_share must be in [0, 1], got {self.thinking_share}")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"data.gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")

    def identity(self) -> dict:
        """The settings that define what a store holds (a resumed run must match them)."""
        d = asdict(self)
        # how and where the work runs, not what it computes; the target is identified by its fingerprint
        how = ("device", "batch_size", "prefill_tokens", "gpu_memory_fraction", "torch_threads", "writer_threads")
        for k in (*how, "overlap", "staged_copies"):
            d.pop(k)
        for k in ("trust_remote_code", "target"):
            d.pop(k)
        d["layer_ids"] = list(self.layer_ids)
        # single turns and unmixed thinking are written as the absence of their key, so that the stores that hold them
        # keep one identity whichever way they were asked for
        if self.turns == "single" or self.mode == "capture":
            d.pop("turns")
        if self.thinking_share is None:
            d.pop("thinking_share")
        return d

    def thinking_for(self, seq_id: str) -> bool | None:
        """The enable_thinking prompt `seq_id` is rendered with: drawn from its id in a mixed capture."""
        if self.thinking_share is None:
            return self.enable_thinking
        return thinking_of(seq_id, self.thinking_share)


@dataclass(frozen=True)
class Task:
    name: str  # the shard this task writes
    records: tuple[PromptRecord, ...]
    attempt: int = 0


def task_seed(seed: int, name: str, batch: int) -> int:
    return int(hashlib.sha256(f"{seed}:{name}:{batch}".encode()).hexdigest()[:15], 16)


@dataclass
class _TaskRun:
    """A task being captured: its open shard, its encoded single-turn records (sorted by length), its
    conversations, and how many of its sequences the shared decode still owes it."""

    task: Task
    shard: BackgroundShard | ShardWriter  # ShardWriter: written in the decode loop (data.writer_threads 0)
    encoded: list
    chats: list
    thinking_of: Callable[[str], bool | None]
    space: int  # the most rows its shard can take (`check_free_space`)
    outstanding: int = 0

    def store(self, seq_id: str, out: Captured) -> None:
        self.shard.append(seq_id, out.input_ids, out.loss_mask, out.features, out.teacher, self.thinking_of(seq_id))


def writer_threads(setting: int | str, device: torch.device, cpu_threads: int) -> tuple[int, str]:
    """(threads writing shards, why): data.writer_threads, or auto: on a GPU every CPU thread of the worker
    (`cpu_threads`: its torch threads, cluster.cpus_per_actor) but the decode loop's, so the host's work overlaps the
    device's; on a CPU 0, shards written in the decode loop (torch's threads compute the decode on every core; a
    writing thread would compete with them)."""
    if setting != "auto":
        return setting, "data.writer_threads"
    if torch.device(device).type == "cuda":
        return max(1, cpu_threads - 1), f"auto on a GPU: the worker's {cpu_threads} CPU thread(s) but the decode loop's"
    return 0, "auto on CPU"


def capture_budgets(
    free: int | None,
    config,
    dtype,
    *,
    mode: str,
    batch_size: int | str,
    prefill_tokens: int | str,
    max_length: int,
    fraction: float,
    captured_layers: int,
    teacher_topk: int = 0,
) -> tuple[int, int | None, list[str]]:
    """(decode rows, prefill token budget or None for unlimited, one line each saying why) of a capture of a target
    of `config` in `dtype`. `auto` on a GPU is sized from `free`, the GPU memory free once the target is loaded
    (flashdraft.target.memory); on a CPU (`free` None) it is a fixed default: CPU_BATCH_SIZE rows; in capture mode
    CPU_PREFILL_TOKENS tokens a prefill, in regenerate mode the joining prompts prefilled together, unsplit."""
    prefill, prefill_line = _prefill_budget(
        free, config, dtype, mode, prefill_tokens, max_length, fraction, captured_layers, teacher_topk
    )
    if mode == "capture":
        return 1, prefill, [prefill_line]
    if batch_size != "auto":
        return batch_size, prefill, [f"decode batch {batch_size} rows: data.batch_size", prefill_line]
    if free is None:
        return CPU_BATCH_SIZE, prefill, [f"decode batch {CPU_BATCH_SIZE} rows: auto on CPU", prefill_line]
    budget = decode_rows(
        free,
        config,
        dtype,
        max_length,
        fraction=fraction,
        prefill_tokens=prefill or 0,
        captured_layers=captured_layers,
    )
    return budget.value, prefill, [budget.line, prefill_line]


def _prefill_budget(
    free, config, dtype, mode, prefill_tokens, max_length, fraction, captured_layers, teacher_topk
) -> tuple[int | None, str]:
    if prefill_tokens != "auto":
        return prefill_tokens, f"prefill budget {prefill_tokens:,} tokens: data.prefill_tokens"
    if free is None and mode == "regenerate":
        return None, "prefill budget unlimited: auto on CPU (the prompts joining the decode prefill together)"
    if free is None or mode == "regenerate":
        n = CPU_PREFILL_TOKENS if free is None else GPU_ADMIT_TOKENS
        return n, f"prefill budget {n:,} tokens: auto on {'CPU' if free is None else 'a GPU, regenerate mode'}"
    budget = prefill_token_budget(
        free,
        config,
        dtype,
        max_length,
        captured_layers=captured_layers,
        fraction=fraction,
        teacher_topk=teacher_topk,
    )
    return budget.value, budget.line


class CaptureWorker:
    def __init__(self, store_path: str, settings: CaptureSettings):
        self.store_path, self.s = str(store_path), settings
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        self.layout = StoreLayout.from_manifest(read_manifest(store_path))
        device = settings.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model, self.tokenizer = load_target(
            settings.target, resolve_dtype(settings.dtype, device), device, trust_remote_code=settings.trust_remote_code
        )
        self.stop_ids = stop_token_ids(self.model, self.tokenizer)
        # a template that does not take enable_thinking renders every prompt alike: no mode to record
        self.template_thinks = template_takes_thinking(self.tokenizer)
        # the mode a prompt rendered with enable_thinking unset (the template's default) is in, read from the template
        self.default_thinking = template_default_thinking(self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.stop_ids[0] if self.stop_ids else 0)
        on_gpu = self.model.device.type == "cuda"
        free = torch.cuda.mem_get_info(self.model.device)[0] if on_gpu else None
        self.batch_size, self.prefill_tokens, lines = self.budgets(free)
        self.threads, why = writer_threads(settings.writer_threads, self.model.device, torch.get_num_threads())
        # 0: written in the decode loop; 1: in each shard's own writing thread; more: a pool the shards' threads share
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shard-encode") if self.threads > 1 else None
        if self.threads:
            lines.append(f"shard writing off the decode loop: {self.threads} compression thread(s): {why}")
        else:
            lines.append(f"shard writing in the decode loop: {why}")
        self.overlap, self.staged = self.decode_switches(lines)
        self._decode: ContinuousDecode | None = None  # the greedy decode, shared by consecutive tasks
        self._stream = None  # its running generator
        self._owner: dict[int, tuple[_TaskRun, int]] = {}  # decode index -> (task run, index into its encoded)
        self._ahead: _TaskRun | None = None  # the lookahead task opened by the last call
        self._projection = None  # the store's basis on the model's device, once a task needs it (`projection`)
        for line in lines:
            print(f"capture worker {os.getpid()}: {line}", file=sys.stderr, flush=True)

    def decode_switches(self, lines: list[str]) -> tuple[bool, bool]:
        """(overlap, staged copies) of the decode: data.overlap and data.staged_copies, auto by the device (on CUDA,
        where the device runs ahead of the host); a line each saying which and why goes to `lines`."""
        device = self.model.device
        overlap = default_overlap(device) if self.s.overlap is None else self.s.overlap
        staged = default_staged(device) if self.s.staged_copies is None else self.s.staged_copies
        switches = (("overlap", overlap, self.s.overlap), ("staged copies", staged, self.s.staged_copies))
        for key, value, given in switches:
            name = "data." + key.replace(" ", "_")
            why = f"{name}={'on' if given else 'off'}" if given is not None else f"{name}=auto on {device.type}"
            lines.append(f"decode {key} {'on' if value else 'off'}: {why}")
        return overlap, staged

    def budgets(self, free: int | None) -> tuple[int, int | None, list[str]]:
        """(decode rows, prefill token budget or None for unlimited, one line each saying why) of this worker's
        settings (`capture_budgets`); `free`: the GPU memory free once the target is loaded, None on a CPU."""
        s = self.s
        return capture_budgets(
            free,
            self.model.config,
            self.model.dtype,
            mode=s.mode,
            batch_size=s.batch_size,
            prefill_tokens=s.prefill_tokens,
            max_length=s.max_length,
            fraction=s.gpu_memory_fraction,
            captured_layers=len(s.layer_ids),
            teacher_topk=self.layout.teacher_topk,
        )

    def pid(self) -> int:
        return os.getpid()

    # --- prompts -> token ids ----------------------------------------------------------------

    def _render(self, messages, seq_id: str, add_generation_prompt=True) -> str:
        return chat_text(
            self.tokenizer,
            list(messages),
            add_generation_prompt=add_generation_prompt,
            enable_thinking=self.s.thinking_for(seq_id),
            system_prompt=self.s.system_prompt,
        )

    def recorded_thinking(self, seq_id: str) -> bool | None:
        """The mode a shard records for `seq_id`: what its template was given, or for nothing given the template's own
        default (`template_default_thinking`: a capture in the chat default of Qwen3 records thinking on); None where
        the template ignores it (or its default cannot be told)."""
        if not self.template_thinks:
            return None
        mode = self.s.thinking_for(seq_id)
        return self.default_thinking if mode is None else mode

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode(self, record: PromptRecord) -> tuple[list[int], list[bool] | None] | Conversation | str:
        """(prompt ids, None) to regenerate, (sequence ids, loss mask) to capture, a Conversation to regenerate turn
        by turn (data.turns=all and more than one user turn), or a reject reason.

        Capture: the prompt is the conversation without its final assistant turn, encoded exactly as regeneration
        would feed it (generation prompt included); the response is what the template renders after it, up to and
        including the first stop token, and only it is in the loss mask (earlier assistant turns are prompt)."""
        s = self.s
        msgs = list(record.messages)
        try:
            if s.mode == "regenerate":
                system, users = user_turns(record)
                if s.turns == "all" and len(users) > 1:
                    msgs = [*system, {"role": "user", "content": users[0]}]
                while msgs and msgs[-1]["role"] == "assistant":
                    msgs.pop()
                ids = self._ids(self._render(msgs, record.seq_id))
                if len(ids) > s.max_prompt_tokens or len(ids) >= s.max_length:
                    limits = f"max_prompt_tokens {s.max_prompt_tokens}, max_length {s.max_length}"
                    return f"prompt too long ({len(ids)} tokens; {limits})"
                if s.turns == "all" and len(users) > 1:
                    return Conversation(record, system, users, ids)
                return ids, None
            if not record.has_response:
                return "no response to capture (capture mode needs a final assistant turn)"
            prefix_text = self._render(msgs[:-1], record.seq_id)
            full_text = self._render(msgs, record.seq_id, add_generation_prompt=False)
        except Exception as e:  # noqa: BLE001 - a template that cannot render this record rejects it
            return f"chat template failed: {type(e).__name__}: {str(e)[:200]}"
        if not full_text.startswith(prefix_text):
            return "chat template renders the response inconsistently with the generation prompt"
        prefix = self._ids(prefix_text)
        response = self._response_ids(prefix, prefix_text, full_text[len(prefix_text) :])
        if len(prefix) > s.max_prompt_tokens or len(prefix) + len(response) > s.max_length:
            lengths = f"{len(prefix)} prompt + {len(response)} response tokens"
            return f"sequence too long ({lengths}; max_length {s.max_length})"
        if not response:
            return "empty response"
        return prefix + response, [False] * len(prefix) + [True] * len(response)

    def _response_ids(self, prefix: list[int], prefix_text: str, response_text: str) -> list[int]:
        """The response's tokens after the prompt's, cut after the first stop token as regeneration would end: as
        the whole rendering encodes them, or, where that encoding merges across the boundary (a response that
        starts with whitespace joins the generation prompt's newline), the response text encoded on its own. The
        prompt's tokens are never re-encoded: they are the ones regeneration feeds."""
        whole = self._ids(prefix_text + response_text)
        ids = whole[len(prefix) :] if whole[: len(prefix)] == prefix else self._ids(response_text)
        end = next((i + 1 for i, t in enumerate(ids) if t in self.stop_ids), len(ids))
        return ids[:end]

    # --- the store's projection -----------------------------------------------------------------

    def projection(self):
        """The store's basis (None for raw features), read from the store once its manifest records it (the file's
        sha256 checked), on the model's device: every worker of a capture applies the one basis the driver fitted."""
        if self.layout.project_dims and self._projection is None:
            proj = load_projection(self.store_path)
            if proj is None or proj.dims != self.layout.project_dims:
                raise RuntimeError(f"{self.store_path}: no projection basis of {self.layout.project_dims} dims")
            self._projection = proj.to(next(self.model.parameters()).device)
        return self._projection

    def projection_sha(self) -> str | None:
        return None if self.projection() is None else self._projection.sha256

    def fit_projection(self, records, tokens: int, method: str = "pca") -> dict:
        """Fit the store's basis on the raw features of the first `tokens` tokens of `records` (their prompts, or in
        capture mode their whole sequences; one prefill a `prefill_tokens` group, on the target's device) and write
        it into the store; returns the manifest's `projection` entry (the driver records it)."""
        seqs, n = [], 0
        for rec in records:
            e = self.encode(rec)
            if isinstance(e, str):
                continue
            seqs.append((e.ids if isinstance(e, Conversation) else e[0])[: max(1, tokens - n)])
            n += len(seqs[-1])
            if n >= tokens:
                break
        if not seqs:
            raise RuntimeError("no prompt of the capture encodes: nothing to fit the store's projection on")
        device = next(self.model.parameters()).device
        feats = []
        for group in token_batches([len(x) for x in seqs], self.prefill_tokens):
            group_seqs = [seqs[i] for i in group]
            masks = [[False] * len(x) for x in group_seqs]
            out = capture(self.model, group_seqs, masks, list(self.s.layer_ids), pad_id=self.pad_id)
            feats += [c.features.to(device) for c in out]
        proj = fit_projection(feats, self.layout.project_dims, method=method)
        entry = save_projection(
            self.store_path, proj, layer_ids=list(self.s.layer_ids), hidden_size=self.layout.hidden_size
        )
        print(
            f"capture worker {os.getpid()}: projection basis fitted on {proj.meta['calibration_tokens']} tokens: "
            f"{proj.dims} of {proj.input_dims} dims keep {100 * proj.meta['explained']:.1f}% of the scaled "
            f"features' second moment (sha256 {entry['sha256'][:12]})",
            file=sys.stderr,
            flush=True,
        )
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
            if lookahead is not None and self._overlaps(current):
                self._ahead = self._open_ahead(lookahead)
            self._decode_task(current)
            if current.chats:  # each turn's round draws from its own seed (round 0 is the single-turn decode's)
                seeds = lambda turn: task_seed(self.s.seed, task.name, 1 + turn)  # noqa: E731
                for conv, out in regenerate_conversations(self, current.chats, seeds):
                    current.store(conv.record.seq_id, out)
                    for text in conv.notes:
                        current.shard.note(conv.record.seq_id, text, turns=len(conv.users))
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
            **({"projection_sha256": self.projection_sha()} if self.layout.project_dims else {}),
        }

    def close(self) -> None:
        """Drop a lookahead never run (its temporary shard goes) and stop the compression threads."""
        self._drop_ahead()
        if self.pool is not None:
            self.pool.shutdown()

    def _open(self, task: Task) -> _TaskRun:
        """Encode a task's records, check the disk has room for its shard, open the shard (written off the decode
        loop) with its rejects, and, in the shared greedy decode, queue its prompts."""
        if shard_exists(self.store_path, task.name):
            raise FileExistsError(f"shard {task.name} already exists in {self.store_path}")
        self.projection()  # a projected store's basis before anything is captured (refused when it is damaged)
        encoded, chats, rejects = [], [], []
        for rec in task.records:
            e = self.encode(rec)
            if isinstance(e, str):
                rejects.append((rec, e))
            elif isinstance(e, Conversation):
                chats.append(e)
            else:
                encoded.append((rec, *e))
        # a conversation holds at most max_length tokens
        space = self.max_tokens(encoded) + len(chats) * self.s.max_length
        check_free_space(shard_dir(self.store_path, task.name), self.layout, space)
        if self.threads:
            shard = BackgroundShard(self.store_path, task.name, self.layout, pool=self.pool)
        else:
            shard = ShardWriter(self.store_path, task.name, self.layout)
        for rec, reason in rejects:
            shard.reject(rec.seq_id, reason, source=rec.source, record_id=rec.record_id)
        encoded.sort(key=lambda x: len(x[1]))  # similar lengths batch (and join the batch) with little padding
        run = _TaskRun(task, shard, encoded, chats, self.recorded_thinking, space)
        if self._shared_decode():
            ids = [x[1] for x in encoded]
            for j, i in enumerate(self._decoder().add(ids, self._limits(ids))):
                self._owner[i] = (run, j)
            run.outstanding = len(ids)
        return run

    def _open_ahead(self, task: Task) -> _TaskRun | None:
        """The lookahead task opened, or None where it cannot be now (its own call will say why)."""
        try:
            return self._open(task)
        except Exception:  # noqa: BLE001 - the task fails in its own call, with its own error
            return None

    def _take_ahead(self, task: Task) -> _TaskRun | None:
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
        self._decode, self._stream, self._owner = None, None, {}

    def _shared_decode(self) -> bool:
        """Greedy regeneration shares one decode across tasks; sampling draws each task from its own seed."""
        return self.s.mode == "regenerate" and not self.s.sampling.do_sample

    def _overlaps(self, run: _TaskRun) -> bool:
        """The next task may join while `run` decodes: a shared decode, and no conversation rounds to run after it."""
        return self._shared_decode() and not run.chats

    def _decoder(self) -> ContinuousDecode:
        if self._decode is None:
            s = self.s
            self._decode = ContinuousDecode(
                self.model,
                list(s.layer_ids),
                self.stop_ids,
                self.pad_id,
                s.sampling,
                None,
                self.layout.teacher_topk,
                overlap=self.overlap,
                project=self.projection(),
                staged_copies=self.staged,
            )
        return self._decode

    def _limits(self, ids: list[list[int]]) -> list[int]:
        return [min(self.s.max_new_tokens, self.s.max_length - len(p)) for p in ids]

    def _decode_task(self, run: _TaskRun) -> None:
        """Decode until every single-turn sequence of `run` is in its shard (and those of the lookahead that end
        meanwhile in the lookahead's)."""
        if not self._shared_decode():
            for i, out in self._capture(run.encoded, task_seed(self.s.seed, run.task.name, 0)):
                run.store(run.encoded[i][0].seq_id, out)
            return
        while run.outstanding:
            self._take_sequence()

    def _commit(self, run: _TaskRun) -> None:
        """Commit `run`'s shard. Written off the decode loop, its thread flushes, fsyncs and renames it while this one
        goes on decoding the lookahead task's sequences (into the lookahead's shard) until the commit is done."""
        if not isinstance(run.shard, BackgroundShard):
            run.shard.commit()
            return
        run.shard.start_commit()
        while run.shard.committing() and self._ahead is not None and self._ahead.outstanding:
            self._take_sequence()
        run.shard.finish_commit()

    def _take_sequence(self) -> None:
        """The shared decode's next sequence into its task's shard."""
        i, out = self._next_sequence()
        owner, j = self._owner.pop(i)
        owner.store(owner.encoded[j][0].seq_id, out)
        owner.outstanding -= 1

    def _next_sequence(self):
        """The shared decode's next (index, Captured); a decode that ran dry restarts on prompts queued since."""
        while True:
            if self._stream is None:
                self._stream = self._decode.run(self.batch_size, self.prefill_tokens)
            try:
                return next(self._stream)
            except StopIteration:
                self._stream = None
                if not self._decode.waiting:
                    raise RuntimeError("the capture decode ended with sequences of a task not returned") from None

    def max_tokens(self, encoded) -> int:
        """The most rows the encoded records can make: captured as they are, or each prompt plus its longest
        response (max_new_tokens, within max_length)."""
        if self.s.mode == "capture":
            return sum(len(x[1]) for x in encoded)
        return sum(min(len(x[1]) + self.s.max_new_tokens, self.s.max_length) for x in encoded)

    def _capture(self, encoded, seed: int):
        """(index into `encoded`, Captured) as each sequence is done, for one task alone. Regenerate (sampled): one
        continuously batched decode over the task's prompts drawing from `seed`, in the order sequences end. Capture:
        one prefill a batch, in order."""
        ids, layers, topk = [x[1] for x in encoded], list(self.s.layer_ids), self.layout.teacher_topk
        if self.s.mode == "capture":
            for group in token_batches([len(x) for x in ids], self.prefill_tokens):
                seqs, masks = [ids[i] for i in group], [encoded[i][2] for i in group]
                got = capture(
                    self.model, seqs, masks, layers, pad_id=self.pad_id, teacher_topk=topk, project=self.projection()
                )
                yield from zip(group, got)
            return
        gen = torch.Generator(device=self.model.device).manual_seed(seed) if self.s.sampling.do_sample else None
        yield from regenerate_stream(
            self.model,
            ids,
            layers,
            max_new_tokens=self._limits(ids),
            stop_ids=self.stop_ids,
            pad_id=self.pad_id,
            sampling=self.s.sampling,
            generator=gen,
            batch_size=self.batch_size,
            teacher_topk=topk,
            prefill_tokens=self.prefill_tokens,
            overlap=self.overlap,
            project=self.projection(),
            staged_copies=self.staged,
        )
