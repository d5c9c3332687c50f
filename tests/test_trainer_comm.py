"""The trainer's collectives on the process group of a GPU run, on a CPU-only machine, with two real ranks.

nccl registers itself for CUDA tensors only, and some collectives carry CPU tensors (on a CPU run, or a GPU run's
tensors that live on the host: `all_sum`, `Tally.all_sum`, the sync of the steps' sums with its NaN check, the CPU
dtype broadcast). A backend registered the same way (`devices=["cuda"]`, a gloo process group
underneath) stands in for nccl here: alone, as the trainer used to initialise a GPU run, it refuses those sums; in the
group `trainer.engine.backend_for` gives a GPU run, they all work."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CUDA_ONLY = "cudaonly"  # nccl's stand-in
WORLD = 2
NO_CPU_BACKEND = "No backend type associated with device type cpu"


def register_cuda_only_backend() -> None:
    if CUDA_ONLY not in dist.Backend.backend_list:
        gloo = lambda store, rank, size, timeout: dist.ProcessGroupGloo(store, rank, size, timeout)  # noqa: E731
        dist.Backend.register_backend(CUDA_ONLY, gloo, devices=["cuda"])


def trainer_collectives(rank: int, ckpt_root: Path) -> dict:
    """Each CPU-tensor collective of the trainer, run here as the loop runs it: name -> what it returned."""
    from trainer.engine import all_sum, training_dtype
    from trainer.metrics import Tally
    from trainer.train import Progress, StepRecord, TrainingDiverged, sync_steps

    def tally(loss):
        t = Tally(block_size=2)
        stats = {"pos_correct": torch.ones(2), "pos_total": torch.full((2,), 2.0)}
        t.add(loss, 10.0, {**stats, "accept": torch.tensor(1.0), "blocks": torch.tensor(1.0)})
        return t

    def nan_check():  # rank 1's loss is NaN: every rank stops at the sync
        try:
            loss = torch.tensor(float("nan") if rank == 1 else 1.0)
            step = StepRecord(0, 1, 0.0, tally(loss), ["s0"], 0.0)
            engine, proc = SimpleNamespace(get_global_grad_norm=lambda: None), SimpleNamespace(rank=rank, world=WORLD)
            sync_steps(engine, proc, 1, Progress(), ckpt_root, [step], 0.0)
        except TrainingDiverged:
            return "stopped"
        return "went on"

    steps = {
        "all_sum": lambda: all_sum(torch.tensor([rank + 1.0])).tolist(),
        "Tally.all_sum": lambda: tally(float(rank + 1)).all_sum().values.tolist(),
        "nan_check": nan_check,
        "dtype_broadcast": lambda: str(training_dtype("auto", torch.device("cpu"))),
    }
    results = {}
    for name, step in steps.items():
        try:
            results[name] = step()
        except RuntimeError as e:
            results[name] = f"RuntimeError: {e}"
    return results


def rank_main(rank: int, port: int, old_way: bool, out: str) -> None:
    """One rank: the process group as the trainer sets it up for a GPU run (or as it used to), then the sums."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")  # no GPU is touched
    import deepspeed

    from trainer.engine import init_distributed

    register_cuda_only_backend()
    if old_way:
        deepspeed.init_distributed(dist_backend=CUDA_ONLY)  # was: dist_backend="nccl" if proc.cuda else "gloo"
    else:
        init_distributed(torch.device("cuda"), gpu_backend=CUDA_ONLY)
    results = trainer_collectives(rank, Path(out) / "checkpoints")
    Path(out, f"rank{rank}.json").write_text(json.dumps({"backend": str(dist.get_backend()), **results}))
    dist.destroy_process_group()


def run_ranks(tmp_path, old_way: bool) -> list[dict]:
    from trainer.engine import free_port

    mp.spawn(rank_main, args=(free_port(), old_way, str(tmp_path)), nprocs=WORLD, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_the_trainers_gpu_process_group_serves_its_cpu_collectives(tmp_path):
    ranks = run_ranks(tmp_path, old_way=False)
    for r in ranks:
        assert r["all_sum"] == [3.0]
        assert r["Tally.all_sum"] == [3.0, 20.0, 0.0, 2.0, 2.0, 4.0, 4.0, 2.0, 2.0]
        assert r["nan_check"] == "stopped"
        assert r["dtype_broadcast"] in ("torch.bfloat16", "torch.float32")
        assert r["backend"] == f"cpu:gloo,cuda:{CUDA_ONLY}"
    assert ranks[0]["dtype_broadcast"] == ranks[1]["dtype_broadcast"]  # rank 0's timing decides for both


def test_a_cuda_only_backend_alone_refuses_them(tmp_path):
    """The failure the fix removes, reproduced: the stand-in is faithful to nccl."""
    for r in run_ranks(tmp_path, old_way=True):
        assert r["backend"] == CUDA_ONLY
        for name in ("all_sum", "Tally.all_sum", "nan_check", "dtype_broadcast"):
            assert NO_CPU_BACKEND in r[name], (name, r[name])
