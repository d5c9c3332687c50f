"""The Slurm path as a user runs it: a real two-node Slurm cluster on this machine (scripts/slurm-local.sh: n1 and
n2, one CPU each), the real jobs/*.sbatch submitted with sbatch from the checkout, chained with
--dependency=afterok. The capture runs a Ray head on n1 and a worker on n2 with one capture actor on each; the
training runs one torchrun per node (c10d rendezvous, gloo on CPU) and exports a drafter the harness loads."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from flashdraft.prompts import load_prompts
from flashdraft.store import StoreReader, read_manifest

ROOT = Path(__file__).resolve().parents[1]
SLURM_LOCAL = ROOT / "scripts" / "slurm-local.sh"
LAYERS = [1, 3, 4]
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}

pytestmark = pytest.mark.cluster


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def slurm_conf():
    """Bring the local cluster up (and down again if this session started it). Skips only where it cannot run:
    not root, or neither Slurm nor apt-get; as root with apt-get (CI) a cluster that does not start fails."""
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (scripts/slurm-local.sh up)")
    if not (shutil.which("slurmctld") or shutil.which("apt-get")):
        pytest.skip("no Slurm installed and no apt-get to install slurm-wlm and munge")
    was_up = subprocess.run(["bash", SLURM_LOCAL, "status"], capture_output=True).returncode == 0
    up = subprocess.run(["bash", SLURM_LOCAL, "up"], capture_output=True, text=True, timeout=900)
    assert up.returncode == 0, f"scripts/slurm-local.sh up failed:\n{up.stderr}"
    conf = re.search(r"export SLURM_CONF=(\S+)", up.stdout).group(1)
    yield conf
    if not was_up:
        subprocess.run(["bash", SLURM_LOCAL, "down"], capture_output=True, timeout=300)


def job_fields(job: str, env) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True, check=True)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def wait_for(job: str, env, timeout=900) -> dict:
    """The job's final `scontrol show job` fields; a job whose dependency failed is cancelled and returned."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        fields = job_fields(job, env)
        if fields["JobState"] in FINAL:
            return fields
        if fields.get("Reason") == "DependencyNeverSatisfied":
            subprocess.run(["scancel", job], env=env)
            return fields
        time.sleep(2)
    subprocess.run(["scancel", job], env=env)
    raise TimeoutError(f"job {job} not done after {timeout} s: {fields}")


