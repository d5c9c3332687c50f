"""One engine's serving of the gate prompts: its rounds, drafts and outputs, per sequence."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Leg:
    """One engine's serving of the gate prompts."""

    engine: str
    rounds: list[list[int]] = field(default_factory=list)  # committed tokens a round, per sequence
    drafts: list[list[list[int]]] = field(default_factory=list)  # drafted tokens a round, per sequence
    outputs: list[list[int]] = field(default_factory=list)  # generated tokens, per sequence
    seconds: float = 0.0
    # where a sequence's first round places its block[0] (the anchor), from the first generated token: 0 where the
    # prefill gives that token (harness, reference), -1 where the first round drafts from the prompt's last (llama.cpp)
    first_anchor: int = 0

    @property
    def tau(self) -> float:
        n = sum(len(r) for r in self.rounds)
        return sum(map(sum, self.rounds)) / n if n else 0.0
