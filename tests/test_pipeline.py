"""Capture (regenerate and capture-only), bad input, resume, NaN targets: in-process, no Ray."""

import functools
import json
import os
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from flashdraft.config import SamplingConfig
from flashdraft.prompts import PromptSourceUnavailable, load_prompts
from flashdraft.store import StoreError, StoreReader, read_manifest, read_rejects, verify_store
from flashdraft.store.files import SHARDS
from flashdraft.target import capture_features, chat_input_ids, load_tokenizer
from pipeline.capture import TargetNaNError, capture, token_batches
from pipeline.decode import regenerate, regenerate_stream
from pipeline.fleet import FleetConfig, run_fleet
from pipeline.job import load_records, open_store
from pipeline.settings import CaptureSettings
from pipeline.worker import CaptureWorker

LAYERS = [1, 3, 4]


def tiny(kind="llama", vocab=64, seed=0):
    torch.manual_seed(seed)
    kw = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **kw)).eval()
    return LlamaForCausalLM(LlamaConfig(**kw)).eval()


def build_tiny_target(folder, nan_layer=None):
    """A tiny random Llama with the SmolLM2 tokenizer (vocab 49152, ChatML), saved as an HF folder."""
    tok = load_tokenizer("smollm2-135m")
    model = tiny(vocab=len(tok))
    model.config.max_position_embeddings = 4096  # room for data.max_length's default (3072), as SmolLM2's 8192 has
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    # make the end token likely so responses have varied lengths
    with torch.no_grad():
        model.lm_head.weight[model.generation_config.eos_token_id] *= 6
        if nan_layer is not None:
            model.model.layers[nan_layer].mlp.down_proj.weight[0, 0] = float("nan")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


@functools.cache
def config_settings() -> CaptureSettings:
    """The capture settings the entry point makes (CaptureSettings has no defaults of its own): fp32 and single turns
    keep the tiny targets' outputs exact and short."""
    from entry import compose, typed_config
    from pipeline.__main__ import settings_from

    over = ["model.dtype=float32", "device=cpu", "data.turns=single", "data.max_new_tokens=12", "data.batch_size=3"]
    return settings_from(typed_config(compose(over)), offline_ok=True)


def settings_for(target, **kw):
    return replace(config_settings(), **{"target": target, "layer_ids": tuple(LAYERS), "torch_threads": None, **kw})


@pytest.mark.parametrize("kind,batch_size", [("llama", None), ("qwen3", None), ("llama", 2), ("qwen3", 3)])
def test_regenerate_captures_what_a_fresh_forward_computes(kind, batch_size):
    """All prompts in one batch, and continuous batching (rows leave when they end, waiting prompts join
    a batch of another width: merged caches, trimmed padding): the same tokens and features either way."""
    model = tiny(kind)
    prompts = [[1, 5, 9, 3], list(range(7, 20)), [2], [4, 4, 4, 4, 4, 4], [8, 9], list(range(30, 52)), [3, 3, 7]]
    limits = [12, 20, 7, 9, 3, 15, 1]
    out = regenerate(model, prompts, LAYERS, max_new_tokens=limits, stop_ids=[5, 6], pad_id=0, batch_size=batch_size)
    assert [len(r.input_ids) - len(p) <= n for r, p, n in zip(out, prompts, limits)] == [True] * len(prompts)
    lengths = set()
    for p, r in zip(prompts, out):
        assert r.input_ids[: len(p)].tolist() == p
        assert r.loss_mask.tolist() == [False] * len(p) + [True] * (len(r.input_ids) - len(p))
        assert r.finished == (r.input_ids[-1].item() in (5, 6))
        ref = capture_features(model, r.input_ids[None], LAYERS)[0]
        assert r.features.shape == ref.shape
        assert (r.features - ref).abs().max() < 1e-4  # padded members included: positions skip the pads
        g = model.generate(
            torch.tensor([p]),
            max_new_tokens=len(r.input_ids) - len(p),
            do_sample=False,
            eos_token_id=[5, 6],
            pad_token_id=0,
        )
        assert g[0].tolist() == r.input_ids.tolist()  # greedy: the same tokens as generate()
        lengths.add(len(r.input_ids) - len(p))
    assert len(lengths) > 1
    seqs = [r.input_ids.tolist() for r in out]
    for r, c in zip(out, capture(model, seqs, [r.loss_mask for r in out], LAYERS, pad_id=0)):
        assert (r.features - c.features).abs().max() < 1e-4 and torch.equal(r.loss_mask, c.loss_mask)


