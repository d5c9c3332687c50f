"""The evaluation entry point: Hydra config -> report.json / report.md with every method, on a
tiny Llama target saved in a tmp folder with a byte-level BPE tokenizer trained in code."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from entry import typed_config
from harness.__main__ import run, run_key
from harness.methods import METHODS
from tests.test_speculative import one_thread, tiny_drafter, tiny_target  # noqa: F401 (one_thread: autouse fixture)

ROOT = Path(__file__).resolve().parents[1]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-target")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(
        ["def solution(x):\n    return x + 1\n", "Write a story about a user and an assistant."] * 50, trainer
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML
    )
    model = tiny_target("llama", vocab=320, layers=10)  # spare rows past the tokenizer: the mask token lands on one;
    # 10 layers: the untrained drafter reads the 5 distinct layers of the reference formula
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_training_store(path, tokenizer_dir, held_out_seq_id):
    """A training store for the datastore: two responses, and one under an eval prompt's id (to be left out)."""
    from flashdraft.store import write_store

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    sequences = []
    for seq_id in ("train-0", "train-1", held_out_seq_id):
        ids = np.asarray(
            tokenizer("Write a story. <|im_start|>assistant\ndef solution(x):\n    return x + 1\n")["input_ids"]
        )
        mask = np.arange(len(ids)) >= 6
        sequences.append({"seq_id": seq_id, "input_ids": ids, "loss_mask": mask, "features": torch.zeros(len(ids), 8)})
    write_store(path, sequences, layer_ids=[0], hidden_size=8, dtype="float32")
    return path


def overrides(target_dir, out_dir, *extra):
    return [
        f"model.target={target_dir}",
        "model.dtype=float32",
        "device=cpu",
        f"run_dir={out_dir}",
        "eval.limit=2",
        "eval.max_new_tokens=12",
        "eval.num_threads=1",
        *extra,
    ]


def compose_config(over):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=over)


def eval_settings(over):
    """The composed config as the harness's entry point hands it to `run`: typed, once."""
    return typed_config(compose_config(over))


def test_quick_eval_writes_reports(target_dir, tmp_path, capsys):
    from flashdraft.prompts import load_prompts

    heldout = load_prompts("humaneval", split="heldout", limit=1)[0].seq_id
    write_training_store(tmp_path / "features", target_dir, heldout)  # the profile's training store: eval.datastore
    report = run(eval_settings(overrides(target_dir, tmp_path, "eval.block_size=4")))  # the untrained drafter's block
    out = tmp_path / "eval"
    saved = json.loads((out / "report.json").read_text())
    assert saved["methods"].keys() == set(METHODS)  # every method of the table
    s = saved["settings"]
    assert s["untrained_drafter"] is True and "UNTRAINED" in saved["warning"]
    assert s["prompt_counts"] == {"humaneval": 2, "mtbench": 2} and s["split"] == "heldout"
    assert s["max_new_tokens"] == 12 and s["temperature"] == 0.0 and s["block_size"] == 4
    for key in ("torch", "transformers", "date", "device", "target", "drafter", "prompt_sources"):
        assert key in s
    for name, m in saved["methods"].items():
        assert m["lossless"] is True or name == "plain_as_loaded", name  # that one is compared, not guaranteed
        assert m["tokens_per_s"] > 0 and m["speedup"] > 0 and m["tau"] >= 1.0 and "speedup_vs_loaded" not in m
        assert m["by_source"].keys() == {"humaneval", "mtbench"}
    assert saved["methods"]["plain"]["tau"] == 1.0 and saved["methods"]["plain"]["speedup"] == 1.0
    assert s["exact"] == {"setting": "auto", "on": True, "why": "auto: greedy on cpu in float32"}
    d = saved["methods"]["dflash"]
    assert list(d["acceptance_histogram"]) == ["1", "2", "3", "4"]
    assert sum(d["acceptance_histogram"].values()) == d["rounds"] > 0
    assert d["round_ms"].keys() == {"draft", "verify", "bookkeeping"} and all(v > 0 for v in d["round_ms"].values())
    t = saved["methods"]["dflash_tree"]
    assert (
        s["tree_size"] == 7 and s["tree_branching"] == 4 and sum(t["acceptance_histogram"].values()) == t["rounds"] > 0
    )
    assert 0 < t["verified_drafts"] <= 7  # a block of 4 offers up to 4 + 16 + 64 candidates: the tree takes 7
    h = saved["methods"]["dflash_lookup"]
    assert s["lookup_ngram"] == 3 and 0 <= h["lookup_rounds"] <= h["rounds"] == sum(h["acceptance_histogram"].values())
    assert len((out / "runs.jsonl").read_text().splitlines()) == 6  # 2 HumanEval prompts, 2 MT-Bench ones x 2 turns
    md = (out / "report.md").read_text()
    assert (
        "UNTRAINED" in md
        and "| dflash |" in md
        and "| dflash_tree |" in md
        and "## dflash_tree rounds (tree of 7" in md
        and "prefill" in md
    )
    assert "## dflash_lookup rounds (tree of 7 candidates, 4 a position; lookup rounds where the newest 3 tokens" in md
    ds = saved["methods"]["dflash_datastore"]
    assert s["datastore"]["store"] == str(tmp_path / "features") and s["datastore"]["excluded_eval_sequences"] == 1
    assert s["datastore"]["sequences"] == 2 and s["datastore"]["tokens"] > 0 and s["datastore"]["ngrams"] > 0
    assert s["datastore_ngram"] == 4 and s["datastore_min_ngram"] == 2 and s["datastore_min_count"] == 2
    assert (
        0 <= ds["datastore_rounds"] <= ds["lookup_rounds"] <= ds["rounds"] == sum(ds["acceptance_histogram"].values())
    )
    assert (
        "datastore rounds, the continuation of the newest 4 (down to 2) tokens "
        "seen at least 2 times in 2 training responses" in md
    )
    printed = capsys.readouterr().out
    assert "| prompt_lookup |" in printed and "UNTRAINED" in printed and "1 eval prompts' sequences left out" in printed
    assert report["methods"]["dflash"]["decode_tokens"] == saved["methods"]["dflash"]["decode_tokens"]


