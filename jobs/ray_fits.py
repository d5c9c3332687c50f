"""Whether a Ray cluster can hold the capture fleet a job asks for; jobs/ray_submit.sh asks before it submits.

    python jobs/ray_fits.py ADDRESS [Hydra overrides...]     # ADDRESS: the dashboard, e.g. http://head:8265

Ray places an actor only on a node with its CPUs and GPUs free, and a job whose actors no node can hold waits for
ever, printing the autoscaler's "No available node types can fulfill resource requests" line. This exits 1 with the
numbers (nodes, their CPUs and GPUs, what each of cluster.num_actors actors asks) when the cluster's alive nodes
cannot hold them all at once, 0 with one line saying what fits otherwise.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path


def capture_request(overrides: list[str]) -> tuple[int, float, float]:
    """(num_actors, cpus_per_actor, gpus_per_actor) of the composed config, as the pipeline reads them."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's `entry` (run as a script)
    from entry import compose, typed_config

    c = typed_config(compose(overrides)).cluster
    cpus = 1.0 if str(c.cpus_per_actor) == "auto" else float(c.cpus_per_actor)  # auto on a Ray cluster: 1
    return c.num_actors, cpus, c.gpus_per_actor


def actors_that_fit(nodes: list[dict], cpus: float, gpus: float) -> int:
    """How many actors of `cpus` CPUs and `gpus` GPUs the nodes (their total resources) hold at once."""
    need = {"CPU": cpus, "GPU": gpus}
    total = 0
    for node in nodes:
        per_node = [math.floor(node.get(k, 0.0) / v + 1e-9) for k, v in need.items() if v > 0]
        total += min(per_node) if per_node else math.inf
    return total


def describe(nodes: list[dict]) -> str:
    """The nodes grouped by size, e.g. "2 nodes with 1 CPUs and 0 GPUs"."""
    sizes: dict[str, int] = {}
    for node in nodes:
        key = f"{node.get('CPU', 0.0):g} CPUs and {node.get('GPU', 0.0):g} GPUs"
        sizes[key] = sizes.get(key, 0) + 1
    return "; ".join(f"{n} node{'s' * (n != 1)} with {key}" for key, n in sizes.items()) or "no alive node"


def main(argv: list[str]) -> int:
    from ray.util.state import list_nodes

    address, overrides = argv[0], argv[1:]
    actors, cpus, gpus = capture_request(overrides)
    try:
        alive = list_nodes(address=address, filters=[("state", "=", "ALIVE")], detail=True)
    except Exception as e:  # the state API raises its own and the HTTP client's errors; all mean: cannot tell
        print(f"error: cannot read the nodes of the Ray cluster at {address} (RAY_ADDRESS): {e}", file=sys.stderr)
        return 1
    nodes = [n.resources_total for n in alive]
    fit = actors_that_fit(nodes, cpus, gpus)
    asked = f"{actors} capture actors of {cpus:g} CPUs and {gpus:g} GPUs each"
    where = f"the Ray cluster at {address} ({describe(nodes)})"
    if fit >= actors:
        print(f"{where} holds the {asked}")
        return 0
    print(
        f"error: {where} holds {fit} of the {asked} (cluster.num_actors={actors}, cluster.cpus_per_actor={cpus:g}, "
        f"cluster.gpus_per_actor={gpus:g}): the job would wait for ever. Lower NUM_ACTORS or the CPUs and GPUs an "
        'actor takes (ARGS="cluster.cpus_per_actor=... cluster.gpus_per_actor=..."), or add nodes; CHECK_FIT=0 '
        "submits anyway (a cluster that scales up)",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
