"""`python -m pipeline repair` on damage inside a listed shard's arrays (issue #58, failure 5): a garbled array
zarr.json and a truncated data file are found as verify finds them, exactly those shards are dropped (their folders
moved aside, not deleted) and a rerun capture captures exactly their prompts; the trainer that meets such damage
names the command."""

import sys

import pytest

from flashdraft.store import read_manifest, verify_store
from flashdraft.store.files import array_file, shard_dir, shard_seq_ids
from tests.test_faults_writer import command_here, prompt_ids, run, stored_once
from trainer.store_verify import CorruptStore, verify_stores


def test_shards_damaged_inside_their_arrays_are_dropped_and_exactly_their_prompts_recaptured(captured_copy):
    _, store, capture = captured_copy  # 6 prompts, 2 a shard
    limit = 6
    names = [e["name"] for e in read_manifest(store)["shards"]]
    assert len(names) == 3
    garbled, truncated = names[0], names[2]
    (shard_dir(store, garbled) / "features" / "zarr.json").write_text("{ not json")
    data = array_file(shard_dir(store, truncated), "input_ids", 1)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    lost = shard_seq_ids(shard_dir(store, garbled)) | shard_seq_ids(shard_dir(store, truncated))

    checked = command_here("verify", store)  # a process exits 1 for verify in test_faults_store
    assert checked.returncode == 1 and garbled in checked.stderr and truncated in checked.stderr
    with pytest.raises(CorruptStore) as refused:  # the trainer's check names the command that repairs
        verify_stores([store], "full", fraction=1.0)
    assert f"python -m pipeline repair {store} drops every missing or damaged shard" in str(refused.value)

    repaired = run([sys.executable, "-m", "pipeline", "repair", str(store)])
    assert repaired.returncode == 0, repaired.stderr
    out = repaired.stdout
    assert f"dropped {garbled} (2 sequences, 0 rejects): shard {garbled}: array features cannot be opened" in out
    assert f"dropped {truncated} (2 sequences, 0 rejects): shard {truncated}: array input_ids: data file" in out
    assert f"its folder moved to {store / 'damaged' / garbled}" in out
    assert "2 shard entries dropped; run the same capture command again to recapture their prompts" in out
    assert [e["name"] for e in read_manifest(store)["shards"]] == [names[1]]
    assert sorted(p.name for p in (store / "damaged").iterdir()) == [garbled, truncated]  # kept, out of shards/
    assert verify_store(store, progress=False)[0] == []

    again = run(capture)
    assert again.returncode == 0, again.stderr[-3000:]
    new = [e["name"] for e in read_manifest(store)["shards"]][1:]
    assert len(new) == 2
    assert set().union(*(shard_seq_ids(shard_dir(store, n)) for n in new)) == lost  # exactly the dropped prompts
    assert stored_once(store) == prompt_ids(limit)
    verified = run([sys.executable, "-m", "pipeline", "verify", str(store)])
    assert verified.returncode == 0, verified.stderr
    nothing = command_here("repair", store)
    assert nothing.returncode == 0 and "nothing to repair" in nothing.stdout