@pytest.mark.parametrize("batch_size", [None, 2])
def test_teacher_topk_is_the_fresh_forwards_next_token_distribution(batch_size):
    """Row j holds the target's top-k after token j: from the last prompt token on in regenerate (the logits
    each step computes anyway), on every token in capture; greedy, so row j's top token is token j + 1."""
    model, k = tiny(), 5
    prompts = [[1, 5, 9, 3], list(range(7, 20)), [2], [8, 9]]
    out = regenerate(
        model,
        prompts,
        LAYERS,
        max_new_tokens=[9, 4, 7, 6],
        stop_ids=[5, 6],
        pad_id=0,
        batch_size=batch_size,
        teacher_topk=k,
    )
    seqs = [r.input_ids.tolist() for r in out]
    captured = capture(model, seqs, [r.loss_mask for r in out], LAYERS, pad_id=0, teacher_topk=k)
    for p, r, c in zip(prompts, out, captured):
        ids, logp = r.teacher
        assert ids.shape == logp.shape == (len(r.input_ids), k)
        ref = torch.log_softmax(model(input_ids=r.input_ids[None]).logits[0].float(), -1).topk(k, -1)
        n = len(p) - 1
        assert torch.isinf(logp[:n]).all() and torch.equal(ids[n:], ref.indices[n:])
        assert (logp[n:] - ref.values[n:]).abs().max() < 1e-4
        assert ids[n:-1, 0].tolist() == r.input_ids[n + 1 :].tolist()
        assert torch.equal(c.teacher[0], ref.indices) and (c.teacher[1] - ref.values).abs().max() < 1e-4


def test_joining_prompts_prefilled_in_token_budgeted_groups_decode_the_same():
    """data.prefill_tokens in regenerate mode (on a GPU): the prompts that join the batch are prefilled in groups
    of rows x longest <= the budget, then merged; the tokens and states are those of one prefill for all."""
    model = tiny("qwen3")
    prompts = [[1, 5, 9, 3], list(range(7, 20)), [2], [4, 4, 4, 4, 4, 4], [8, 9], list(range(30, 52)), [3, 3, 7]]
    kw = dict(max_new_tokens=[6, 9, 4, 7, 3, 8, 5], stop_ids=[5, 6], pad_id=0, batch_size=4)
    whole = regenerate(model, prompts, LAYERS, **kw)
    grouped = regenerate(model, prompts, LAYERS, prefill_tokens=12, **kw)
    for a, b in zip(whole, grouped):
        assert torch.equal(a.input_ids, b.input_ids) and (a.features - b.features).abs().max() < 1e-4


def test_sampling_is_seeded_and_respects_top_k():
    model = tiny()
    s = SamplingConfig(do_sample=True, temperature=1.5, top_k=3)
    run = lambda seed: regenerate(
        model,
        [[1, 2, 3]] * 2,
        LAYERS,
        max_new_tokens=10,
        stop_ids=[],
        pad_id=0,
        sampling=s,
        generator=torch.Generator().manual_seed(seed),
    )  # noqa: E731
    a, b, c = run(1), run(1), run(2)
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, b))
    assert any(not torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, c))
    ref = capture_features(model, a[0].input_ids[None], LAYERS)[0]
    assert (a[0].features - ref).abs().max() < 1e-4


