"""The audits behind the known train/serve failures of DFlash trainers (issue #48 point 4), each on the real code and
each shown to fail on a planted fault:

(i) a block's labels are the response tokens at the block's own positions: position k of a block anchored at a is
    trained on token a + k; the anchor token is given (the block's first input), never a label;
(ii) the context a block sees is the target features strictly before its anchor (kv < a) and nothing of other
    blocks: the dense mask says so, the drafter's output does not move when later context changes, and the
    FlexAttention forward on CPU equals the dense one;
(iii) the layer ids captured are the ids the reference reads, with the +1 offset of `hidden_states` (index 0 is the
    embeddings), for Qwen3 and Llama, and the exported config hands the reference the same ids;
(iv) the thinking mode a drafter was trained on is in its config.json (`flashdraft_trained_thinking`), and the
    harness warns when it evaluates another.
"""

import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flashdraft.model import DFlashDrafter
from flashdraft.model import extract_context_feature as our_extract
from flashdraft.spec import TRAINED_THINKING_KEY, DraftSpec
from flashdraft.target import frozen_head_from_model, load_config
from harness.drafter import thinking_warning
from pipeline.capture import capture
from pipeline.decode import regenerate
from tests.test_speculative import one_thread, tiny_target  # noqa: F401 (one_thread: autouse fixture)
from tests.test_trainer_fixtures import tiny_store
from tests.test_trainer_fixtures import tiny_target as tiny_target_dir
from trainer import batch as batch_module
from trainer.anchors import valid_anchor_positions
from trainer.batch import collate
from trainer.data import TrainingData
from trainer.drafter import trained_thinking
from trainer.masks import dense_block_mask, flex_block_mask
from trainer.objective import attention_mask, draft_hidden

