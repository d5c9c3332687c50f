"""A worker's decode: each task's encoded prompts in, its sequences out into its shard.

Greedy regeneration shares one continuous decode (`ContinuousDecode`) across consecutive tasks: a task's prompts are
queued when it is opened (the lookahead task's too, so the batch stays full across the boundary), and each sequence
that ends goes to its own task's shard. Sampled regeneration decodes each task alone, from its own seed; capture mode
prefills each task's sequences a batch at a time. A task's conversations (data.turns=all) are regenerated turn by
turn after its single-turn sequences (`pipeline.turns`), each turn's round from its own seed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashdraft.store import ShardWriter
from pipeline.capture import Captured, capture, token_batches
from pipeline.decode import ContinuousDecode, regenerate_stream
from pipeline.encode import PromptEncoder
from pipeline.plan import WorkerPlan
from pipeline.settings import CaptureSettings, Task, task_seed
from pipeline.shardqueue import BackgroundShard
from pipeline.turns import regenerate_conversations


@dataclass
class TaskRun:
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


class TaskDecoder:
    """The target run over tasks' prompts as the settings and the worker's plan ask. `projection()`: the store's
    basis on the model's device, or None for raw features."""

    def __init__(
        self,
        model,
        encoder: PromptEncoder,
        settings: CaptureSettings,
        plan: WorkerPlan,
        teacher_topk: int,
        projection: Callable,
    ):
        self.model, self.encoder, self.s, self.plan = model, encoder, settings, plan
        self.teacher_topk, self.projection = teacher_topk, projection
        # greedy regeneration shares one decode across tasks; sampling draws each task from its own seed
        self.sharing = settings.mode == "regenerate" and not settings.sampling.do_sample
        self.reset()

    def reset(self) -> None:
        """Drop the shared decode (after an error, or a lookahead not run): the next task queued starts a fresh one."""
        self.shared: ContinuousDecode | None = None
        self.stream = None  # its running generator
        self.owner: dict[int, tuple[TaskRun, int]] = {}  # decode index -> (task run, index into its encoded)

    def overlaps(self, run: TaskRun) -> bool:
        """The next task may join while `run` decodes: a shared decode, and no conversation rounds to run after it."""
        return self.sharing and not run.chats

    def queue(self, run: TaskRun) -> None:
        """In the shared decode, queue `run`'s single-turn prompts (a task decoded alone starts when it is decoded)."""
        if not self.sharing:
            return
        ids = [x[1] for x in run.encoded]
        for j, i in enumerate(self._shared().add(ids, self.limits(ids))):
            self.owner[i] = (run, j)
        run.outstanding = len(ids)

    def decode_task(self, run: TaskRun) -> None:
        """Every sequence of `run` into its shard: its single-turn ones (and those of the lookahead that end meanwhile
        into the lookahead's), then its conversations, turn by turn."""
        if self.sharing:
            while run.outstanding:
                self.take()
        else:
            for i, out in self._alone(run.encoded, task_seed(self.s.seed, run.task.name, 0)):
                run.store(run.encoded[i][0].seq_id, out)
        if run.chats:  # each turn's round draws from its own seed (round 0 is the single-turn decode's)
            seeds = lambda turn: task_seed(self.s.seed, run.task.name, 1 + turn)  # noqa: E731
            for conv, out in regenerate_conversations(self, run.chats, seeds):
                run.store(conv.record.seq_id, out)
                for text in conv.notes:
                    run.shard.note(conv.record.seq_id, text, turns=len(conv.users))

    def take(self) -> None:
        """The shared decode's next sequence into its task's shard."""
        i, out = self._next_sequence()
        owner, j = self.owner.pop(i)
        owner.store(owner.encoded[j][0].seq_id, out)
        owner.outstanding -= 1

    def limits(self, ids: list[list[int]]) -> list[int]:
        """Each prompt's most new tokens: max_new_tokens, within max_length."""
        return [min(self.s.max_new_tokens, self.s.max_length - len(p)) for p in ids]

    def _shared(self) -> ContinuousDecode:
        if self.shared is None:
            s = self.s
            self.shared = ContinuousDecode(
                self.model,
                list(s.layer_ids),
                self.encoder.stop_ids,
                self.encoder.pad_id,
                s.sampling,
                None,
                self.teacher_topk,
                overlap=self.plan.overlap,
                project=self.projection(),
                staged_copies=self.plan.staged,
            )
        return self.shared

    def _next_sequence(self) -> tuple[int, Captured]:
        """The shared decode's next (index, Captured); a decode that ran dry restarts on prompts queued since."""
        while True:
            if self.stream is None:
                self.stream = self.shared.run(self.plan.batch_size, self.plan.prefill_tokens)
            try:
                return next(self.stream)
            except StopIteration:
                self.stream = None
                if not self.shared.waiting:
                    raise RuntimeError("the capture decode ended with sequences of a task not returned") from None

    def _alone(self, encoded, seed: int):
        """(index into `encoded`, Captured) as each sequence is done, for one task alone. Regenerate (sampled): one
        continuously batched decode over the task's prompts drawing from `seed`, in the order sequences end. Capture:
        one prefill a batch, in order."""
        ids, layers, topk = [x[1] for x in encoded], list(self.s.layer_ids), self.teacher_topk
        pad_id, plan, project = self.encoder.pad_id, self.plan, self.projection()
        if self.s.mode == "capture":
            for group in token_batches([len(x) for x in ids], plan.prefill_tokens):
                seqs, masks = [ids[i] for i in group], [encoded[i][2] for i in group]
                got = capture(self.model, seqs, masks, layers, pad_id=pad_id, teacher_topk=topk, project=project)
                yield from zip(group, got)
            return
        gen = torch.Generator(device=self.model.device).manual_seed(seed) if self.s.sampling.do_sample else None
        yield from regenerate_stream(
            self.model,
            ids,
            layers,
            max_new_tokens=self.limits(ids),
            stop_ids=self.encoder.stop_ids,
            pad_id=pad_id,
            sampling=self.s.sampling,
            generator=gen,
            batch_size=plan.batch_size,
            teacher_topk=topk,
            prefill_tokens=plan.prefill_tokens,
            overlap=plan.overlap,
            project=project,
            staged_copies=plan.staged,
        )
