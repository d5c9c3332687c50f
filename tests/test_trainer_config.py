"""The Hydra configs compose into a TrainConfig and a DrafterConfig: train=auto (default: the recipe by device), cpu
and paper profiles, overrides, sweeps, type checks; the training dtype; the device-dependent settings."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import open_dict

from entry import register_configs, typed_config
from flashdraft.config import TrainConfig
from trainer.__main__ import train_config, with_train_recipe
from trainer.settings import resolve_device_settings

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def composed(*overrides, cuda_available: bool = False):
    """The config as the trainer's entry point hands it on: composed, train=auto resolved for a machine with CUDA or
    without, then typed once."""
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
        choice = cfg.hydra.runtime.choices.train
        with open_dict(cfg):
            del cfg["hydra"]
        return typed_config(with_train_recipe(cfg, choice, list(overrides), cuda_available))


def drafter_config(cfg):
    return cfg.drafter


def test_the_default_recipe_on_a_cpu_is_the_cpu_profile_and_follows_the_model(capsys):
    cfg = composed()
    assert "train=auto: no CUDA device -> the cpu recipe" in capsys.readouterr().out
    tc, drafter = train_config(cfg), drafter_config(cfg)
    assert tc.stores == ["runs/smollm2-135m/features"] and tc.drafter_dir == "runs/smollm2-135m/drafter"
    assert tc.target == "smollm2-135m" and (drafter.block_size, drafter.num_layers) == (16, 5)
    assert drafter.layer_ids is None and drafter.intermediate_size is None  # the stores' layers, the target's width
    assert tc.dtype == "float32" and tc.attention == "dense" and tc.wandb.mode == "offline"
    assert tc.compile == "false"
    assert tc == train_config(composed("train=cpu"))


def test_the_default_recipe_on_cuda_is_the_papers_and_overrides_win(capsys):
    gpu = train_config(composed(cuda_available=True))
    assert "train=auto: CUDA available -> the paper recipe" in capsys.readouterr().out
    assert gpu == train_config(composed("train=paper", cuda_available=True)) == train_config(composed("train=paper"))
    assert (gpu.dtype, gpu.attention, gpu.compile, gpu.num_anchors, gpu.max_length) == (
        "bfloat16",
        "flex",
        "auto",
        512,
        3072,
    )
    assert train_config(composed("train.device=cpu", cuda_available=True)).num_anchors == 8  # the CPU recipe
    assert train_config(composed("train.device=cuda")).num_anchors == 512  # where the trainer will train
    for cuda_available, recipe in ((True, "paper"), (False, "cpu")):
        tc = train_config(composed("train.lr=3e-4", "train.num_anchors=16", cuda_available=cuda_available))
        want = train_config(composed(f"train={recipe}", "train.lr=3e-4", "train.num_anchors=16"))
        assert tc == want and (tc.lr, tc.num_anchors) == (3e-4, 16)


@pytest.mark.parametrize("chosen", ["train=cpu", "train=quick", "train=full", "train=paper", "profile=quick"])
def test_a_chosen_recipe_or_profile_is_the_same_on_any_device(chosen):
    assert train_config(composed(chosen, cuda_available=True)) == train_config(composed(chosen))


def test_device_settings_resolve_by_device_and_say_why():
    cpu = resolve_device_settings(TrainConfig(), cuda_available=False)
    gpu = resolve_device_settings(TrainConfig(), cuda_available=True, local_rank=1)
    assert (cpu.device, cpu.attention, cpu.dense_kv_heads, cpu.compile, cpu.dist_backend, cpu.pin_memory) == (
        torch.device("cpu"),
        "dense",
        "grouped",
        False,
        "gloo",
        False,
    )
    assert (gpu.device, gpu.attention, gpu.dense_kv_heads, gpu.compile, gpu.dist_backend, gpu.pin_memory) == (
        torch.device("cuda:1"),
        "flex",
        "expanded",
        True,
        "cpu:gloo,cuda:nccl",
        True,
    )
    line = gpu.describe(torch.bfloat16, "auto: CUDA")
    assert line.startswith("train settings: device=cuda:1 (auto: CUDA is available); dtype=bfloat16 (auto: CUDA)")
    assert "dense_kv_heads=expanded (auto: CUDA, SDPA's memory-efficient kernel" in line
    asked = TrainConfig(device="cpu", attention="flex", dense_kv_heads="expanded", compile="true", dist_backend="mpi")
    told = resolve_device_settings(asked, cuda_available=True)
    assert (told.device.type, told.attention, told.dense_kv_heads, told.compile, told.dist_backend) == (
        "cpu",
        "flex",
        "expanded",
        True,
        "mpi",
    )
    assert told.reasons == {"pin_memory": "auto: CPU"}  # what was asked for needs no reason
    with pytest.raises(ValueError, match="train.dense_kv_heads must be one of"):
        resolve_device_settings(TrainConfig(dense_kv_heads="shared"), cuda_available=False)
    with pytest.raises(ValueError, match="train.pin_memory=true needs CUDA"):
        resolve_device_settings(TrainConfig(pin_memory="true"), cuda_available=False)
    with pytest.raises(ValueError, match="train.device=cuda, but"):
        resolve_device_settings(TrainConfig(device="cuda"), cuda_available=False)


def test_paper_profile_holds_the_recipe_and_knobs_override():
    tc = train_config(composed("train=paper", "model=qwen3-8b"))
    assert (tc.epochs, tc.lr, tc.warmup_ratio, tc.grad_clip, tc.num_anchors, tc.max_length) == (
        6,
        6e-4,
        0.04,
        1.0,
        512,
        3072,
    )
    assert (tc.dtype, tc.zero_stage, tc.attention) == ("bfloat16", 2, "flex")
    assert tc.target == "Qwen/Qwen3-8B"
    cfg = composed(
        "drafter.block_size=8",
        "train.gamma=4",
        "drafter.layer_ids=[1,9,17]",
        "train.stores=[a,b]",
        "train.lr=3e-4",
        "train.compile=false",
    )
    tc, drafter = train_config(cfg), drafter_config(cfg)
    assert (drafter.block_size, tc.gamma, drafter.layer_ids, tc.stores, tc.lr) == (8, 4, [1, 9, 17], ["a", "b"], 3e-4)
    assert tc.compile.lower() == "false"


def test_train_settings_are_checked_against_their_types():
    with pytest.raises(ConfigCompositionException, match="train.max_steps"):
        composed("train.max_steps=many")
    with pytest.raises(ConfigCompositionException, match="train.stores"):
        composed("train.stores=one/path")  # a list, even of one store


def test_sweep_jobs_train_into_their_own_directories():
    tc = train_config(composed("drafter.block_size=8"), sweep_subdir="drafter.block_size=8")
    assert tc.out_dir == "runs/smollm2-135m/train/drafter.block_size=8"
    assert tc.drafter_dir == "runs/smollm2-135m/train/drafter.block_size=8/drafter"


def profile(name: str, data: str | None = None):
    """`make ... PROFILE=name` passes profile=name (and data=heldout for the eval prompts' store)."""
    return composed(f"profile={name}", *([f"data={data}"] if data else []))


@pytest.mark.parametrize("name", ["quick", "full"])
def test_profiles_compose_for_every_stage(name):
    """`make ... PROFILE=name`: the trainer evaluates on the store of the eval's own held-out prompts."""
    run = f"runs/{name}-smollm2-135m"
    cfg = profile(name)
    tc = train_config(cfg)
    assert tc.init == "target" and drafter_config(cfg).block_size == 8 and tc.dtype == "auto"
    assert (tc.num_anchors, tc.lr) == (16, 2e-3)
    assert tc.gamma == {"quick": 1, "full": 2}[name]  # measured per profile (docs/notebook.md, "What we tried")
    assert tc.stores == [f"{run}/features"] and tc.eval_stores == [f"{run}/features-heldout"]
    assert cfg.eval.metrics == f"{run}/train/metrics.jsonl" and cfg.data.split == "train"
    held = profile(name, data="heldout")
    assert held.data.split == "heldout" and list(held.data.sources) == list(held.eval.prompts)
    assert held.data.limit == held.eval.limit and held.data.max_new_tokens == held.eval.max_new_tokens


def test_training_dtype_times_the_cpu_and_a_resumed_run_keeps_its_checkpoints():
    import math

    import torch

    from flashdraft.target import cpu_bf16_gemm_speedup
    from trainer.engine import training_dtype

    cpu = torch.device("cpu")
    speedup = cpu_bf16_gemm_speedup()
    assert math.isfinite(speedup) and speedup > 0 and cpu_bf16_gemm_speedup() == speedup  # timed once a process
    assert training_dtype("auto", cpu) == (torch.bfloat16 if speedup > 1 else torch.float32)
    assert training_dtype("float32", cpu) == torch.float32 and training_dtype("bfloat16", cpu) == torch.bfloat16
    assert training_dtype("auto", torch.device("cuda")) == torch.bfloat16  # on CUDA nothing is timed
    for saved in ("bfloat16", "float32"):
        assert training_dtype("auto", cpu, resumed=saved) == getattr(torch, saved)
        assert training_dtype(saved, cpu, resumed=saved) == getattr(torch, saved)
    with pytest.raises(ValueError, match="train.dtype=float32 cannot resume a run saved in bfloat16"):
        training_dtype("float32", cpu, resumed="bfloat16")


def test_a_checkpoint_that_does_not_record_its_dtype_is_refused_by_name(tmp_path):
    import json

    from trainer.checkpoint import CLIENT_STATE
    from trainer.train import saved_dtype

    for tag, client_state in (("step-00000004", {"global_step": 4}), ("step-00000008", None)):
        (tmp_path / tag).mkdir()
        if client_state is not None:
            (tmp_path / tag / CLIENT_STATE).write_text(json.dumps(client_state))
        with pytest.raises(ValueError, match=f"checkpoint {tmp_path / tag} does not record the dtype"):
            saved_dtype(tmp_path, tag)
    (tmp_path / "step-00000004" / CLIENT_STATE).write_text(json.dumps({"global_step": 4, "dtype": "bfloat16"}))
    assert saved_dtype(tmp_path, "step-00000004") == "bfloat16"
