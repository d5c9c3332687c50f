"""Every assistant turn regenerated (data.turns=all, pipeline/turns.py): on tiny targets with a ChatML tokenizer."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from flashdraft.prompts import load_prompts
from flashdraft.store import StoreReader, read_manifest
from flashdraft.target import capture_features, chat_input_ids, load_tokenizer
from pipeline.job import load_records
from pipeline.turns import regenerate_conversations
from pipeline.worker import CaptureWorker
from tests.test_pipeline import LAYERS, build_tiny_target, build_word_target, conversation, fleet_run, settings_for
from tests.test_pipeline import write_jsonl as write_lines


def build_stopping_target(folder):
    """The word target with its end token made likely too, so that answers end with a stop token."""
    folder = build_word_target(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.lm_head.weight[model.generation_config.eos_token_id] *= 8
    model.save_pretrained(folder)
    return folder


def manual_chat(model, tok, users, max_new_tokens):
    """A greedy chat by hand: generate a1, put it in the conversation, append u2, generate a2, ... Returns the last
    generate()'s tokens and the positions each generate() added."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    msgs, seq, mask = [], [], []
    for user in users:
        msgs.append({"role": "user", "content": user})
        prompt = chat_input_ids(tok, msgs)
        assert prompt[: len(seq)] == seq  # the rendering extends what was generated (whole-word answers)
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=im_end, pad_token_id=0
        )[0].tolist()
        answer = out[len(prompt) :]
        mask = mask + [False] * (len(prompt) - len(mask)) + [True] * len(answer)
        seq = out
        text = tok.decode(answer[:-1] if answer[-1] == im_end else answer)
        msgs.append({"role": "assistant", "content": text})
    return seq, mask


# (the stopping target ends its answers to these two within a few tokens; the word target never stops)
@pytest.mark.parametrize("stops,users", [(True, ["Name a colour.", "Hi."]), (False, ["Tell me a story.", "Cats?"])])
def test_two_turns_are_one_sequence_as_a_greedy_chat_with_every_answer_in_the_loss_mask(tmp_path, stops, users):
    """A record [u1, given answer, u2]: the given answer is replaced; the stored sequence is token for token a greedy
    chat by hand, the loss mask exactly both generated answers (stop tokens included where they end), nothing of the
    user turns, and the features a fresh prefill of the whole sequence. Answers cut at max_new_tokens stay in the
    conversation (the template closes them) and the shard notes say so."""
    target = (build_stopping_target if stops else build_word_target)(tmp_path / "t")
    line = conversation(users[0], "Given answer, replaced.", users[1])
    write_lines(tmp_path / "chat.jsonl", [line])
    records, _ = load_records([str(tmp_path / "chat.jsonl")], split=None)
    summary = fleet_run(tmp_path / "s", target, records, turns="all")
    assert summary.sequences == 1
    store, tok = StoreReader(tmp_path / "s"), load_tokenizer(target)
    s = store.read(store.index(records[0].seq_id))
    worker = CaptureWorker(str(tmp_path / "s"), settings_for(target, turns="all"))
    ids, mask = manual_chat(worker.model, tok, users, max_new_tokens=12)
    assert s.input_ids.tolist() == ids and s.loss_mask.tolist() == mask
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    answers = np.split(s.input_ids, np.flatnonzero(np.diff(s.loss_mask.astype(int))) + 1)[1::2]
    assert len(answers) == 2 and all((a[-1] == im_end) == stops for a in answers)
    prompt_text = tok.decode(s.input_ids[~s.loss_mask])
    assert users[0] in prompt_text and users[1] in prompt_text
    assert "Given answer" not in tok.decode(s.input_ids)
    notes = read_manifest(tmp_path / "s")["shards"][0].get("notes", [])
    assert [n["note"] for n in notes] == (
        [] if stops else ["turn 1's answer reached its token limit without a stop token; the template closes it"]
    )
    conv = worker.encoder.encode(records[0])
    [(_, out)] = list(regenerate_conversations(worker.decoder, [conv], seeds=lambda turn: turn))
    assert out.input_ids.tolist() == ids
    fresh = capture_features(worker.model, out.input_ids[None], LAYERS)[0]
    assert (out.features - fresh).abs().max() < 1e-4


