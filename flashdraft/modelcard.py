"""The drafter folder's model card, README.md: what the Hugging Face hub shows and its model-card parser reads.

YAML front matter (`huggingface_hub.ModelCard` reads it): `base_model`, the target's hub id (left out where the target
is only a local folder: a machine-local path means nothing on the hub); `library_name: flashdraft`; `tags`; `datasets`,
the hub datasets the training stores' prompts came from. `library_name` is ours, not `transformers`: the folder has
no `dflash.py`, so transformers' AutoModel cannot load it (docs/serving.md); `flashdraft.model.DFlashDrafter` and the
reference `dflash` package can, and the serving engines read it as a draft model beside the target. No
`pipeline_tag`: a drafter generates nothing alone (it has no embedding or head), so no hub pipeline can run it.

The body says what the drafter is (from its config.json), how to use it, the stores and the recipe it was trained on,
and an evaluation section of two marked parts, each rewritten whole by its writer (`set_card_section`), the rest of
the card kept: the trainer's held-out offline eval (`OFFLINE_EVAL`, at export) and the harness's served results
(`SERVED_EVAL`, after `make eval`). Every write is atomic and leaves the file world-readable (0644).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import yaml

from flashdraft.config import TrainConfig
from flashdraft.durable import write_text_durably
from flashdraft.spec import TRAINED_THINKING_KEY
from flashdraft.store import StoreError, read_manifest

CARD_FILE = "README.md"
LIBRARY_NAME = "flashdraft"
TAGS = ("dflash", "speculative-decoding", "draft-model")
OFFLINE_EVAL, SERVED_EVAL = "offline-eval", "served-eval"  # the card's marked sections
_HUB_CACHE_FOLDER = re.compile(r"models--([^/]+)--([^/]+)/snapshots/[^/]+/?$")


@dataclass(frozen=True)
class TargetName:
    """How the card names the target: its hub id (None: a local folder only), the words for the body, and the
    name to give the harness (`model.target`)."""

    hub_id: str | None
    words: str
    run_as: str


def target_name(target: str) -> TargetName:
    """The hub id of `target` as the trainer was given it: a hub id itself; the embedded default's source model; a
    folder of the hub's cache (models--ORG--NAME/snapshots/REV) its repo id. Any other local folder has none."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    from flashdraft.target.load import EMBEDDED_ALIASES, EMBEDDED_HUB_ID

    if target in EMBEDDED_ALIASES:
        return TargetName(EMBEDDED_HUB_ID, f"`{EMBEDDED_HUB_ID}` (this project's embedded default `{target}`)", target)
    folder = Path(target).expanduser()
    if folder.is_dir():
        if (found := _HUB_CACHE_FOLDER.search(folder.resolve().as_posix())) is not None:
            hub_id = f"{found[1]}/{found[2]}"
            return TargetName(hub_id, f"`{hub_id}`", hub_id)
        words = f"the local model folder `{folder.name}` (no hub id known: `base_model` left out)"
        return TargetName(None, words, "<the target's folder>")
    try:
        validate_repo_id(target)
    except HFValidationError:
        return TargetName(None, f"`{target}` (not a hub id: `base_model` left out)", target)
    return TargetName(target, f"`{target}`", target)


def hub_datasets(sources) -> list[str]:
    """The hub datasets among prompt `sources` (names as the stores record them); the packaged and file sources
    have no hub id and are named in the card's body only."""
    from flashdraft.prompts import HUB_SOURCES

    return list(dict.fromkeys(HUB_SOURCES[s][0] for s in sources if s in HUB_SOURCES))


def store_facts(paths) -> list[dict]:
    """Per store: its path as given, its counts and prompt sources (from its manifest; {} where it has none)."""
    out = []
    for path in paths or []:
        try:
            manifest = read_manifest(path)
        except (OSError, StoreError):  # the trainer read it already: gone since, the card names the path alone
            manifest = {}
        counts = manifest.get("counts", {})
        out.append({"path": str(path), "sources": list(manifest.get("sources", [])), **counts})
    return out


