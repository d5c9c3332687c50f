"""The feature stores against the drafter being trained, before step 1: the layer ids they hold, their target."""

from __future__ import annotations


class StoreMismatch(ValueError):
    """A store does not fit the configured target / drafter; the message names what differs."""


def _listing(held: dict) -> str:
    return "; ".join(f"{path}: {ids}" for path, ids in held.items())


def store_layer_ids(manifests: dict, wanted=None) -> list[int]:
    """The target layer ids a drafter trains on, from the stores' manifests ({path: manifest}): every id the stores
    hold (they must all hold the same), or `wanted`, in its order, which every store must hold."""
    held = {str(path): [int(i) for i in manifest["layer_ids"]] for path, manifest in manifests.items()}
    if wanted is None:
        distinct = {tuple(ids) for ids in held.values()}
        if len(distinct) > 1:
            raise StoreMismatch(
                f"the feature stores hold different target layers ({_listing(held)}); train on "
                f"stores of one capture, or pick layers they all hold with layer_ids"
            )
        return list(distinct.pop())
    wanted = [int(i) for i in wanted]
    lacking = {path: ids for path, ids in held.items() if not set(wanted) <= set(ids)}
    if lacking:
        raise StoreMismatch(
            f"layer_ids {wanted} are not all in the feature stores ({_listing(lacking)}); train with "
            f"layer_ids within the stores or capture them"
        )
    return wanted


def check_store(path, manifest: dict, *, hidden_size: int, vocab_size: int, target: dict | None) -> None:
    """`target` is `flashdraft.target.target_fingerprint(...)` of the configured target (or None to skip)."""
    where = f"feature store {path}"
    if int(manifest["hidden_size"]) != int(hidden_size):
        raise StoreMismatch(f"{where}: hidden size {manifest['hidden_size']} != the target's {hidden_size}")
    if manifest.get("vocab_size") is not None and int(manifest["vocab_size"]) != int(vocab_size):
        raise StoreMismatch(f"{where}: vocabulary size {manifest['vocab_size']} != the target's {vocab_size}")
    stored = manifest.get("target") or {}
    for key in ("config_sha256", "tokenizer_sha256"):
        if target and stored.get(key) and target.get(key) and stored[key] != target[key]:
            raise StoreMismatch(
                f"{where}: captured from target {stored.get('name')!r} whose {key} differs from the "
                f"configured target {target.get('name')!r} ({stored[key][:12]} != {target[key][:12]})"
            )