def write_jsonl(path, lines):
    with open(path, "wb") as f:
        for line in lines:
            f.write((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n")


def fleet_run(store, target, records, rejects=(), **kw):
    settings = settings_for(target, **{k: kw.pop(k) for k in list(kw) if k in CaptureSettings.__dataclass_fields__})
    writer = open_store(store, settings, sources=["test"], store_options=dict(shard_tokens=256, chunk_tokens=32))
    fleet = FleetConfig(num_actors=0, shard_size=kw.pop("shard_size", 3), **kw)
    return run_fleet(store, records, settings, writer, fleet, load_rejects=list(rejects), progress=False)


def test_bad_input_is_rejected_with_reasons_and_the_rest_is_captured(tmp_path, target):
    src = tmp_path / "prompts.jsonl"
    write_jsonl(
        src,
        [
            {"prompt": "Write a haiku about the sea."},
            b'{"messages": [{"role": "user", "content": "unterminated',
            {"prompt": "   \n\t "},
            {"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "hello"}]},
            b'{"prompt": "caf\xe9 au lait"}',
            {"prompt": "word " * 600},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]},
            [1, 2],
        ],
    )
    records, rejects = load_records([str(src)], split=None)
    summary = fleet_run(tmp_path / "s", target, records + records[:1], rejects, max_prompt_tokens=300)
    reasons = [r["reason"] for r in read_rejects(tmp_path / "s")]
    for want in (
        "malformed JSON",
        "empty prompt (message 0)",
        "conversation starts with an assistant turn",
        "not UTF-8",
        "prompt too long",
        f"duplicate of {records[0].seq_id} (line 1 of {src})",
        "not a JSON object",
    ):
        assert sum(want in r for r in reasons) == 1, (want, reasons)
    assert sum(summary.rejects.values()) == len(reasons) == 7
    assert {"empty prompt", "conversation starts with an assistant turn", "duplicate"} <= set(summary.rejects)
    assert sum(summary.accounts().values()) == summary.read == 9 and summary.duplicates == 1
    r = StoreReader(tmp_path / "s")
    assert len(r) == 2 == summary.sequences and not summary.failed
    assert verify_store(tmp_path / "s", progress=False)[0] == []
    tok = load_tokenizer(target)
    texts = [tok.decode(r.read(i).input_ids) for i in range(len(r))]
    assert any("Be brief." in t and "Name a prime." in t for t in texts) and any("haiku" in t for t in texts)


def test_capture_mode_keeps_given_responses(tmp_path, target):
    src = tmp_path / "chat.jsonl"
    write_jsonl(
        src,
        [
            {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4, of course."}]},
            {"prompt": "Capital of France?", "response": "Paris."},
            {"prompt": "no answer here"},
        ],
    )
    records, rejects = load_records([str(src)], split=None)
    fleet_run(tmp_path / "s", target, records, rejects, mode="capture")
    r = StoreReader(tmp_path / "s")
    tok = load_tokenizer(target)
    worker = CaptureWorker(str(tmp_path / "s"), settings_for(target, mode="capture"))
    assert len(r) == 2
    for i in range(2):
        s = r.read(i)
        assert tok.decode(s.input_ids[s.loss_mask]) in ("4, of course.<|im_end|>", "Paris.<|im_end|>")
        ref = capture_features(worker.model, torch.as_tensor(s.input_ids)[None], LAYERS)[0]
        assert (s.features - ref.to(torch.bfloat16).float()).abs().max() <= 0.02 * ref.abs().max()
    assert any("no response to capture" in r["reason"] for r in read_rejects(tmp_path / "s"))


def test_a_store_with_teacher_topk_is_captured_through_the_fleet(tmp_path, target):
    records = load_prompts("humaneval", limit=3)
    settings = settings_for(target)
    writer = open_store(
        tmp_path / "s",
        settings,
        sources=["test"],
        store_options=dict(shard_tokens=256, chunk_tokens=32, teacher_topk=3),
    )
    run_fleet(
        tmp_path / "s",
        records,
        settings,
        writer,
        FleetConfig(num_actors=0, shard_size=2),
        load_rejects=[],
        progress=False,
    )
    r = StoreReader(tmp_path / "s")
    assert len(r) == 3 and r.teacher_topk == 3 and verify_store(tmp_path / "s", progress=False)[0] == []
    for i in range(3):
        s = r.read(i, teacher=True)
        first = int(s.loss_mask.argmax())  # the first response token is the top token after the last prompt token
        assert np.isinf(s.teacher_logp[: first - 1]).all() and np.isfinite(s.teacher_logp[first - 1 :]).all()
        assert (s.teacher_ids[first - 1 : -1, 0] == s.input_ids[first:]).all()
    with pytest.raises(StoreError, match="different capture"):  # a resume must keep the same setting
        open_store(tmp_path / "s", settings, sources=["test"], store_options=dict(shard_tokens=256, chunk_tokens=32))


def test_resume_skips_committed_and_refuses_another_capture(tmp_path, target):
    records = load_prompts("humaneval", limit=7)
    first = fleet_run(tmp_path / "s", target, records[:4])
    assert first.new_sequences == 4 and first.shards_done == 2
    manifest = read_manifest(tmp_path / "s")  # the layers it captured, no mask token: the trainer chooses that
    assert manifest["layer_ids"] == LAYERS and "mask_token_id" not in manifest
    again = fleet_run(tmp_path / "s", target, records)  # a longer run over the same store: only the rest
    assert again.new_sequences == 3 and again.sequences == 7
    r = StoreReader(tmp_path / "s")
    assert sorted(r.seq_ids) == sorted(x.seq_id for x in records)
    assert fleet_run(tmp_path / "s", target, records).new_sequences == 0
    with pytest.raises(StoreError, match="different capture.*generation"):
        fleet_run(tmp_path / "s", target, records, max_new_tokens=5)


def test_nan_target_fails_its_shard_without_retries(tmp_path):
    target = build_tiny_target(tmp_path / "nan-target", nan_layer=2)
    t0 = time.time()
    summary = fleet_run(tmp_path / "s", target, load_prompts("humaneval", limit=2), max_attempts=3)
    assert [f["attempts"] for f in summary.failed] == [1]
    assert "TargetNaNError" in summary.failed[0]["error"] and "NaN" in summary.failed[0]["error"]
    assert summary.accounts()["in failed shards"] == summary.read == 2  # still accounted for in the summary
    assert summary.sequences == 0 and os.listdir(tmp_path / "s" / SHARDS) == []
    assert time.time() - t0 < 60
    with pytest.raises(TargetNaNError):
        regenerate(LlamaForCausalLM.from_pretrained(target), [[1, 2]], LAYERS, max_new_tokens=2, stop_ids=[], pad_id=0)


def test_hub_sources_fail_fast_and_clearly(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.time()
    with pytest.raises(PromptSourceUnavailable, match="codealpaca"):
        load_records(["codealpaca"])
    assert time.time() - t0 < 30


def test_regenerate_stream_hands_over_each_sequence_as_it_ends():
    """Sequences come out while later prompts still wait (a worker writes them instead of holding the task), and
    collected they are what `regenerate` returns."""
    model = tiny("qwen3")
    prompts = [[1, 5, 9, 3], [2], [8, 9], list(range(7, 20)), [3, 3, 7], [4, 4, 4]]
    limits = [2, 9, 3, 5, 1, 4]
    kw = dict(max_new_tokens=limits, stop_ids=[], pad_id=0, batch_size=2)
    stream = regenerate_stream(model, prompts, LAYERS, **kw)
    first_i, first = next(stream)
    assert len(first.input_ids) == len(prompts[first_i]) + limits[first_i]
    assert stream.gi_frame.f_locals["decode"].waiting, "the first sequence came out only after every prompt started"
    got = {first_i: first, **dict(stream)}
    for i, r in enumerate(regenerate(model, prompts, LAYERS, **kw)):
        assert torch.equal(got[i].input_ids, r.input_ids) and torch.equal(got[i].features, r.features)


def test_auto_batch_on_cpu_is_8_and_says_so(tmp_path, target, capsys):
    settings = settings_for(target, batch_size="auto")
    open_store(tmp_path / "s", settings, sources=["test"], store_options={})
    worker = CaptureWorker(str(tmp_path / "s"), settings)
    assert (worker.plan.batch_size, worker.plan.prefill_tokens) == (8, None)  # the CPU regenerate path as before auto
    err = capsys.readouterr().err
    assert "decode batch 8 rows: auto on CPU" in err and "prefill budget unlimited: auto on CPU" in err
    capture_mode = CaptureWorker(str(tmp_path / "s"), settings_for(target, mode="capture", prefill_tokens="auto"))
    assert capture_mode.plan.prefill_tokens == 16384
    assert "prefill budget 16,384 tokens: auto on CPU" in capsys.readouterr().err
    with pytest.raises(ValueError, match="data.batch_size must be a positive number or auto"):
        settings_for(target, batch_size="many")


def test_capture_mode_batches_by_token_budget_and_stores_the_same(tmp_path, target):
    """Length-sorted sequences go to the target in prefills of rows x longest <= data.prefill_tokens (an over-long
    one alone); the store holds the same tokens, masks and (to bf16 rounding) features whatever the budget."""
    answers = ["Yes.", "Seven, counted twice over.", "A list: " + ", ".join(map(str, range(40))), "No", "Maybe so."]
    lines = [
        {"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": a}]}
        for i, a in enumerate(answers * 2)
    ]
    write_jsonl(tmp_path / "chat.jsonl", lines)
    records, _ = load_records([str(tmp_path / "chat.jsonl")], split=None)
    prefills = []

    def note_prefill(module, args):
        if isinstance(module, torch.nn.Embedding):
            prefills.append(tuple(args[0].shape))

    stores = {}
    for budget in (100, 100_000):
        prefills.clear()
        handle = torch.nn.modules.module.register_module_forward_pre_hook(note_prefill)
        try:
            fleet_run(tmp_path / str(budget), target, records, mode="capture", prefill_tokens=budget, shard_size=10)
        finally:
            handle.remove()
        stores[budget] = r = StoreReader(tmp_path / str(budget))
        lengths = sorted(len(r.read(i).input_ids) for i in range(len(r)))
        assert prefills == [(len(g), lengths[g[-1]]) for g in token_batches(lengths, budget)]
        assert all(rows * width <= budget or rows == 1 for rows, width in prefills), prefills
    assert len(prefills) == 1 and len(token_batches(lengths, 100)) > 3 and lengths[-1] > 100  # the long one: alone
    small, large = stores[100], stores[100_000]
    assert sorted(small.seq_ids) == sorted(large.seq_ids) and len(small) == 10
    for seq_id in small.seq_ids:
        a, b = small.read(small.index(seq_id)), large.read(large.index(seq_id))
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)
        assert np.abs(a.features - b.features).max() <= 0.02 * np.abs(b.features).max()


