"""Drafters cross between our format (the published z-lab one) and the peer's, vLLM's `speculators` 0.9.0
(flashdraft.speculators_format): a drafter saved by the peer's DFlashDraftModel loads in ours, one of ours exported in
the peer's format loads in the peer's class, and both compute the same draft logits on the same features, in float32
within LOGITS_ATOL (summation order only: the peer adds its masked keys as exact zeros, ours leaves them out). What
cannot cross is refused, naming the file and every field. Tests needing the peer skip where it is not installed
(scripts/setup.sh installs it)."""

import json
import stat
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from flashdraft.model import DFlashDrafter
from flashdraft.spec import DraftSpec
from flashdraft.speculators_format import VERIFIER_OWNED, from_speculators, to_speculators
from harness.drafter import load_drafter

LOGITS_ATOL = 1e-5  # float32; measured max |diff| 3.4e-7 on these shapes
MASK = 96  # the tiny verifier's last token serves as the mask
VERIFIER = Qwen3Config(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def peer():
    return pytest.importorskip("speculators.models.dflash")


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    """A tiny Qwen3 target saved as an HF folder (safetensors): the verifier both sides borrow the head from."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("verifier")
    Qwen3ForCausalLM(VERIFIER).save_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    return SimpleNamespace(path=folder, embed=tensors["model.embed_tokens.weight"], head=tensors["lm_head.weight"])


def _randomize(module, names=None):
    """Weights away from their init (norms around 1), so that a swapped or missing tensor shows."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if names is not None and not name.startswith(names):
                continue
            p.copy_(1 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.05 * torch.randn_like(p))


def peer_drafter(peer, verifier, aux, block_size, num_layers=2, intermediate=80):
    """A DFlashDraftModel built the way the peer's trainer builds one (its config classes), eager attention."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    layer = {k: v for k, v in VERIFIER.to_dict().items() if k != "layer_types"}
    layer |= {"num_hidden_layers": num_layers, "intermediate_size": intermediate}
    layer_config = Qwen3Config(**layer)
    layer_config._attn_implementation = "eager"
    config = peer.DFlashSpeculatorConfig(
        transformer_layer_config=layer_config,
        draft_vocab_size=VERIFIER.vocab_size,
        block_size=block_size,
        aux_hidden_state_layer_ids=aux,
        mask_token_id=MASK,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block_size - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(str(verifier.path)),
        ),
    )
    model = peer.DFlashDraftModel(config)
    _randomize(model, ("layers.", "fc.", "hidden_norm.", "norm."))
    model.load_verifier_weights()
    return model.eval()


def load_peer(peer, folder):
    """The peer's saved drafter as the peer loads it (weights from the folder, head and embedding from the verifier),
    its attention made eager (flex has no dense-mask CPU path here)."""
    config = peer.DFlashSpeculatorConfig.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = "eager"
    return peer.DFlashDraftModel.from_pretrained(str(folder), config=config).eval()


def ours_block_logits(drafter, verifier, features, tokens, anchor):
    """Our drafter on one block [tokens[anchor], MASK x (B-1)] after the context features[:anchor]."""
    block = torch.full((1, drafter.block_size), MASK)
    block[0, 0] = tokens[0, anchor]
    noise = torch.nn.functional.embedding(block, verifier.embed)
    positions = torch.arange(anchor + drafter.block_size)[None]
    return drafter(noise, features[:, :anchor], positions) @ verifier.head.T


def peer_block_logits(model, features, tokens, anchor):
    """The peer's layers composed on the same block, as its backbone runs them (fc + hidden_norm on the context, the
    block's embedding as the hidden states, context then block positions), no mask: the block sees all the context."""
    block_size = model.block_size
    block = torch.full((1, block_size), MASK)
    block[0, 0] = tokens[0, anchor]
    ctx = model.hidden_norm(model.fc(features[:, :anchor]))
    positions = torch.arange(anchor + block_size)[None]
    cos_sin = model.rotary_emb(features, positions)
    x = model.embed_tokens(block)
    for layer in model.layers:
        x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_embeddings=cos_sin)
    return model.lm_head(model.norm(x))


