"""llama.cpp's rounds set against the harness's one by one: as served (llama.cpp's rounds start one token before
ours), and anchored (each prompt served again with the harness's first generated token appended)."""

from __future__ import annotations

from pathlib import Path

from gate.engines import serve_llamacpp
from gate.leg import Leg


def unequal_round(s: int, p: int, r: int, q: int, ours, theirs, d_ours, d_theirs) -> dict:
    """An aligned pair of rounds that differs in its commit count or its drafts, both sides' figures."""
    return {
        "sequence": s,
        "output_position": p,
        "harness_round": r,
        "llamacpp_round": q,
        "harness_committed": ours[r],
        "llamacpp_committed": theirs[q],
        "harness_drafts": d_ours,
        "llamacpp_drafts": d_theirs,
    }


def rounds_against_harness(harness: Leg, llama: Leg, llama_first: int = 0) -> dict:
    """llama.cpp's rounds set against the harness's one by one (`harness.llamacpp.aligned_rounds`: rounds aligned by
    the output position of their first committed token, within the stretch both outputs agree on; `llama_first`: the
    output position of llama.cpp's first round's first token, 1 in the anchored run): per sequence and in all,
    aligned rounds, those committing the same count and those drafting the same tokens (over the positions both
    drafted), and each aligned round that differs in either, with both sides' drafts."""
    from harness.llamacpp import aligned_rounds, common_prefix

    out = {"aligned": 0, "equal": 0, "equal_drafts": 0, "per_sequence": [], "unequal": []}
    for s, (ours, theirs) in enumerate(zip(harness.rounds, llama.rounds)):
        agree = common_prefix(harness.outputs[s], llama.outputs[s])
        pairs = aligned_rounds(ours, theirs, agree, llama_first)
        aligned, equal = len(pairs), sum(ours[r] == theirs[q] for _, r, q in pairs)
        same_drafts = 0
        for p, r, q in pairs:
            d_ours = harness.drafts[s][r] if r < len(harness.drafts[s]) else []
            d_theirs = llama.drafts[s][q] if q < len(llama.drafts[s]) else []
            n = min(len(d_ours), len(d_theirs))
            drafts_equal = d_ours[:n] == d_theirs[:n]
            same_drafts += drafts_equal
            if ours[r] != theirs[q] or not drafts_equal:
                out["unequal"].append(unequal_round(s, p, r, q, ours, theirs, d_ours, d_theirs))
        out["aligned"] += aligned
        out["equal"] += equal
        out["equal_drafts"] += same_drafts
        out["per_sequence"].append({"agree": agree, "aligned": aligned, "equal": equal, "equal_drafts": same_drafts})
    return out


def anchored_llamacpp(harness: Leg, drafter_dir: Path, prompts, max_new_tokens: int, stop, **kw) -> dict:
    """llama.cpp's rounds against the harness's with llama.cpp's first round anchored where the harness's is: each
    prompt served again with the harness's first generated token appended (what the harness takes from the prefill),
    so llama.cpp's round k drafts from the same anchor, with the same context, as the harness's round k. A near-certain
    drafter otherwise commits a full block in llama.cpp's extra first round and its rounds never start where the
    harness's do. A prompt whose text with that token does not tokenize back to the same ids is left out (named)."""
    tokenizer = kw["tokenizer"]
    keep, left_out = [], []
    for s, prompt in enumerate(prompts):
        ids = list(prompt) + harness.outputs[s][:1]
        text = tokenizer.decode(ids, skip_special_tokens=False)
        ok = len(harness.outputs[s]) > 1 and tokenizer(text, add_special_tokens=False).input_ids == ids
        (keep if ok else left_out).append(s)
    if not keep:
        return {"sequences": [], "left_out": left_out}
    extended = [list(prompts[s]) + harness.outputs[s][:1] for s in keep]
    leg = serve_llamacpp(None, drafter_dir, extended, max_new_tokens - 1, stop, **kw)
    leg.outputs = [harness.outputs[s][:1] + o for s, o in zip(keep, leg.outputs)]
    ours = Leg(
        "harness",
        rounds=[harness.rounds[s] for s in keep],
        drafts=[harness.drafts[s] for s in keep],
        outputs=[harness.outputs[s] for s in keep],
    )
    parity = rounds_against_harness(ours, leg, llama_first=1)
    for d in parity["unequal"]:
        d["sequence"] = keep[d["sequence"]]
    return {**parity, "sequences": keep, "left_out": left_out, "llamacpp_rounds": leg.rounds}


def log_unequal(parity: dict, log, most: int = 3) -> None:
    for d in parity["unequal"][:most]:
        log(
            f"  unequal: sequence {d['sequence']} at output position {d['output_position']}: harness round "
            f"{d['harness_round']} commits {d['harness_committed']}, llama.cpp round {d['llamacpp_round']} "
            f"{d['llamacpp_committed']}\n    harness drafts   {d['harness_drafts']}\n"
            f"    llama.cpp drafts {d['llamacpp_drafts']}"
        )