def sbatch(script: str, *args: str, env) -> str:
    cmd = ["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1", "--time=20"]
    out = subprocess.run([*cmd, f"jobs/{script}", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


TRAIN_ARGS = [
    *(f"train.{a}" for a in "max_steps=3 num_anchors=4 max_length=64 token_budget=256 heldout_fraction=0".split()),
    *(f"train.{a}" for a in "checkpoint_every=0 eval_every=0 progress=false loader_workers=1 prefetch=1".split()),
    "drafter.num_layers=1",
    "drafter.block_size=4",
]


def make_train_after(job: str, overrides: list[str], env) -> str:
    """`make train CLUSTER=slurm AFTER=<job>` (the README's chain; -o: the checkout's .venv is not rebuilt here)."""
    make = ["make", "--no-print-directory", "-o", ".venv/.installed", "train", "CLUSTER=slurm", f"AFTER={job}"]
    opts = ["NODES=2", "GPUS_PER_NODE=0", "TIME=20", "SBATCH_ARGS=--cpus-per-task=1", f"ARGS={' '.join(overrides)}"]
    out = subprocess.run([*make, *opts], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return re.search(r"submitted train job (\d+): log logs/flashdraft-train-\1\.out", out.stdout).group(1)


def tiny_qwen3_target(folder: Path) -> str:
    """A random 6-layer Qwen3 with the SmolLM2 tokenizer: too random to end its answers, so each is max_new_tokens."""
    from flashdraft.target import load_tokenizer
    from tests.test_pipeline import tiny

    tok = load_tokenizer("smollm2-135m")
    tiny("qwen3", vocab=len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def jobs(slurm_conf, tmp_path_factory):
    """Submit the capture and, chained after it, the training, as the README tells a user; cancel what is left."""
    tmp = tmp_path_factory.mktemp("slurm")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Name {i} rivers of the world."}) + "\n" for i in range(6)))
    target = tiny_qwen3_target(tmp / "target")
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    env = {
        **os.environ,
        "SLURM_CONF": slurm_conf,
        "GPUS_PER_NODE": "0",
        "RAY_PORT": str(free_port()),
        "RAY_HEAD_ARGS": f"--temp-dir={ray_tmp} --include-dashboard=false --ray-client-server-port={free_port()}",
        "RAY_START_ARGS": "--object-store-memory=100000000 --disable-usage-stats",
        "RAY_DEDUP_LOGS": "0",
        "RDZV_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }
    model = [f"model.target={target}", "model.name=tiny", "model.num_layers=6", "model.hidden_size=64"]
    paths = [f"run_dir={tmp / 'run'}", f"features_dir={tmp / 'features'}"]
    capture = sbatch(
        "slurm_capture.sbatch",
        *model,
        f"drafter.layer_ids=[{','.join(map(str, LAYERS))}]",
        "model.dtype=float32",
        "data=local",
        f"data.path={prompts}",
        "data.split=all",
        "data.max_new_tokens=16",
        "data.shard_size=2",
        "data.batch_size=2",
        *paths,
        env=env,
    )
    train = make_train_after(capture, [*model, *paths, *TRAIN_ARGS], env)
    yield dict(capture=capture, train=train, env=env, tmp=tmp, target=target, prompts=prompts, ray_tmp=ray_tmp)
    subprocess.run(["scancel", capture, train], env=env, capture_output=True)
    shutil.rmtree(ray_tmp, ignore_errors=True)


def finished_log(job: str, name: str, env) -> str:
    """Wait for the job; it must complete, its log where the README says (logs/<job name>-<id>.out)."""
    fields = wait_for(job, env)
    log = ROOT / "logs" / f"{name}-{job}.out"
    assert fields["StdOut"] == str(log)
    text = log.read_text() if log.is_file() else f"(no log at {log})"
    assert fields["JobState"] == "COMPLETED", f"job {job}: {fields['JobState']} {fields.get('Reason')}\n{text[-6000:]}"
    return text


def actor_nodes(log: str, ray_tmp: str) -> set[str]:
    """The Ray nodes (their raylet logs: raylet.out is the head's) that started the capture actors of the log."""
    pids = set(re.findall(r"\(CaptureWorker pid=(\d+)", log))
    assert len(pids) == 2, f"expected 2 capture actors in the job log, found pids {pids}"
    nodes = set()
    for raylet in Path(ray_tmp, "session_latest", "logs").glob("raylet*.out"):
        started = set(re.findall(r"Started worker process with pid (\d+)", raylet.read_text()))
        if started & pids:
            nodes.add(raylet.name)
    return nodes


def test_capture_on_two_slurm_nodes(jobs):
    log = finished_log(jobs["capture"], "flashdraft-capture", jobs["env"])
    assert re.search(r"Ray at 127\.0\.0\.1:\d+: 2/2 nodes up", log)  # n1 and n2 by their NodeAddr
    assert actor_nodes(log, jobs["ray_tmp"]) == {"raylet.out", "raylet.1.out"}  # one actor on each node
    store = jobs["tmp"] / "features"
    verify = subprocess.run(
        [sys.executable, "-m", "pipeline", "verify", str(store)], cwd=ROOT, capture_output=True, text=True
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    expected = sorted(r.seq_id for r in load_prompts(str(jobs["prompts"]), split="all"))
    assert sorted(StoreReader(store).seq_ids) == expected  # every prompt, once
    assert read_manifest(store)["counts"]["sequences"] == 6 and len(read_manifest(store)["shards"]) == 3


def test_train_after_capture_one_rank_per_node(jobs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flashdraft.config import DrafterConfig
    from harness.drafter import load_drafter

    finished_log(jobs["train"], "flashdraft-train", jobs["env"])
    run = jobs["tmp"] / "run"
    steps = [json.loads(line)["step"] for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 3
    last = run / "train" / "checkpoints" / "step-00000003"
    assert sorted(p.name for p in last.glob("rng-rank*.pt")) == ["rng-rank0.pt", "rng-rank1.pt"]  # two ranks
    target = AutoModelForCausalLM.from_pretrained(jobs["target"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(jobs["target"])
    drafter, untrained = load_drafter(run / "drafter", target, tokenizer, DrafterConfig())
    assert not untrained and drafter.block_size == 4 and len(drafter.layers) == 1
    assert list(drafter.target_layer_ids) == LAYERS
