"""The methods an eval compares, by name: each is a draft policy for the harness loop (`harness.policies`) built
from the decode settings, except prompt_lookup, the transformers baseline (`harness.baselines`).

  plain            the loop without drafts: KV cache, one target forward per token
  plain_as_loaded  the same on a copy of the target as loaded, beside the exact one (eval.exact on): unpadded GEMMs,
                   SDPA, the plain decoding a user runs; its speedup over plain is what exactness costs
  prompt_lookup    transformers generate(prompt_lookup_num_tokens=...), the free baseline
  dflash           the drafter's block verified as one chain (the reference), optionally its confident prefix
  dflash_tree      a tree of the draft's most probable candidates verified a round (greedy only)
  dflash_lookup    a lookup draft where the newest `lookup_ngram` tokens occurred before, else dflash_tree
  dflash_datastore a lookup draft, else the training responses' continuation (`harness.datastore`), else dflash_tree
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from flashdraft.config import EvalConfig
from harness.acceptance import Sampling
from harness.baselines import prompt_lookup_generate
from harness.policies import PLAIN, ChainPolicy, DatastorePolicy, LookupPolicy, TreePolicy
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


@dataclass(frozen=True)
class Method:
    policy: Callable | None  # (settings, proposer, datastore) -> a draft policy; None: the transformers baseline
    drafter: bool = False  # drafts with the drafter
    as_loaded: bool = False  # runs on the target as loaded, not on the exact one


METHODS = {
    "plain": Method(lambda s, proposer, datastore: PLAIN),
    "plain_as_loaded": Method(lambda s, proposer, datastore: PLAIN, as_loaded=True),
    "prompt_lookup": Method(None),
    "dflash": Method(_chain, drafter=True),
    "dflash_tree": Method(_tree, drafter=True),
    "dflash_lookup": Method(_lookup_tree, drafter=True),
    "dflash_datastore": Method(_lookup_datastore_tree, drafter=True),
}
DRAFTER_METHODS = tuple(name for name, method in METHODS.items() if method.drafter)
LOOKUP_METHODS = ("dflash_lookup", "dflash_datastore")  # their reports count lookup rounds


def build_policies(methods, settings: DecodeSettings, proposer=None, datastore=None) -> dict:
    """{method: its draft policy (None: the baseline)}, refusing unknown methods, drafter methods without a drafter
    and greedy-only ones when sampling."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
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
