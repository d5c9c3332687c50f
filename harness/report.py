"""report.json and report.md: settings, per-method tau / throughput / speedup / losslessness, per
prompt-set breakdown, DFlash acceptance histogram and round-time split, train/serve parity, picture links."""

from __future__ import annotations

import json
from pathlib import Path

from harness.methods import DRAFTER_METHODS, METHODS
from harness.training_log import PARITY_TOLERANCE, parity_line

TIMING_NOTE = (
    "Decode time excludes the prefill (the prompt forward that emits the first token; for prompt lookup, "
    "generate's first forward, which also verifies its first candidates) for every method. tau = tokens "
    "committed per target forward after the prefill. speedup = decode tokens/s over plain decoding's on the "
    "same prompts, both on the same target (with greedy, identical outputs: plain decode wall time / method decode "
    "wall time). break-even tau = the method's decode seconds a round / plain decoding's decode seconds a token, on "
    "this machine: the tau at which a round costs what plain decoding pays for as many tokens, so speedup = tau / "
    "break-even tau (blank for plain, which drafts nothing). "
    "plain and the dflash methods run the same harness loop (plain = block size 1, no drafter); prompt lookup runs "
    "transformers generate. With exact verification on ('exact verification' above; eval.exact) every method but "
    "plain_as_loaded runs the target made exact (GEMMs on tiles of at most 16 rows, a shorter tile zero-padded to the "
    "fewest rows whose kernel every longer tile shares, probed per shape at load: 'GEMM rows' above; attention a row "
    "at a time; every RMSNorm's sum of squares in one fixed order), whose greedy output speculative decoding "
    "reproduces bit for bit; plain_as_loaded decodes a copy of "
    "the target as loaded (plain GEMMs and SDPA): its speedup is what exactness costs plain decoding, and its "
    "'lossless' says whether its tokens equal the exact target's. With it off every method runs the target as loaded, "
    "the speed a user gets, and greedy outputs are compared with plain decoding's as information (agreement)."
)


def _fmt(value, spec=".2f", unit="") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return format(value, spec) + unit


