"""The feature stores against the drafter being trained, before step 1: the layer ids they hold, their target."""

from __future__ import annotations


class StoreMismatch(ValueError):
    """A store does not fit the configured target / drafter; the message names what differs."""


class PartialStore(StoreMismatch):
    """A store is a partial transcode (it holds part of its source); the message names it and its finishing command."""


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


def store_projection_sha(manifests: dict, layer_ids=None) -> str | None:
    """The one projection basis (its sha256) the stores ({path: manifest}) hold, None where all hold raw features.
    Refused by name: raw and projected stores mixed (a drafter's fc reads one or the other), stores projected by
    different bases (their r columns mean different things), or a projected store read for a subset of its layers
    (the basis mixes them)."""
    from flashdraft.store.projection import projection_sha

    shas = {str(path): projection_sha(manifest) for path, manifest in manifests.items()}
    raw = [p for p, s in shas.items() if s is None]
    projected = {p: s for p, s in shas.items() if s is not None}
    if raw and projected:
        raise StoreMismatch(
            f"raw and projected feature stores mixed: raw {raw}; projected {list(projected)}. Train on one kind: "
            f"transcode the raw ones with the same basis (python -m pipeline transcode SRC DST "
            f"project=pca basis={next(iter(projected))})"
        )
    if len(set(projected.values())) > 1:
        listing = "; ".join(f"{p}: basis {s[:12]}" for p, s in projected.items())
        raise StoreMismatch(
            f"the feature stores are projected by different bases ({listing}); train on stores of one basis "
            f"(transcode a raw copy with basis=OTHER_STORE)"
        )
    if not projected:
        return None
    for path, manifest in manifests.items():
        held = [int(i) for i in manifest["layer_ids"]]
        if layer_ids is not None and [int(i) for i in layer_ids] != held:
            raise StoreMismatch(
                f"feature store {path} is projected (its basis mixes layers {held}): drafter.layer_ids "
                f"{list(layer_ids)} cannot be read from it; leave drafter.layer_ids unset"
            )
    return next(iter(projected.values()))


def check_store(path, manifest: dict, *, hidden_size: int, vocab_size: int, target: dict | None) -> None:
    """`target` is `flashdraft.target.target_fingerprint(...)` of the configured target (or None to skip). A partial
    transcode is refused by name (`flashdraft.store.transcode.partial_transcode_problem`)."""
    from flashdraft.store.transcode import partial_transcode_problem

    where = f"feature store {path}"
    partial = partial_transcode_problem(path, manifest)
    if partial:
        raise PartialStore(f"feature store {partial}; nothing was trained: finish it, or train on another store")
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
