"""No path that only a GPU takes: every place the code chooses by device has a CPU test of its GPU side, or a reason
a CPU cannot run it.

The scan (AST, every .py file of the project outside tests/) finds a device choice wherever the code compares with
the word "cuda" (`device.type == "cuda"`, `str(x) in ("auto", "cuda")`), reads `.is_cuda`, or asks
`torch.cuda.is_available()` / `torch.cuda.device_count()`. Each function holding one must be in `GPU_SIDE_TESTS`
(the tests that run its GPU side on a CPU: a setting forced on, the device passed as an argument, the resolution
function called with "cuda") or in `CPU_CANNOT` (why no CPU can). The test fails on a new choice with neither, on an
entry whose test does not exist, and on an entry for a function that no longer chooses by device.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("flashdraft", "pipeline", "trainer", "harness", "gate", "entry", "jobs", "benchmarks", "scripts")

# "path:function" -> the tests ("tests/file.py::test_name") that run its GPU side on a CPU
GPU_SIDE_TESTS: dict[str, list[str]] = {
    "flashdraft/model.py:_flex_attention": [
        "tests/test_masks.py::test_the_gpu_attention_forms_forced_on_a_cpu_match_the_dense_reference"
    ],
    "flashdraft/model.py:_dense_attention": [
        "tests/test_masks.py::test_the_gpu_attention_forms_forced_on_a_cpu_match_the_dense_reference"
    ],
    "trainer/objective.py:attention_mask": [
        "tests/test_masks.py::test_the_gpu_attention_forms_forced_on_a_cpu_match_the_dense_reference"
    ],
    "flashdraft/target/cpu.py:resolve_dtype": ["tests/test_device_branches.py::test_auto_settings_resolve_for_cuda"],
    "pipeline/decode.py:default_overlap": [
        "tests/test_device_branches.py::test_auto_settings_resolve_for_cuda",
        "tests/test_capture_decode.py::test_overlap_and_staged_copies_give_what_the_plain_decode_gives_as_slots_grow_and_shrink",
        "tests/test_capture_decode.py::test_a_store_captured_across_task_boundaries_equals_a_plain_reference_capture",
    ],
    "pipeline/hostcopy.py:default_staged": [
        "tests/test_device_branches.py::test_auto_settings_resolve_for_cuda",
        "tests/test_capture_decode.py::test_overlap_and_staged_copies_give_what_the_plain_decode_gives_as_slots_grow_and_shrink",
    ],
    "pipeline/plan.py:writer_threads": [
        "tests/test_capture_decode.py::test_the_capture_workers_device_settings_resolve_by_device",
        "tests/test_capture_decode.py::test_a_shard_commits_in_its_writing_thread_while_the_decode_goes_on",
    ],
    "trainer/__main__.py:main": [
        "tests/test_trainer_config.py::test_the_default_recipe_on_cuda_is_the_papers_and_overrides_win"
    ],
    "trainer/engine.py:backend_for": [
        "tests/test_trainer_comm.py::test_the_trainers_gpu_process_group_serves_its_cpu_collectives",
        "tests/test_trainer_comm.py::test_a_cuda_only_backend_alone_refuses_them",
    ],
    "trainer/engine.py:training_dtype": [
        "tests/test_trainer_config.py::test_training_dtype_times_the_cpu_and_a_resumed_run_keeps_its_checkpoints"
    ],
    "trainer/launch.py:local_ranks": [
        "tests/test_trainer_launch.py::test_several_gpus_and_no_launcher_start_one_rank_per_gpu"
    ],
    "trainer/settings.py:DeviceSettings.cuda": [
        "tests/test_trainer_config.py::test_device_settings_resolve_by_device_and_say_why",
        "tests/test_trainer_engine.py::test_the_gpu_recipe_trains_at_tiny_size_on_a_cpu",
    ],
    "trainer/settings.py:trains_on_cuda": [
        "tests/test_trainer_config.py::test_device_settings_resolve_by_device_and_say_why"
    ],
    "jobs/gpu_smoke.py:preflight": [
        "tests/test_install.py::test_smoke_preflight_names_an_old_transformers_without_a_wheelhouse",
        "tests/test_install.py::test_smoke_preflight_names_a_missing_compiler",
    ],
}

# "path:function" -> why a CPU cannot run its GPU side (what needs a GPU, and where a GPU run checks it)
GPU_ONLY = "needs a CUDA device"
SMOKE = (
    "the GPU run of jobs/gpu_smoke.sh (and gpu_paper_shapes.py) takes it; tests/test_gpu_paper_shapes.py runs the rest"
)
CPU_CANNOT: dict[str, str] = {
    "pipeline/fleet.py:local_gpus": "counts the GPUs torch sees; what the count decides is tested with counts given "
    "(test_pipeline_gpus.py resolve_actors, test_capture_decode.py cpus_per_actor)",
    "pipeline/hostcopy.py:HostCopy.__init__": "pinned host memory and a CUDA event "
    + GPU_ONLY
    + "; the staged path around them (fresh buffers, copy, wait) runs on a CPU with data.staged_copies=on",
    "pipeline/worker.py:load_capture_target": "device=auto asks torch whether a CUDA device exists; loading the "
    "target on cuda " + GPU_ONLY,
    "pipeline/plan.py:free_gpu_memory": "reads free GPU memory "
    + GPU_ONLY
    + "; the planning from free memory runs on a CPU (test_capture_decode.py, the worker plans from free memory)",
    "trainer/__main__.py:relaunch_per_gpu": "counts the visible GPUs; the rank count it decides is tested with counts "
    "given (test_trainer_launch.py), and torchrun over 2 gloo ranks runs on a CPU (test_torchrun_runs_the_command)",
    "trainer/checkpoint.py:save_checkpoint": "the CUDA RNG state exists only with a CUDA device",
    "trainer/checkpoint.py:load_checkpoint": "the CUDA RNG state exists only with a CUDA device",
    "trainer/train.py:start_process": "torch.cuda.set_device " + GPU_ONLY,
    "harness/__main__.py:resolve_device": "device=auto asks torch whether a CUDA device exists; eval on cuda is "
    + SMOKE,
    "harness/speculative.py:clock": "torch.cuda.synchronize before a clock read " + GPU_ONLY + " (a CPU runs in order)",
    "benchmarks/bench_exact.py:main": "picks cuda where present; --device cpu runs the same measurements",
    "gate/engines.py:serve_reference": "the reference package's CUDA timer " + GPU_ONLY + " (replaced on a CPU)",
    "jobs/gpu_paper_shapes.py:parse_args": "the device default: " + SMOKE,
    "jobs/gpu_paper_shapes.py:sync": "torch.cuda.synchronize " + GPU_ONLY,
    "jobs/gpu_paper_shapes.py:Part.__enter__": "peak GPU memory counters " + GPU_ONLY,
    "jobs/gpu_paper_shapes.py:Part.__exit__": "peak GPU memory counters " + GPU_ONLY,
    "jobs/gpu_paper_shapes.py:budgets": "reads free GPU memory; the planning it feeds (flashdraft.target.budgets."
    "capture_budgets) is tested with free memory given (test_capture_decode.py, the worker plans from free memory)",
    "jobs/gpu_paper_shapes.py:describe": "the GPU's name " + GPU_ONLY,
    "jobs/gpu_smoke.py:check_torch": "a CUDA build that sees a GPU " + GPU_ONLY,
    "jobs/gpu_smoke.py:record_peak_memory": "peak GPU memory counters " + GPU_ONLY,
    "jobs/gpu_smoke.py:device_name": "the GPU's name " + GPU_ONLY,
}


def _is_cuda_word(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and node.value == "cuda":
        return True
    return isinstance(node, ast.Tuple | ast.List | ast.Set) and any(_is_cuda_word(e) for e in node.elts)


def _chooses_by_device(node: ast.AST) -> bool:
    if isinstance(node, ast.Compare):
        return any(_is_cuda_word(x) for x in (node.left, *node.comparators))
    if isinstance(node, ast.Attribute) and node.attr == "is_cuda":
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        f = node.func
        return (
            f.attr in ("is_available", "device_count") and isinstance(f.value, ast.Attribute) and f.value.attr == "cuda"
        )
    return False


class _Scan(ast.NodeVisitor):
    """(function qualname, source of the choice) for each device choice in a module."""

    def __init__(self):
        self.scope: list[str] = []
        self.found: list[tuple[str, str]] = []

    def _enter(self, node) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _enter

    def generic_visit(self, node) -> None:
        if _chooses_by_device(node):
            self.found.append((".".join(self.scope) or "<module>", ast.unparse(node)))
        super().generic_visit(node)


def device_choices() -> dict[str, list[str]]:
    """ "path:function" -> the device choices in it, over the scanned folders."""
    out: dict[str, list[str]] = {}
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            scan = _Scan()
            scan.visit(ast.parse(path.read_text(), str(path)))
            for where, text in scan.found:
                out.setdefault(f"{path.relative_to(ROOT)}:{where}", []).append(text)
    return out


def test_every_device_choice_has_a_cpu_test_of_its_gpu_side_or_a_reason():
    choices = device_choices()
    missing = {k: v for k, v in choices.items() if k not in GPU_SIDE_TESTS and k not in CPU_CANNOT}
    assert not missing, "device choices with neither a CPU test of their GPU side nor a reason:\n" + "\n".join(
        f"  {k}: {v}" for k, v in missing.items()
    )
    stale = sorted((set(GPU_SIDE_TESTS) | set(CPU_CANNOT)) - set(choices))
    assert not stale, f"entries for functions that no longer choose by device: {stale}"
    both = sorted(set(GPU_SIDE_TESTS) & set(CPU_CANNOT))
    assert not both, f"entries both tested and said untestable: {both}"


def test_the_named_tests_exist():
    for where, tests in GPU_SIDE_TESTS.items():
        assert tests, where
        for test in tests:
            path, name = test.split("::")
            source = (ROOT / path).read_text()
            assert re.search(rf"^def {re.escape(name)}\(", source, re.M), f"{where}: {test} not found"


def test_the_scan_finds_each_kind_of_choice():
    """The scan itself, on a module holding each kind (so that an empty inventory cannot pass by finding nothing)."""
    source = """
def a(device):
    return device.type == "cuda"
def b(x):
    return x.is_cuda
def c():
    import torch
    return torch.cuda.is_available() or torch.cuda.device_count()
def d(name):
    return str(name).lower() in ("auto", "cuda")
def e(device):
    return device.type == "cpu"
"""
    scan = _Scan()
    scan.visit(ast.parse(source))
    assert sorted({w for w, _ in scan.found}) == ["a", "b", "c", "d"]


def test_auto_settings_resolve_for_cuda():
    """The small resolvers of `auto` settings give their GPU side when asked for cuda, on a CPU."""
    from flashdraft.target.cpu import resolve_dtype
    from pipeline.decode import default_overlap
    from pipeline.hostcopy import default_staged

    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert default_overlap(torch.device("cuda")) and not default_overlap(torch.device("cpu"))
    assert default_staged("cuda") and not default_staged("cpu")
