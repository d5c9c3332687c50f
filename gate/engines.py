"""The gate prompts served greedily from the trained drafter in each engine: our harness's loop, the reference
`dflash` package's loop and llama.cpp's `llama-speculative-simple`; each gives a Leg (its rounds, drafts, outputs)."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from flashdraft.config import Config
from gate.config import GateRefused
from gate.leg import Leg


def load_serving_target(cfg: Config):
    from flashdraft.target import load_target
    from harness.__main__ import resolve_device  # the harness's reading of `device`, as `make eval` serves

    device = resolve_device(cfg.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(cfg.model.dtype)
    if dtype is None:
        raise GateRefused(f"the gate serves in float32 or bfloat16, got model.dtype={cfg.model.dtype}")
    return load_target(cfg.model.target, dtype=dtype, device=device, trust_remote_code=cfg.trust_remote_code)


class RecordingProposer:
    """A proposer that keeps each call's greedy drafts (the harness leg's rounds, for the report)."""

    def __init__(self, inner):
        self.inner, self.drafts = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def start(self) -> None:
        self.inner.start()

    def __call__(self, block, context, start):
        logits = self.inner(block, context, start)
        self.drafts.append(logits.argmax(dim=-1).tolist())
        return logits


def serve_harness(target, drafter_dir: Path, prompts, max_new_tokens: int, stop) -> Leg:
    from flashdraft.model import DFlashDrafter
    from flashdraft.target import frozen_head_from_model
    from harness.drafter import DrafterProposer
    from harness.policies import ChainPolicy
    from harness.speculative import speculative_generate

    drafter = DFlashDrafter.from_pretrained(drafter_dir, dtype=target.dtype, device=target.device).eval()
    proposer = RecordingProposer(DrafterProposer(drafter, frozen_head_from_model(target)))
    leg, t0 = Leg("harness"), time.perf_counter()
    for prompt in prompts:
        proposer.drafts = []
        out = speculative_generate(
            target, prompt, ChainPolicy(proposer), max_new_tokens=max_new_tokens, stop_token_ids=stop
        )
        leg.rounds.append(list(out.acceptance_lengths))
        leg.drafts.append(list(proposer.drafts))
        leg.outputs.append(list(out.tokens))
    leg.seconds = time.perf_counter() - t0
    return leg


def serve_reference(target, drafter_dir: Path, prompts, max_new_tokens: int, stop) -> Leg:
    import dflash.model as ref

    drafter = ref.DFlashDraftModel.from_pretrained(str(drafter_dir), dtype=target.dtype).to(target.device).eval()
    drafts: list = []
    compute_logits = drafter.compute_logits

    def recording(hidden, head):
        logits = compute_logits(hidden, head)
        drafts.append(logits.argmax(dim=-1)[0].tolist())
        return logits

    drafter.compute_logits = recording
    saved_clock = ref._cuda_time
    if target.device.type != "cuda":
        ref._cuda_time = time.perf_counter  # the package's clock synchronises CUDA
    leg, t0 = Leg("reference"), time.perf_counter()
    try:
        for prompt in prompts:
            drafts.clear()
            ids = torch.tensor([prompt], dtype=torch.long, device=target.device)
            out = ref.dflash_generate(drafter, target, ids, max_new_tokens, list(stop) or None, return_stats=True)
            leg.rounds.append([int(n) for n in out.acceptance_lengths])
            leg.drafts.append(list(drafts))
            leg.outputs.append(out.output_ids[0, len(prompt) :].tolist())
    finally:
        ref._cuda_time = saved_clock
    leg.seconds = time.perf_counter() - t0
    return leg


def llamacpp_leg(logs: list[list[dict]], max_new_tokens: int, stop, seconds: float = 0.0) -> Leg:
    """The Leg of llama.cpp's rounds (`harness.llamacpp.spec_rounds` of each sequence's debug log): each round's
    drafts and committed tokens, up to a stop token (`harness.llamacpp.cut_at_stop`) and the gate's token budget. The
    budget cuts as the harness's loop does (its last round commits what is left): llama.cpp's loop stops only once
    past `-n` tokens. Its first round drafts from the prompt's last token (first_anchor -1) and commits the first
    generated token, which the harness and the reference take from the prefill: one round more, its rounds one token
    later."""
    from harness.llamacpp import cut_at_stop

    leg = Leg("llamacpp", first_anchor=-1, seconds=seconds)
    for log in logs:
        rounds, drafts, output = [], [], []
        for r in cut_at_stop(log, stop):
            take = r["committed"][: max_new_tokens - len(output)]
            if not take:
                break
            rounds.append(len(take))
            drafts.append(r["drafts"])
            output += take
        leg.rounds.append(rounds)
        leg.drafts.append(drafts)
        leg.outputs.append(output)
    return leg


def llamacpp_settings(prompt, max_new_tokens: int, block: int):
    """llama-speculative-simple's settings for one gate prompt (`harness.llamacpp.run_speculative`'s `args`)."""
    import argparse

    return argparse.Namespace(
        max_new_tokens=max_new_tokens,
        threads=max(1, torch.get_num_threads()),
        ctx_size=max(2048, len(prompt) + max_new_tokens + 2 * block),
        prompt_batch=max(256, (len(prompt) + 16 + 63) // 64 * 64),  # the whole prompt in one batch
        flash_attn="on",
        draft_n_max=block - 1,
        rounds_log=True,
    )


def serve_llamacpp(
    target, drafter_dir: Path, prompts, max_new_tokens: int, stop, *, tokenizer, target_name: str, gguf_dir: Path
) -> Leg:
    """The prompts greedily through llama.cpp's `llama-speculative-simple --spec-type draft-dflash` with the served
    drafter and the target as f32 GGUF (`harness.llamacpp.export_gguf`, llama.cpp's own converter): each prompt's
    token ids as text (checked to tokenize back to them, here and in llama.cpp's `encoded N tokens`), its rounds,
    drafts and committed tokens from the debug log (`harness.llamacpp.run_speculative` with `rounds_log`)."""
    from harness import llamacpp

    gguf = llamacpp.export_gguf(drafter_dir, target_name, gguf_dir)  # `target` is served in torch: its name converts
    block = json.loads((Path(drafter_dir) / "config.json").read_text()).get("block_size", 16)
    tools = {"llama-speculative-simple": llamacpp.tool_path("llama-speculative-simple")}
    logs, t0 = [], time.perf_counter()
    for s, prompt in enumerate(prompts):
        text = tokenizer.decode(prompt, skip_special_tokens=False)
        if tokenizer(text, add_special_tokens=False).input_ids != list(prompt):
            raise RuntimeError(
                f"gate prompt {s} does not tokenize back to its ids from its text: llama.cpp cannot take it"
            )
        args = llamacpp_settings(prompt, max_new_tokens, block)
        with tempfile.TemporaryDirectory(prefix="gate-llamacpp-") as tmp:
            prompt_file = llamacpp.write_prompt_file(Path(tmp) / "prompt.txt", text)
            run = llamacpp.run_speculative(tools, gguf, prompt_file, "draft-dflash", args, text)
        if run.get("prompt_tokens") != len(prompt):
            raise RuntimeError(
                f"llama.cpp encoded gate prompt {s} as {run.get('prompt_tokens')} tokens, the gate's has {len(prompt)}"
            )
        logs.append(run["round_log"])
    return llamacpp_leg(logs, max_new_tokens, stop, time.perf_counter() - t0)


SERVERS = {"harness": serve_harness, "reference": serve_reference, "llamacpp": serve_llamacpp}
