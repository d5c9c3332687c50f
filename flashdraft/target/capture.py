"""The target's hidden states at the drafter's layers, over a whole sequence (which layers: `flashdraft.spec`)."""

from __future__ import annotations

import torch

from flashdraft.model import extract_context_feature


@torch.no_grad()
def capture_features(model, input_ids: torch.Tensor, layer_ids: list[int], attention_mask=None) -> torch.Tensor:
    """Concatenated outputs of the chosen decoder layers over `input_ids`: [b, s, n*H]."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    return extract_context_feature(out.hidden_states, layer_ids)
