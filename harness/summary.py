"""Per-method summaries of an eval's records: tau, throughput, speedup over plain decoding, losslessness, and for
the drafter methods the acceptance histogram, drafts verified and the round-time split."""

from __future__ import annotations

from collections import Counter

from harness.methods import METHODS, PLAIN


def _decode_throughput(records, method) -> tuple[int, float]:
    """(decode tokens, decode seconds) of `method` over `records`."""
    runs = [r["methods"][method] for r in records]
    return sum(sum(run["acceptance_lengths"]) for run in runs), sum(run["decode_s"] for run in runs)


def break_even_tau(records, method, rounds: int, decode_s: float) -> float | None:
    """The tau at which `method` would decode as fast as plain decoding on this machine: its mean seconds a round
    over plain decoding's seconds a token, both from decode wall time (prefill excluded), the timing the speedup uses,
    so speedup = tau / break-even tau. None for a method that drafts nothing (plain itself and plain_as_loaded: a
    round is one token), or without plain's timing in the records."""
    if METHODS[method].policy is METHODS[PLAIN].policy or PLAIN not in records[0]["methods"] or not rounds:
        return None
    plain_tokens, plain_s = _decode_throughput(records, PLAIN)
    if not plain_tokens or plain_s <= 0 or decode_s <= 0:
        return None
    return (decode_s / rounds) / (plain_s / plain_tokens)


def first_difference(tokens: list[int], plain: list[int]) -> int | None:
    """The tokens a method's output shares with plain decoding's before they first differ (None: identical)."""
    if tokens == plain:
        return None
    return next((i for i, (a, b) in enumerate(zip(tokens, plain)) if a != b), min(len(tokens), len(plain)))


def method_summary(records, method, *, greedy: bool, block_size: int | None = None, exact: bool = True) -> dict:
    """`exact`: whether the target ran with exact verification; without it, greedy outputs that part from plain
    decoding's are information (`agreement`), not a lossless failure (`lossless` None)."""
    runs = [r["methods"][method] for r in records]
    rounds = [a for run in runs for a in run["acceptance_lengths"]]
    decode_tokens, decode_s = _decode_throughput(records, method)
    summary = {
        "prompts": len(runs),
        "new_tokens": sum(len(run["tokens"]) for run in runs),
        "decode_tokens": decode_tokens,
        "decode_s": decode_s,
        "prefill_s": sum(run["prefill_s"] for run in runs),
        "rounds": len(rounds),
        "tau": decode_tokens / len(rounds) if rounds else None,
        "break_even_tau": break_even_tau(records, method, len(rounds), decode_s),
        "tokens_per_s": decode_tokens / decode_s if decode_s > 0 else None,
        "speedup": None,
        "lossless": None,
    }
    for baseline, key in ((name, m.speedup_key) for name, m in METHODS.items() if m.speedup_key):
        if baseline in records[0]["methods"]:
            tokens, seconds = _decode_throughput(records, baseline)
            if summary["tokens_per_s"] and tokens and seconds > 0:
                summary[key] = summary["tokens_per_s"] / (tokens / seconds)
    if PLAIN in records[0]["methods"] and greedy:
        parted = [first_difference(r["methods"][method]["tokens"], r["methods"][PLAIN]["tokens"]) for r in records]
        summary["lossless"] = all(at is None for at in parted) if exact else None
        summary["mismatched_prompts"] = [
            f"{r['source']}/{r['record_id']}" for r, at in zip(records, parted) if at is not None
        ]
        summary["agreement"] = {
            "identical_prompts": sum(at is None for at in parted),
            "prompts": len(parted),
            "tokens_before_first_difference": [at for at in parted if at is not None],
        }
    if METHODS[method].drafter:
        counts = Counter(rounds)
        longest = max(block_size or 1, max(rounds, default=1))  # a lookup round can commit more than a block
        summary["acceptance_histogram"] = {str(k): counts.get(k, 0) for k in range(1, longest + 1)}
        n = max(len(rounds), 1)
        verified = [v for run in runs for v in run.get("verified_drafts", [])]
        summary["verified_drafts"] = sum(verified) / len(verified) if verified else None
        summary["round_ms"] = {
            part: 1000 * sum(run[f"{part}_s"] for run in runs) / n for part in ("draft", "verify", "bookkeeping")
        }
        for count in METHODS[method].counts:
            summary[count] = sum(run.get(count, 0) for run in runs)
    return summary


def thinking_name(record) -> str | None:
    """A record's thinking mode as the report names it: on, off, or None where none was set."""
    mode = record.get("thinking")
    return None if mode is None else ("on" if mode else "off")


def summarize(records, methods, *, greedy: bool, block_size: int | None, exact: bool = True) -> dict:
    """Each method's summary over every record, with the same summary per prompt source (`by_source`), per
    conversation turn (`by_turn`, "1", "2", ...: a record without a turn is a first turn) and per thinking mode
    (`by_thinking`, on / off, where the records carry one: a drafter trained in one mode accepts far less in the
    other, so the modes are kept apart)."""
    out = {}
    modes = [m for m in dict.fromkeys(thinking_name(r) for r in records) if m is not None]
    for method in methods:
        out[method] = method_summary(records, method, greedy=greedy, block_size=block_size, exact=exact)
        keys = [("by_source", _source), ("by_turn", _turn)] + ([("by_thinking", thinking_name)] if modes else [])
        for name, key in keys:
            out[method][name] = {
                value: method_summary(
                    [r for r in records if key(r) == value], method, greedy=greedy, block_size=block_size, exact=exact
                )
                for value in dict.fromkeys(key(r) for r in records)
                if value is not None
            }
    return out


def _source(record) -> str:
    return record["source"]


def _turn(record) -> str:
    return str(record.get("turn", 1))
