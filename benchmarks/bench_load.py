"""Peak host memory (RSS) of loading a target: staged in host RAM then moved (`from_pretrained` + `.to(device)`)
against straight to the device (`device_map`, what `load_target` does off the CPU; on the CPU it loads staged).

Each way runs in its own fresh Python process (peak RSS never goes down inside a process), in turn, `--repeats`
times; each prints its RSS after importing torch and transformers, its peak after loading and reading every weight
once (a checkpoint's pages mapped lazily count only once read), and the difference (what loading the model cost).
On a CPU the device is the host, so neither way can avoid holding the model in host RAM; on a GPU the staged way
holds it there whole first and the direct one does not.

    python benchmarks/bench_load.py                      # the embedded default, float32, on cpu
    python benchmarks/bench_load.py --dtype bfloat16 --device cuda
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def load_once(way: str, target: str, dtype: str, device: str) -> dict:
    """In this process: import, then load the target one way; the RSS figures (MiB)."""
    import torch
    import transformers  # noqa: F401 - imported before the baseline, as loading needs it

    from flashdraft.target.load import resolve_reachable

    path = resolve_reachable(target)  # the embedded default is converted once, before any figure is taken
    torch_dtype = getattr(torch, dtype)
    baseline = rss_mib()
    if way == "staged":
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa")
        model.to(device).eval().requires_grad_(False)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, attn_implementation="sdpa", device_map={"": torch.device(device)}
        )
    params = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    with torch.no_grad():  # touch every weight: pages a checkpoint maps in lazily count once they are read
        sum(float(p.float().sum()) for p in model.parameters())
    return {
        "way": way,
        "baseline_mib": baseline,
        "peak_mib": peak_rss_mib(),
        "after_mib": rss_mib(),
        "loading_peak_mib": peak_rss_mib() - baseline,
        "weights_mib": params,
        "device": str(next(model.parameters()).device),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=["staged", "direct"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(load_once(args.child, args.target, args.dtype, args.device)))
        return
    common = ["--target", args.target, "--dtype", args.dtype, "--device", args.device]
    subprocess.run([sys.executable, __file__, "--child", "direct", *common], check=True, capture_output=True)  # warm
    runs = {"staged": [], "direct": []}
    for _ in range(args.repeats):
        for way in runs:
            out = subprocess.run([sys.executable, __file__, "--child", way, *common], check=True, capture_output=True)
            runs[way].append(json.loads(out.stdout.decode().strip().splitlines()[-1]))
    print(f"{args.target} {args.dtype} on {args.device}, {args.repeats} fresh processes each (MiB)")
    print("way     | RSS after imports | peak RSS | RSS after load | loading's peak (peak - imports) | weights")
    for way, rows in runs.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.endswith("_mib")}
        print(
            f"{way:7} | {med['baseline_mib']:17.0f} | {med['peak_mib']:8.0f} | {med['after_mib']:14.0f} | "
            f"{med['loading_peak_mib']:31.0f} | {med['weights_mib']:.0f}"
        )
    staged = statistics.median(r["loading_peak_mib"] for r in runs["staged"])
    direct = statistics.median(r["loading_peak_mib"] for r in runs["direct"])
    print(f"loading's peak: staged {staged:.0f} MiB, direct {direct:.0f} MiB ({direct / staged:.2f}x)")


if __name__ == "__main__":
    main()
