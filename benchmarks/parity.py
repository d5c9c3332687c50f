"""Drafter parity with the reference `dflash` package: save ours, load theirs, compare logits.

Prints the max |logit difference| over random drafters shaped like the embedded default
(SmolLM2-135M: hidden 576, 9/3 heads, 30 target layers) and like Qwen3-8B (one layer, for memory).
"""

import tempfile

import dflash.model as ref_model
import torch
from transformers import AutoConfig, LlamaConfig

from flashdraft.model import DFlashDrafter
from flashdraft.spec import DraftSpec, capture_layer_ids
from flashdraft.target import resolve_target


def compare(target_config, num_layers, ctx_len=64, block=16, seed=0):
    torch.manual_seed(seed)
    spec = DraftSpec(capture_layer_ids(target_config), 0, block_size=block, num_draft_layers=num_layers)
    ours = DFlashDrafter(spec.draft_config(target_config)).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.02 * torch.randn_like(p))
    with tempfile.TemporaryDirectory() as d:
        ours.save_pretrained(d)
        ref = ref_model.DFlashDraftModel.from_pretrained(d, dtype=torch.float32).eval()
    h = target_config.hidden_size
    head = torch.nn.Linear(h, target_config.vocab_size, bias=False)
    ctx = torch.randn(1, ctx_len, len(ours.target_layer_ids) * h)
    noise = torch.randn(1, block, h)
    pos = torch.arange(ctx_len + block)[None]
    with torch.no_grad():
        a = head(ours(noise, ctx, pos))
        b = ref.compute_logits(ref(position_ids=pos, noise_embedding=noise, target_hidden=ctx), head)
    return (a - b).abs().max().item(), a.abs().max().item()


if __name__ == "__main__":
    smol = AutoConfig.from_pretrained(resolve_target("smollm2-135m"))
    diff, scale = compare(smol, 5)
    print(f"smollm2-135m shape, 5 draft layers, block 16: max |dlogit| = {diff:.3e} (max |logit| {scale:.2f})")
    qwen8b = LlamaConfig(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    diff, scale = compare(qwen8b, 1, ctx_len=32)
    print(f"qwen3-8b shape, 1 draft layer, block 16: max |dlogit| = {diff:.3e} (max |logit| {scale:.2f})")
