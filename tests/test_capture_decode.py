"""The capture decode that keeps a GPU fed: slots refilled in place, steps read one behind (overlap), the next task's
prompts joining before the current task's end, shards written off the decode loop; all against a plain reference."""

import os
import threading
import time

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
from pipeline.plan import budgets, writer_threads
from pipeline.settings import Task
from pipeline.shardqueue import BackgroundShard
from pipeline.worker import CaptureWorker
from tests.test_pipeline import LAYERS, build_tiny_target, settings_for, tiny

PROMPTS = [[1, 5, 9, 3], list(range(7, 20)), [2], [4, 4, 4, 4, 4, 4], [8, 9], list(range(30, 52)), [3, 3, 7]]
LIMITS = [12, 20, 7, 9, 3, 15, 1]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


def decode(model, batch_size, overlap, topk=0, added_late=0, staged=None, page_rows=None):
    """{prompt index: Captured}; the last `added_late` prompts are added after the first sequence has ended."""
    d = ContinuousDecode(model, LAYERS, [5, 6], 0, SamplingConfig(), None, topk, overlap=overlap, staged_copies=staged)
    if page_rows:
        d.host.page_rows = page_rows
    first = len(PROMPTS) - added_late
    d.add(PROMPTS[:first], LIMITS[:first])
    out, stream = {}, d.run(batch_size)
    for i, captured in stream:
        out[i] = captured
        if added_late and len(out) == 1:
            d.add(PROMPTS[first:], LIMITS[first:])
    return out


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("batch_size,added_late", [(2, 0), (3, 3), (7, 0), (4, 5)])
def test_decode_equals_generate_and_a_fresh_forward(overlap, batch_size, added_late):
    """Token for token what generate() decodes greedily, features and teacher rows what a fresh forward computes,
    with slots refilled in place, steps read one behind (overlap) and prompts added while it runs (batch 4 with 5
    added late: the batch grows from 2 slots to 4 while a step is pending, then shrinks as the last ones end)."""
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


@pytest.mark.parametrize("batch_size,added_late", [(4, 5), (3, 3), (6, 6)])
def test_overlap_and_staged_copies_give_what_the_plain_decode_gives_as_slots_grow_and_shrink(batch_size, added_late):
    """The GPU's decode on a CPU: steps read one behind, copies staged through host buffers, prompts joining while
    a step is pending so that the batch grows, and slots compacted away at the end: every sequence and teacher id
    equal to the plain decode's, features and log-probs to float rounding (an ended row is fed one step more, so the
    steps batch other rows); with the plain decode's schedule (no overlap), staged copies and 3-row pages (sequences
    span several) give the plain decode's bits."""
    model = tiny("llama")
    plain = decode(model, batch_size, overlap=False, topk=2, added_late=added_late, staged=False)
    gpu_side = decode(model, batch_size, overlap=True, topk=2, added_late=added_late, staged=True, page_rows=3)
    paged = decode(model, batch_size, overlap=False, topk=2, added_late=added_late, staged=True, page_rows=3)
    assert sorted(plain) == sorted(gpu_side) == sorted(paged) == list(range(len(PROMPTS)))
    for i in plain:
        a, b, c = plain[i], gpu_side[i], paged[i]
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask), i
        assert torch.allclose(a.features, b.features, rtol=0, atol=1e-6) and a.finished == b.finished, i
        assert torch.equal(a.teacher[0], b.teacher[0]) and torch.allclose(a.teacher[1], b.teacher[1], atol=1e-5), i
        for x, y in zip((a.input_ids, a.features, *a.teacher), (c.input_ids, c.features, *c.teacher)):
            assert torch.equal(x, y), i


def test_a_step_read_over_other_slots_than_it_was_launched_over_is_refused():
    """The guard behind the fix: results laid out by 2 slots are never written into 3 (they would land in the wrong
    rows, or fail on a shape deep in torch)."""
    model = tiny("qwen3")
    d = ContinuousDecode(model, LAYERS, [5, 6], 0, SamplingConfig(), None, 0, overlap=True)
    d.add(PROMPTS[:2], LIMITS[:2])
    d._admit([0, 1])
    launched = d._launch()
    d.host.add_slots(1)
    with pytest.raises(RuntimeError, match="launched over 2 slots is read over 3"):
        list(d._collect(*launched))


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


def fleet_store(tmp_path, target, records, writer_threads="auto", gpu_decode=False, **fleet):
    """A store captured by an in-process fleet in shards of 2 prompts (each task's prompts join the decode while the
    previous task's decode), batch 3; `gpu_decode`: overlap and staged copies forced on, as on CUDA, batch 5 (more
    rows than a task and its lookahead fill: the batch shrinks as a task ends and grows as the next one joins)."""
    gpu = dict(overlap=True, staged_copies=True, batch_size=8) if gpu_decode else dict(batch_size=3)
    settings = settings_for(target, torch_threads=1, max_new_tokens=10, writer_threads=writer_threads, **gpu)
    writer = open_store(tmp_path, settings, sources=["test"], store_options=dict(shard_tokens=64, chunk_tokens=16))
    summary = run_fleet(tmp_path, records, settings, writer, FleetConfig(shard_size=2, **fleet), progress=False)
    assert summary.ok, summary.lines()
    assert summary.retried == [], summary.lines()  # every task committed at its first attempt
    return StoreReader(tmp_path)


