"""The drafter compiles once a variant: a compiled training step, its no-grad eval and the FlexAttention eval each
take one graph (plus one when the first shapes turn dynamic), and nothing recompiles after that.

Counted with dynamo's own counters on CPU with the `aot_eager` backend (no inductor codegen, no GPU); the CUDA-only
branch of `_flex_attention` is kept out of compiled graphs by `torch.compiler.is_compiling()`, which the source
check below guards (a module global assigned inside a compiled call is a guard that fails on its next call)."""

import ast
import inspect

import torch
import torch._dynamo
from transformers import LlamaConfig

import flashdraft.model
from flashdraft.model import DFlashDrafter
from flashdraft.spec import DraftSpec
from trainer.masks import dense_block_mask, flex_block_mask

BLOCK = 4


def tiny_drafter() -> DFlashDrafter:
    torch.manual_seed(0)
    target = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return DFlashDrafter(DraftSpec([1, 3], 63, BLOCK, 2).draft_config(target))


def step_inputs(rows: int, context: int, anchors: int, mask_kind: str):
    """(noise, context features, position ids, mask) of a training micro-batch of this shape."""
    g = torch.Generator().manual_seed(context * 7 + anchors)
    starts = torch.stack([torch.randperm(context - BLOCK, generator=g)[:anchors].sort().values for _ in range(rows)])
    positions = torch.cat(
        [torch.arange(context).expand(rows, context), (starts[:, :, None] + torch.arange(BLOCK)).reshape(rows, -1)], 1
    )
    make_mask = dense_block_mask if mask_kind == "dense" else flex_block_mask
    return (
        torch.randn(rows, anchors * BLOCK, 32, generator=g),
        torch.randn(rows, context, 64, generator=g),
        positions,
        make_mask(starts, context, BLOCK),
    )


def graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_compiled_drafter_compiles_once_per_variant():
    drafter = tiny_drafter()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(drafter, backend="aot_eager", dynamic=True)
    optimizer = torch.optim.AdamW(drafter.parameters())

    def run(shapes, mask_kind="dense") -> int:
        before = graphs_compiled()
        for rows, context, anchors in shapes:
            noise, ctx, positions, mask = step_inputs(rows, context, anchors, mask_kind)
            out = compiled(noise, ctx, positions, attention_mask=mask)
            if torch.is_grad_enabled():
                out.pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
        return graphs_compiled() - before

    # training: the first shapes compile once, the second once more with the sequence lengths made dynamic, and a
    # third shape (more rows, longer context, fewer anchors) reuses that graph
    assert run([(2, 20, 3), (2, 24, 4), (3, 30, 2)]) == 2
    drafter.eval()
    with torch.no_grad():
        assert run([(2, 20, 3), (3, 30, 2)]) == 1  # eval without grad: one graph (grad mode is a guard)
        assert run([(2, 20, 3), (2, 24, 4)], "flex") == 1  # the BlockMask path: one more
    drafter.train()
    assert run([(2, 28, 3), (4, 20, 3)]) == 0  # back to training: the first graph serves, nothing recompiles
    assert graphs_compiled() == 4 < torch._dynamo.config.recompile_limit


def test_model_assigns_no_module_global():
    """No function of flashdraft/model.py rebinds a module global: inside a compiled forward that is a guard that
    fails on the next call (the compiled flex kernel is cached by functools.cache instead)."""
    tree = ast.parse(inspect.getsource(flashdraft.model))
    assert [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Global)] == []