def conversation(*turns: str) -> dict:
    return {"messages": [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]}


def test_capture_mode_contract_prompt_as_regeneration_feeds_it_and_only_the_final_turn_as_response(tmp_path, target):
    """data.mode=capture, for responses written by a serving engine: the stored prompt is, token for token, what
    regeneration feeds the target for the conversation without its final assistant turn (generation prompt
    included); the response is the final turn's text encoded, then the stop token, and only it is in the loss mask,
    not an earlier assistant turn. A response that starts with whitespace (which the whole rendering's encoding
    would merge into the generation prompt's newline) is kept, not rejected."""
    lines = [
        conversation("Name a colour.", "Blue.", "And another one?", "Green, like grass."),
        conversation("2+2?", "4, of course."),
        conversation("Indent this.", "\n\n    indented = True"),
    ]
    write_jsonl(tmp_path / "chat.jsonl", lines)
    records, rejects = load_records([str(tmp_path / "chat.jsonl")], split=None)
    summary = fleet_run(tmp_path / "s", target, records, rejects, mode="capture")
    assert summary.sequences == 3 and not read_rejects(tmp_path / "s")
    tok, r = load_tokenizer(target), StoreReader(tmp_path / "s")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    regenerating = CaptureWorker(str(tmp_path / "s"), settings_for(target))  # regenerate mode: what it would feed
    for rec, line in zip(records, lines):
        s = r.read(r.index(rec.seq_id))
        ids, mask = s.input_ids.tolist(), s.loss_mask.tolist()
        prompt, _ = regenerating.encoder.encode(rec)
        assert prompt == chat_input_ids(tok, line["messages"][:-1])  # the template, generation prompt included
        n = len(prompt)
        assert ids[:n] == prompt
        assert mask == [False] * n + [True] * (len(ids) - n)
        assert ids[n:] == tok(line["messages"][-1]["content"], add_special_tokens=False)["input_ids"] + [im_end]
    multi = r.read(r.index(records[0].seq_id))
    assert "Blue." in tok.decode(multi.input_ids[~multi.loss_mask])  # the earlier assistant turn is prompt
    assert tok.decode(multi.input_ids[multi.loss_mask]) == "Green, like grass.<|im_end|>"