B, MASK = 4, 63

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def sequences(seed: int = 0, n: int = 3):
    """Stored sequences with a prompt (loss_mask False) and a response, and each one's valid anchors."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        s, p = int(rng.integers(14, 22)), int(rng.integers(3, 6))
        mask = np.zeros(s, bool)
        mask[p:] = True
        seq = SimpleNamespace(
            seq_id=f"s{i}",
            input_ids=rng.integers(0, 60, s).astype(np.int64),
            loss_mask=mask,
            features=torch.randn(s, 2 * 16),
        )
        out.append((seq, valid_anchor_positions(mask, B)))
    return out


# --- (i) labels --------------------------------------------------------------------------------


def label_problems(batch, samples, block_size: int) -> list[str]:
    """Where the batch's blocks break the convention: block j of row r anchored at a holds [token a, MASK ...] at
    positions a..a+B-1, and its position k >= 1 carries label token a + k (weight > 0) where a + k is a response
    token, no weight elsewhere; position 0 (the anchor) carries no weight."""
    problems = []
    for r, (seq, anchors) in enumerate(samples):
        for j, a in enumerate(anchors):
            row = slice(j * block_size, (j + 1) * block_size)
            ids, labels = batch.block_ids[r, row].tolist(), batch.labels[r, row].tolist()
            weights = batch.weights[r, row].tolist()
            if ids[0] != seq.input_ids[a] or any(t != MASK for t in ids[1:]):
                problems.append(f"row {r} block {j}: inputs {ids}, not [token {a}, MASK...]")
            if batch.position_ids[r, batch.context_len + row.start].item() != a:
                problems.append(f"row {r} block {j}: first position is not its anchor {a}")
            if weights[0] != 0:
                problems.append(f"row {r} block {j}: the anchor (given) carries weight {weights[0]}")
            for k in range(1, block_size):
                response = a + k < len(seq.input_ids) and seq.loss_mask[a + k]
                if response and (labels[k] != seq.input_ids[a + k] or weights[k] <= 0):
                    problems.append(
                        f"row {r} block {j} position {k}: label {labels[k]}, token a+k {seq.input_ids[a + k]}"
                    )
                if not response and weights[k] != 0:
                    problems.append(f"row {r} block {j} position {k}: weight on a non-response token")
    return problems


def test_a_blocks_labels_are_the_tokens_at_its_own_positions(monkeypatch):
    samples = sequences()
    assert all(seq.loss_mask[a + 1] for seq, anchors in samples for a in anchors)  # an anchor precedes a response
    batch = collate(samples, B, MASK, gamma=4.0)
    assert label_problems(batch, samples, B) == []

    original = batch_module.block_labels  # planted: each position learns the token after its own
    monkeypatch.setattr(batch_module, "block_labels", lambda ids, m, a, b, g: original(ids, m, a + 1, b, g))
    assert label_problems(collate(samples, B, MASK, gamma=4.0), samples, B)


# --- (ii) the context mask ---------------------------------------------------------------------


def mask_problems(mask: torch.Tensor, anchors: torch.Tensor, context_len: int, block_size: int) -> list[str]:
    """Where a [b, 1, N*B, S + N*B] mask breaks the rule: block j sees context kv < a_j and its own block only."""
    problems = []
    b, n = anchors.shape
    kv = torch.arange(mask.shape[-1])
    for r in range(b):
        for j in range(n):
            want = (kv < min(int(anchors[r, j]), context_len)) | (
                (kv >= context_len + j * block_size) & (kv < context_len + (j + 1) * block_size)
            )
            for q in range(j * block_size, (j + 1) * block_size):
                if not torch.equal(mask[r, 0, q], want):
                    bad = (mask[r, 0, q] != want).nonzero().flatten().tolist()
                    problems.append(f"row {r} block {j} query {q}: wrong visibility at kv {bad[:4]}")
                    break
    return problems


@pytest.fixture(scope="module")
def drafter_and_head():
    target = tiny_target("qwen3", vocab=64, layers=6, hidden=16)
    config = DraftSpec((1, 3), MASK, B, 2).draft_config(target.config)
    torch.manual_seed(0)
    return DFlashDrafter(config).eval().requires_grad_(False), frozen_head_from_model(target)


def test_a_block_sees_only_the_context_before_its_anchor(drafter_and_head):
    drafter, head = drafter_and_head
    samples = sequences(seed=1)
    batch = collate(samples, B, MASK, gamma=4.0)
    mask = dense_block_mask(batch.anchors, batch.context_len, B)
    assert mask_problems(mask, batch.anchors, batch.context_len, B) == []
    leaky = mask.clone()  # planted: the anchor's own feature visible (kv <= a)
    a = int(batch.anchors[0, 0])
    leaky[0, 0, :B, a] = True
    assert mask_problems(leaky, batch.anchors, batch.context_len, B)

    # what the trainer computes: block 0's outputs do not move when the context at its anchor or later changes,
    # and do when the feature just before its anchor changes
    before = draft_hidden(drafter, head, batch, attention_mask(batch, B, "dense"))
    context = batch.context.clone()
    context[0, a:] += 5.0
    later = replace(batch, context=context)
    after = draft_hidden(drafter, head, later, attention_mask(batch, B, "dense"))
    torch.testing.assert_close(after[0, :B], before[0, :B])
    context = batch.context.clone()
    context[0, a - 1] += 5.0
    earlier = replace(batch, context=context)
    moved = draft_hidden(drafter, head, earlier, attention_mask(batch, B, "dense"))
    assert (moved[0, :B] - before[0, :B]).abs().max() > 1e-3

    # the FlexAttention forward (GPU training's kernel), run on CPU, equals the dense one
    flex = flex_block_mask(batch.anchors, batch.context_len, B)
    torch.testing.assert_close(draft_hidden(drafter, head, batch, flex), before, atol=1e-5, rtol=1e-5)


# --- (iii) layer ids ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_captured_layers_are_the_ones_the_reference_reads(arch, tmp_path):
    ref = pytest.importorskip("dflash.model")
    target = tiny_target(arch, vocab=64, layers=8)
    layer_ids = [1, 3, 5]
    prompt = torch.randint(0, 60, (9,)).tolist()
    (generated,) = regenerate(target, [prompt], layer_ids, max_new_tokens=6, stop_ids=[], pad_id=0)
    (prefilled,) = capture(target, [generated.input_ids.tolist()], [generated.loss_mask], layer_ids, pad_id=0)
    with torch.no_grad():
        hidden = target(generated.input_ids[None], output_hidden_states=True).hidden_states
    theirs = ref.extract_context_feature(hidden, layer_ids)[0]
    torch.testing.assert_close(our_extract(hidden, layer_ids)[0], theirs)  # the harness's serving-time features
    for captured in (generated, prefilled):  # the pipeline's decode and prefill paths
        torch.testing.assert_close(captured.features, theirs, atol=1e-4, rtol=1e-4)
        off_by_one = ref.extract_context_feature(hidden, [i - 1 for i in layer_ids])[0]
        assert not torch.allclose(captured.features, off_by_one, atol=1e-2)  # the audit tells the offsets apart

    # the exported config hands the reference the captured ids
    spec = DraftSpec(tuple(layer_ids), 63, block_size=4, num_draft_layers=1)
    DFlashDrafter(spec.draft_config(target.config)).save_pretrained(tmp_path / "drafter")
    assert list(ref.DFlashDraftModel.from_pretrained(tmp_path / "drafter").target_layer_ids) == layer_ids


# --- (iv) thinking provenance ------------------------------------------------------------------


def test_the_trained_thinking_mode_is_recorded_and_the_harness_warns_on_another(tmp_path):
    assert [trained_thinking(m) for m in ([True, True], [False], [True, False, None], [None], [])] == [
        "on",
        "off",
        "mixed",
        None,
        None,
    ]
    on = SimpleNamespace(**{TRAINED_THINKING_KEY: "on"})
    assert "trained with thinking on" in thinking_warning(on, [False])
    assert "evaluated with thinking off" in thinking_warning(on, [True, False])
    assert thinking_warning(on, [True]) is None and thinking_warning(on, [None]) is None
    assert thinking_warning(SimpleNamespace(**{TRAINED_THINKING_KEY: "mixed"}), [True, False]) is None
    assert thinking_warning(SimpleNamespace(), [False]) is None  # an older drafter: nothing recorded

    # the trainer's record, from the stores' per-sequence modes, goes into the exported config.json and back
    # (the trainer setting it in a real run: tests/test_gate.py, whose Qwen3 gate captures with thinking off)
    target = tiny_target_dir(tmp_path / "target")
    tiny_store(tmp_path / "store", target, n=8, thinking=True)  # every sequence captured with thinking on
    data = TrainingData(
        [str(tmp_path / "store")],
        layer_ids=[1, 3],
        block_size=B,
        num_anchors=4,
        max_length=64,
        mask_token_id=MASK,
        gamma=4.0,
        heldout_fraction=0.2,
    )
    assert len(data.thinking_modes()) == int((~data.heldout).sum()) and trained_thinking(data.thinking_modes()) == "on"
    config = DraftSpec((1, 3), MASK, B, 1).draft_config(load_config(target))
    setattr(config, TRAINED_THINKING_KEY, trained_thinking(data.thinking_modes()))
    DFlashDrafter(config).save_pretrained(tmp_path / "drafter")
    exported = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert exported[TRAINED_THINKING_KEY] == "on"
    reloaded = DFlashDrafter.from_pretrained(tmp_path / "drafter")
    assert "evaluated with thinking off" in thinking_warning(reloaded.config, [False])
    assert thinking_warning(reloaded.config, [True]) is None