def test_plain_as_loaded_decodes_a_copy_of_the_target_without_exact_verification(target_dir, tmp_path, monkeypatch):
    """With exact verification on, the harness makes the target exact (padded GEMMs, row-wise attention);
    plain_as_loaded decodes a copy left as loaded, the plain decoding a user runs, and the speed table compares every
    method with plain on the exact target (plain_as_loaded's speedup: what exactness costs plain decoding)."""
    import harness.methods
    from harness.policies import PLAIN

    plain_runs = []

    def recording(target, input_ids, policy, **kw):
        if policy is PLAIN:
            plain_runs.append(target.config._attn_implementation)
        return speculative_generate(target, input_ids, policy, **kw)

    speculative_generate = harness.methods.speculative_generate
    monkeypatch.setattr(harness.methods, "speculative_generate", recording)
    report = run(
        eval_settings(
            overrides(
                target_dir,
                tmp_path,
                "eval.methods=[plain,plain_as_loaded,dflash]",
                "eval.warmup=false",
                "eval.exact=on",
            )
        )
    )
    assert plain_runs == ["rowwise_exact", "sdpa"] * 6  # per prompt turn: plain on the exact target, then the copy
    m = report["methods"]
    assert m["plain_as_loaded"]["tau"] == 1.0
    for name in ("plain_as_loaded", "dflash"):
        assert m[name]["speedup"] == pytest.approx(m[name]["tokens_per_s"] / m["plain"]["tokens_per_s"])
        assert "speedup_vs_loaded" not in m[name]
    assert report["settings"]["attention"] == "rowwise_exact" and m["dflash"]["lossless"] is True
    assert report["settings"]["exact"] == {"setting": "on", "on": True, "why": "eval.exact=on"}
    assert m["dflash"]["agreement"] == {"identical_prompts": 6, "prompts": 6, "tokens_before_first_difference": []}
    gemm_rows = report["settings"]["exact_gemm_rows"]  # every linear shape of the target, with the rows it pads to
    assert "64->320" in gemm_rows and all(1 <= rows <= 16 for rows in gemm_rows.values())
    md = (tmp_path / "eval" / "report.md").read_text()
    assert "- exact verification, GEMM rows (a shorter tile padded to): " in md
    assert "- exact verification: on (eval.exact=on); greedy outputs must equal plain decoding's (lossless)" in md
    assert "| method | tau | break-even tau | tokens/s | speedup | lossless | decode tokens | decode s |" in md
    assert "| plain_as_loaded | 1.00 |" in md and "plain_as_loaded decodes a copy of the target as loaded" in md
    assert "## Agreement with plain decoding" not in md