def build_word_target(folder):
    """A tiny random Llama with the SmolLM2 tokenizer whose greedy responses are whole words (tokens that decode
    and encode back to themselves), like a trained model's text."""
    tok = load_tokenizer("smollm2-135m")
    model = tiny(vocab=len(tok), seed=1)
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        for word in (" the", " cat", " sat", " on", " a", " mat", " and", " ran", " far", " away", "\n", ".", " dog"):
            (i,) = tok(word, add_special_tokens=False)["input_ids"]
            model.lm_head.weight[i] *= 8
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def test_regenerated_responses_written_as_a_serving_engine_would_capture_back_the_same(tmp_path):
    """A greedy regenerate store, its responses decoded to text and written as {"messages": [..., assistant]} lines
    (what the serving-engine recipe in docs/pipeline.md writes), captured back with mode=capture: the same prompt
    ids and response tokens for every record; a response cut at max_new_tokens gains the stop token the template
    closes the turn with (one more loss-mask token)."""
    target = build_word_target(tmp_path / "t")
    prompts = [conversation("Tell me a story."), conversation("Hi.", "Hello there.", "Say more about cats.")]
    write_jsonl(tmp_path / "prompts.jsonl", prompts + [conversation(f"Count to {n}.") for n in range(3, 7)])
    records, _ = load_records([str(tmp_path / "prompts.jsonl")], split=None)
    fleet_run(tmp_path / "regen", target, records)
    tok, regen = load_tokenizer(target), StoreReader(tmp_path / "regen")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    served, finished = [], []
    for rec in records:
        s = regen.read(regen.index(rec.seq_id))
        response = s.input_ids[s.loss_mask].tolist()
        finished.append(response[-1] == im_end)
        text = tok.decode(response[:-1] if finished[-1] else response)
        assert tok(text, add_special_tokens=False)["input_ids"] == response[: len(response) - finished[-1]]
        served.append({"messages": [*rec.messages, {"role": "assistant", "content": text}]})
    write_jsonl(tmp_path / "served.jsonl", served)
    captured_records, rejects = load_records([str(tmp_path / "served.jsonl")], split=None)
    fleet_run(tmp_path / "cap", target, captured_records, rejects, mode="capture")
    cap = StoreReader(tmp_path / "cap")
    assert len(cap) == len(regen) == len(records) == 6
    for rec, again, done in zip(records, captured_records, finished):
        a, b = regen.read(regen.index(rec.seq_id)), cap.read(cap.index(again.seq_id))
        n = int((~a.loss_mask).sum())
        assert int((~b.loss_mask).sum()) == n and np.array_equal(a.input_ids[:n], b.input_ids[:n])
        assert int(b.loss_mask.sum()) == int(a.loss_mask.sum()) + (not done)
        assert b.input_ids.tolist() == a.input_ids.tolist() + ([] if done else [im_end])


def test_batch_settings_take_auto_or_a_number_from_the_command_line():
    from entry import compose, typed_config
    from pipeline.__main__ import settings_from

    def settings(*overrides):
        return settings_from(typed_config(compose(list(overrides))), offline_ok=True)

    default = settings()
    assert (default.batch_size, default.prefill_tokens, default.gpu_memory_fraction) == ("auto", "auto", 0.85)
    assert settings("profile=quick").batch_size == 32  # the CPU profiles keep their fixed batch
    chosen = settings("data.batch_size=64", "data.prefill_tokens=8192", "data.gpu_memory_fraction=0.7")
    assert (chosen.batch_size, chosen.prefill_tokens, chosen.gpu_memory_fraction) == (64, 8192, 0.7)
    assert chosen.identity() == default.identity()  # how work is batched is not what a store holds
    with pytest.raises(ValueError, match="data.batch_size must be a number or auto"):
        settings("data.batch_size=many")