def train_recipe(cfg: TrainConfig, gamma: float, dtype: str) -> dict:
    """The recipe's key figures as the card shows them (`gamma`, `dtype`: as the run resolved them)."""
    return {
        "epochs": cfg.epochs,
        "max steps": cfg.max_steps if cfg.max_steps else "all",
        "lr": f"{cfg.lr:g} (AdamW, cosine, {cfg.warmup_ratio:.0%} warmup, grad clip {cfg.grad_clip:g})",
        "anchors a sequence": cfg.num_anchors,
        "max length": cfg.max_length,
        "loss gamma": f"{gamma:g}",
        "labels": f"soft, weight {cfg.soft_labels:g} on the target's top-k" if cfg.soft_labels else "hard",
        "loss vocabulary": f"{cfg.loss_vocab} most frequent words" if cfg.loss_vocab else "all words",
        "token budget a micro-batch": f"{cfg.token_budget} x grad accum {cfg.grad_accum}",
        "init": cfg.init,
        "dtype": dtype,
        "seed": cfg.seed,
    }


def front_matter(target: TargetName, datasets: list[str]) -> dict:
    data = {"base_model": target.hub_id, "library_name": LIBRARY_NAME, "tags": list(TAGS), "datasets": datasets}
    return {k: v for k, v in data.items() if v}


def _table(rows: dict) -> list[str]:
    return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows.items())]


def _what_it_is(config: dict, target: TargetName) -> list[str]:
    dflash = config.get("dflash_config", {})
    block, layer_ids = config.get("block_size"), dflash.get("target_layer_ids")
    mask = dflash.get("mask_token")
    return [
        f"A DFlash drafter for {target.words}: a small block-diffusion model that drafts {block - 1} tokens in one "
        "forward pass, conditioned on the target's hidden states; the target verifies them in one pass, so it decodes "
        "faster with exactly its own output. It has no embedding or output head of its own (it uses the target's), so "
        "it works with this target only.",
        "",
        *_table(
            {
                "block size": block,
                "draft layers": config.get("num_hidden_layers"),
                "target layer ids": f"{layer_ids} (of {config.get('num_target_layers')}: outputs of those layers)",
                "mask token": f"id {dflash.get('mask_token_id')}" + (f" (`{mask}`)" if mask else ""),
                "hidden size": config.get("hidden_size"),
                "dtype": config.get("dtype"),
                **({"trained thinking mode": thinking} if (thinking := config.get(TRAINED_THINKING_KEY)) else {}),
            }
        ),
    ]


def _how_to_use(config: dict, target: TargetName) -> list[str]:
    block = config.get("block_size")
    return [
        "## How to use",
        "",
        "Measure it against plain decoding (tau, speedup, lossless output) with this project's harness, which writes "
        "its results into this card:",
        "",
        "```bash",
        f"python -m harness model.target={target.run_as} eval.drafter=<this folder>   # or: make eval",
        "```",
        "",
        "Load it with `flashdraft.model.DFlashDrafter.from_pretrained(<this folder>)` or the reference `dflash` "
        "package (`dflash.model.DFlashDraftModel.from_pretrained`). Serve it beside its target (docs/serving.md of "
        "flashdraft): SGLang `--speculative-algorithm DFLASH --speculative-draft-model-path <this folder> "
        f"--speculative-num-draft-tokens {block}`, vLLM `--speculative-config "
        f'\'{{"method": "dflash", "model": "<this folder>", "num_speculative_tokens": {block - 1}}}\'`, llama.cpp '
        "after its `convert_hf_to_gguf.py --target-model-dir`. transformers' AutoModel cannot load it (no "
        "`dflash.py` ships with it).",
    ]