def peer_backbone_logits(model, features, tokens, num_anchors):
    """The peer's own training forward (`_backbone_forward`: its anchors, its dense float mask over the whole packed
    sequence): (anchors, logits [anchors, B, V])."""
    seq = features.shape[1]
    with torch.no_grad():
        _, logits, _, _, index = model._backbone_forward(
            features,
            tokens,
            torch.ones(1, seq, dtype=torch.long),
            torch.randn(1, seq, VERIFIER.hidden_size),
            torch.zeros(1, seq, dtype=torch.long),
            max_anchors=num_anchors,
        )
    return index[:: model.block_size].tolist(), logits.view(num_anchors, model.block_size, -1)


def features_and_tokens(num_features, seq=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(1, seq, num_features * VERIFIER.hidden_size, generator=g)
    return features, torch.randint(0, MASK, (1, seq), generator=g)


def assert_same_logits(ours, peer_model, verifier, anchors=(0, 5, 13)):
    """Ours and the peer's on the same features and blocks: composed block by block, and the peer's backbone."""
    features, tokens = features_and_tokens(len(ours.target_layer_ids))
    worst = 0.0
    with torch.no_grad():
        for anchor in anchors:
            a = ours_block_logits(ours, verifier, features, tokens, anchor)
            b = peer_block_logits(peer_model, features, tokens, anchor)
            torch.testing.assert_close(a, b, rtol=0, atol=LOGITS_ATOL)
            worst = max(worst, (a - b).abs().max().item())
        torch.manual_seed(3)
        starts, logits = peer_backbone_logits(peer_model, features, tokens, num_anchors=6)
        for anchor, row in zip(starts, logits, strict=True):
            a = ours_block_logits(ours, verifier, features, tokens, anchor)[0]
            torch.testing.assert_close(a, row, rtol=0, atol=LOGITS_ATOL)
            worst = max(worst, (a - row).abs().max().item())
    return worst


def test_a_drafter_the_peer_saved_loads_in_ours_with_the_same_logits(peer, verifier, tmp_path):
    torch.manual_seed(0)
    aux = [1, 3, 5]  # the verifier's hidden_states indices: our layer outputs 0, 2, 4
    saved = peer_drafter(peer, verifier, aux, block_size=4)
    saved.save_pretrained(tmp_path / "peer")
    ours = DFlashDrafter.from_pretrained(tmp_path / "peer")
    assert ours.target_layer_ids == [0, 2, 4] and ours.block_size == 4 and ours.mask_token_id == MASK
    assert ours.config.intermediate_size == 80 and ours.config.num_hidden_layers == 2
    assert ours.config.num_target_layers == VERIFIER.num_hidden_layers  # read from the verifier's local folder
    worst = assert_same_logits(ours, load_peer(peer, tmp_path / "peer"), verifier)
    print(f"peer -> ours: max |logit diff| {worst:.2e}")
    # the harness takes the folder as it is
    target = Qwen3ForCausalLM(VERIFIER).eval()
    drafter, untrained = load_drafter(tmp_path / "peer", target, tokenizer=None, geometry=None)
    assert not untrained and drafter.target_layer_ids == [0, 2, 4]


def our_drafter(layer_ids=(0, 2, 4), block_size=8, mask_token="<|MASK|>"):
    torch.manual_seed(0)
    spec = DraftSpec(layer_ids, MASK, block_size, num_draft_layers=2, intermediate_size=80, mask_token=mask_token)
    drafter = DFlashDrafter(spec.draft_config(VERIFIER))
    _randomize(drafter)
    return drafter.eval()


def test_our_drafter_exported_loads_in_the_peer_with_the_same_logits(peer, verifier, tmp_path):
    ours = our_drafter()
    ours.save_pretrained(tmp_path / "zlab")
    out = to_speculators(tmp_path / "zlab", tmp_path / "zlab-speculators", str(verifier.path))
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7
    assert config["speculators_config"]["verifier"]["architectures"] == ["Qwen3ForCausalLM"]
    for path in out.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    saved = load_file(str(out / "model.safetensors"))
    assert set(saved) == set(ours.state_dict())
    loaded = load_peer(peer, out)
    theirs = loaded.state_dict()
    assert set(theirs) - set(saved) == set(VERIFIER_OWNED)  # only what the peer rebuilds from the verifier
    for name, tensor in saved.items():
        assert torch.equal(theirs[name], tensor), name
    assert torch.equal(theirs["embed_tokens.weight"], verifier.embed)
    assert loaded.block_size == 8 and loaded.mask_token_id == MASK and loaded.target_layer_ids == [1, 3, 5]
    worst = assert_same_logits(ours, loaded, verifier, anchors=(0, 4, 11))
    print(f"ours -> peer: max |logit diff| {worst:.2e}")


def test_a_drafter_crosses_there_and_back_unchanged(tmp_path):
    """Ours -> the peer's format -> ours: the same tensors, geometry and our own keys (the mask token's string, the
    target's layer count), from a folder or from the model; the peer is not needed."""
    ours = our_drafter(layer_ids=(1, 3, 5), block_size=4)
    ours.config.flashdraft_trained_thinking = "off"
    ours.save_pretrained(tmp_path / "zlab")
    to_speculators(tmp_path / "zlab", tmp_path / "a", "smollm2-135m-not-resolved-here", verifier_architectures=[])
    to_speculators(ours, tmp_path / "b", "smollm2-135m-not-resolved-here", verifier_architectures=[])
    original = json.loads((tmp_path / "zlab" / "config.json").read_text())
    for folder in ("a", "b"):
        config, state = from_speculators(tmp_path / folder)
        config = json.loads(json.dumps(config))  # as written to config.json (id2label's keys become strings)
        assert {k: config[k] for k in original} == original, folder
        back = DFlashDrafter.from_pretrained(tmp_path / folder)
        for name, tensor in ours.state_dict().items():
            assert torch.equal(back.state_dict()[name], tensor), name
        assert back.spec == ours.spec


def test_what_cannot_cross_is_refused_naming_every_field(tmp_path):
    ours = our_drafter()
    to_speculators(ours, tmp_path / "peer", "verifier", verifier_architectures=[])
    cfg_file = tmp_path / "peer" / "config.json"
    raw = json.loads(cfg_file.read_text())
    raw["draft_vocab_size"] = 64  # a reduced vocabulary with its d2t/t2d mapping
    raw["transformer_layer_config"]["layer_types"] = ["sliding_attention", "full_attention"]
    raw["sample_from_anchor"] = True
    raw["aux_hidden_state_layer_ids"] = [0, 3, 5]
    raw["target_hidden_size"] = 128
    cfg_file.write_text(json.dumps(raw))
    with pytest.raises(ValueError) as err:
        DFlashDrafter.from_pretrained(tmp_path / "peer")
    message = str(err.value)
    assert str(cfg_file) in message
    for field in (
        "draft_vocab_size",
        "layer_types",
        "sample_from_anchor",
        "aux_hidden_state_layer_ids",
        "target_hidden_size",
    ):
        assert field in message, field
    raw = json.loads(cfg_file.read_text()) | {"speculators_model_type": "dspark", "mask_token_id": None}
    cfg_file.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"(?s)speculators_model_type 'dspark'.*mask_token_id missing"):
        from_speculators(tmp_path / "peer")


def test_a_projected_drafter_is_refused_until_folded(tmp_path):
    ours = our_drafter()
    ours.config.feature_projection = {"dims": 32, "folded": False}
    with pytest.raises(ValueError, match="not folded"):
        to_speculators(ours, tmp_path / "peer", "verifier", verifier_architectures=[])


def test_the_trainer_exports_the_peer_format_beside_ours_when_asked(verifier, tmp_path):
    from trainer.train import export_copies

    ours = our_drafter()
    engine = SimpleNamespace(module=ours, zero_optimization_stage=lambda: 2)
    ckpt, copy = tmp_path / "ckpt" / "drafter", tmp_path / "run" / "drafter"
    export_copies(engine, ours.config, torch.float32, str(copy), ckpt, peer=str(verifier.path))
    for folder in (ckpt, copy):
        peer_folder = folder.with_name("drafter-speculators")
        assert json.loads((peer_folder / "config.json").read_text())["speculators_model_type"] == "dflash"
        back = DFlashDrafter.from_pretrained(peer_folder)
        assert torch.equal(back.fc.weight, ours.fc.weight)
    export_copies(engine, ours.config, torch.float32, None, tmp_path / "plain" / "drafter")
    assert not (tmp_path / "plain" / "drafter-speculators").exists()