def shard_files(store) -> dict:
    root = store / "shards"
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_single_turn_records_store_the_same_bytes_with_turns_all_or_single(tmp_path):
    """A record with one user turn (a given answer or not) is regenerated as before: the shards are byte for byte
    those of data.turns=single, and the store's generation identity under single is the one before the setting."""
    target = build_word_target(tmp_path / "t")
    lines = [conversation("Tell me a story."), conversation("Hi.", "Hello there."), conversation("Count to 4.")]
    write_lines(tmp_path / "p.jsonl", lines)
    records, _ = load_records([str(tmp_path / "p.jsonl")], split=None)
    fleet_run(tmp_path / "single", target, records, turns="single")
    fleet_run(tmp_path / "all", target, records, turns="all")
    assert shard_files(tmp_path / "single") == shard_files(tmp_path / "all")
    assert "turns" not in read_manifest(tmp_path / "single")["generation"]
    assert read_manifest(tmp_path / "all")["generation"]["turns"] == "all"


def test_mtbench_records_give_two_turn_sequences(tmp_path):
    """MT-Bench's two questions become one sequence each: both user turns in the prompt part, answered in order,
    the last answer in the loss mask; with data.turns=single only the first turn, as before."""
    target = build_tiny_target(tmp_path / "t")
    records = load_prompts("mtbench", limit=3)
    assert all(len(r.followups) == 1 for r in records)
    fleet_run(tmp_path / "all", target, records, turns="all", max_new_tokens=6)
    fleet_run(tmp_path / "single", target, records, turns="single", max_new_tokens=6)
    tok, both, first = load_tokenizer(target), StoreReader(tmp_path / "all"), StoreReader(tmp_path / "single")
    for rec in records:
        s, f = both.read(both.index(rec.seq_id)), first.read(first.index(rec.seq_id))
        prompt_text = tok.decode(s.input_ids[~s.loss_mask])
        assert rec.messages[0]["content"] in prompt_text and rec.followups[0] in prompt_text
        assert rec.followups[0] not in tok.decode(f.input_ids)
        assert s.loss_mask[-1] and len(s.input_ids) > len(f.input_ids)
        # the first turn's answer is the single-turn one: the same greedy tokens after the same prompt
        n = int(np.argmax(f.loss_mask))
        assert s.input_ids[:n].tolist() == f.input_ids[:n].tolist()


def test_a_turn_that_no_longer_fits_max_length_ends_the_conversation_with_a_note(tmp_path):
    """The next turn's prompt leaves no room within max_length: the conversation is kept with the turns done (the
    first answer in the loss mask, ending where it ended) and the shard notes say why."""
    target = build_word_target(tmp_path / "t")
    tok = load_tokenizer(target)
    first = chat_input_ids(tok, [{"role": "user", "content": "Tell me a story."}])
    write_lines(tmp_path / "p.jsonl", [conversation("Tell me a story.", "Old.", "And then?")])
    records, _ = load_records([str(tmp_path / "p.jsonl")], split=None)
    fleet_run(tmp_path / "s", target, records, turns="all", max_length=len(first) + 20)
    store = StoreReader(tmp_path / "s")
    s = store.read(store.index(records[0].seq_id))
    assert s.input_ids[: len(first)].tolist() == first and s.loss_mask.tolist() == [False] * len(first) + [True] * 12
    notes = [n["note"] for n in read_manifest(tmp_path / "s")["shards"][0]["notes"]]
    assert notes[-1].startswith("turn 2's prompt (") and notes[-1].endswith(
        f"max_length {len(first) + 20}: kept 1 of 2 turns"
    )
