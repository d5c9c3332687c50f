"""Exact verification's reductions: a row's bits do not depend on how many rows share the call, even where the
device's reduce kernel sums a row in an order chosen by the number of rows (CUDA picks its block shape so).

A CPU reduces each row alike whatever the row count, so it cannot show the difference by itself. The tests run
under `RowCountDependentReductions`, an imitation of such a device: above a few rows, a reduction over the last dim
(mean, sum, softmax, log-softmax, logsumexp) sums in another order (sequentially from the last column), as a CUDA
verify of 16 rows takes another block shape than a one-token step. It bites the target's norms as loaded in float32
(the tests show rows that change with the batch, and verify logits that differ from one-token steps') and leaves the
exact ones (`fixed_order_sum`) alone. In bf16 it seldom bites at these widths: the squares of bf16 values are exact
in float32, their sums seldom round, and a last-bit change of the scale seldom survives rounding to bf16 (a
long eval at real widths makes many such draws); bf16 is held to the same invariance all the same."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import GemmaConfig, GemmaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

from flashdraft.target import fixed_order_sum, make_norms_exact, make_verification_exact
from flashdraft.target.exact import T5_RMS_NORMS
from harness.acceptance import GREEDY, accept
from harness.policies import Draft, LookupPolicy
from harness.speculative import speculative_generate
from harness.tree import build_tree, tree_mask
from tests.test_speculative import VOCAB, one_thread, tiny_target  # noqa: F401 (one_thread: autouse fixture)

ARCHS = ("llama", "qwen3")
DTYPES = (torch.float32, torch.bfloat16)


def _reversed_sum(x: torch.Tensor) -> torch.Tensor:
    """The last dim summed one term at a time from its end (kept, size 1): an order no CPU kernel uses."""
    return x.flip(-1).cumsum(-1)[..., -1:]


def _mean(x, keepdim, dtype):
    x = x.to(dtype) if dtype is not None else x
    out = _reversed_sum(x) / x.shape[-1]
    return out if keepdim else out[..., 0]


def _sum(x, keepdim, dtype):
    out = _reversed_sum(x.to(dtype) if dtype is not None else x)
    return out if keepdim else out[..., 0]


def _softmax(x, keepdim, dtype):
    x = x.to(dtype) if dtype is not None else x
    e = (x - x.amax(-1, keepdim=True)).exp()  # the max is exact in any order
    return e / _reversed_sum(e)


def _log_softmax(x, keepdim, dtype):
    x = x.to(dtype) if dtype is not None else x
    shifted = x - x.amax(-1, keepdim=True)
    return shifted - _reversed_sum(shifted.exp()).log()


def _logsumexp(x, keepdim, dtype):
    m = x.amax(-1, keepdim=True)
    out = m + _reversed_sum((x - m).exp()).log()
    return out if keepdim else out[..., 0]


REORDERED = {
    torch.Tensor.mean: _mean,
    torch.mean: _mean,
    torch.Tensor.sum: _sum,
    torch.sum: _sum,
    torch.Tensor.softmax: _softmax,
    torch.softmax: _softmax,
    F.softmax: _softmax,
    torch.Tensor.log_softmax: _log_softmax,
    torch.log_softmax: _log_softmax,
    F.log_softmax: _log_softmax,
    torch.Tensor.logsumexp: _logsumexp,
    torch.logsumexp: _logsumexp,
}


def _last_dim(x: torch.Tensor, args, kwargs) -> bool:
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if isinstance(dim, (list, tuple)):
        dim = dim[0] if len(dim) == 1 else None
    return isinstance(dim, int) and x.ndim > 0 and dim % x.ndim == x.ndim - 1


class RowCountDependentReductions(TorchFunctionMode):
    """Every reduction over the last dim of a float tensor is counted (`calls`, by name); one over more than `rows`
    rows sums in another order than the device's own (`_reversed_sum`), as a CUDA reduce does once the row count
    changes its block shape."""

    def __init__(self, rows: int = 4):
        super().__init__()
        self.rows, self.calls = rows, Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if func in REORDERED and isinstance(x, torch.Tensor) and x.is_floating_point() and _last_dim(x, args, kwargs):
            self.calls[func.__name__] += 1
            if x.numel() // max(x.shape[-1], 1) > self.rows:
                return REORDERED[func](x, kwargs.get("keepdim", False), kwargs.get("dtype"))
        elif func in (F.rms_norm, F.layer_norm, F.group_norm):
            self.calls[func.__name__] += 1  # fused norms: counted, not reordered (none of ours calls them)
        return func(*args, **kwargs)


def _rows_alone_and_together(op, x: torch.Tensor) -> tuple[int, int]:
    """(rows whose output in a call over the first n rows of `x`, n = 1..len, differs from its output alone;
    rows compared). `x` [n, ...]: the rows of a call lie along dim 0."""
    alone = [op(x[i : i + 1])[0] for i in range(x.shape[0])]
    differ = compared = 0
    for n in range(1, x.shape[0] + 1):
        out = op(x[:n])
        differ += sum(not torch.equal(out[i], alone[i]) for i in range(n))
        compared += n
    return differ, compared


def test_the_fixed_order_sum_sums_and_keeps_a_rows_bits_whatever_the_rows():
    g = torch.Generator().manual_seed(0)
    ints = torch.randint(-50, 50, (7, 37), generator=g).float()  # small integers: every order sums them exactly
    assert torch.equal(fixed_order_sum(ints), ints.sum(-1, keepdim=True))
    assert fixed_order_sum(torch.ones(3, 1)).shape == (3, 1)
    for width in (1, 5, 64, 576, 1024):
        x = torch.randn(16, width, generator=g) * 2.0 ** torch.randint(-20, 20, (16, width), generator=g)
        with RowCountDependentReductions() as imitation:
            assert _rows_alone_and_together(fixed_order_sum, x) == (0, 136), width
        assert not imitation.calls  # elementwise adds only: nothing for the device's reduce to reorder
        assert torch.allclose(fixed_order_sum(x.double()), x.double().sum(-1, keepdim=True), rtol=1e-12)


def _norm(cls, width: int, dtype):
    norm = cls(width, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(width, generator=torch.Generator().manual_seed(1)))
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen3RMSNorm, Qwen3MoeRMSNorm])
def test_each_exact_norm_gives_a_row_the_same_bits_in_a_batch_of_1_to_16(cls, dtype):
    """Hidden-state norms ([rows, 1, D]) and Qwen3's per-head q/k norms ([rows, 1, heads, head_dim]), D not a power
    of two among them. Under the imitation the norms as loaded give rows that change with the batch (in float32; a
    bf16 output rounds most such differences away, which the whole-model test shows surviving); the exact ones give
    every row the bits it gets alone, with or without it, and the values of the norm as loaded."""
    assert cls.__name__ in T5_RMS_NORMS
    g = torch.Generator().manual_seed(2)
    for shape in ((16, 1, 96), (16, 1, 4, 32), (16, 1, 576)):
        x = (torch.randn(*shape, generator=g) * 3).to(dtype)
        loaded, exact = _norm(cls, shape[-1], dtype), _norm(cls, shape[-1], dtype)
        assert make_norms_exact(exact) == 1
        with RowCountDependentReductions():
            differ, compared = _rows_alone_and_together(loaded, x)
            if dtype == torch.float32:  # bf16 rounds most last-bit differences away (the model test shows them)
                assert differ > 0, (shape, "the imitation must bite the norm as loaded")
            assert _rows_alone_and_together(exact, x) == (0, compared), shape
        assert _rows_alone_and_together(exact, x) == (0, compared), shape
        tolerance = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(exact(x), loaded(x), **tolerance)


def _verify_and_steps(target, ids: torch.Tensor, start: int, rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of a `rows`-token forward over a cache of ids[:start], those of `rows` one-token forwards)."""
    out = target(ids[:, :start], use_cache=True)
    block = target(ids[:, start : start + rows], past_key_values=out.past_key_values, use_cache=True).logits[0]
    out.past_key_values.crop(-rows)
    steps = [
        target(ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True).logits[0, -1]
        for t in range(start, start + rows)
    ]
    return block, torch.stack(steps)


