"""The Slurm path as a user runs it: a real two-node Slurm cluster on this machine (scripts/slurm-local.sh: n1 and
n2, one CPU each). What the partition cannot run is refused by `make features CLUSTER=slurm` before sbatch; a batch
script sbatch'd by its path from elsewhere logs there. The capture and the training are submitted with make and its
default CPUs and GPUs, chained with AFTER (--dependency=afterok). The capture runs a Ray head on n1 and a worker on
n2 with one capture actor on each; the training runs one torchrun per node (c10d rendezvous, gloo on CPU) and
exports a drafter the harness loads."""

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


def make_cluster(target: str, *options: str, env) -> subprocess.CompletedProcess:
    """`make TARGET CLUSTER=slurm OPTIONS` in the checkout (-o: the checkout's .venv is not rebuilt here)."""
    make = ["make", "--no-print-directory", "-o", ".venv/.installed", target, "CLUSTER=slurm", *options]
    return subprocess.run(make, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def submitted(out: subprocess.CompletedProcess, job: str) -> str:
    """The job id `make features|train CLUSTER=slurm` printed, with its log in the checkout's logs/."""
    assert out.returncode == 0, out.stdout + out.stderr
    return re.search(rf"submitted {job} job (\d+) .*: log logs/flashdraft-{job}-\1\.out", out.stdout).group(1)


def slurm_env(conf: str) -> dict:
    """The user's environment with the local cluster's SLURM_CONF: nothing set that the make variables default."""
    drop = {"GPUS_PER_NODE", "CPUS_PER_NODE", "NODES", "PARTITION", "SBATCH_ARGS", "FLASHDRAFT_ROOT"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "SLURM_CONF": conf}


@pytest.mark.parametrize(
    "option, refusal",
    [
        ("CPUS_PER_NODE=64", "partition local has no 2 nodes with 64 CPUs (CPUS_PER_NODE) and 0 GPUs"),
        ("GPUS_PER_NODE=8", "partition local has no 2 nodes with 1 CPUs (CPUS_PER_NODE) and 8 GPUs (GPUS_PER_NODE)"),
        ("NODES=3", "partition local has 2 nodes, NODES=3"),
        ("PARTITION=gpu", "no partition gpu (PARTITION) with nodes; sinfo lists: local* (2 nodes)"),
        ("SBATCH_ARGS=--mem=999999999", "sbatch --test-only "),
    ],
)
def test_make_refuses_a_job_the_partition_cannot_run_naming_the_limit(slurm_conf, option, refusal):
    """Slurm would accept these and leave them pending for ever (PartitionConfig): refused before sbatch, with
    what the partition's nodes have (n1 and n2, one CPU each, no GPU)."""
    env = slurm_env(slurm_conf)
    before = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True).stdout
    out = make_cluster("features", option, env=env)
    assert out.returncode != 0 and "submitted" not in out.stdout
    assert f"refused, nothing submitted: {refusal}" in out.stderr, out.stderr
    assert option.startswith("PARTITION=") or "2 nodes with 1 CPUs and 0 GPUs (n1 n2)" in out.stderr
    after = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True).stdout
    assert after == before


def test_a_job_sbatched_from_elsewhere_logs_there_and_runs_the_checkout(slurm_conf, tmp_path):
    """Submitted by its path from another directory (Slurm runs a copy from its spool): the log is in the submit
    directory, and the job runs the checkout's trainer, whose error (no store here) the log shows."""
    env = slurm_env(slurm_conf)
    cmd = ["sbatch", "--parsable", "--cpus-per-task=1", "--gpus-per-node=0", "--time=5"]
    script = ROOT / "jobs" / "slurm_train.sbatch"
    out = subprocess.run(
        [*cmd, str(script), f"features_dir={tmp_path / 'none'}", f"run_dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip().split(";")[0]
    fields = wait_for(job, env, timeout=300)
    log = tmp_path / f"flashdraft-train-{job}.out"
    assert fields["StdOut"] == str(log) and log.is_file()
    assert fields["JobState"] == "FAILED"
    assert f"no feature store at {tmp_path / 'none'}" in log.read_text()


TRAIN_ARGS = [
    *(f"train.{a}" for a in "max_steps=3 num_anchors=4 max_length=64 token_budget=256 heldout_fraction=0".split()),
    *(f"train.{a}" for a in "checkpoint_every=0 eval_every=0 progress=false loader_workers=1 prefetch=1".split()),
    "drafter.num_layers=1",
    "drafter.block_size=4",
]


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
        **slurm_env(slurm_conf),
        "RAY_PORT": str(free_port()),
        "RAY_HEAD_ARGS": f"--temp-dir={ray_tmp} --include-dashboard=false --ray-client-server-port={free_port()}",
        "RAY_START_ARGS": "--object-store-memory=100000000",
        "RAY_DEDUP_LOGS": "0",
        "RDZV_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }
    model = [f"model.target={target}", "model.name=tiny", "model.num_layers=6", "model.hidden_size=64"]
    paths = [f"run_dir={tmp / 'run'}", f"features_dir={tmp / 'features'}"]
    capture_args = [
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
    ]
    # the README's commands with no CPU or GPU count: the partition's (one CPU, no GPU) by default
    capture = submitted(make_cluster("features", "TIME=20", f"ARGS={' '.join(capture_args)}", env=env), "capture")
    train_args = " ".join([*model, *paths, *TRAIN_ARGS])
    train = submitted(make_cluster("train", f"AFTER={capture}", "TIME=20", f"ARGS={train_args}", env=env), "train")
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
    plain = re.sub(r"\x1b\[[0-9;]*m", "", log)
    # n1 and n2 (NodeAddr 127.0.0.1) under the address Ray gives them, the one it prints for each node
    head = re.search(r"Ray at (\S+):\d+: 2/2 nodes up", plain).group(1)
    assert re.findall(r"Local node IP: (\S+)", plain) == [head, head]
    assert "Usage stats collection is disabled." in plain  # the head's word, for the cluster; no RAY_START_ARGS
    assert "srun: error" not in plain  # the Ray steps stopped at the end are no failed tasks
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