def test_exact_off_runs_every_method_on_the_target_as_loaded(target_dir, tmp_path, monkeypatch):
    """eval.exact=off: no exact copy, every method (plain included) decodes the target as loaded, plain_as_loaded is
    left out (plain is that already), and greedy outputs are compared with plain's as information: `agreement`
    (tokens before the first difference), `lossless` n/a, no NOT LOSSLESS section."""
    import harness.methods

    attention = []

    def recording(target, input_ids, policy, **kw):
        attention.append(target.config._attn_implementation)
        return speculative_generate(target, input_ids, policy, **kw)

    speculative_generate = harness.methods.speculative_generate
    monkeypatch.setattr(harness.methods, "speculative_generate", recording)
    report = run(
        eval_settings(
            overrides(
                target_dir,
                tmp_path,
                "eval.methods=[plain,plain_as_loaded,dflash]",
                "eval.warmup=false",
                "eval.exact=off",
            )
        )
    )
    assert set(attention) == {"sdpa"} and len(attention) == 12  # plain and dflash, 6 prompt turns each
    s, m = report["settings"], report["methods"]
    assert s["exact"] == {"setting": "off", "on": False, "why": "eval.exact=off"}
    assert s["attention"] == "sdpa" and s["exact_gemm_rows"] == {}
    assert m.keys() == {"plain", "dflash"} and m["dflash"]["lossless"] is None
    agreement = m["dflash"]["agreement"]
    assert (
        agreement["prompts"] == 6
        and agreement["identical_prompts"] + len(agreement["tokens_before_first_difference"]) == 6
    )
    assert m["dflash"]["speedup"] == pytest.approx(m["dflash"]["tokens_per_s"] / m["plain"]["tokens_per_s"])
    md = (tmp_path / "eval" / "report.md").read_text()
    assert "- exact verification: off (eval.exact=off): every method runs the target as loaded" in md
    assert "## Agreement with plain decoding (as loaded, information)" in md and "| dflash | " in md
    assert "NOT LOSSLESS" not in md


def test_trained_drafter_is_loaded_and_sampling_runs(target_dir, tmp_path):
    drafter = tiny_drafter(tiny_target("llama", vocab=320), block_size=8, mask_token_id=310, layers=1)
    drafter.save_pretrained(tmp_path / "drafter")
    cfg = eval_settings(
        overrides(
            target_dir,
            tmp_path,
            f"eval.drafter={tmp_path / 'drafter'}",
            "eval.allow_untrained=false",
            "eval.temperature=0.8",
            "eval.top_k=20",
            "eval.methods=[plain,dflash]",
            "eval.prompts=[mtbench]",
            "eval.draft_cutoff=0.01",
        )
    )
    report = run(cfg)
    s = report["settings"]
    assert s["untrained_drafter"] is False and s["drafter"] == str(tmp_path / "drafter") and s["block_size"] == 8
    assert s["draft_cutoff"] == 0.01 and 0 <= report["methods"]["dflash"]["verified_drafts"] < 7
    assert report["methods"].keys() == {"plain", "dflash"} and report["methods"]["dflash"]["lossless"] is None
    assert s["exact"]["on"] is False and s["exact"]["why"].startswith("auto: sampling")  # the speed a user gets
    assert "warning" not in report


def test_break_even_tau_gives_the_speedup_and_the_drafters_card_gets_the_table(target_dir, tmp_path):
    """break-even tau = a method's decode seconds a round / plain decoding's a token, the timing the speedup uses:
    speedup = tau / break-even tau for each method that drafts; plain drafts nothing and has none. The results table
    goes into the evaluated drafter's model card, the rest of the card kept."""
    from huggingface_hub import ModelCard

    from flashdraft.modelcard import LIBRARY_NAME, SERVED_EVAL, write_card

    drafter = tiny_drafter(tiny_target("llama", vocab=320), block_size=4, mask_token_id=310, layers=1)
    folder = drafter.save_pretrained(tmp_path / "drafter")
    write_card(folder, target=str(target_dir), stores=[], recipe={}, steps=1, tokens_seen=1)
    before = (folder / "README.md").read_text()
    methods = "eval.methods=[plain,prompt_lookup,dflash]"
    run(eval_settings(overrides(target_dir, tmp_path, f"eval.drafter={folder}", methods, "eval.prompts=[humaneval]")))
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    for m in (report["methods"], {k: v["by_source"]["humaneval"] for k, v in report["methods"].items()}):
        assert m["plain"]["break_even_tau"] is None
        plain_token_s = m["plain"]["decode_s"] / m["plain"]["decode_tokens"]
        for name in ("prompt_lookup", "dflash"):
            round_s = m[name]["decode_s"] / m[name]["rounds"]
            assert m[name]["break_even_tau"] == pytest.approx(round_s / plain_token_s, rel=1e-12)
            assert m[name]["speedup"] == pytest.approx(m[name]["tau"] / m[name]["break_even_tau"], rel=1e-9)
    m = report["methods"]
    md = (tmp_path / "eval" / "report.md").read_text()
    assert (
        "| plain | 1.00 |  |" in md
        and f"| dflash | {m['dflash']['tau']:.2f} | {m['dflash']['break_even_tau']:.2f} |" in md
    )
    card = (folder / "README.md").read_text()
    assert f"| prompt_lookup | {m['prompt_lookup']['tau']:.2f} | {m['prompt_lookup']['break_even_tau']:.2f} |" in card
    served = card.index(f"<!-- flashdraft:{SERVED_EVAL} -->")
    assert card[:served] == before[:served] and "not measured yet" not in card
    assert ModelCard(card).data.library_name == LIBRARY_NAME


