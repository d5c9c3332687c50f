"""The capture decode that keeps a GPU fed: slots refilled in place, steps read one behind (overlap), the next task's
prompts joining before the current task's end, shards written off the decode loop; all against a plain reference."""

import pytest
import torch

from flashdraft.config import SamplingConfig
from flashdraft.prompts import PromptRecord
from flashdraft.store import ShardWriter, StoreError, StoreLayout, StoreReader, shard_name, verify_store
from flashdraft.store.files import shard_dir, temp_shard_dir
from flashdraft.target import capture_features, load_target
from pipeline.decode import ContinuousDecode
from pipeline.fleet import FleetConfig, run_fleet
from pipeline.job import open_store
from pipeline.shardqueue import BackgroundShard
from pipeline.worker import CaptureWorker, Task
from tests.test_pipeline import LAYERS, build_tiny_target, settings_for, tiny

PROMPTS = [[1, 5, 9, 3], list(range(7, 20)), [2], [4, 4, 4, 4, 4, 4], [8, 9], list(range(30, 52)), [3, 3, 7]]
LIMITS = [12, 20, 7, 9, 3, 15, 1]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


def decode(model, batch_size, overlap, topk=0, added_late=0):
    """{prompt index: Captured}; the last `added_late` prompts are added after the first sequence has ended."""
    d = ContinuousDecode(model, LAYERS, [5, 6], 0, SamplingConfig(), None, topk, overlap=overlap)
    first = len(PROMPTS) - added_late
    d.add(PROMPTS[:first], LIMITS[:first])
    out, stream = {}, d.run(batch_size)
    for i, captured in stream:
        out[i] = captured
        if added_late and len(out) == 1:
            d.add(PROMPTS[first:], LIMITS[first:])
    return out


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("batch_size,added_late", [(2, 0), (3, 3), (7, 0)])
def test_decode_equals_generate_and_a_fresh_forward(overlap, batch_size, added_late):
    """Token for token what generate() decodes greedily, features and teacher rows what a fresh forward computes,
    with slots refilled in place, steps read one behind (overlap) and prompts added while it runs."""
    model = tiny("qwen3")
    out = decode(model, batch_size, overlap, topk=3, added_late=added_late)
    assert sorted(out) == list(range(len(PROMPTS)))
    for i, (p, n) in enumerate(zip(PROMPTS, LIMITS)):
        r = out[i]
        g = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=[5, 6], pad_token_id=0)
        assert r.input_ids.tolist() == g[0].tolist()
        assert r.finished == (r.input_ids[-1].item() in (5, 6))
        assert r.loss_mask.tolist() == [False] * len(p) + [True] * (len(r.input_ids) - len(p))
        ref = capture_features(model, r.input_ids[None], LAYERS)[0]
        assert (r.features - ref).abs().max() < 1e-4
        with torch.no_grad():
            logp = torch.log_softmax(model(r.input_ids[None]).logits[0].float(), -1)
        top = logp.topk(3, -1)
        assert (r.teacher[0][len(p) - 1 :] == top.indices[len(p) - 1 :]).all()
        assert (r.teacher[1][len(p) - 1 :] - top.values[len(p) - 1 :]).abs().max() < 1e-4
        assert (r.teacher[1][: len(p) - 1] == -torch.inf).all()


def test_rows_that_end_and_join_leave_the_cache_buffers_in_place():
    """A sequence that ends frees its slot and a joining one is written into it: the cache's buffers are the same
    tensors through it, except when they need more capacity (no copy a row leaving or joining)."""
    model = tiny("llama")
    d = ContinuousDecode(model, LAYERS, [], 0, SamplingConfig(), None, 0, overlap=False)
    d.add([[1 + i % 5, 2, 3] for i in range(24)], [4 + (i * 7) % 9 for i in range(24)])
    buffers, ended = set(), 0
    for _ in d.run(4):
        ended += 1
        buffers.add(d.cache.layers[0]._k.data_ptr())
    assert ended == 24 and len(d.host.live) <= 4
    assert len(buffers) <= 3, f"{len(buffers)} cache buffers over {ended} rows ending and joining"


def fleet_store(tmp_path, target, records, writer_threads="auto", **fleet):
    settings = settings_for(target, torch_threads=1, batch_size=3, max_new_tokens=10, writer_threads=writer_threads)
    writer = open_store(tmp_path, settings, sources=["test"], store_options=dict(shard_tokens=64, chunk_tokens=16))
    summary = run_fleet(tmp_path, records, settings, writer, FleetConfig(shard_size=2, **fleet), progress=False)
    assert summary.ok, summary.lines()
    return StoreReader(tmp_path)


