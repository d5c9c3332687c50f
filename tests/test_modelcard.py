"""The drafter folder as the hub publishes it: its model card (README.md) read back by huggingface_hub's own
parser, world-readable files, and the card's sections rewritten alone."""

import json
import stat

import pytest
from huggingface_hub import ModelCard

from flashdraft.modelcard import (
    LIBRARY_NAME,
    OFFLINE_EVAL,
    SERVED_EVAL,
    render_card,
    set_card_section,
    store_facts,
    target_name,
    write_card,
)
from flashdraft.target.load import EMBEDDED_HUB_ID
from tests.test_speculative import tiny_drafter
from tests.test_speculative import tiny_target as tiny_target_model
from tests.test_trainer_fixtures import metrics, tiny_store, tiny_target, train_here, train_kwargs


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real run of 3 steps: evals at step 2 (before the step-3 export) and at the end (after it)."""
    tmp = tmp_path_factory.mktemp("card")
    target = tiny_target(tmp / "target")
    store = tiny_store(tmp / "features", target)
    kw = train_kwargs(tmp, store.path, target, epochs=1, max_steps=3, checkpoint_every=0, eval_every=2)
    train_here(kw)
    return tmp, target, store


def test_export_writes_a_card_the_hub_parser_reads_and_files_others_can_read(trained):
    tmp, target, store = trained
    drafter = tmp / "drafter"
    in_checkpoint = next((tmp / "run" / "checkpoints").glob("step-*")) / "drafter"
    for folder in (drafter, in_checkpoint):
        assert {p.name for p in folder.iterdir()} == {"config.json", "model.safetensors", "README.md"}
        assert {p.name: mode(p) for p in folder.iterdir()} == dict.fromkeys(
            ("config.json", "model.safetensors", "README.md"), 0o644
        )  # safetensors alone would leave its file 0600
        assert mode(folder) == 0o755
    card = ModelCard.load(drafter / "README.md")
    assert card.data.library_name == LIBRARY_NAME and {"dflash", "speculative-decoding"} <= set(card.data.tags)
    assert card.data.base_model is None and "no hub id known: `base_model` left out" in card.text  # a local folder
    assert card.data.datasets is None  # the store's prompts have no hub dataset
    config = json.loads((drafter / "config.json").read_text())
    assert f"| block size | {config['block_size']} |" in card.text
    assert f"| target layer ids | {config['dflash_config']['target_layer_ids']} (of 6" in card.text
    assert f"id {config['dflash_config']['mask_token_id']}" in card.text
    manifest = json.loads((store.path / "manifest.json").read_text())
    assert f"| train | `{store.path}` | - | {manifest['counts']['sequences']} | {manifest['counts']['tokens']} |" in (
        card.text
    )
    assert "Trained 3 optimizer steps" in card.text and "| anchors a sequence | 6 |" in card.text
    evals = metrics(tmp / "run", "eval/tau")
    assert [r["step"] for r in evals] == [2, 3]  # the last eval came after the export: the card was brought up to it
    assert f"| 3 | {evals[-1]['eval/tau']:.3f} | {evals[-1]['eval/loss']:.4f} |" in card.text
    assert (in_checkpoint / "README.md").read_text() == (drafter / "README.md").read_text()
    assert "Served: not measured yet" in card.text


def test_a_drafter_saved_alone_is_world_readable(tmp_path):
    folder = tiny_drafter(tiny_target_model("llama", vocab=320), block_size=4, layers=1).save_pretrained(tmp_path / "d")
    assert mode(folder / "model.safetensors") == mode(folder / "config.json") == 0o644 and mode(folder) == 0o755


def test_base_model_is_a_hub_id_never_a_local_path(tmp_path):
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "mine").mkdir()
    assert target_name("Qwen/Qwen3-8B").hub_id == "Qwen/Qwen3-8B"
    assert target_name("smollm2-135m").hub_id == EMBEDDED_HUB_ID  # the embedded default: the model it came from
    assert target_name(str(snapshot)).hub_id == "Qwen/Qwen3-8B"  # the hub cache's folder: its repo
    assert target_name(str(tmp_path / "mine")).hub_id is None
    folder = tiny_drafter(tiny_target_model("llama", vocab=320), block_size=4, layers=1).save_pretrained(tmp_path / "d")
    config = json.loads((folder / "config.json").read_text())
    facts = dict(stores=[], recipe={"epochs": 6}, steps=10, tokens_seen=1000)
    for target, expected in (("smollm2-135m", EMBEDDED_HUB_ID), (str(snapshot), "Qwen/Qwen3-8B")):
        data = ModelCard(render_card(config, target=target, **facts)).data
        assert data.base_model == expected and str(tmp_path) not in str(data.to_dict())


def test_datasets_are_the_hub_sources_of_the_stores(tmp_path):
    target = tiny_target(tmp_path / "target")
    store = tiny_store(tmp_path / "features", target, n=4, extra={"sources": ["codealpaca", "humaneval", "my.jsonl"]})
    facts = store_facts([store.path])
    assert facts[0]["sources"] == ["codealpaca", "humaneval", "my.jsonl"] and facts[0]["sequences"] == 4
    folder = tiny_drafter(tiny_target_model("llama", vocab=320), block_size=4, layers=1).save_pretrained(tmp_path / "d")
    write_card(folder, target="Qwen/Qwen3-8B", stores=facts, recipe={}, steps=1, tokens_seen=1)
    card = ModelCard.load(folder / "README.md")
    assert card.data.datasets == ["sahil2801/CodeAlpaca-20k"]  # packaged and file sources: in the body only
    assert "codealpaca, humaneval, my.jsonl" in card.text


def test_a_section_is_rewritten_alone(tmp_path):
    folder = tiny_drafter(tiny_target_model("llama", vocab=320), block_size=4, layers=1).save_pretrained(tmp_path / "d")
    assert not set_card_section(folder, SERVED_EVAL, "x")  # no card: nothing written
    write_card(folder, target="Qwen/Qwen3-8B", stores=[], recipe={}, steps=1, tokens_seen=1)
    before = (folder / "README.md").read_text()
    assert set_card_section(folder, SERVED_EVAL, "| dflash | 3.00 |") and set_card_section(folder, SERVED_EVAL, "new")
    after = (folder / "README.md").read_text()
    start = before.index(f"<!-- flashdraft:{SERVED_EVAL} -->")
    assert after[:start] == before[:start] and after.endswith(before[before.index(f"<!-- /flashdraft:{SERVED_EVAL}") :])
    assert "new" in after and "3.00" not in after and after.count(f"<!-- flashdraft:{OFFLINE_EVAL} -->") == 1
    assert mode(folder / "README.md") == 0o644 and not list(folder.glob("*.tmp"))
    assert ModelCard(after).data.library_name == LIBRARY_NAME
