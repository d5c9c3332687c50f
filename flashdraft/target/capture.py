"""The target's hidden states at the drafter's layers (which layers: `flashdraft.spec`), taken by forward hooks.

The feature of layer id i is the output of decoder layer i, which Hugging Face's `output_hidden_states` returns as
`hidden_states[i + 1]`. Asking for all hidden states keeps every layer's output alive until the forward ends (37
tensors for a 36-layer target where 5 are used); hooks on the chosen layers keep only those. HF returns the last
entry after the final norm (`last_hidden_state`), so a chosen last layer is read at the norm's output: the tensors
are the very ones `output_hidden_states` would select, bit for bit.
"""

from __future__ import annotations

import torch


def _decoder(model):
    """The decoder stack (`layers`, `norm`) of a causal LM."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    if not hasattr(base, "layers"):
        raise TypeError(f"{type(model).__name__}: no decoder layers to hook (expected .model.layers)")
    return base


class LayerTap:
    """Forward hooks on the chosen decoder layers while the `with` block runs.

    After a forward inside the block, `features()` is the concatenation [b, s, n*H] in `layer_ids` order, and
    `final` (with `final=True`) the final-normed states the output head reads. With `project` (a store's basis,
    `flashdraft.store.projection.Projection`, on the model's device) `features()` is the concatenation projected,
    [b, s, r], computed where the layers' outputs are: only r columns a token leave the device.
    """

    def __init__(self, model, layer_ids, final: bool = False, project=None):
        self.base, self.layer_ids, self.want_final = _decoder(model), [int(i) for i in layer_ids], final
        self.project = project
        self.n_layers = int(getattr(model.config, "num_hidden_layers", len(self.base.layers)))
        self.outputs: dict[int, torch.Tensor] = {}
        self.final: torch.Tensor | None = None
        self._handles = []

    def _keep(self, key):
        def hook(_module, _args, output):
            out = output[0] if isinstance(output, tuple) else output
            if key == "final":
                self.final = out
            else:
                self.outputs[key] = out

        return hook

    def __enter__(self) -> LayerTap:
        last = self.n_layers - 1
        for i in self.layer_ids:
            if i != last:
                self._handles.append(self.base.layers[i].register_forward_hook(self._keep(i)))
        if self.want_final or last in self.layer_ids:
            self._handles.append(self.base.norm.register_forward_hook(self._keep("final")))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def features(self) -> torch.Tensor:
        """The chosen layers' outputs of the last forward, concatenated; the tap lets go of them."""
        last = self.n_layers - 1
        feats = torch.cat([self.final if i == last else self.outputs[i] for i in self.layer_ids], dim=-1)
        self.outputs.clear()
        return feats if self.project is None else self.project.apply(feats)


@torch.no_grad()
def capture_features(model, input_ids: torch.Tensor, layer_ids: list[int], attention_mask=None) -> torch.Tensor:
    """Concatenated outputs of the chosen decoder layers over `input_ids`: [b, s, n*H]."""
    with LayerTap(model, layer_ids) as tap:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1)
        return tap.features()
