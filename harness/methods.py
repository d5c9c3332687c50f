"""The methods an eval compares, by name, in one table (`METHODS`): each is a draft policy for the harness loop
(`harness.policies`) built from the decode settings, except prompt_lookup, the transformers baseline
(`harness.baselines`), and carries what the report and the pictures say of it. A new draft policy is a class in
harness/policies.py and an entry here; nothing else names a method.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from flashdraft.config import EvalConfig
from harness.acceptance import Sampling
from harness.baselines import prompt_lookup_generate
from harness.policies import PLAIN as PLAIN_POLICY
from harness.policies import ChainPolicy, DatastorePolicy, LookupPolicy, TreePolicy
from harness.speculative import Generation, speculative_generate


@dataclass(frozen=True)
class DecodeSettings:
    """The eval settings a measurement depends on (`block_size`: the one the loop runs, the drafter's by default)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    block_size: int
    prompt_lookup_num_tokens: int
    draft_cutoff: float
    tree_size: int
    tree_branching: int
    lookup_ngram: int
    datastore_ngram: int
    datastore_min_ngram: int
    datastore_min_count: int
    seed: int

    @classmethod
    def from_eval(cls, config: EvalConfig, block_size: int) -> DecodeSettings:
        return cls(
            **{f.name: getattr(config, f.name) for f in fields(cls) if f.name != "block_size"}, block_size=block_size
        )


def _chain(s: DecodeSettings, proposer, datastore):
    return ChainPolicy(proposer, s.block_size, s.draft_cutoff)


def _tree(s: DecodeSettings, proposer, datastore):
    return TreePolicy(proposer, s.tree_size, s.tree_branching, s.block_size)


def _lookup(s: DecodeSettings, fallback):
    return LookupPolicy(s.lookup_ngram, s.prompt_lookup_num_tokens, fallback) if s.lookup_ngram else fallback


def _lookup_tree(s: DecodeSettings, proposer, datastore):
    return _lookup(s, _tree(s, proposer, datastore))


def _lookup_datastore_tree(s: DecodeSettings, proposer, datastore):
    if datastore is None:
        raise ValueError("method dflash_datastore needs a datastore (eval.datastore: the training feature store)")
    return _lookup(s, DatastorePolicy(datastore, s.prompt_lookup_num_tokens, _tree(s, proposer, datastore)))


def _chain_words(s: dict, d: dict) -> list[str]:
    cutoff = s.get("draft_cutoff")
    return (
        [f"drafts verified while their cumulative confidence is at least eval.draft_cutoff {cutoff}"] if cutoff else []
    )


def _tree_words(s: dict, d: dict) -> list[str]:
    return [f"tree of {s['tree_size']} candidates, {s['tree_branching']} a position"]


def _lookup_words(s: dict, d: dict) -> list[str]:
    return [
        *_tree_words(s, d),
        f"lookup rounds where the newest {s.get('lookup_ngram')} tokens occurred before: "
        f"{d.get('lookup_rounds', 0) - d.get('datastore_rounds', 0)} of {d['rounds']}",
    ]


def _datastore_words(s: dict, d: dict) -> list[str]:
    store = s.get("datastore")
    if not store:
        return _lookup_words(s, d)
    return [
        *_lookup_words(s, d),
        f"datastore rounds, the continuation of the newest {s.get('datastore_ngram')} (down to "
        f"{s.get('datastore_min_ngram')}) tokens seen at least {s.get('datastore_min_count')} times in "
        f"{store['sequences']:,} training responses: {d.get('datastore_rounds', 0)} of {d['rounds']}",
    ]


def _no_words(s: dict, d: dict) -> list[str]:
    return []


def _plain(s: DecodeSettings, proposer, datastore):
    return PLAIN_POLICY


@dataclass(frozen=True)
class Method:
    policy: Callable | None  # (settings, proposer, datastore) -> a draft policy; None: the transformers baseline
    label: str  # what it is, in a line: the report lists every method run with it
    colour: str | None = None  # its bars in acceptance.png (None: not drawn)
    drafter: bool = False  # drafts with the drafter: the report gives its rounds (histogram, round time)
    # the report's words on its rounds, from the eval settings and its summary (`harness.summary.method_summary`)
    rounds_words: Callable[[dict, dict], list[str]] = _no_words
    counts: tuple[str, ...] = ()  # counters of its rounds in runs.jsonl that its summary sums
    datastore: bool = False  # needs the datastore (eval.datastore; built for it alone)
    as_loaded: bool = False  # runs on the target as loaded (a second copy), not on the exact one
    speedup_key: str | None = None  # a baseline: the summary key of every method's speedup over it


PLAIN = "plain"  # the reference: every other method's output is compared with its, and multi-turn history is its
CHAIN, TREE = "dflash", "dflash_tree"  # the drafter's chain and tree: the served-order replay of train/serve parity

METHODS = {
    PLAIN: Method(_plain, "the loop without drafts: KV cache, one target forward a token", speedup_key="speedup"),
    "plain_as_loaded": Method(
        _plain,
        "the same on a copy of the target as loaded, beside the exact one (eval.exact on; unpadded GEMMs, SDPA): the "
        "plain decoding a user runs; its speedup over plain is what exactness costs",
        as_loaded=True,
    ),
    "prompt_lookup": Method(None, "transformers generate(prompt_lookup_num_tokens=...), the free baseline", "#9ec3ea"),
    CHAIN: Method(
        _chain,
        "the drafter's block verified as one chain (the reference), optionally its confident prefix",
        "#1f4e9c",
        drafter=True,
        rounds_words=_chain_words,
    ),
    TREE: Method(
        _tree,
        "a tree of the draft's most probable candidates verified a round (greedy only)",
        "#5f3dc4",
        drafter=True,
        rounds_words=_tree_words,
    ),
    "dflash_lookup": Method(
        _lookup_tree,
        "a lookup draft where the newest `lookup_ngram` tokens occurred before, else dflash_tree",
        "#2b8a3e",
        drafter=True,
        rounds_words=_lookup_words,
        counts=("lookup_rounds",),
    ),
    "dflash_datastore": Method(
        _lookup_datastore_tree,
        "a lookup draft, else the training responses' continuation (`harness.datastore`), else dflash_tree",
        "#e67700",
        drafter=True,
        rounds_words=_datastore_words,
        counts=("lookup_rounds", "datastore_rounds"),
        datastore=True,
    ),
}
DRAFTER_METHODS = tuple(name for name, method in METHODS.items() if method.drafter)
# acceptance.png's bars: the drafter's methods, then the baselines they are compared with
DRAWN_METHODS = tuple(sorted((n for n, m in METHODS.items() if m.colour), key=lambda n: not METHODS[n].drafter))


def methods_asked(methods: list[str] | None) -> list[str]:
    """eval.methods as a list of known names (None: every method of the table); an unknown one is refused by name."""
    if methods is None:
        return list(METHODS)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown} in eval.methods; known: {', '.join(METHODS)}")
    return list(methods)