def _norms_as_loaded(model):
    """Undo `make_norms_exact` alone: the target as exact mode made it before its norms were."""
    for module in model.modules():
        if type(module).__name__ in T5_RMS_NORMS:
            vars(module).pop("forward", None)
    return model


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_a_16_token_verify_gives_the_logits_of_16_steps_under_a_row_count_dependent_reduce(arch, dtype):
    """Tiny Llama and Qwen3 targets made exact, under the imitation: a 16-token verify over a cache equals 16
    one-token forwards bit for bit; with the norms left as loaded (exact GEMMs and attention only), in float32, it
    does not at any context length tried."""
    ids = torch.randint(0, VOCAB - 2, (1, 80), generator=torch.Generator().manual_seed(3))
    exact = make_verification_exact(tiny_target(arch).to(dtype), rows=16)
    gemms_only = _norms_as_loaded(make_verification_exact(tiny_target(arch).to(dtype), rows=16))
    with RowCountDependentReductions() as imitation:
        for start in (30, 47, 64):
            assert torch.equal(*_verify_and_steps(exact, ids, start)), start
        assert not imitation.calls  # an exact forward leaves nothing for the device's reduce to reorder
        same = [torch.equal(*_verify_and_steps(gemms_only, ids, start)) for start in (30, 47, 64)]
        assert imitation.calls["mean"] > 0
    if dtype == torch.float32:  # at these widths bf16 rounds the reordered sums' last bits away (see the module)
        assert not any(same), "the imitation must bite the target whose norms are as loaded"


