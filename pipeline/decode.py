"""Regenerate responses with the target and capture its hidden states in the same pass: the continuously batched
decode, built to keep a GPU busy.

`regenerate_stream` decodes a list of prompts and hands over each sequence, prompt and response with the chosen
layers' features (`pipeline.capture.Captured`), the step it ends, so a caller that writes it out holds only the
sequences still decoding; `regenerate` collects them in prompt order. The prefill yields the prompt tokens' states,
each decode step the state of the token it consumes; after the last generated token one more (cheap, one-token) step
runs so that every stored position, the last one included, holds the target's real state: the features of a sequence
equal a fresh full forward over its tokens. With `teacher_topk=k` each sequence also keeps, from the last prompt token
on, the target's k most likely next tokens and their log-probabilities, from the logits each step computes anyway.

`ContinuousDecode` is the engine: a batch of slots (`SlotCache`) that sequences join and leave. A sequence that ends
frees its slot without copying the cache; waiting prompts are prefilled together and written into free slots in place.
Per slot the device holds the next token, position, response length, limit and end flags; the host (`SlotRows`) holds
which prompt each slot serves and the tokens, features and teacher rows of its sequence so far. Prompts can be added
while it runs (`add`): a capture worker adds the next task's prompts before the current task's have all ended.

A step is launched (forward, next tokens, the device-to-host copies of what the host needs queued: `_launch`) and
its results are read on the host afterwards (`_collect`). With `overlap` (`data.overlap`; auto: on CUDA) a step's
results are read once the next step is launched, so the host's bookkeeping runs while the device computes; a
sequence that ends is then fed one step more, whose results are dropped. Anything that adds or removes slots
(admitting prompts, compacting) first reads the pending step, whose results are laid out by the slots it was launched
over. Nothing in a step loops over rows in Python or waits for the device, except the wait for the copies of the
step being read. Ended slots are refilled by joining prompts; with none waiting they are removed once `refill_at`
have gathered (the one scheduled whole-cache copy). `staged_copies` (`data.staged_copies`; auto: on CUDA): the
device-to-host copies go through fresh (pinned, on CUDA) host buffers behind an event (`HostCopy`).
"""

from __future__ import annotations

from collections import deque

import torch
from transformers import DynamicCache

from flashdraft.config import SamplingConfig
from flashdraft.target.capture import LayerTap
from pipeline.capture import Captured, left_pad, pick_tokens, token_batches
from pipeline.hostcopy import HostCopy
from pipeline.slotcache import SlotCache
from pipeline.slotrows import SlotRows

# the per-slot state on the device: name -> dtype
STATE = {
    "tok": torch.long,  # the token the next step feeds
    "pos": torch.long,  # its position
    "lengths": torch.long,  # response tokens so far, that one included
    "limits": torch.long,  # max new tokens
    "stopped": torch.bool,  # that token is a stop token
    "ending": torch.bool,  # that token is the sequence's last (a stop token or the limit)
}


