"""One rank per GPU on one machine: `python -m trainer` on a machine with several visible GPUs starts itself again
under torchrun (`--standalone`, one process per GPU) instead of training on the first GPU alone."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

# set by the launchers that start ranks (torchrun, deepspeed, jobs/slurm_train.sbatch's torchrun per node) and by
# MPI-style ones (mpirun, srun with PMI): this process is one rank already
LAUNCHED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def local_ranks(env: Mapping[str, str], visible_gpus: int, device: str, *, sweep: bool = False) -> int:
    """How many ranks this start should run on this machine: one per visible GPU where there are several, the device
    is CUDA (`train.device` auto or cuda), no launcher started this process (`LAUNCHED_ENV`, or an srun step of several
    tasks) and it is not one job of
    a Hydra sweep (the sweep runs its jobs one after another in this process); 1 otherwise: train right here."""
    if visible_gpus < 2 or str(device).lower() not in ("auto", "cuda") or sweep:
        return 1
    if any(name in env for name in LAUNCHED_ENV) or int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        return 1  # a rank already, or one of an srun step's several tasks
    return visible_gpus


def torchrun_command(nproc: int, args: Sequence[str]) -> list[str]:
    """The command that runs `python -m trainer args` as `nproc` ranks of one machine (rendezvous on loopback)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "trainer",
        *args,
    ]