def test_an_eval_block_size_the_drafter_does_not_fit_is_refused_by_name(target_dir, tmp_path):
    drafter = tiny_drafter(tiny_target("llama", vocab=320), block_size=8, mask_token_id=310, layers=1)
    drafter.save_pretrained(tmp_path / "drafter")
    trained = [f"eval.drafter={tmp_path / 'drafter'}", "eval.allow_untrained=false", "eval.methods=[plain,dflash]"]
    with pytest.raises(ValueError, match=r"eval.block_size 9 does not fit the drafter at .*drafter, whose block is 8"):
        run(eval_settings(overrides(target_dir, tmp_path, *trained, "eval.block_size=9")))
    with pytest.raises(ValueError, match=r"eval.block_size must be an integer in 1..64 or null"):  # entry.ranges
        run(eval_settings(overrides(target_dir, tmp_path, *trained, "eval.block_size=0")))
    untrained = [f"eval.drafter={tmp_path / 'none'}", "eval.methods=[plain,dflash]", "drafter.block_size=4"]
    with pytest.raises(
        ValueError, match=r"eval.block_size 5 does not fit the untrained drafter \(drafter.block_size\)"
    ):
        run(eval_settings(overrides(target_dir, tmp_path, *untrained, "eval.block_size=5")))


def test_unknown_or_retired_eval_settings_are_refused_by_name(target_dir, tmp_path):
    with pytest.raises(ValueError, match=r"unknown settings \['eval.verify_by_cost'\]"):
        run(eval_settings(overrides(target_dir, tmp_path, "eval.methods=[plain]", "+eval.verify_by_cost=true")))


def test_interrupted_eval_resumes_without_rerunning_finished_prompts(target_dir, tmp_path, capsys):
    over = overrides(target_dir, tmp_path, "eval.methods=[plain,dflash]")
    first = run(eval_settings(over))
    log = tmp_path / "eval" / "runs.jsonl"
    lines = log.read_text().splitlines()
    assert len(lines) == 6 and first["settings"]["resumed_prompts"] == 0  # MT-Bench: two turns a prompt
    log.write_text("\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2])  # killed while writing the third line
    second = run(eval_settings(over))
    assert second["settings"]["resumed_prompts"] == 2 and "resuming: 2 of 6 prompt turns" in capsys.readouterr().out
    again = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["seq_id"] for r in again] == [json.loads(line)["seq_id"] for line in lines]
    assert again[:2] == [json.loads(line) for line in lines[:2]]  # taken as measured, not run again
    assert again[2]["methods"]["plain"]["decode_s"] != json.loads(lines[2])["methods"]["plain"]["decode_s"]  # rerun
    for method in ("plain", "dflash"):
        assert second["methods"][method]["new_tokens"] == first["methods"][method]["new_tokens"]
    assert second["methods"]["dflash"]["lossless"] is True
    assert "Resumed: 2 prompt turns" in (tmp_path / "eval" / "report.md").read_text()
    other = run(eval_settings([*over, "eval.max_new_tokens=10"]))  # other settings: nothing is reused
    assert other["settings"]["resumed_prompts"] == 0 and len(log.read_text().splitlines()) == 6
    fresh = run(eval_settings([*over, "eval.max_new_tokens=10", "eval.resume=false"]))
    assert fresh["settings"]["resumed_prompts"] == 0 and len(log.read_text().splitlines()) == 6


