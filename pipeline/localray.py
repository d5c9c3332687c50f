"""Ray local mode on loopback only, and none of its processes left running after the driver, even a SIGKILLed one.

On Linux Ray takes the machine's network address as the node address: gcs_server, raylet, the workers and the
agents then listen on every interface (Ray's gRPC servers bind to 0.0.0.0 unless the node address is 127.0.0.1)
and anyone who reaches the machine can submit code. Ray's single-machine switch (the one it uses on macOS and
Windows) makes the node address 127.0.0.1, and then every server, agent and metrics port binds to loopback.

A plain `ray.init()` joins the cluster in RAY_ADDRESS or the one a `ray start` recorded in Ray's temp folder
(`ray_current_cluster`, left behind by any earlier job), and then refuses `num_cpus`. The local instance is
asked for by `address="local"`: it is started whatever the machine remembers, and says what it ignored.

After a SIGKILLed driver, gcs_server and raylet die with it, but the dashboard and runtime-env agents first wait
out a 60 s error report to the dead GCS: a minute or more, still listening. So a small watchdog process notes the
driver's descendants while it runs and stops those still there when the driver's pipe to it closes: at the end
of a clean run (after `ray.shutdown()`) and at a crash alike. (A process's environment cannot mark it: Ray's
Python processes overwrite theirs with their process title.)
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from contextlib import contextmanager

import psutil

LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": node address 127.0.0.1 (read by every Ray process)
WATCH_INTERVAL_S = 0.5
RAY_ADDRESS = "RAY_ADDRESS"  # the cluster a plain ray.init() joins


def stop_processes(procs: list[psutil.Process], grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL what is still there after `grace_s` (psutil skips a pid that was reused)."""
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


def _watchdog(driver_pid: int) -> None:
    """Run as `python pipeline/localray.py DRIVER_PID` with the driver's pipe as stdin: note the driver's
    descendants until the pipe closes, then stop those still running."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the driver must not skip the clean-up
    driver, seen = psutil.Process(driver_pid), {}
    while True:
        try:
            for p in driver.children(recursive=True):
                if p.pid != os.getpid():
                    seen.setdefault(p.pid, p)
        except psutil.NoSuchProcess:  # the driver is gone: its pipe reads EOF now
            pass
        ready, _, _ = select.select([sys.stdin], [], [], WATCH_INTERVAL_S)
        if ready and not os.read(sys.stdin.fileno(), 1 << 12):
            break
    stop_processes([p for p in seen.values() if p.is_running()])


def _start_watchdog() -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), str(os.getpid())],  # by path: it needs psutil, not this package
        stdin=subprocess.PIPE,
        start_new_session=True,  # outside the driver's process group: a signal to the group leaves it running
    )


def remembered_clusters() -> list[str]:
    """The clusters a plain `ray.init()` on this machine would join instead of starting its own Ray: RAY_ADDRESS,
    and the address a `ray start` left in Ray's temp folder (`ray_current_cluster`, often of a long-gone job)."""
    from ray._common.utils import get_ray_address_file

    found = []
    if os.environ.get(RAY_ADDRESS):
        found.append(f"RAY_ADDRESS={os.environ[RAY_ADDRESS]}")
    address_file = get_ray_address_file(None)
    try:
        with open(address_file) as f:
            remembered = f.read().strip()
    except OSError:
        remembered = ""
    if remembered:
        found.append(f"{remembered} in {address_file}")
    return found


@contextmanager
def local_ray(**init_kwargs):
    """`ray.init(address="local", **init_kwargs)`: a new local instance on 127.0.0.1, whatever cluster the machine
    remembers (`remembered_clusters`, ignored and said so), stopped (all of it) when the block ends or the driver
    dies. RAY_AUTH_MODE stays as the user set it; unset, it is `disabled` (no token file written to the home folder:
    nothing listens off loopback)."""
    import ray
    from ray._private import ray_constants

    ignored = remembered_clusters()
    print(
        "Ray: a local instance on 127.0.0.1, started for this run"
        + (f" (not joining {' or '.join(ignored)}; cluster=ray joins a cluster)" if ignored else ""),
        flush=True,
    )
    watchdog = _start_watchdog()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    saved_env, saved_switch = os.environ.get(LOOPBACK_SWITCH), ray_constants.ENABLE_RAY_CLUSTER
    saved_address = os.environ.pop(RAY_ADDRESS, None)  # not inherited by the instance's processes either
    os.environ[LOOPBACK_SWITCH] = "0"  # for the processes ray.init starts
    ray_constants.ENABLE_RAY_CLUSTER = False  # this process read the switch when it imported ray
    try:
        try:
            ray.init(address="local", **init_kwargs)  # "local": never RAY_ADDRESS nor ray_current_cluster
        finally:  # the switch is for the instance's processes (started by now), not for a later cluster driver
            ray_constants.ENABLE_RAY_CLUSTER = saved_switch
            if saved_env is None:
                os.environ.pop(LOOPBACK_SWITCH, None)
            else:
                os.environ[LOOPBACK_SWITCH] = saved_env
            if saved_address is not None:
                os.environ[RAY_ADDRESS] = saved_address
        yield
    finally:
        try:
            ray.shutdown()
        finally:
            watchdog.stdin.close()  # the watchdog stops what shutdown left
            watchdog.wait(timeout=30)


if __name__ == "__main__":
    _watchdog(int(sys.argv[1]))
