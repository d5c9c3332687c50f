"""The training mask: dense == FlexAttention, and dense == running every block on its own."""

import warnings
from types import SimpleNamespace as StoredSequence

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from flashdraft.model import DFlashDrafter
from flashdraft.spec import DraftSpec
from trainer.batch import collate
from trainer.masks import dense_block_mask, flex_block_mask

B = 4
H = 64


def tiny_drafter(seed=0):
    target = LlamaConfig(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(seed)
    cfg = DraftSpec([1, 3], 63, block_size=B, num_draft_layers=2).draft_config(target)
    return DFlashDrafter(cfg).float()


def sample_batch(seed=0):
    """Two rows of different lengths and anchor counts: row 1 has padded context and padded blocks."""
    rng = np.random.default_rng(seed)
    rows = []
    for s, anchors in ((19, [0, 3, 7, 15]), (11, [2, 5])):
        seq = StoredSequence(
            seq_id=f"s{s}", input_ids=rng.integers(0, 60, s), loss_mask=np.ones(s, bool), features=torch.randn(s, 2 * H)
        )
        rows.append((seq, np.array(anchors)))
    return collate(rows, B, 63, 7.0)


def test_mask_visibility_by_hand():
    anchors = torch.tensor([[2, 5], [3, 0]])  # row 1, block 1 is padding
    m = dense_block_mask(anchors, context_len=8, block_size=2)[:, 0]
    assert m.shape == (2, 4, 12)
    # row 0, block 0 (queries 0,1): context 0..1, own block at kv 8,9
    assert m[0, 0].nonzero().flatten().tolist() == [0, 1, 8, 9]
    assert m[0, 3].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 10, 11]
    assert m[1, 1].nonzero().flatten().tolist() == [0, 1, 2, 8, 9]
    assert m[1, 2].nonzero().flatten().tolist() == [10, 11]  # padded block: itself only
    assert m.any(-1).all()


def test_dense_matches_per_block_reference_with_gradients():
    drafter, batch = tiny_drafter(), sample_batch()
    embed = torch.nn.Embedding(64, H)
    noise = embed(batch.block_ids).detach()
    probe = torch.randn(batch.block_ids.shape + (H,))
    real = batch.weights.view(*batch.anchors.shape, B).sum(-1) > 0  # [b, N]: not padding
    assert not real.all()
    real_q = real.repeat_interleave(B, dim=1)

    out = drafter(
        noise, batch.context, batch.position_ids, attention_mask=dense_block_mask(batch.anchors, batch.context_len, B)
    )
    assert torch.isfinite(out).all()
    (out * probe * real_q[..., None]).sum().backward()
    dense_grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()

    ref = torch.zeros_like(out)
    total = 0
    for r in range(out.shape[0]):
        for j in range(batch.anchors.shape[1]):
            if not real[r, j]:
                continue
            a = int(batch.anchors[r, j])
            pos = torch.cat([torch.arange(a), a + torch.arange(B)])[None]
            o = drafter(noise[r : r + 1, j * B : (j + 1) * B], batch.context[r : r + 1, :a], pos)
            ref[r, j * B : (j + 1) * B] = o[0].detach()
            total = total + (o * probe[r : r + 1, j * B : (j + 1) * B]).sum()
    total.backward()
    torch.testing.assert_close(out[real_q], ref[real_q], atol=1e-5, rtol=1e-4)
    for n, p in drafter.named_parameters():
        torch.testing.assert_close(dense_grads[n], p.grad, atol=1e-5, rtol=1e-4, msg=f"gradient of {n}")


def test_flex_block_mask_matches_dense_forward():
    drafter, batch = tiny_drafter(1), sample_batch(1)
    noise = torch.randn(batch.block_ids.shape + (H,))
    dense = drafter(
        noise, batch.context, batch.position_ids, attention_mask=dense_block_mask(batch.anchors, batch.context_len, B)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            flex = drafter(
                noise,
                batch.context,
                batch.position_ids,
                attention_mask=flex_block_mask(batch.anchors, batch.context_len, B),
            )
    torch.testing.assert_close(flex, dense.detach(), atol=1e-5, rtol=1e-4)


def test_the_gpu_attention_forms_forced_on_a_cpu_match_the_dense_reference():
    """What a GPU run takes where the settings say auto, forced on a CPU, against the dense grouped call every earlier
    result came from: dense with key/value heads expanded (the form SDPA's memory-efficient kernel takes; gradients
    too), and FlexAttention through the compiled kernel with its block mask made by the compiled
    create_block_mask, forward only (FlexAttention has no backward on a CPU). Inductor's vectorised CPU code for
    the mask function does not compile (torch 2.13: a VecMask type mismatch), so here the mask compiles scalar
    (cpp.simdlen=1); on a GPU it is Triton code."""
    import torch._inductor.config

    from trainer.objective import attention_mask

    drafter, batch = tiny_drafter(2), sample_batch(2)
    noise = torch.randn(batch.block_ids.shape + (H,))
    dense = attention_mask(batch, B, "dense")
    grads = {}
    for kv_heads in ("grouped", "expanded"):
        drafter.set_attention_kernels(dense_kv_heads=kv_heads)
        drafter.zero_grad()
        out = drafter(noise, batch.context, batch.position_ids, attention_mask=dense)
        out.square().sum().backward()
        grads[kv_heads] = (out.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()})
    (ref, ref_grads), (expanded, expanded_grads) = grads["grouped"], grads["expanded"]
    torch.testing.assert_close(expanded, ref, atol=1e-6, rtol=1e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(expanded_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)

    drafter.set_attention_kernels(flex_kernel="compiled")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        with torch._inductor.config.patch({"cpp.simdlen": 1}):
            compiled_mask = attention_mask(batch, B, "flex", compile_mask=True)
        eager_mask = attention_mask(batch, B, "flex", compile_mask=False)
        assert torch.equal(compiled_mask.to_dense(), eager_mask.to_dense())
        flex = drafter(noise, batch.context, batch.position_ids, attention_mask=compiled_mask)
    torch.testing.assert_close(flex, ref, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="dense_kv_heads must be one of"):
        drafter.set_attention_kernels(dense_kv_heads="shared")