def test_the_resume_key_holds_the_methods_and_the_drafter():
    from flashdraft.config import EvalConfig
    from harness.methods import DecodeSettings

    def key(methods, drafter, **kw):
        return run_key(DecodeSettings.from_eval(EvalConfig(**kw), 4), methods, drafter, None, {}, "float32", "cpu")

    base = key(["plain", "dflash"], "a")
    assert base == key(["plain", "dflash"], "a")
    assert base != key(["plain", "dflash_tree"], "a") and base != key(["plain", "dflash"], "b")
    assert base != key(["plain", "dflash"], "a", draft_cutoff=0.1)


def test_missing_datastore_store_is_named(target_dir, tmp_path):
    cfg = eval_settings(overrides(target_dir, tmp_path, "eval.methods=[plain,dflash_datastore]"))
    with pytest.raises(FileNotFoundError, match="no feature store at .*features.*eval.datastore"):
        run(cfg)


def test_draft_vocabulary_is_counted_in_the_training_store_and_stays_lossless(
    target_dir, tmp_path, capsys, monkeypatch
):
    from flashdraft.prompts import load_prompts
    from harness.drafter import DrafterProposer

    vocabularies, draft = [], DrafterProposer.__call__

    def recording(self, *args):  # the drafts the eval makes: with which vocabulary
        vocabularies.append(None if self.vocab is None else len(self.vocab))
        return draft(self, *args)

    monkeypatch.setattr(DrafterProposer, "__call__", recording)
    heldout = load_prompts("humaneval", split="heldout", limit=1)[0].seq_id
    write_training_store(tmp_path / "features", target_dir, heldout)
    report = run(
        eval_settings(overrides(target_dir, tmp_path, "eval.methods=[plain,dflash,dflash_tree]", "eval.draft_vocab=16"))
    )
    assert report["settings"]["draft_vocab"] == {"words": 16, "store": str(tmp_path / "features")}
    assert vocabularies and set(vocabularies) == {16}  # every draft scored the 16 words
    assert all(report["methods"][m]["lossless"] for m in ("dflash", "dflash_tree"))
    without = run(
        eval_settings(
            overrides(
                target_dir,
                tmp_path,
                "eval.methods=[plain,dflash]",
                "eval.draft_vocab=16",
                f"eval.draft_vocab_store={tmp_path / 'none'}",
            )
        )
    )
    assert without["settings"]["draft_vocab"] is None  # no store to count it in: all words, said on stderr
    assert "no feature store at" in capsys.readouterr().err


def test_missing_drafter_is_an_error_unless_allowed(target_dir, tmp_path):
    cfg = eval_settings(
        overrides(target_dir, tmp_path, f"eval.drafter={tmp_path / 'none'}", "eval.allow_untrained=false")
    )
    with pytest.raises(FileNotFoundError, match="no drafter at"):
        run(cfg)


def test_full_config_composes():
    cfg = compose_config(["eval=full"])
    assert cfg.eval.name == "full" and cfg.eval.limit is None and cfg.eval.allow_untrained is False
    assert cfg.eval.methods is None  # eval=full runs every method of the table (harness.methods.methods_asked)
    assert (
        cfg.eval.datastore.endswith("/features") and cfg.eval.datastore_ngram == 4 and cfg.eval.datastore_min_ngram == 2
    )
    assert cfg.eval.draft_vocab == 8192 and cfg.eval.draft_vocab_store.endswith("/features")
    assert compose_config(["eval=paper"]).eval.draft_vocab == 0  # the reference drafts over every word


def test_tree_method_with_sampling_is_refused_by_name(target_dir, tmp_path):
    cfg = eval_settings(overrides(target_dir, tmp_path, "eval.temperature=0.7"))
    with pytest.raises(ValueError, match="dflash_tree is greedy only"):
        run(cfg)