def test_the_greedy_exact_path_reduces_target_logits_only_by_argmax():
    """Under the imitation, speculative decoding on the exact target (lookup drafts of up to 8 tokens, verified in
    one forward) reduces no float tensor but by argmax (exact in any order) and commits plain decoding's tokens;
    so does the greedy walk of a tree over 16 rows of logits."""
    target = make_verification_exact(tiny_target("qwen3"), rows=16)
    prompt = torch.randint(0, VOCAB - 2, (12,), generator=torch.Generator().manual_seed(4)).repeat(3)
    plain = speculative_generate(target, prompt, max_new_tokens=40).tokens
    tree = build_tree(torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(5)), size=15, branching=3)
    tokens = torch.cat([prompt[:1], tree.tokens])[None]
    draft = Draft(tokens, torch.tensor([[0, *tree.depths]]), "tree", tree=tree, mask=tree_mask(tree, 0))
    with RowCountDependentReductions() as imitation:
        lookup = speculative_generate(target, prompt, LookupPolicy(ngram=2, num_tokens=8), max_new_tokens=40)
        accept(draft, torch.randn(16, VOCAB), GREEDY)
    assert lookup.tokens == plain and max(lookup.verified_drafts) > 4
    assert not imitation.calls


def test_a_model_with_another_norm_is_refused_by_class_before_anything_changes():
    """Gemma's RMSNorm (x * (1 + weight), in float32) is not T5's: made exact as is, it would keep a row-count
    dependent mean; `make_verification_exact` names it and leaves the model as it was."""
    config = GemmaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    model = GemmaForCausalLM(config).eval()
    with pytest.raises(ValueError, match=r"model\.layers\.0\.input_layernorm \(GemmaRMSNorm\)"):
        make_verification_exact(model)
    assert not any("forward" in vars(m) for m in model.modules())
    llama = tiny_target("llama", layers=1)
    llama.model.norm = torch.nn.LayerNorm(llama.config.hidden_size)
    with pytest.raises(ValueError, match=r"model\.norm \(LayerNorm\)"):
        make_verification_exact(llama)
