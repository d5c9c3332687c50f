"""Every assistant turn regenerated (data.turns=all): a conversation of user turns u1, u2, ... becomes one sequence.

The target answers u1; its answer a1 joins the conversation; u2 is appended as a chat would continue it (the chat
template renders [u1, a1, u2] with the generation prompt); the target answers u2; and so on. Assistant turns a
record carries are replaced by the target's own. The stored sequence is the last rendering plus the last answer;
the loss mask covers every answer's generated tokens, stop tokens included, and nothing of the prompts.

Turn by turn: each round is one continuously batched regeneration (`regenerate_stream`) over the conversations that
still have a turn to answer, prompted with the whole conversation so far; a last prefill (`capture`) of each whole
sequence gives the features of every token. That prefill costs one extra forward over each sequence (the rounds'
own features are dropped), and it is exact: the features are by construction a fresh forward over the stored
tokens, whatever re-rendering happened between turns. Each round also re-prefills the conversation so far (no KV
cache is kept across turns): simple before fast.

Where the template's rendering of the conversation so far does not reproduce the generated tokens (a template that
strips earlier turns' thinking, an answer whose text encodes back to other tokens, an answer ended by another stop
token), the rendering wins: it is what a served chat feeds the target for the next turn, so the next answer is
generated, and stored, after it. Tokens from the first difference on are prompt, out of the loss mask; tokens up to
it are the same tokens in the same context and keep their mask. The record's shard notes say so.

An answer cut at its token limit (max_new_tokens, or the room left within max_length) stays in the conversation as
the target wrote it; the template closes the turn, so its stop token is prompt. A conversation stops, kept with the
turns done, where the next turn's prompt leaves no room within max_length; the shard notes say which turn and why.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from pipeline.capture import Captured, capture, token_batches
from pipeline.decode import regenerate_stream
from pipeline.encode import Conversation, PromptEncoder


def regenerate_conversations(decoder, chats: list[Conversation], seeds) -> Iterator[tuple[Conversation, Captured]]:
    """(conversation, Captured) for every conversation, all turns answered (or stopped), in `chats` order per prefill
    group. `decoder`: the worker's `pipeline.taskdecode.TaskDecoder` (target, encoder, settings, plan, the store's
    basis); `seeds(turn)`: a round's sampling seed."""
    d, s, encoder = decoder, decoder.s, decoder.encoder
    for turn in range(max(len(c.users) for c in chats)):
        active = [c for c in chats if not c.ended]
        if not active:
            break
        gen = torch.Generator(device=d.model.device).manual_seed(seeds(turn)) if s.sampling.do_sample else None
        prompts = [c.ids for c in active]
        # the rounds' features are not kept (the last prefill recomputes them): tap one layer only
        for i, out in regenerate_stream(
            d.model,
            prompts,
            list(s.layer_ids[:1]),
            max_new_tokens=[min(s.max_new_tokens, s.max_length - len(p)) for p in prompts],
            stop_ids=encoder.stop_ids,
            pad_id=encoder.pad_id,
            sampling=s.sampling,
            generator=gen,
            batch_size=d.plan.batch_size,
            prefill_tokens=d.plan.prefill_tokens,
        ):
            take_answer(encoder, active[i], out)
    yield from final_prefill(d, chats)


def take_answer(encoder: PromptEncoder, conv: Conversation, out: Captured) -> None:
    """Append a turn's answer to the sequence (in the loss mask) and prepare the next turn's prompt, or end. An
    answer cut at its token limit is put in the conversation as the target wrote it (the template closes the turn,
    its stop token then prompt, as a chat continued after a cut reply would be)."""
    answer = out.input_ids[len(conv.ids) :].tolist()
    conv.ids, conv.mask = out.input_ids.tolist(), conv.mask + [True] * len(answer)
    done, total = len(conv.answers) + 1, len(conv.users)
    if done == total:
        conv.ended = True
        return
    if not out.finished:
        conv.notes.append(f"turn {done}'s answer reached its token limit without a stop token; the template closes it")
    conv.answers.append(encoder.tokenizer.decode(answer[:-1] if out.finished else answer, skip_special_tokens=False))
    next_prompt(encoder, conv)


def next_prompt(encoder: PromptEncoder, conv: Conversation) -> None:
    """The next turn's prompt: the template's rendering of the conversation so far plus the next user turn. The loss
    mask keeps the tokens the rendering reproduces (the common prefix); where it does not fit, the conversation
    ends with the turns done."""
    done, total, s = len(conv.answers), len(conv.users), encoder.s
    try:
        rendered = encoder.ids(encoder.render(conv.messages(), conv.record.seq_id))
    except Exception as e:  # noqa: BLE001 - a template that cannot render the continuation ends the conversation
        conv.notes.append(f"chat template failed on turn {done + 1} ({type(e).__name__}): kept {done} of {total} turns")
        conv.ended = True
        return
    if len(rendered) >= s.max_length:
        conv.notes.append(
            f"turn {done + 1}'s prompt ({len(rendered)} tokens) leaves no room within max_length {s.max_length}: "
            f"kept {done} of {total} turns"
        )
        conv.ended = True
        return
    common = next((j for j, (a, b) in enumerate(zip(conv.ids, rendered)) if a != b), min(len(conv.ids), len(rendered)))
    if common < len(conv.ids):
        conv.notes.append(
            f"before turn {done + 1} the chat template re-renders the conversation differently from token {common} "
            f"on: {len(conv.ids) - common} generated tokens are prompt there, out of the loss mask"
        )
    conv.ids, conv.mask = rendered, conv.mask[:common] + [False] * (len(rendered) - common)


def final_prefill(decoder, chats: list[Conversation]) -> Iterator[tuple[Conversation, Captured]]:
    """Each whole sequence's features (and teacher top-k) from one fresh prefill, batched by the prefill budget."""
    d = decoder
    order = sorted(range(len(chats)), key=lambda i: len(chats[i].ids))  # similar lengths pad least
    for group in token_batches([len(chats[i].ids) for i in order], d.plan.prefill_tokens):
        convs = [chats[order[g]] for g in group]
        outs = capture(
            d.model,
            [c.ids for c in convs],
            [c.mask for c in convs],
            list(d.s.layer_ids),
            pad_id=d.encoder.pad_id,
            teacher_topk=d.teacher_topk,
            project=d.projection(),
        )
        yield from zip(convs, outs)
