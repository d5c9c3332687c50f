"""Check a feature store against the drafter being trained, before step 1."""

from __future__ import annotations


class StoreMismatch(ValueError):
    """A store does not fit the configured target / drafter; the message names what differs."""


def check_store(path, manifest: dict, *, layer_ids, hidden_size: int, vocab_size: int, mask_token_id: int | None,
                target: dict | None) -> None:
    """`target` is `flashdraft.target.target_fingerprint(...)` of the configured target (or None to skip)."""
    where = f"feature store {path}"
    missing = [i for i in layer_ids if i not in manifest["layer_ids"]]
    if missing:
        raise StoreMismatch(f"{where}: target layers {missing} are not in the store (it holds {manifest['layer_ids']}); "
                            f"train with layer_ids within the store or capture them")
    if int(manifest["hidden_size"]) != int(hidden_size):
        raise StoreMismatch(f"{where}: hidden size {manifest['hidden_size']} != the target's {hidden_size}")
    if manifest.get("vocab_size") is not None and int(manifest["vocab_size"]) != int(vocab_size):
        raise StoreMismatch(f"{where}: vocabulary size {manifest['vocab_size']} != the target's {vocab_size}")
    if mask_token_id is not None and manifest.get("mask_token_id") is not None and int(manifest["mask_token_id"]) != int(mask_token_id):
        raise StoreMismatch(f"{where}: mask token {manifest['mask_token_id']} != the drafter's {mask_token_id}")
    stored = manifest.get("target") or {}
    for key in ("config_sha256", "tokenizer_sha256"):
        if target and stored.get(key) and target.get(key) and stored[key] != target[key]:
            raise StoreMismatch(f"{where}: captured from target {stored.get('name')!r} whose {key} differs from the "
                                f"configured target {target.get('name')!r} ({stored[key][:12]} != {target[key][:12]})")