def _training(stores: list[dict], eval_stores: list[dict], recipe: dict, steps: int, tokens_seen: int) -> list[str]:
    rows = [
        f"| {kind} | `{s['path']}` | {', '.join(s['sources']) or '-'} | {s.get('sequences', '-')} | "
        f"{s.get('tokens', '-')} | {s.get('response_tokens', '-')} |"
        for kind, group in (("train", stores), ("eval", eval_stores))
        for s in group
    ]
    return [
        "## Training",
        "",
        "Feature stores (the target's responses to the prompts, regenerated, with its hidden states):",
        "",
        "| use | store | prompt sources | sequences | tokens | response tokens |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Trained {steps} optimizer steps ({tokens_seen:,} tokens). Recipe:",
        "",
        *_table(recipe),
    ]


def offline_eval_text(row: dict | None) -> str:
    """The trainer's held-out eval at export: a row of its metrics.jsonl (`step`, `eval/tau`, `eval/loss`,
    `eval/acc`), or None where it has none yet."""
    if not row or row.get("eval/tau") is None:
        return "Offline (the trainer's held-out eval): none yet."
    return "\n".join(
        [
            "Offline, the trainer's held-out eval (teacher-forced: tau per block is 1 + the leading run of right "
            "predictions, on sequences it did not train on):",
            "",
            "| step | tau | loss | accuracy (positions 1..B-1) |",
            "|---|---|---|---|",
            f"| {row['step']} | {row['eval/tau']:.3f} | {row.get('eval/loss', float('nan')):.4f} | "
            f"{row.get('eval/acc', float('nan')):.3f} |",
        ]
    )


NOT_SERVED = "Served: not measured yet (`python -m harness eval.drafter=<this folder>` writes its results here)."


def _marked(name: str, body: str) -> list[str]:
    return [f"<!-- flashdraft:{name} -->", body.strip(), f"<!-- /flashdraft:{name} -->"]


def render_card(
    config: dict,
    *,
    target: str,
    stores: list[dict],
    recipe: dict,
    steps: int,
    tokens_seen: int,
    eval_stores: list[dict] = (),
    offline_eval: dict | None = None,
) -> str:
    """The card's text: `config`, the drafter's config.json; `target` as the trainer was given it; `stores` and
    `eval_stores` from `store_facts`; `recipe` from `train_recipe`; `offline_eval` for `offline_eval_text`."""
    name = target_name(target)
    sources = [s for store in stores for s in store["sources"]]
    meta = yaml.safe_dump(front_matter(name, hub_datasets(sources)), sort_keys=False)
    when = datetime.now(UTC).strftime("%Y-%m-%d")
    lines = [
        "---",
        meta.rstrip(),
        "---",
        "",
        f"# DFlash drafter for {name.hub_id or Path(target).name}",
        "",
        *_what_it_is(config, name),
        "",
        *_how_to_use(config, name),
        "",
        *_training(stores, list(eval_stores), recipe, steps, tokens_seen),
        "",
        "## Evaluation",
        "",
        *_marked(OFFLINE_EVAL, offline_eval_text(offline_eval)),
        "",
        *_marked(SERVED_EVAL, NOT_SERVED),
        "",
        f"Written by flashdraft at export, {when}.",
    ]
    return "\n".join(lines) + "\n"


def write_card(folder: str | Path, **facts) -> Path:
    """README.md in the drafter `folder` (its config.json written already), from `facts` (`render_card`'s)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    return _write(folder / CARD_FILE, render_card(config, **facts))


def replace_section(text: str, name: str, body: str) -> str:
    """`text` with the marked section `name` holding `body` (appended at the end where it has none)."""
    start, end = f"<!-- flashdraft:{name} -->", f"<!-- /flashdraft:{name} -->"
    a, b = text.find(start), text.find(end)
    block = "\n".join(_marked(name, body))
    if a < 0 or b < a:
        return text.rstrip("\n") + "\n\n" + block + "\n"
    return text[:a] + block + text[b + len(end) :]


def set_card_section(folder: str | Path, name: str, body: str) -> bool:
    """Rewrite the section `name` of the card in `folder`, keeping the rest; False where the folder has no card."""
    path = Path(folder) / CARD_FILE
    if not path.is_file():
        return False
    _write(path, replace_section(path.read_text(), name, body))
    return True


def _write(path: Path, text: str) -> Path:
    write_text_durably(path, text)
    path.chmod(0o644)
    return path
