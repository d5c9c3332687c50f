import os
import shutil

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def captured_six(tmp_path_factory):
    """(the tiny target, a store) that `python -m pipeline` captured of the first 6 humaneval prompts, two a shard:
    captured once a run; `captured_copy` gives each test its own copy to damage."""
    from tests.test_faults_writer import pipeline_cmd, run
    from tests.test_pipeline import build_tiny_target

    tmp = tmp_path_factory.mktemp("captured-six")
    target = build_tiny_target(tmp / "target")
    done = run(pipeline_cmd(target, tmp / "store", 6, tmp / "run"))
    assert done.returncode == 0, done.stderr[-3000:]
    return target, tmp / "store"


@pytest.fixture
def captured_copy(captured_six, tmp_path):
    """(the tiny target, this test's copy of `captured_six`'s store, the capture command that wrote it, run again
    into the copy)."""
    from tests.test_faults_writer import pipeline_cmd

    target, store = captured_six
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    return target, copy, pipeline_cmd(target, copy, 6, tmp_path / "run")