class ContinuousDecode:
    """`add` prompts, then iterate `run` for (prompt index, Captured) as sequences end."""

    def __init__(
        self,
        model,
        layer_ids,
        stop_ids,
        pad_id,
        sampling,
        generator,
        teacher_topk,
        overlap=None,
        project=None,
        staged_copies=None,
    ):
        self.model, self.layer_ids, self.project = model, layer_ids, project
        self.pad_id, self.sampling, self.generator, self.teacher_topk = pad_id, sampling, generator, teacher_topk
        self.device = next(model.parameters()).device
        self.overlap = default_overlap(self.device) if overlap is None else overlap
        self.staged = staged_copies
        self.stops = torch.as_tensor(stop_ids or [-1], device=self.device)
        self.prompts: list[list[int]] = []
        self.limits: list[int] = []
        self.waiting: deque[int] = deque()
        self.cache: SlotCache | None = None
        self.mask: torch.Tensor | None = None  # [slots, cache width]
        self.state = {name: torch.zeros(0, dtype=dtype, device=self.device) for name, dtype in STATE.items()}
        self.host = SlotRows(teacher_topk)
        self.pending = None  # a launched step whose results are not read yet (overlap)

    def add(self, prompts: list[list[int]], limits: list[int]) -> range:
        """Queue prompts, each with its max new tokens; returns their indices in what `run` yields."""
        if len(limits) != len(prompts) or any(n < 1 for n in limits):
            raise ValueError(f"max_new_tokens must be >= 1 for every prompt, got {limits}")
        first = len(self.prompts)
        self.prompts += prompts
        self.limits += limits
        self.waiting.extend(range(first, len(self.prompts)))
        return range(first, len(self.prompts))

    @torch.no_grad()
    def run(self, batch_size: int, prefill_tokens: int | None = None):
        """Yield (prompt index, Captured) as sequences end, until none is waiting or decoding."""
        refill_at = max(1, batch_size // 8)  # free rows worth a prefill
        while True:
            live = self.host.live_count()
            if self.waiting and (batch_size - live >= refill_at or not live):
                # an admission adds slots or refills them: the pending step is read against the slots it fed first
                yield from self._collect_pending()
                live = self.host.live_count()
                joining = [self.waiting.popleft() for _ in range(min(batch_size - live, len(self.waiting)))]
                for group in token_batches([len(self.prompts[i]) for i in joining], prefill_tokens):
                    self._admit([joining[g] for g in group])
            elif not self.waiting and live and self.host.dead_count() >= refill_at:
                yield from self._collect_pending()  # slot numbers change below
                self._compact()
            if not self.host.live_count():
                yield from self._collect_pending()
                if not self.waiting:
                    return
                continue
            launched = self._launch()
            if self.overlap:
                yield from self._collect_pending()
                self.pending = launched
            else:
                yield from self._collect(*launched)

    def _collect_pending(self):
        pending, self.pending = self.pending, None
        if pending is not None:
            yield from self._collect(*pending)

    def _forward(self, **kwargs):
        """One target forward; returns its output and the chosen layers' features, on the device."""
        with LayerTap(self.model, self.layer_ids, project=self.project) as tap:
            out = self.model(**kwargs, use_cache=True, logits_to_keep=1)
            return out, tap.features()

    def _admit(self, joining: list[int]) -> None:
        """Prefill the joining prompts together and write them into free slots."""
        ids, new_mask, new_pos = left_pad([self.prompts[i] for i in joining], self.pad_id, self.device)
        prefilled = DynamicCache(config=self.model.config)
        out, prompt_feats = self._forward(input_ids=ids, attention_mask=new_mask, position_ids=new_pos, cache=prefilled)
        if self.cache is None:
            self.cache = SlotCache(self.model, prefilled)
            self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        slots = self._free_slots(len(joining))
        extra = ids.shape[1] - self.cache.width
        if extra > 0:
            self.mask = torch.cat([self.mask.new_zeros(len(self.mask), extra), self.mask], dim=1)
        self.cache.write_rows(slots, prefilled)
        self.mask[slots] = 0
        self.mask[slots, self.mask.shape[1] - ids.shape[1] :] = new_mask
        tok = pick_tokens(out.logits[:, -1], self.sampling, self.generator)
        limits = torch.as_tensor([self.limits[i] for i in joining], device=self.device)
        new = _slot_state(tok, new_pos[:, -1] + 1, torch.ones_like(tok), limits, self.stops)
        # out of place: a launched step's copies may still read the old tensors
        self.state = {name: x.index_put((slots,), new[name]) for name, x in self.state.items()}
        top = _device_topk(out.logits[:, -1], self.teacher_topk) if self.teacher_topk else {}
        host = HostCopy(self.device, self.staged, feats=prompt_feats, **top).wait()
        self.host.admit(slots.tolist(), joining, [self.prompts[i] for i in joining], host)
        self.mask = _trim(self.cache, self.mask)

    def _free_slots(self, n: int) -> torch.Tensor:
        """`n` slots for joining prompts: ended ones first, then new ones added to the batch."""
        free = self.host.dead_slots()[:n]
        missing = n - len(free)
        if missing:
            first = len(self.mask)
            self.cache.add_rows(missing)
            self.mask = torch.cat([self.mask, self.mask.new_zeros(missing, self.mask.shape[1])])
            self.state = {name: torch.cat([x, x.new_zeros(missing)]) for name, x in self.state.items()}
            self.host.add_slots(missing)
            free += list(range(first, first + missing))
        return torch.as_tensor(free, device=self.device)

    def _launch(self) -> tuple[HostCopy, tuple]:
        """Feed each slot's next token: its state is that token's feature, its logits give the next token. Queues the
        copies of what the host needs (features, fed tokens and their end flags, teacher rows); returns them with
        the slots' (live, version) at launch."""
        s = self.state
        fed = dict(tok=s["tok"], end=s["ending"], stop=s["stopped"])
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        out, feats = self._forward(
            input_ids=s["tok"][:, None], attention_mask=self.mask, position_ids=s["pos"][:, None], cache=self.cache
        )
        if self.teacher_topk:
            fed |= _device_topk(out.logits[:, -1], self.teacher_topk)
        tok = pick_tokens(out.logits[:, -1], self.sampling, self.generator)
        self.state = _slot_state(tok, s["pos"] + 1, s["lengths"] + 1, s["limits"], self.stops)
        return HostCopy(self.device, self.staged, feats=feats[:, 0], **fed), self.host.snapshot()

    def _collect(self, launched: HostCopy, rows: tuple):
        """Record a launched step's results into the slots that still hold the sequences it fed; yield the
        sequences that ended with it."""
        ended = self.host.record(rows, launched.wait())
        if ended:  # their columns are trimmed at the next admission or compaction (a trim waits for the device)
            self.mask[torch.as_tensor([slot for slot, _, _ in ended], device=self.device)] = 0
        for _, i, captured in ended:
            yield i, captured

    def _compact(self) -> None:
        """Remove the ended slots (a copy of the cache; scheduled: when enough have gathered and none refill them)."""
        keep = torch.as_tensor(self.host.keep_live(), device=self.device)
        self.cache.select_rows(keep)
        self.mask = self.mask[keep]
        self.state = {name: x[keep] for name, x in self.state.items()}
        self.mask = _trim(self.cache, self.mask)


def default_overlap(device: torch.device) -> bool:
    """`data.overlap` auto: on where the device runs ahead of the host (CUDA); on a CPU the host is the device."""
    return torch.device(device).type == "cuda"


def _trim(cache: SlotCache, mask: torch.Tensor) -> torch.Tensor:
    """`mask` without its leading columns that no slot attends to, dropped from `cache` too (views: nothing copied)."""
    lead = int((mask.sum(0) == 0).int().cumprod(0).sum())
    lead = min(lead, mask.shape[1] - 1)  # the width never reaches zero
    if lead > 0:
        cache.drop_left(lead)
        mask = mask[:, lead:]
    return mask


def _slot_state(tok, pos, lengths, limits, stops) -> dict[str, torch.Tensor]:
    """The per-slot state (`STATE`) once `tok` is picked: it ends its sequence where it is a stop token or the
    response reaches its limit."""
    stopped = torch.isin(tok, stops)
    return dict(tok=tok, pos=pos, lengths=lengths, limits=limits, stopped=stopped, ending=stopped | (lengths >= limits))


def _device_topk(logits: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """[B, V] logits -> ids and log-probs [B, k] of the k most likely next tokens, where the logits are."""
    top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return {"top_ids": top.indices, "top_logp": top.values}


@torch.no_grad()
def regenerate(model, prompts: list[list[int]], layer_ids: list[int], **options) -> list[Captured]:
    """Generate a response per prompt and return prompt+response with their features, in prompt order:
    `regenerate_stream` with the same arguments (`options`: its keyword arguments), collected.

    Continuous batching: at most `batch_size` sequences (default: all of them) decode together; a
    sequence leaves the batch the step it ends, and waiting prompts take the free rows (prefilled
    together, then merged into the batch's cache, left-padded to a common width), so no step is spent
    on finished rows. `max_new_tokens` may be per prompt. The response includes its stop token. `sampling`:
    None is greedy.
    """
    results = [None] * len(prompts)
    for i, captured in regenerate_stream(model, prompts, layer_ids, **options):
        results[i] = captured
    return results


def regenerate_stream(
    model,
    prompts: list[list[int]],
    layer_ids: list[int],
    *,
    max_new_tokens: int | list[int],
    stop_ids: list[int],
    pad_id: int,
    sampling: SamplingConfig | None = None,
    generator: torch.Generator | None = None,
    batch_size: int | None = None,
    teacher_topk: int = 0,
    prefill_tokens: int | None = None,
    overlap: bool | None = None,
    project=None,
    staged_copies: bool | None = None,
):
    """`regenerate` as a generator of (prompt index, Captured), each yielded the step its sequence ends; nothing
    is kept once yielded, so the caller's memory stays bounded by the batch, not by the number of prompts.
    `prefill_tokens`: the prompts joining the batch are prefilled in groups of at most this many tokens, padding
    included (`token_batches`); None: all together. `overlap`: read each step's results while the next one runs
    (`ContinuousDecode`; None: on CUDA). `project`: a store's basis, applied on the device (`LayerTap`).
    `staged_copies`: the device-to-host copies through fresh host buffers behind an event (`HostCopy`; None: on
    CUDA)."""
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    sampling = sampling or SamplingConfig()
    decode = ContinuousDecode(
        model, layer_ids, stop_ids, pad_id, sampling, generator, teacher_topk, overlap, project, staged_copies
    )
    decode.add(prompts, limits)
    yield from decode.run(batch_size or max(1, len(prompts)), prefill_tokens)