def records(n):
    words = "why is the sky blue and the sea green at noon".split()
    asks = [" ".join(words[i % 5 : i % 5 + 2 + i % 4]) for i in range(n)]
    return [
        PromptRecord(f"r{i}", "test", str(i), ({"role": "user", "content": a},), "train") for i, a in enumerate(asks)
    ]


@pytest.mark.parametrize("writer_threads", ["auto", 1, 2])  # auto on a CPU: in the decode loop
def test_a_store_captured_across_task_boundaries_equals_a_plain_reference_capture(tmp_path, target, writer_threads):
    """In-process fleet (the next task's prompts join the decode before the current task's end), shards written in
    the decode loop or by writing threads: every stored sequence is the target's greedy answer token for token, its
    features a fresh forward's (bf16 store)."""
    reader = fleet_store(tmp_path / "s", target, records(9), writer_threads, num_actors=0)
    assert verify_store(tmp_path / "s", progress=False)[0] == []
    model, _ = load_target(target)
    lengths = set()
    for j, seq_id in enumerate(reader.seq_ids):
        seq = reader.read(j)
        prompt = seq.input_ids[~seq.loss_mask].tolist()
        n = int(seq.loss_mask.sum())
        eos = model.generation_config.eos_token_id
        g = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0)
        assert seq.input_ids.tolist() == g[0].tolist(), seq_id
        ids = torch.as_tensor(seq.input_ids, dtype=torch.long)[None]
        ref = capture_features(model, ids, LAYERS)[0].to(torch.bfloat16).float()
        assert torch.allclose(seq.features.float(), ref, rtol=1e-2, atol=1e-3), seq_id
        lengths.add(n)
    assert len(reader.seq_ids) == 9 and len(lengths) > 1


def temp_shards(store, name: str) -> list:
    """The temporary folders of shard `name` (a writer's folder name ends in a random suffix)."""
    return list(temp_shard_dir(store, name).parent.glob(temp_shard_dir(store, name).name.rsplit("-", 1)[0] + "-*"))


@pytest.mark.parametrize("writer_threads,writes", [("auto", ShardWriter), (1, BackgroundShard)])
def test_the_lookahead_task_is_decoded_ahead_committed_by_its_own_call_and_dropped_by_another(
    tmp_path, target, writer_threads, writes
):
    """(auto on a CPU writes shards in the decode loop; a number of threads, off it.)"""
    settings = settings_for(target, torch_threads=1, batch_size=3, max_new_tokens=10, writer_threads=writer_threads)
    open_store(tmp_path, settings, sources=["test"], store_options=dict(shard_tokens=64, chunk_tokens=16))
    recs = records(6)
    tasks = [Task(shard_name(k), tuple(recs[2 * k : 2 * k + 2])) for k in range(3)]
    worker = CaptureWorker(str(tmp_path), settings)
    assert worker.threads == (0 if writer_threads == "auto" else writer_threads)
    worker.run(tasks[0], lookahead=tasks[1])
    assert shard_dir(tmp_path, tasks[0].name).exists() and not shard_dir(tmp_path, tasks[1].name).exists()
    assert len(worker._decode.waiting) < 2  # a prompt of the lookahead took the batch's free row at once
    worker.run(tasks[1], lookahead=tasks[2])
    assert shard_dir(tmp_path, tasks[1].name).exists() and temp_shards(tmp_path, tasks[2].name)
    assert type(worker._ahead.shard) is writes
    worker.run(
        tasks[0]._replace(name=shard_name(3)) if hasattr(tasks[0], "_replace") else Task(shard_name(3), recs[:1])
    )
    assert not temp_shards(tmp_path, tasks[2].name)  # another task came: the lookahead is dropped


def test_a_write_that_fails_in_the_writing_thread_is_raised_in_the_decode_loop_and_leaves_nothing(tmp_path):
    layout = StoreLayout(layer_ids=(0, 1), hidden_size=4)
    shard = BackgroundShard(tmp_path, shard_name(0), layout, queue_items=1)
    shard.append("a", [1, 2], [False, True], torch.zeros(2, 8))
    shard.append("b", [1, 2], [False, True], torch.zeros(2, 7))  # the wrong width: refused in the writing thread
    with pytest.raises(StoreError, match="'b'"):
        for k in range(3):
            shard.append(f"c{k}", [1], [True], torch.zeros(1, 8))
        shard.commit()
    assert not temp_shards(tmp_path, shard_name(0)) and not shard_dir(tmp_path, shard_name(0)).exists()


def test_writer_threads_below_zero_are_refused_naming_the_setting(target):
    with pytest.raises(ValueError, match=r"data.writer_threads must be 0 \(in the decode loop\), .* got -1"):
        settings_for(target, writer_threads=-1)
