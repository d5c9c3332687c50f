"""The gate's verdict on one engine: the first round that committed fewer tokens than the gate needs, and how it
reads (its positions, the drafted tokens against the committed ones)."""

from __future__ import annotations

from gate.leg import Leg


def first_short_round(leg: Leg, prompts, block_size: int, need: float) -> dict | None:
    """The first round committing fewer than `need` tokens, a sequence's last round left out (the token budget or a
    stop token ends it); its positions, drafts and the tokens committed there. None if there is none."""
    for s, (rounds, drafts, output) in enumerate(zip(leg.rounds, leg.drafts, leg.outputs)):
        start = len(prompts[s]) + leg.first_anchor  # the newest committed token's position: block[0] of the round
        for r, committed in enumerate(rounds):
            if committed < need and r < len(rounds) - 1:
                gen = start - len(prompts[s])  # index of block[0] among the generated tokens
                drafted = drafts[r] if r < len(drafts) else []
                truth = output[gen + 1 : gen + block_size]
                wrong = next((k for k, (d, t) in enumerate(zip(drafted, truth)) if d != t), None)
                return {
                    "sequence": s,
                    "round": r,
                    "committed": committed,
                    "block_positions": [start, start + block_size - 1],
                    "first_wrong_position": None if wrong is None else start + 1 + wrong,
                    "drafted": drafted,
                    "committed_tokens": truth,
                }
            start += committed
    return None


def describe_round(short: dict, tokenizer) -> str:
    def words(ids):
        return " ".join(repr(tokenizer.decode([t])) for t in ids)

    at = short["first_wrong_position"]
    return (
        f"  first short round: sequence {short['sequence']}, round {short['round']}: {short['committed']} tokens "
        f"committed, block at positions {short['block_positions'][0]}..{short['block_positions'][1]}, "
        f"first wrong draft at position {at}\n"
        f"    drafted   {short['drafted']}\n              {words(short['drafted'])}\n"
        f"    committed {short['committed_tokens']}\n              {words(short['committed_tokens'])}"
    )