def records(n):
    words = "why is the sky blue and the sea green at noon".split()
    asks = [" ".join(words[i % 5 : i % 5 + 2 + i % 4]) for i in range(n)]
    return [
        PromptRecord(f"r{i}", "test", str(i), ({"role": "user", "content": a},), "train") for i, a in enumerate(asks)
    ]


@pytest.mark.parametrize(
    "writer_threads,gpu_decode", [("auto", False), (1, False), (2, False), ("auto", True), (2, True)]
)  # writer_threads auto on a CPU: in the decode loop; gpu_decode: overlap and staged copies forced on
def test_a_store_captured_across_task_boundaries_equals_a_plain_reference_capture(
    tmp_path, target, writer_threads, gpu_decode
):
    """In-process fleet (the next task's prompts join the decode before the current task's end), shards written in
    the decode loop or by writing threads, with the decode CUDA would run (overlap, staged copies: the slots grow while
    a step is pending at each task boundary): every task commits at its first attempt, every stored sequence is the
    target's greedy answer token for token, its features a fresh forward's (bf16 store)."""
    reader = fleet_store(tmp_path / "s", target, records(12), writer_threads, gpu_decode, num_actors=0)
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
    assert len(reader.seq_ids) == 12 and len(lengths) > 1


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
    assert worker.plan.threads == (0 if writer_threads == "auto" else writer_threads)
    worker.run(tasks[0], lookahead=tasks[1])
    assert shard_dir(tmp_path, tasks[0].name).exists() and not shard_dir(tmp_path, tasks[1].name).exists()
    assert len(worker.decoder.shared.waiting) < 2  # a prompt of the lookahead took the batch's free row at once
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


def test_a_shard_commits_in_its_writing_thread_while_the_decode_goes_on(tmp_path, target, monkeypatch):
    """Shards written off the decode loop commit (flush, fsync, rename) in their own thread, and the decode loop goes
    on with the lookahead task meanwhile: a commit made slow on purpose sees the next task's sequences arrive."""
    commits, appends, slow = [], [], 0.5
    commit, append = ShardWriter.commit, ShardWriter.append

    def slow_commit(self):
        t0 = time.monotonic()
        time.sleep(slow)
        entry = commit(self)
        others = [name for name, t in appends if name != self.name and t0 <= t]
        commits.append((self.name, threading.current_thread() is threading.main_thread(), others))
        return entry

    def noted_append(self, *args, **kwargs):
        appends.append((self.name, time.monotonic()))
        return append(self, *args, **kwargs)

    monkeypatch.setattr(ShardWriter, "commit", slow_commit)
    monkeypatch.setattr(ShardWriter, "append", noted_append)
    reader = fleet_store(tmp_path / "s", target, records(12), writer_threads=1, gpu_decode=True, num_actors=0)
    assert len(reader.seq_ids) == 12 and len(commits) == 6
    assert not any(on_main for _, on_main, _ in commits), commits
    assert any(others for _, _, others in commits), f"no sequence of another task arrived during a commit: {commits}"


def test_the_capture_workers_device_settings_resolve_by_device(monkeypatch):
    """auto on CUDA (the side a GPU machine takes, resolved here on a CPU): every CPU of this machine shared by one
    actor a GPU, and every CPU thread of an actor but the decode loop's writing shards; on a CPU one CPU an actor and
    shards written in the decode loop. A number is taken as set; each resolution says why."""
    import pipeline.__main__ as main
    from entry import compose, typed_config

    assert writer_threads("auto", torch.device("cpu"), 8) == (0, "auto on CPU")
    threads, why = writer_threads("auto", torch.device("cuda"), 8)
    assert threads == 7 and "auto on a GPU" in why
    assert writer_threads(3, torch.device("cuda"), 8) == (3, "data.writer_threads")
    cfg = typed_config(compose([]))
    assert main.cpus_per_actor(cfg) == (1.0, "cluster.cpus_per_actor=auto on CPU")
    monkeypatch.setattr(main, "local_gpus", lambda device: 2)
    cpus = len(os.sched_getaffinity(0))
    assert main.cpus_per_actor(cfg)[0] == max(1, cpus // 2)
    assert main.settings_from(cfg, offline_ok=True).torch_threads == max(1, cpus // 2)
    assert main.cpus_per_actor(typed_config(compose(["cluster.cpus_per_actor=6"]))) == (6.0, "cluster.cpus_per_actor")
    assert main.cpus_per_actor(typed_config(compose(["cluster=ray"])))[0] == 4  # conf/cluster/ray.yaml's
    with pytest.raises(ValueError, match="cluster.cpus_per_actor must be a number or auto, got 'many'"):
        main.cpus_per_actor(typed_config(compose(["cluster.cpus_per_actor=many"])))


def test_the_worker_plans_its_batch_from_free_gpu_memory_when_given_some(tmp_path, target):
    """The planning a worker does on a GPU (free memory known), run on a CPU: decode rows and a prefill budget sized
    from the memory, each with the line that says why; without free memory (a CPU) the fixed defaults."""
    settings = settings_for(target, batch_size="auto", torch_threads=1)
    open_store(tmp_path, settings, sources=["test"], store_options={})
    worker = CaptureWorker(str(tmp_path), settings)
    model, topk = worker.model, worker.layout.teacher_topk
    plan = lambda free: budgets(worker.s, model.config, model.dtype, topk, free)
    rows, prefill, lines = plan(2 * 2**30)
    assert rows > 8 and prefill == 16384, lines
    assert any("GiB" in line or "free" in line for line in lines), lines
    fewer, _, _ = plan(2**28)
    assert 1 <= fewer < rows
    assert plan(None)[:2] == (8, None)
