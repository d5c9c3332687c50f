"""python -m harness [overrides]: measure a drafter against plain decoding and prompt lookup.

    python -m harness                                   # conf/eval/quick.yaml, the model's drafter_dir
    python -m harness eval=full eval.drafter=PATH
    python -m harness eval.limit=2 eval.temperature=0.7 eval.methods=[plain,dflash]
    python -m harness eval.methods=[plain,dflash,dflash_tree] eval.tree_size=15   # tree verification (greedy)
    python -m harness eval.methods=[plain,prompt_lookup,dflash_lookup] eval.lookup_ngram=2   # DFlash + lookup rounds
    python -m harness eval.methods=[plain,dflash_datastore] eval.datastore=runs/x/features   # + the training responses
Writes report.json, report.md and runs.jsonl (one line per prompt, as it goes) into eval.out_dir, with
acceptance.png and training.png (from eval.metrics, the trainer's metrics.jsonl) next to report.md.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from flashdraft.target import (
    exact_gemm_rows,
    frozen_head_from_model,
    load_target,
    make_verification_exact,
    needs_exact_verification,
    resolve_dtype,
    stop_token_ids,
    target_fingerprint,
)
from flashdraft.store import StoreReader
from flashdraft.vocab import frequent_tokens
from harness.datastore import Datastore
from harness.evaluate import (
    DRAFTER_METHODS,
    LOOKUP_METHODS,
    UNTRAINED_WARNING,
    DecodeSettings,
    build_prompts,
    environment,
    evaluate,
    finished_records,
    load_drafter,
    summarize,
)
from harness.pictures import acceptance_lengths_by_source, plot_acceptance, plot_training
from harness.report import TIMING_NOTE, methods_table, write_report
from harness.replay import replay_tau
from harness.speculative import DrafterProposer, measure_verify_ms
from harness.training_log import parity_line, read_metrics, train_serve_parity


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def add_pictures_and_parity(report: dict, records: list[dict], out_dir: Path, metrics_path, block_size: int, replay: dict | None = None) -> None:
    """Draws acceptance.png and training.png into out_dir, and sets report["pictures"] (their names, for
    report.md) and report["train_serve_parity"] (None without trainer metrics or a trained drafter)."""
    untrained = report["settings"]["untrained_drafter"]
    served_tau = None if untrained else report["methods"].get("dflash", {}).get("tau")
    rows = read_metrics(metrics_path) if metrics_path else None
    pictures = {}
    for name in ("acceptance", "training"):
        (out_dir / f"{name}.png").unlink(missing_ok=True)  # never leave an earlier run's picture next to this report
    try:  # a plotting failure must not cost the report of a long eval
        if plot_acceptance(acceptance_lengths_by_source(records), block_size, out_dir / "acceptance.png"):
            pictures["acceptance"] = "acceptance.png"
        if rows is None:
            print(f"training.png skipped: no trainer metrics at {metrics_path} (eval.metrics)")
        elif plot_training(rows, out_dir / "training.png", served_tau=served_tau):
            pictures["training"] = "training.png"
        else:
            print(f"training.png skipped: {metrics_path} has no train or eval rows")
    except Exception as error:
        print(f"pictures incomplete ({', '.join(pictures) or 'none'} drawn): {error!r}", file=sys.stderr)
    settings = report["settings"]
    parity = train_serve_parity(rows, served_tau, draft_cutoff=settings.get("draft_cutoff") or 0.0,
                                verify_by_cost=bool(settings.get("verify_ms")), replay=replay)
    if parity:
        parity["metrics"] = str(metrics_path)
        if (replay or {}).get("tree_tau"):  # the tree method: its replay next to its served tau
            parity["replay_tree_tau"] = replay["tree_tau"]
            parity["served_tree_tau"] = report["methods"]["dflash_tree"]["tau"]
    report["pictures"], report["train_serve_parity"] = pictures, parity


def run_key(settings: DecodeSettings, methods, drafter_name, drafter_dir, fingerprint: dict, dtype, device, datastore=None,
            draft_vocab=None, verification=None) -> str:
    """What a finished prompt's measurement depends on: an interrupted eval resumes only under the same key
    (`verification`: how the target was made exact, which sets every method's timing)."""
    weights = Path(drafter_dir, "model.safetensors") if drafter_dir else None
    identity = {
        "settings": {**asdict(settings), "verify_ms": settings.verify_ms is not None},  # verify_ms: measured anew each run
        "methods": list(methods), "drafter": drafter_name,
        "drafter_weights": [weights.stat().st_size, weights.stat().st_mtime_ns] if weights and weights.is_file() else None,
        "target": fingerprint, "dtype": str(dtype), "device": str(device), "threads": torch.get_num_threads(),
        "datastore": datastore, "draft_vocab": draft_vocab, "verification": verification,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run(cfg: DictConfig) -> dict:
    e, m = cfg.eval, cfg.model
    if e.num_threads:
        torch.set_num_threads(int(e.num_threads))
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(m.dtype, device)
    target, tokenizer = load_target(m.target, dtype=dtype, device=device, trust_remote_code=cfg.trust_remote_code)
    methods = list(e.methods)
    proposer, untrained, drafter_path, block_size = None, False, None, 1
    if any(m in DRAFTER_METHODS for m in methods):
        drafter, untrained = load_drafter(
            e.drafter, target, tokenizer, allow_untrained=e.allow_untrained, num_layers=m.drafter.num_layers,
            block_size=m.drafter.block_size, layer_ids=m.layer_ids, num_target_features=m.num_target_features,
            intermediate_size=m.drafter.intermediate_size, seed=cfg.seed,
        )
        proposer = DrafterProposer(drafter, frozen_head_from_model(target))
        drafter_path = "UNTRAINED (random init)" if untrained else str(e.drafter)
        block_size = e.block_size or drafter.block_size
        if untrained:
            print(f"\n{'!' * 100}\n!!! {UNTRAINED_WARNING}\n{'!' * 100}\n", file=sys.stderr, flush=True)
    loaded_target = None
    if needs_exact_verification(dtype, device):
        if "plain_as_loaded" in methods:  # a second copy, left as loaded: plain decoding as a user runs it
            loaded_target = load_target(m.target, dtype=dtype, device=device, trust_remote_code=cfg.trust_remote_code)[0]
        make_verification_exact(target)
    settings = DecodeSettings(
        max_new_tokens=e.max_new_tokens, temperature=e.temperature, top_p=e.top_p, top_k=e.top_k,
        block_size=block_size, prompt_lookup_num_tokens=e.prompt_lookup_num_tokens,
        draft_cutoff=float(e.get("draft_cutoff") or 0.0), tree_size=int(e.get("tree_size") or 7),
        tree_branching=int(e.get("tree_branching") or 4), lookup_ngram=int(e.get("lookup_ngram", 3)),
        datastore_ngram=int(e.get("datastore_ngram") or 4), datastore_min_ngram=int(e.get("datastore_min_ngram") or 2),
        datastore_min_count=int(e.get("datastore_min_count") or 2), seed=e.seed,
    )
    trees = bool({"dflash_tree", *LOOKUP_METHODS} & set(methods))  # the methods that verify trees
    if e.get("verify_by_cost") and set(DRAFTER_METHODS) & set(methods):
        if settings.draft_cutoff > 0:
            raise ValueError(f"eval.verify_by_cost and eval.draft_cutoff={settings.draft_cutoff} both choose what dflash verifies: set one of them")
        costs = measure_verify_ms(target, max(block_size, 1 + settings.tree_size) if trees else block_size)
        settings = replace(settings, verify_ms=tuple(round(c, 2) for c in costs))
        print(f"verify costs (ms, 1..{len(costs)} rows): " + ", ".join(f"{c:.1f}" for c in costs))
    prompts = build_prompts(
        tokenizer, OmegaConf.to_object(e.prompts) if OmegaConf.is_config(e.prompts) else e.prompts,
        split=e.split, limit=e.limit, system_prompt=m.chat.system_prompt, enable_thinking=m.chat.enable_thinking,
    )
    draft_vocab_info, k, vocab_store = None, int(e.get("draft_vocab") or 0), e.get("draft_vocab_store")
    if proposer is not None and k and not (vocab_store and Path(vocab_store, "manifest.json").is_file()):
        print(f"draft vocabulary: no feature store at {str(vocab_store)!r} (eval.draft_vocab_store) to count it in: drafts score "
              "all words (eval.draft_vocab=0 says so quietly)", file=sys.stderr)
    elif proposer is not None and k:
        words = frequent_tokens(StoreReader(vocab_store).token_sequences(skip=[p.seq_id for p in prompts]),  # never their own responses
                                min(k, target.config.vocab_size), target.config.vocab_size)  # fmt: skip
        proposer = DrafterProposer(proposer.drafter, proposer.head, draft_vocab=words)
        draft_vocab_info = {"words": len(words), "store": str(vocab_store)}
        print(f"draft vocabulary: the {len(words):,} most frequent response tokens of {vocab_store} (eval prompts' sequences left out)")
    datastore, datastore_info = None, None
    if "dflash_datastore" in methods and e.temperature == 0:  # (greedy only: evaluate refuses it by name otherwise)
        datastore = Datastore.from_store(e.get("datastore"), exclude=[p.seq_id for p in prompts],  # never their own responses
                                         ngram=settings.datastore_ngram, min_ngram=settings.datastore_min_ngram,
                                         min_count=settings.datastore_min_count)  # fmt: skip
        datastore_info = {"store": str(e.datastore), "sequences": datastore.sequences, "tokens": datastore.tokens,
                          "ngrams": len(datastore), "excluded_eval_sequences": datastore.excluded}  # fmt: skip
        print(f"datastore: {len(datastore):,} {settings.datastore_min_ngram}- to {settings.datastore_ngram}-grams with a continuation from {datastore.sequences:,} "
              f"responses ({datastore.tokens:,} tokens) of {e.datastore}; {datastore.excluded} eval prompts' sequences left out")
    out_dir = Path(e.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "runs.jsonl"
    fingerprint = target_fingerprint(m.target)
    gemm_rows = exact_gemm_rows(target)
    key = run_key(settings, methods, drafter_path, e.drafter if proposer and not untrained else None, fingerprint, dtype, device,
                  datastore_info, draft_vocab_info,
                  {"attention": target.config._attn_implementation, "gemm_rows": gemm_rows})
    done = {}
    if e.get("resume", True):
        done = finished_records(log_path, key, [p.seq_id for p in prompts])
        if done:
            print(f"resuming: {len(done)} of {len(prompts)} prompts were finished by an interrupted run with the same "
                  f"settings ({log_path}; eval.resume=false starts over)")
    else:
        log_path.unlink(missing_ok=True)
    records = evaluate(
        target, prompts, settings, methods=methods, proposer=proposer, datastore=datastore,
        stop_token_ids=stop_token_ids(target, tokenizer),
        log_path=log_path, warmup=e.warmup, done=done, run_key=key, loaded_target=loaded_target,
    )
    counts = {}
    for p in prompts:
        counts[p.source] = counts.get(p.source, 0) + 1
    report = {
        "settings": {
            "target": str(m.target),
            "target_fingerprint": fingerprint,
            "drafter": drafter_path,
            "untrained_drafter": untrained,
            "drafter_layer_ids": proposer.layer_ids if proposer else None,
            "prompt_sources": list(counts),
            "prompt_counts": counts,
            "split": e.split,
            "limit": e.limit,
            "max_new_tokens": e.max_new_tokens,
            "temperature": e.temperature,
            "top_p": e.top_p,
            "top_k": e.top_k,
            "block_size": block_size,
            "prompt_lookup_num_tokens": e.prompt_lookup_num_tokens,
            "draft_cutoff": settings.draft_cutoff,
            "verify_ms": list(settings.verify_ms) if settings.verify_ms else None,
            "tree_size": settings.tree_size if trees else None,
            "tree_branching": settings.tree_branching if trees else None,
            "lookup_ngram": settings.lookup_ngram if set(LOOKUP_METHODS) & set(methods) else None,
            "datastore_ngram": settings.datastore_ngram if datastore else None,
            "datastore_min_ngram": settings.datastore_min_ngram if datastore else None,
            "datastore_min_count": settings.datastore_min_count if datastore else None,
            "datastore": datastore_info,
            "draft_vocab": draft_vocab_info,
            "methods": methods,
            "seed": e.seed,
            "resumed_prompts": len(done),
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "attention": target.config._attn_implementation,
            "exact_gemm_rows": gemm_rows,
            "timing": TIMING_NOTE,
            **environment(),
        },
        "methods": summarize(records, methods, greedy=e.temperature == 0, block_size=block_size),
        "prompts": [
            {
                "source": r["source"], "record_id": r["record_id"], "prompt_tokens": r["prompt_tokens"],
                **{f"{k}_new_tokens": len(v["tokens"]) for k, v in r["methods"].items()},
                "text": tokenizer.decode(next(iter(r["methods"].values()))["tokens"]),
            }
            for r in records
        ],
    }
    if untrained:
        report["warning"] = UNTRAINED_WARNING
    replay = None
    store = e.get("replay_store")
    if proposer is not None and not untrained and e.temperature == 0 and store and Path(store, "manifest.json").is_file():
        seq_ids = [p.seq_id for p in prompts]
        replay = replay_tau(proposer, store, seq_ids, max_new_tokens=e.max_new_tokens, draft_cutoff=settings.draft_cutoff)
        if "dflash_tree" in methods and replay:
            tree = replay_tau(proposer, store, seq_ids, max_new_tokens=e.max_new_tokens, tree_size=settings.tree_size,
                              tree_branching=settings.tree_branching)  # fmt: skip
            replay["tree_tau"] = tree["tau"] if tree else None
    add_pictures_and_parity(report, records, out_dir, e.get("metrics"), block_size, replay)
    json_path, md_path = write_report(report, out_dir)
    print(("\n!!! " + UNTRAINED_WARNING + "\n" if untrained else "") + "\n" + methods_table(report["methods"]))
    for method in (m for m in methods if m in DRAFTER_METHODS):
        d = report["methods"][method]
        verified = "" if d.get("verified_drafts") is None else f"; drafts verified per round {d['verified_drafts']:.2f}"
        lookup = f"; lookup rounds {d['lookup_rounds']} of {d['rounds']}" if "lookup_rounds" in d else ""
        lookup += f" ({d['datastore_rounds']} from the datastore)" if "datastore_rounds" in d else ""
        print(f"{method} acceptance histogram {json.dumps(d['acceptance_histogram'])}{verified}{lookup}; round ms "
              + ", ".join(f"{k} {v:.1f}" for k, v in d["round_ms"].items()))
    if parity := report["train_serve_parity"]:
        print(parity_line(parity) + (f"\n  {parity['explanation']}" if parity["explanation"] else ""))
    print(f"\nwrote {json_path} and {md_path}" + "".join(f", {out_dir / p}" for p in report["pictures"].values()))
    return report


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
