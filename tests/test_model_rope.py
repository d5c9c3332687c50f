"""The drafter's rotary frequencies stay float32 whatever dtype it is loaded or served in: a bf16 `inv_freq` turns
position p by p times its rounding error, so a drafter trained with float32 angles would be served other ones."""

import torch
from transformers import LlamaConfig
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from flashdraft.model import DFlashDrafter
from flashdraft.spec import DraftSpec

POSITIONS = torch.arange(4096)[None]


def tiny_drafter() -> DFlashDrafter:
    torch.manual_seed(0)
    target = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
    )
    return DFlashDrafter(DraftSpec([1, 3], 63, 8, 2).draft_config(target)).eval()


def test_bf16_loaded_drafter_keeps_float32_rotary_angles(tmp_path):
    fp32 = tiny_drafter()
    fp32.save_pretrained(tmp_path / "drafter")
    bf16 = DFlashDrafter.from_pretrained(tmp_path / "drafter", dtype=torch.bfloat16)
    assert next(bf16.parameters()).dtype == torch.bfloat16
    assert bf16.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(bf16.rotary_emb.inv_freq, fp32.rotary_emb.inv_freq)
    x16, x32 = torch.zeros(1, 1, 64, dtype=torch.bfloat16), torch.zeros(1, 1, 64)
    for served, trained in zip(bf16.rotary_emb(x16, POSITIONS), fp32.rotary_emb(x32, POSITIONS), strict=True):
        assert served.dtype == torch.bfloat16
        assert torch.equal(served, trained.to(torch.bfloat16))  # the float32 angles, rounded once at the end
    for cast in (lambda m: m.to(dtype=torch.bfloat16), lambda m: m.half(), lambda m: m.bfloat16().float()):
        assert cast(tiny_drafter()).rotary_emb.inv_freq.dtype == torch.float32


def test_a_plain_bf16_rotary_embedding_is_off_where_ours_is_not():
    """The hazard the float32 buffers remove, measured: Qwen3's own rotary embedding cast to bf16 turns late
    positions by whole radians (cos off by more than 0.5), ours stays within bf16 rounding of the float32 angles."""
    drafter = tiny_drafter()
    reference = drafter.rotary_emb(torch.zeros(1, 1, 64), POSITIONS)[0]
    plain = Qwen3RotaryEmbedding(drafter.config).to(dtype=torch.bfloat16)
    ours = drafter.to(dtype=torch.bfloat16).rotary_emb
    x = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    assert (plain(x, POSITIONS)[0].float() - reference).abs().max() > 0.5
    assert (ours(x, POSITIONS)[0].float() - reference).abs().max() <= 2**-8


def test_bf16_served_drafter_follows_the_float32_one_over_long_contexts():
    """A small served comparison: the same drafter run in bf16 and in float32 on a context spread over 3,200
    positions (RoPE errors grow with the distance between query and key). What the layers add to the block's input
    stays within bf16 noise of float32 with float32 angles, and is several times further off with bf16-rounded ones.
    (bf16- against float32-served tau on the quick eval is the full-size check.)"""
    g = torch.Generator().manual_seed(1)
    noise, ctx = torch.randn(4, 8, 64, generator=g), torch.randn(4, 32, 128, generator=g)
    positions = torch.cat([torch.arange(0, 3200, 100), torch.arange(3200, 3208)]).expand(4, -1)

    def drafter() -> DFlashDrafter:
        model = tiny_drafter()
        model.reset_parameters(std=0.3)  # attention that depends on where the keys are
        return model

    trained = drafter()
    with torch.no_grad():
        residual = trained.norm(noise)
        reference = trained(noise, ctx, positions) - residual

    def error(model) -> float:
        with torch.no_grad():
            added = model(noise.bfloat16(), ctx.bfloat16(), positions).float() - residual
        return ((added - reference).norm() / reference.norm()).item()

    served = drafter().to(dtype=torch.bfloat16)
    rounded = drafter().to(dtype=torch.bfloat16)
    rounded.rotary_emb = Qwen3RotaryEmbedding(rounded.config).to(dtype=torch.bfloat16)
    assert error(served) < 0.03
    assert error(rounded) > 3 * error(served)