def build_policies(methods, settings: DecodeSettings, proposer=None, datastore=None) -> dict:
    """{method: its draft policy (None: the baseline)}, refusing unknown methods, drafter methods without a drafter
    and greedy-only ones when sampling."""
    methods = methods_asked(methods)
    policies = {}
    for name in methods:
        method = METHODS[name]
        if method.drafter and proposer is None:
            raise ValueError(f"method {name} needs a drafter")
        policies[name] = policy = method.policy(settings, proposer, datastore) if method.policy else None
        if policy is not None and policy.greedy_only and settings.temperature > 0:
            raise ValueError(
                f"method {name} is greedy only: drop it from eval.methods or set eval.temperature=0 "
                f"(got {settings.temperature})"
            )
    return policies


def run_method(
    name, policy, target, input_ids, settings: DecodeSettings, *, stop_token_ids=(), seed=0, loaded_target=None
) -> Generation:
    """One generation of method `name` with its `policy` (`build_policies`); `loaded_target`: the target without
    exact verification, for plain_as_loaded (None: `target` itself)."""
    if policy is None:
        torch.manual_seed(seed)
        return prompt_lookup_generate(
            target,
            input_ids,
            max_new_tokens=settings.max_new_tokens,
            stop_token_ids=stop_token_ids,
            num_lookup_tokens=settings.prompt_lookup_num_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
        )
    model = loaded_target if METHODS[name].as_loaded and loaded_target is not None else target
    generator = torch.Generator(device=target.device).manual_seed(seed)
    sampling = Sampling(settings.temperature, settings.top_p, settings.top_k, generator)
    return speculative_generate(
        model,
        input_ids,
        policy,
        max_new_tokens=settings.max_new_tokens,
        stop_token_ids=stop_token_ids,
        sampling=sampling,
    )