def methods_table(methods: dict) -> str:
    lines = [
        "| method | tau | break-even tau | tokens/s | speedup | lossless | decode tokens | decode s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in methods.items():
        even = m.get("break_even_tau")  # None: plain, or a report written before it was measured
        lines.append(
            f"| {name} | {_fmt(m['tau'])} | {'' if even is None else _fmt(even)} | {_fmt(m['tokens_per_s'])} |"
            f" {_fmt(m['speedup'], unit='x')} |"
            f" {_fmt(m['lossless'])} "
            f"| {m['decode_tokens']} | {_fmt(m['decode_s'])} |"
        )
    return "\n".join(lines)


def exact_line(exact: dict | None) -> list[str]:
    """The report's line saying which verification ran (eval.exact)."""
    if not exact:
        return []
    if exact["on"]:
        return [f"- exact verification: on ({exact['why']}); greedy outputs must equal plain decoding's (lossless)"]
    return [
        f"- exact verification: off ({exact['why']}): every method runs the target as loaded; greedy outputs are "
        "compared with plain decoding's as information (agreement below), not held to them"
    ]


def agreement_section(methods: dict) -> list[str]:
    """Without exact verification: per method, on how many prompts its greedy output equals plain decoding's, and
    after how many tokens the others part (a near-tie the target's kernels break differently by row count)."""
    rows = [
        f"| {name} | {a['identical_prompts']} of {a['prompts']} | "
        f"{', '.join(map(str, a['tokens_before_first_difference'])) or '-'} |"
        for name, m in methods.items()
        if name != "plain" and (a := m.get("agreement"))
    ]
    if not rows:
        return []
    return [
        "## Agreement with plain decoding (as loaded, information)",
        "",
        "| method | identical outputs | tokens before the first difference, per other prompt |",
        "|---|---|---|",
        *rows,
        "",
    ]


def breakdown_table(methods: dict) -> str:
    """tau (rounds) per method: over everything, per prompt source, and per conversation turn (a turn's rounds and
    tokens are the sums over its prompts; the sources' or the turns' rounds add up to the whole)."""
    first = next(iter(methods.values()))
    sources, turns = list(first["by_source"]), list(first.get("by_turn", {}))
    lines = [
        "| method | all | " + " | ".join([*sources, *(f"turn {t}" for t in turns)]) + " |",
        "|---|---|" + "---|" * (len(sources) + len(turns)),
    ]
    for name, m in methods.items():
        parts = [m, *m["by_source"].values(), *m.get("by_turn", {}).values()]
        lines.append(f"| {name} | " + " | ".join(f"{_fmt(p['tau'])} ({p['rounds']})" for p in parts) + " |")
    return "\n".join(["tau (rounds: target forwards after the prefill):", "", *lines])


def render_markdown(report: dict) -> str:
    s, methods = report["settings"], report["methods"]
    out = ["# DFlash evaluation", ""]
    if s["untrained_drafter"]:
        out += [f"> **WARNING: {report['warning']}**", ""]
    out += [
        f"- target: `{s['target']}`; drafter: `{s['drafter']}`",
        f"- prompts: {', '.join(f'{k} ({v})' for k, v in s['prompt_counts'].items())}; "
        f"split {s['split']}, limit {s['limit']} per source, turns {s.get('turns', 'single')}",
        f"- max_new_tokens {s['max_new_tokens']}, temperature {s['temperature']}, "
        f"top_p {s['top_p']}, top_k {s['top_k']}, "
        f"block size {s['block_size']}, prompt lookup {s['prompt_lookup_num_tokens']} tokens",
        f"- device {s['device']} ({s['dtype']}, {s.get('attention', 'sdpa')} attention), "
        f"torch {s['torch']}, transformers {s['transformers']}, "
        f"{s['torch_threads']} threads, {s['date']}",
        *exact_line(s.get("exact")),
        *(
            [
                "- exact verification, GEMM rows (a shorter tile padded to): "
                + ", ".join(f"{k} {v}" for k, v in s["exact_gemm_rows"].items())
            ]
            if s.get("exact_gemm_rows")
            else []
        ),
        "",
        methods_table(methods),
        "",
        f"Timing: {TIMING_NOTE}",
        "",
    ]
    if s.get("resumed_prompts"):
        out[-1:-1] = [
            f"Resumed: {s['resumed_prompts']} prompt turns were measured by an interrupted run with the same settings.",
            "",
        ]
    out += ["Methods:", "", *(f"- {name}: {METHODS[name].label}" for name in methods), ""]
    out += ["## tau per prompt set and turn", "", breakdown_table(methods), ""]
    sources = list(next(iter(methods.values()))["by_source"])
    for source in sources:
        out += [f"## {source}", "", methods_table({name: m["by_source"][source] for name, m in methods.items()}), ""]
    out += _thinking_sections(methods)
    for method in (m for m in DRAFTER_METHODS if m in methods):
        out += _rounds_section(method, methods[method], s)
    out += _training_section(report)
    bad = {
        name: m.get("mismatched_prompts")
        for name, m in methods.items()
        if m.get("lossless") is False and not METHODS[name].as_loaded
    }
    if not (s.get("exact") or {"on": True})["on"]:
        out += agreement_section(methods)
    if bad:
        out += ["## NOT LOSSLESS", "", *[f"- {name}: {', '.join(p)}" for name, p in bad.items()], ""]
    for name in (n for n, m in methods.items() if METHODS[n].as_loaded and m.get("lossless") is False):
        out += [
            f"{name}, the target as loaded, left the exact target's greedy output on "
            f"{', '.join(methods[name]['mismatched_prompts'])} (last-bit differences at a near-tie; the "
            "speculative methods are compared with the exact target's plain decoding).",
            "",
        ]
    return "\n".join(out)


def _rounds_section(method: str, d: dict, s: dict) -> list[str]:
    """A drafter method's acceptance histogram and round-time split (`d`: its summary, `s`: the settings)."""
    hist = d["acceptance_histogram"]
    total = max(sum(hist.values()), 1)
    parts = METHODS[method].rounds_words(s, d)
    tree = f" ({'; '.join(parts)})" if parts else ""
    return [
        f"## {method} rounds{tree}",
        "",
        "Acceptance length (tokens committed per round) histogram:",
        "",
        "| " + " | ".join(hist) + " |",
        "|" + "---|" * len(hist),
        "| " + " | ".join(f"{c} ({100 * c / total:.0f}%)" for c in hist.values()) + " |",
        "",
        "Mean round time: "
        + ", ".join(f"{k} {v:.2f} ms" for k, v in d["round_ms"].items())
        + f" (total {sum(d['round_ms'].values()):.2f} ms over {d['rounds']} rounds)"
        + (f"; drafts verified per round {d['verified_drafts']:.2f}" if d.get("verified_drafts") is not None else ""),
        "",
    ]


def _training_section(report: dict) -> list[str]:
    """The acceptance picture, then train/serve parity and the training picture."""
    out = []
    pictures = report.get("pictures") or {}
    if "acceptance" in pictures:
        out += [f"![Acceptance length per prompt set]({pictures['acceptance']})", ""]
    parity = report.get("train_serve_parity")
    if parity or "training" in pictures:
        out += ["## Training", ""]
    if parity:
        replayed = "-" if not parity.get("replay_tau") else format(parity["replay_tau"], ".3f")
        gap = f" The gap exceeds {PARITY_TOLERANCE:.0%}: {parity['explanation']}" if parity["explanation"] else ""
        out += [
            "Train/serve parity:",
            "",
            f"| offline tau (trainer's held-out eval, step {parity['offline_step']}) | "
            "served-order replay on the stored "
            "responses | served DFlash tau (this eval) | relative gap |",
            "|---|---|---|---|",
            f"| {parity['offline_tau']:.3f} | {replayed} | {parity['served_tau']:.3f} | "
            f"{100 * parity['relative_gap']:+.1f}% |",
            "",
            f"Trainer metrics: `{parity['metrics']}`.{gap}",
            "",
        ]
        if parity.get("replay_tree_tau"):
            out += [
                f"Tree verification: served-order replay {parity['replay_tree_tau']:.3f}, served dflash_tree tau "
                f"{parity['served_tree_tau']:.3f}.",
                "",
            ]
    if "training" in pictures:
        out += [f"![Training curves: loss and offline tau]({pictures['training']})", ""]
    return out


def _thinking_sections(methods: dict) -> list[str]:
    """One table per thinking mode (eval.thinking): every method's tau and speedup on that mode's prompts."""
    out = []
    for mode in next(iter(methods.values())).get("by_thinking", {}):
        table = methods_table({name: m["by_thinking"][mode] for name, m in methods.items()})
        out += [f"## thinking {mode}", "", table, ""]
    return out


def thinking_tau_line(methods: dict) -> str | None:
    """tau per thinking mode of every method that has one, on one line (None without modes)."""
    modes = next(iter(methods.values())).get("by_thinking", {})
    if not modes:
        return None
    parts = [
        f"{mode}: " + ", ".join(f"{name} {_fmt(m['by_thinking'][mode]['tau'])}" for name, m in methods.items())
        for mode in modes
    ]
    return "tau by thinking mode: " + "; ".join(parts)


def console_summary(report: dict) -> str:
    """What `python -m harness` prints: the methods table, each drafter method's rounds, train/serve parity."""
    untrained = "\n!!! " + report["warning"] + "\n" if report.get("warning") else ""
    exact = exact_line(report["settings"].get("exact"))
    lines = [
        untrained + "\n" + "\n".join([*exact, methods_table(report["methods"])]),
        breakdown_table(report["methods"]),
    ]
    if by_mode := thinking_tau_line(report["methods"]):
        lines.append(by_mode)
    for method in (m for m in DRAFTER_METHODS if m in report["methods"]):
        d = report["methods"][method]
        verified = "" if d.get("verified_drafts") is None else f"; drafts verified per round {d['verified_drafts']:.2f}"
        lookup = f"; lookup rounds {d['lookup_rounds']} of {d['rounds']}" if "lookup_rounds" in d else ""
        lookup += f" ({d['datastore_rounds']} from the datastore)" if "datastore_rounds" in d else ""
        lines.append(
            f"{method} acceptance histogram {json.dumps(d['acceptance_histogram'])}{verified}{lookup}; round ms "
            + ", ".join(f"{k} {v:.1f}" for k, v in d["round_ms"].items())
        )
    if parity := report.get("train_serve_parity"):
        lines.append(parity_line(parity) + (f"\n  {parity['explanation']}" if parity["explanation"] else ""))
    return "\n".join(lines)


def card_eval_text(report: dict) -> str:
    """The served results as the drafter's model card shows them (`flashdraft.modelcard.SERVED_EVAL`): the settings
    in a sentence, the methods table, what its columns mean."""
    s = report["settings"]
    exact = s.get("exact") or {}
    prompts = ", ".join(f"{k} ({v})" for k, v in s["prompt_counts"].items())
    return "\n".join(
        [
            f"Served, measured by the harness (`python -m harness`) on {s['date']}: target `{s['target']}`, "
            f"{s['device']} ({s['dtype']}, torch threads {s['torch_threads']}), prompts {prompts} ({s['split']} "
            f"split), max_new_tokens {s['max_new_tokens']}, temperature {s['temperature']}, block size "
            f"{s['block_size']}, exact verification {'on' if exact.get('on') else 'off'}.",
            "",
            methods_table(report["methods"]),
            "",
            "tau: tokens committed per target forward after the prefill, bonus included. speedup: decode tokens/s over "
            "plain decoding's on the same prompts. break-even tau: the tau at which a round would cost what plain "
            "decoding pays for as many tokens, on this machine (speedup = tau / break-even tau); it moves with the "
            "hardware, tau does not.",
        ]
    )


def write_report(report: dict, out_dir) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "report.json", out_dir / "report.md"
    for path, text in zip(paths, (json.dumps(report, indent=2) + "\n", render_markdown(report) + "\n")):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return paths
