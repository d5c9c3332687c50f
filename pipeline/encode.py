"""Prompt records -> token ids, through the target's chat template as the capture's settings ask.

A record encodes to one of: a prompt to regenerate, a whole sequence with its loss mask to capture as it is (capture
mode), a `Conversation` to regenerate turn by turn (data.turns=all and more than one user turn: `pipeline.turns`), or
a reason it is rejected.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashdraft.prompts import PromptRecord
from flashdraft.target import chat_text, template_default_thinking, template_takes_thinking
from pipeline.settings import CaptureSettings


@dataclass
class Conversation:
    """One record's turn-by-turn state: its user turns, and the sequence so far with its loss mask."""

    record: PromptRecord
    system: list[dict]  # the record's leading system message, if any
    users: list[str]  # every user turn, in order (messages, then followups)
    ids: list[int]  # the sequence so far: the rendered conversation, then the answer being generated
    mask: list[bool] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)  # the target's answers as text, as the template re-renders them
    notes: list[str] = field(default_factory=list)
    ended: bool = False

    def __post_init__(self):
        self.mask = self.mask or [False] * len(self.ids)  # the first prompt: nothing in the loss mask

    def messages(self) -> list[dict]:
        """The conversation for the next turn: system, then each answered user turn with its answer, then the next."""
        msgs = list(self.system)
        for user, answer in zip(self.users, self.answers):
            msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        return msgs + [{"role": "user", "content": self.users[len(self.answers)]}]


def user_turns(record: PromptRecord) -> tuple[list[dict], list[str]]:
    """(leading system message or [], every user turn in order); given assistant turns are dropped."""
    msgs = list(record.messages)
    system = msgs[:1] if msgs and msgs[0]["role"] == "system" else []
    return system, [m["content"] for m in msgs if m["role"] == "user"] + list(record.followups)


class PromptEncoder:
    """The target's tokenizer and stop tokens, rendering and encoding records as `settings` ask."""

    def __init__(self, tokenizer, stop_ids: list[int], settings: CaptureSettings):
        self.tokenizer, self.stop_ids, self.s = tokenizer, stop_ids, settings
        # a template that does not take enable_thinking renders every prompt alike: no mode to record
        self.template_thinks = template_takes_thinking(tokenizer)
        # the mode a prompt rendered with enable_thinking unset (the template's default) is in, read from the template
        self.default_thinking = template_default_thinking(tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (stop_ids[0] if stop_ids else 0)

    def render(self, messages, seq_id: str, add_generation_prompt=True) -> str:
        return chat_text(
            self.tokenizer,
            list(messages),
            add_generation_prompt=add_generation_prompt,
            enable_thinking=self.s.thinking_for(seq_id),
            system_prompt=self.s.system_prompt,
        )

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def recorded_thinking(self, seq_id: str) -> bool | None:
        """The mode a shard records for `seq_id`: what its template was given, or for nothing given the template's own
        default (`template_default_thinking`: a capture in the chat default of Qwen3 records thinking on); None where
        the template ignores it (or its default cannot be told)."""
        if not self.template_thinks:
            return None
        mode = self.s.thinking_for(seq_id)
        return self.default_thinking if mode is None else mode

    def encode_task(self, records) -> tuple[list[tuple], list[Conversation], list[tuple[PromptRecord, str]]]:
        """`records` encoded: (record, ids, loss mask or None) of each single-turn one, the conversations, and
        (record, reason) of each rejected one."""
        encoded, chats, rejects = [], [], []
        for rec in records:
            e = self.encode(rec)
            if isinstance(e, str):
                rejects.append((rec, e))
            elif isinstance(e, Conversation):
                chats.append(e)
            else:
                encoded.append((rec, *e))
        return encoded, chats, rejects

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
                ids = self.ids(self.render(msgs, record.seq_id))
                if len(ids) > s.max_prompt_tokens or len(ids) >= s.max_length:
                    limits = f"max_prompt_tokens {s.max_prompt_tokens}, max_length {s.max_length}"
                    return f"prompt too long ({len(ids)} tokens; {limits})"
                if s.turns == "all" and len(users) > 1:
                    return Conversation(record, system, users, ids)
                return ids, None
            if not record.has_response:
                return "no response to capture (capture mode needs a final assistant turn)"
            prefix_text = self.render(msgs[:-1], record.seq_id)
            full_text = self.render(msgs, record.seq_id, add_generation_prompt=False)
        except Exception as e:  # noqa: BLE001 - a template that cannot render this record rejects it
            return f"chat template failed: {type(e).__name__}: {str(e)[:200]}"
        if not full_text.startswith(prefix_text):
            return "chat template renders the response inconsistently with the generation prompt"
        prefix = self.ids(prefix_text)
        response = self.response_ids(prefix, prefix_text, full_text[len(prefix_text) :])
        if len(prefix) > s.max_prompt_tokens or len(prefix) + len(response) > s.max_length:
            lengths = f"{len(prefix)} prompt + {len(response)} response tokens"
            return f"sequence too long ({lengths}; max_length {s.max_length})"
        if not response:
            return "empty response"
        return prefix + response, [False] * len(prefix) + [True] * len(response)

    def response_ids(self, prefix: list[int], prefix_text: str, response_text: str) -> list[int]:
        """The response's tokens after the prompt's, cut after the first stop token as regeneration would end: as
        the whole rendering encodes them, or, where that encoding merges across the boundary (a response that
        starts with whitespace joins the generation prompt's newline), the response text encoded on its own. The
        prompt's tokens are never re-encoded: they are the ones regeneration feeds."""
        whole = self.ids(prefix_text + response_text)
        ids = whole[len(prefix) :] if whole[: len(prefix)] == prefix else self.ids(response_text)
        end = next((i + 1 for i, t in enumerate(ids) if t in self.stop_ids), len(ids))
        return ids[:end]
