"""PNG pictures for the eval report: acceptance-length histograms per prompt set, and the trainer's loss and
offline-tau curves. Plain data in, a PNG out; matplotlib's Agg canvas on a bare Figure (no pyplot state).
matplotlib is imported where a picture is drawn, so the harness runs where it is not installed (jobs/gpu_smoke.sh's
wheelhouse leaves it out); the caller then reports the pictures as not drawn."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

from harness.methods import DRAWN_METHODS, METHODS

TRAIN_COLOUR, EVAL_COLOUR, SERVED_COLOUR = "#1f4e9c", "#d9480f", "#2b8a3e"


def acceptance_lengths_by_source(records, methods=DRAWN_METHODS) -> dict[str, dict[str, list[int]]]:
    """{source: {method: acceptance lengths of every round of every prompt}} from evaluate()'s records
    (or the lines of runs.jsonl)."""
    out: dict[str, dict[str, list[int]]] = {}
    for r in records:
        for method in methods:
            if method in r["methods"]:
                out.setdefault(r["source"], {}).setdefault(method, []).extend(
                    r["methods"][method]["acceptance_lengths"]
                )
    return out


def _save(fig: Figure, path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def plot_acceptance(lengths_by_source: dict[str, dict[str, list[int]]], block_size: int, path) -> Path | None:
    """One panel per prompt set: fraction of rounds committing 1..block_size tokens (further if a method's rounds
    are longer), a bar per method in its colour (`harness.methods.METHODS`), tau per method in the legend. None when
    there are no rounds to draw."""
    panels = {s: {m: v for m, v in per.items() if v} for s, per in lengths_by_source.items()}
    panels = {s: per for s, per in panels.items() if per}
    if not panels:
        return None
    from matplotlib.figure import Figure

    top = max([block_size, *(max(v) for per in panels.values() for v in per.values())])
    x = np.arange(1, top + 1)
    ncols = min(len(panels), 3)
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=((0.3 * top + 1.6) * ncols, 3.4 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, sharey=True, squeeze=False).ravel()
    for ax, (source, per_method) in zip(axes, panels.items()):
        width = 0.8 / len(per_method)
        for i, (method, lengths) in enumerate(per_method.items()):
            fractions = np.bincount(lengths, minlength=top + 1)[1:] / len(lengths)
            tau = sum(lengths) / len(lengths)
            ax.bar(
                x + (i - (len(per_method) - 1) / 2) * width,
                fractions,
                width,
                color=METHODS[method].colour if method in METHODS else None,
                label=f"{method}: tau {tau:.2f}, {len(lengths)} rounds",
            )
        ax.set_title(source)
        ax.set_xticks(x if top <= 24 else x[::2])
        ax.set_xlabel("tokens committed per round")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    for ax in axes[::ncols]:
        ax.set_ylabel("fraction of rounds")
    fig.suptitle(f"Acceptance length per prompt set (DFlash block size {block_size})")
    return _save(fig, path)


def running_mean(values, window: int) -> np.ndarray:
    """Trailing mean over the last `window` values (fewer at the start)."""
    sums = np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=float))])
    end = np.arange(1, len(values) + 1)
    start = np.maximum(end - window, 0)
    return (sums[end] - sums[start]) / (end - start)


def plot_training(rows: list[dict], path, *, served_tau: float | None = None) -> Path | None:
    """Two panels from metrics.jsonl rows: loss and offline tau, train (raw, faint, and a running mean) and
    held-out eval; `served_tau` (this eval's DFlash tau) as a dashed line. None when there is nothing to draw."""
    train = [r for r in rows if r.get("loss") is not None]
    evals = [r for r in rows if r.get("eval/loss") is not None or r.get("eval/tau") is not None]
    if not train and not evals:
        return None
    from matplotlib import ticker
    from matplotlib.figure import Figure

    window = max(1, len(train) // 20)
    fig = Figure(figsize=(11, 4), layout="constrained")
    ax_loss, ax_tau = fig.subplots(1, 2)
    for ax, key, title in (
        (ax_loss, "loss", "Loss (decayed-weight cross-entropy)"),
        (ax_tau, "tau", "Offline tau (1 + leading correct per block)"),
    ):
        train_points = np.array([(r["step"], r[key]) for r in train if r.get(key) is not None], dtype=float).reshape(
            -1, 2
        )
        eval_points = np.array(
            [(r["step"], r[f"eval/{key}"]) for r in evals if r.get(f"eval/{key}") is not None], dtype=float
        ).reshape(-1, 2)
        if len(train_points):
            steps, values = train_points.T
            ax.plot(steps, values, color=TRAIN_COLOUR, alpha=0.2, lw=0.8, label="train, per step")
            ax.plot(steps, running_mean(values, window), color=TRAIN_COLOUR, label=f"train (running mean of {window})")
        if len(eval_points):
            ax.plot(*eval_points.T, "o-", color=EVAL_COLOUR, ms=4, label="held-out eval")
        if key == "tau" and served_tau is not None:
            ax.axhline(
                served_tau, color=SERVED_COLOUR, ls="--", label=f"served DFlash tau {served_tau:.2f} (this eval)"
            )
        values = np.concatenate([train_points[:, 1], eval_points[:, 1]])
        if key == "loss" and len(values) and values.min() > 0 and values.max() > 10 * values.min():
            ax.set_yscale("log")  # the first steps' loss dwarfs the rest
            ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%g"))
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.suptitle("Training")
    return _save(fig, path)