def test_python_dash_m_harness(target_dir, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "RAY_AUTH_MODE": "disabled"}
    cmd = [
        sys.executable,
        "-m",
        "harness",
        *overrides(target_dir, tmp_path, "eval.limit=1", "eval.methods=[plain,dflash]"),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| dflash |" in proc.stdout and "UNTRAINED" in proc.stderr
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["methods"]["dflash"]["lossless"] is True


def test_the_method_table_builds_each_methods_policy():
    """Each method name maps to its policy: the lookup methods fall back through the datastore to the tree, and
    the refusals name the method."""
    from flashdraft.config import EvalConfig
    from harness.methods import DecodeSettings, build_policies
    from harness.policies import PLAIN, ChainPolicy, DatastorePolicy, LookupPolicy, TreePolicy
    from tests.test_speculative import OracleProposer

    settings = DecodeSettings.from_eval(EvalConfig(draft_cutoff=0.1, tree_size=5), 4)
    proposer, datastore = OracleProposer([], 3, 8), object()
    policies = build_policies(EvalConfig().methods, settings, proposer, datastore)
    assert policies["plain"] is PLAIN and policies["plain_as_loaded"] is PLAIN and policies["prompt_lookup"] is None
    chain = policies["dflash"]
    assert isinstance(chain, ChainPolicy) and chain.cutoff == 0.1 and chain.block_size == 4
    tree = policies["dflash_tree"]
    assert isinstance(tree, TreePolicy) and (tree.size, tree.branching, tree.block_size) == (5, 4, 4)
    lookup = policies["dflash_lookup"]
    assert isinstance(lookup, LookupPolicy) and lookup.ngram == 3 and isinstance(lookup.fallback, TreePolicy)
    store = policies["dflash_datastore"].fallback
    assert (
        isinstance(store, DatastorePolicy) and store.datastore is datastore and isinstance(store.fallback, TreePolicy)
    )
    assert isinstance(
        build_policies(["dflash_lookup"], DecodeSettings.from_eval(EvalConfig(lookup_ngram=0), 4), proposer)[
            "dflash_lookup"
        ],
        TreePolicy,
    )  # lookup_ngram 0: no lookup rounds
    with pytest.raises(ValueError, match="unknown methods"):
        build_policies(["dflash_chain"], settings, proposer)
    with pytest.raises(ValueError, match="dflash needs a drafter"):
        build_policies(["plain", "dflash"], settings)
    with pytest.raises(ValueError, match="dflash_datastore needs a datastore"):
        build_policies(["dflash_datastore"], settings, proposer)
    with pytest.raises(ValueError, match="dflash_lookup is greedy only"):
        build_policies(["dflash", "dflash_lookup"], DecodeSettings.from_eval(EvalConfig(temperature=0.5), 4), proposer)


def test_untrained_drafter_geometry_comes_from_the_spec_and_a_trained_one_must_fit(target_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flashdraft.config import DrafterConfig
    from flashdraft.spec import DraftSpec, capture_layer_ids
    from flashdraft.target import choose_mask_token, mask_token_string
    from harness.drafter import load_drafter

    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    drafter, untrained = load_drafter(None, target, tokenizer, DrafterConfig(), allow_untrained=True)
    assert untrained and (drafter.spec.block_size, drafter.spec.num_draft_layers) == (
        DraftSpec.block_size,
        DraftSpec.num_draft_layers,
    )  # DraftSpec's defaults, through the drafter settings
    assert drafter.target_layer_ids == capture_layer_ids(target.config)
    assert drafter.mask_token_id == choose_mask_token(tokenizer, target.config.vocab_size)
    shaped = DrafterConfig(block_size=4, num_layers=2, layer_ids=[2, 7])  # made as the trainer makes its spec
    drafter = load_drafter(None, target, tokenizer, shaped, allow_untrained=True)[0]
    mask_token = mask_token_string(tokenizer, drafter.mask_token_id)  # the string too, as trainer/drafter.py writes it
    assert drafter.config.dflash_config["mask_token"] == mask_token
    made = DraftSpec.from_settings(shaped, [2, 7], drafter.mask_token_id, mask_token).draft_config(target.config)
    assert drafter.config.to_dict() == made.to_dict()
    tiny_drafter(tiny_target("llama", vocab=300), block_size=8, mask_token_id=290, layers=1).save_pretrained(
        tmp_path / "d"
    )
    with pytest.raises(ValueError, match="does not fit the target: vocab_size 300 != target's 320"):
        load_drafter(tmp_path / "d", target, tokenizer, DrafterConfig())


def test_eval_config_defaults_are_the_quick_profile():
    """EvalConfig states each default once: the quick eval differs from it only in the keys conf/config.yaml links
    to the root (paths and seed)."""
    from dataclasses import asdict

    from omegaconf import OmegaConf

    from flashdraft.config import EvalConfig

    quick = OmegaConf.to_container(compose_config([]).eval, resolve=False)
    defaults = asdict(EvalConfig())
    assert quick.keys() == defaults.keys()
    linked = {"drafter", "draft_vocab_store", "datastore", "out_dir", "metrics", "replay_store", "seed"}
    assert all(str(quick[k]).startswith("${") for k in linked)
    assert {k: v for k, v in quick.items() if k not in linked} == {k: v for k, v in defaults.items() if k not in linked}
