"""The drafter as the harness uses it: loaded from its checkpoint (or an untrained one, when allowed) and run as a
proposer, the target's frozen embedding and output head around it. Its geometry (block size, mask token, the target
layers it reads) comes from the drafter alone (`DFlashDrafter.spec`); an untrained one's is made as the trainer makes
a trained one's (`DraftSpec.from_settings`, from the `drafter` settings)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from flashdraft.model import DFlashDrafter
from flashdraft.spec import TRAINED_THINKING_KEY, DraftSpec, capture_layer_ids
from flashdraft.target import choose_mask_token, family_of, mask_token_string, text_config


def load_drafter(path, target, tokenizer, geometry, *, allow_untrained=False, seed=0) -> tuple[DFlashDrafter, bool]:
    """(drafter, untrained): the checkpoint at `path`, checked against the target, or, when allowed and there is
    none, a random one of the `geometry` settings (flashdraft.config.DrafterConfig) reading the layers a capture
    with those settings stores."""
    dtype, device = target.dtype, target.device
    if path and (Path(path) / "config.json").is_file():
        drafter = DFlashDrafter.from_pretrained(path, dtype=dtype, device=device)
        check_drafter_fits(drafter, target, path)
        return drafter, False
    if not allow_untrained:
        raise FileNotFoundError(
            f"no drafter at {path!r} (config.json missing): train one (make train) or pass eval.drafter=PATH; "
            "eval.allow_untrained=true measures an untrained random drafter instead"
        )
    torch.manual_seed(seed)
    mask_token_id = choose_mask_token(tokenizer, target.config.vocab_size, family=family_of(target.config))
    layer_ids = capture_layer_ids(target.config, geometry.num_features, geometry.layer_ids)
    spec = DraftSpec.from_settings(geometry, layer_ids, mask_token_id, mask_token_string(tokenizer, mask_token_id))
    return DFlashDrafter(spec.draft_config(target.config)).to(device=device, dtype=dtype).eval().requires_grad_(
        False
    ), True


def check_drafter_fits(drafter, target, path) -> None:
    tc = text_config(target.config)
    dc = drafter.config
    problems = [
        f"{key} {getattr(dc, key)} != target's {getattr(tc, key)}"
        for key in ("hidden_size", "vocab_size")
        if getattr(dc, key) != getattr(tc, key)
    ]
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < tc.num_hidden_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside the target's {tc.num_hidden_layers} layers")
    if problems:
        raise ValueError(f"drafter {path} does not fit the target: " + "; ".join(problems))


def thinking_warning(drafter_config, modes) -> str | None:
    """A warning where the harness evaluates a thinking mode (`modes`: the enable_thinking values of the eval,
    `harness.evaluate.thinking_modes`, with the chat default resolved to the mode the template renders it in by
    `flashdraft.target.resolved_thinking`; None: a template without thinking, not compared) other than the one the
    drafter's config.json records it was trained in (`flashdraft_trained_thinking`: "on" | "off"; "mixed" or
    unrecorded: nothing to warn of). A drafter accepts well only in the modes it was trained on."""
    trained = getattr(drafter_config, TRAINED_THINKING_KEY, None)
    if trained not in ("on", "off"):
        return None
    others = sorted({"on" if m else "off" for m in modes if m is not None} - {trained})
    if not others:
        return None
    return (
        f"the drafter was trained with thinking {trained} ({TRAINED_THINKING_KEY} in its config.json) and is "
        f"evaluated with thinking {' and '.join(others)}: expect lower acceptance there (train on data.thinking=mixed "
        "to serve both)"
    )


def loop_block_size(asked: int | None, drafter, where: str) -> int:
    """The block the harness loop runs: `asked` (eval.block_size), else the drafter's; refused, naming `where`, above
    the drafter's block (positions it was never trained to draft) or below 1."""
    if asked is None:
        return drafter.block_size
    if not 1 <= asked <= drafter.block_size:
        raise ValueError(
            f"eval.block_size {asked} does not fit {where}, whose block is {drafter.block_size}: give 1 to "
            f"{drafter.block_size}, or null for the drafter's own"
        )
    return asked


class DrafterProposer:
    """Drafts a block with a DFlashDrafter and the target's frozen embedding and output head.

    Proposers are called as `proposer(block [1, B], context [1, c, n*H] | None, start) -> draft
    logits [B-1, V]`, where `context` holds the target features of the tokens verified since the
    last call and `start` is the absolute position of block[0]. `start()` resets per-sequence state.

    `draft_vocab` (token ids, `flashdraft.vocab.frequent_tokens`): the draft is scored over those words only,
    by a copy of their rows of the head, and every other word gets logit -inf (FR-Spec). The target still
    verifies over all words, so the output is unchanged; drafts of the words left out are lost.
    """

    def __init__(self, drafter, head, draft_vocab=None):
        self.drafter, self.head = drafter, head
        self.block_size = drafter.block_size
        self.mask_token_id = drafter.mask_token_id
        self.layer_ids = drafter.target_layer_ids  # features the loop must capture
        self.cache = None
        self.vocab = self.vocab_weight = None
        if draft_vocab is not None:
            weight = head.lm_head.weight
            self.vocab = torch.as_tensor(draft_vocab, dtype=torch.long, device=weight.device)
            words = weight.shape[0]
            if (
                self.vocab.ndim != 1
                or self.vocab.numel() == 0
                or int(self.vocab.min()) < 0
                or int(self.vocab.max()) >= words
            ):
                raise ValueError(
                    f"draft_vocab must be a non-empty 1-D list of token ids below the target's {words} words, "
                    f"got shape {tuple(self.vocab.shape)}"
                )
            self.vocab_weight = weight.detach().index_select(0, self.vocab).contiguous()

    def start(self) -> None:
        self.cache = self.drafter.new_cache()

    def __call__(self, block: torch.Tensor, context: torch.Tensor, start: int) -> torch.Tensor:
        c = context.shape[1]
        if self.cache.length + c != start:
            raise RuntimeError(
                f"drafter cache holds {self.cache.length} + {c} new context tokens, block starts at {start}"
            )
        positions = torch.arange(start - c, start + block.shape[1], device=block.device)[None]
        hidden = self.drafter(self.head.embed_tokens(block), context, positions, cache=self.cache)[0, 1:]
        if self.vocab is None:
            return self.head.lm_head(hidden)
        logits = hidden.new_full((hidden.shape[0], self.head.lm_head.weight.shape[0]), float("-inf"))
        return logits.index_copy_(1, self.vocab, F.linear(hidden, self.vocab_weight))
