"""The allowed range of every numeric setting, checked once where the composed config becomes typed settings
(`entry.typed_config`): a value out of range is refused naming its key, the range and what the setting means, before
any stage reads it (and before a fleet would retry it, a trainer divide by it or a capture reject every prompt).

`RULES` maps each dotted key to its `Rule`; tests/test_faults_settings.py walks the typed configs' numeric fields
and asserts that each has one. `NON_EMPTY` names the lists that must hold something, `CROSS_CHECKS` the few ranges
that depend on another setting. Lengths against the target's positions need the target's config, which the
pipeline loads: `check_target_lengths`.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """What a numeric setting may hold: a number of `kind` (int | real) in [low, high] (a bound open where said),
    each item of a list where `each`, or one of `words` (auto), or null where `null` says what null means."""

    kind: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    meaning: str = ""
    null: str | None = None  # what null means; None: null is refused
    words: tuple[str, ...] = ()
    each: bool = False  # a list of such numbers (null or non-empty)
    length: int | None = None  # ... of exactly this many

    def allows(self, number) -> bool:
        if self.kind == "int" and not float(number).is_integer():
            return False
        above = self.low is None or (number > self.low if self.low_open else number >= self.low)
        below = self.high is None or (number < self.high if self.high_open else number <= self.high)
        return above and below

    def describe(self) -> str:
        """The range in words: "an integer >= 1", "a number in (0, 1]", "... or auto", "... or null (null: all)"."""
        noun = "an integer" if self.kind == "int" else "a number"
        if self.low is not None and self.high is not None:
            if self.kind == "int" and not (self.low_open or self.high_open):
                span = f"in {self.low:g}..{self.high:g}"
            else:
                span = f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        elif self.low is not None:
            span = f"{'>' if self.low_open else '>='} {self.low:g}"
        else:
            span = f"{'<' if self.high_open else '<='} {self.high:g}"
        text = f"{noun} {span}"
        if self.each:
            items = "integers" if self.kind == "int" else "numbers"
            text = f"a list of {self.length or 'one or more'} {items}, each {span}"
        text += "".join(f" or {w}" for w in self.words)
        return text + (f" or null (null: {self.null})" if self.null else "")


def count(low: int = 1, high: int | None = None, meaning: str = "", **kw) -> Rule:
    """An integer setting in low..high."""
    return Rule("int", low, high, meaning=meaning, **kw)


def real(low=None, high=None, meaning: str = "", *, low_open=False, high_open=False, **kw) -> Rule:
    """A real-valued setting in [low, high] (open where said)."""
    return Rule("real", low, high, low_open, high_open, meaning=meaning, **kw)


def share(meaning: str, *, low_open=False, high_open=False, **kw) -> Rule:
    """A fraction in [0, 1] (open where said)."""
    return real(0, 1, meaning, low_open=low_open, high_open=high_open, **kw)


AUTO = ("auto",)
FIGURES = "data.figures.*"  # per source: {source: SourceFigures' fields}, a plain mapping (flashdraft.config)

RULES: dict[str, Rule] = {
    "seed": count(0, meaning="the run's seed, linked to train.seed and eval.seed"),
    # model: the target as the estimates take it where its own config is out of reach
    "model.num_layers": count(meaning="the target's decoder layers"),
    "model.hidden_size": count(meaning="the target's hidden size"),
    # drafter
    "drafter.block_size": count(1, 64, "tokens a draft block"),
    "drafter.num_layers": count(meaning="draft layers"),
    "drafter.layer_ids": count(0, meaning="target layers the drafter reads", each=True, null="the default layers"),
    "drafter.num_features": count(meaning="target layers the default layer ids take"),
    "drafter.intermediate_size": count(meaning="the draft MLP's width", null="the target's"),
    # data: what the capture generates and stores
    "data.sampling.temperature": real(0, None, "the sampling temperature (data.sampling.do_sample)", low_open=True),
    "data.sampling.top_p": share("the nucleus kept when sampling", low_open=True),
    "data.sampling.top_k": count(0, meaning="tokens kept when sampling; 0: off"),
    "data.store.clevel": count(0, 22, "the compression level (blosc codecs: 0..9)"),
    "data.store.chunk_tokens": count(meaning="inner chunk rows, the unit of a random read"),
    "data.store.shard_tokens": count(meaning="rows buffered per write, a multiple of data.store.chunk_tokens"),
    "data.store.teacher_topk": count(0, meaning="the target's top-k next tokens kept per token; 0: none"),
    "data.store.calibration_tokens": count(meaning="tokens a projected store's basis is fitted on"),
    "data.heldout_fraction": share("the share of each source held out for evaluation", high_open=True),
    "data.thinking_share": share("the share of prompts in thinking mode (data.thinking=mixed)"),
    "data.max_new_tokens": count(meaning="response tokens a prompt at most"),
    "data.max_length": count(2, meaning="prompt + response tokens a sequence at most"),
    "data.max_prompt_tokens": count(meaning="prompt tokens at most; longer prompts are rejected"),
    "data.expected_response_tokens": count(meaning="estimate's response tokens", null="max_new_tokens / 2"),
    "data.capture_tokens_per_s": real(0, None, "stored tokens one GPU captures a second (estimate)", low_open=True),
    "data.batch_size": count(meaning="rows decoding together", words=AUTO),
    "data.prefill_tokens": count(meaning="tokens one prefill holds", words=AUTO),
    "data.writer_threads": count(0, meaning="threads writing shards; 0: in the decode loop", words=AUTO),
    "data.gpu_memory_fraction": share("of the GPU memory free after the target loads, what auto fills", low_open=True),
    "data.shard_size": count(meaning="prompts per fleet task = per store shard"),
    f"{FIGURES}.samples": count(meaning="records in the source, both splits"),
    f"{FIGURES}.prompt_tokens": real(0, None, "mean rendered prompt tokens", low_open=True),
    f"{FIGURES}.response_tokens": real(0, None, "mean response tokens", low_open=True),
    # cluster
    "cluster.num_actors": count(0, meaning="capture workers; 0: in this process, no Ray", words=AUTO),
    "cluster.gpus_per_actor": real(0, None, "GPUs each capture worker takes", words=AUTO),
    "cluster.cpus_per_actor": real(0, None, "CPUs each capture worker takes", low_open=True, words=AUTO),
    "cluster.max_attempts": count(meaning="attempts a shard gets before it is reported"),
    "cluster.object_store_mb": count(meaning="a local Ray's object store, MiB"),
    # train
    "train.num_anchors": count(meaning="blocks per sequence per epoch"),
    "train.gamma": real(0, None, "the loss decay exp(-(k-1)/gamma)", low_open=True, null="the paper's"),
    "train.soft_labels": share("the weight of the target's top-k distribution in the labels"),
    "train.loss_vocab": count(0, meaning="the training softmax's most frequent tokens; 0: the whole vocabulary"),
    "train.max_length": count(2, meaning="tokens a training sequence at most"),
    "train.token_budget": count(meaning="padded tokens a micro-batch"),
    "train.grad_accum": count(meaning="micro-batches a step"),
    "train.epochs": count(meaning="passes over the stores"),
    "train.max_steps": count(meaning="optimizer steps at most", null="every step of train.epochs"),
    "train.lr": real(0, None, "the peak learning rate", low_open=True),
    "train.weight_decay": real(0, None, "AdamW's weight decay"),
    "train.betas": share("AdamW's betas", high_open=True, each=True, length=2),
    "train.warmup_ratio": share("the share of steps the learning rate warms up"),
    "train.grad_clip": real(0, None, "the gradient norm clipped to; 0: off"),
    "train.zero_stage": count(0, 3, "DeepSpeed ZeRO's stage"),
    "train.ce_chunk": count(meaning="loss rows a chunk"),
    "train.loader_workers": count(meaning="threads building micro-batches ahead"),
    "train.prefetch": count(meaning="micro-batches built ahead"),
    "train.checkpoint_every": count(0, meaning="steps between checkpoints; 0: only at the end"),
    "train.keep_checkpoints": count(meaning="checkpoints kept"),
    "train.eval_every": count(0, meaning="steps between held-out evals; 0: only at the end"),
    "train.eval_batches": count(meaning="held-out steps an eval"),
    "train.heldout_fraction": share("the hashed held-out part of the stores", high_open=True),
    "train.log_every": count(meaning="steps between logged rows"),
    "train.seed": count(0, meaning="the trainer's seed"),
    "train.stop_tau": real(0, None, "the training tau that stops training", low_open=True, null="train every step"),
    "train.stop_steps": count(meaning="steps in a row at train.stop_tau"),
    "train.verify_sample": share("the share of inner chunks train.verify_store=sample reads", low_open=True),
    # eval
    "eval.heldout_fraction": share("the share of each source held out", high_open=True),
    "eval.limit": count(meaning="prompts per source", null="all"),
    "eval.max_new_tokens": count(meaning="tokens generated a prompt"),
    "eval.temperature": real(0, None, "the sampling temperature; 0: greedy"),
    "eval.top_p": share("the nucleus kept when sampling", low_open=True),
    "eval.top_k": count(0, meaning="tokens kept when sampling; 0: off"),
    "eval.block_size": count(1, 64, "the block the loop runs; 1: plain decoding", null="the drafter's"),
    "eval.prompt_lookup_num_tokens": count(meaning="tokens a lookup round verifies at most"),
    "eval.draft_cutoff": share("cumulative draft probability a verified draft needs; 0: all", high_open=True),
    "eval.tree_size": count(meaning="tree candidates verified a round"),
    "eval.tree_branching": count(meaning="candidate tokens a block position"),
    "eval.draft_vocab": count(0, meaning="the most frequent response tokens drafts score; 0: every word"),
    "eval.lookup_ngram": count(meaning="tokens a lookup matches"),
    "eval.datastore_ngram": count(meaning="tokens a datastore lookup matches"),
    "eval.datastore_min_ngram": count(meaning="the fewest a datastore lookup backs off to"),
    "eval.datastore_min_count": count(meaning="times a datastore continuation was seen at least"),
    "eval.num_threads": count(meaning="torch CPU threads", null="torch's default"),
    "eval.seed": count(0, meaning="the eval's seed"),
    # gate (gate/, `make gate`)
    "gate.sequences": count(meaning="prompts captured, trained on and served"),
    "gate.max_new_tokens": count(2, meaning="response tokens each"),
    "gate.max_steps": count(meaning="training steps at most"),
    "gate.train_tau": share("the share of the block size a step's training tau must reach", low_open=True),
    "gate.stable_steps": count(meaning="steps in a row at gate.train_tau"),
    "gate.threshold": share("the share of the block size each engine must commit a round", low_open=True),
}

# lists that must hold something: what they hold (a rule's `null` meaning, where null is allowed)
NON_EMPTY: dict[str, tuple[str, str | None]] = {
    "data.sources": ("the prompt sources", None),
    "train.stores": ("the feature stores to train on", None),
    "train.eval_stores": ("the held-out stores", "a hashed held-out part of train.stores"),
    "eval.prompts": ("the prompt sources", None),
    "eval.methods": ("the methods compared", "every method"),
    "gate.engines": ("the engines served", None),
}


def _blosc_level(get) -> str | None:
    if str(get("data.store.codec")).startswith("blosc") and get("data.store.clevel") > 9:
        return f"data.store.clevel must be in 0..9 for {get('data.store.codec')}, got {get('data.store.clevel')}"
    return None


def _whole_chunks(get) -> str | None:
    shard, chunk = get("data.store.shard_tokens"), get("data.store.chunk_tokens")
    if shard % chunk:
        return f"data.store.shard_tokens must be a multiple of data.store.chunk_tokens ({chunk}), got {shard}"
    return None


def _datastore_ngrams(get) -> str | None:
    low, high = get("eval.datastore_min_ngram"), get("eval.datastore_ngram")
    if low > high:
        return f"eval.datastore_min_ngram must be at most eval.datastore_ngram ({high}), got {low}"
    return None


CROSS_CHECKS = (_blosc_level, _whole_chunks, _datastore_ngrams)  # run once every value is in its own range


def check_settings(cfg) -> None:
    """Refuse the first setting of `cfg` (flashdraft.config.Config) out of its range, naming key, value and range;
    every numeric setting is checked (`RULES`), every list of `NON_EMPTY`, then `CROSS_CHECKS`."""

    def get(key: str):
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        return node

    for key, rule in RULES.items():
        if key.startswith(FIGURES + "."):
            field = key.rsplit(".", 1)[1]
            for source, values in (cfg.data.figures or {}).items():
                if isinstance(values, dict) and field in values:
                    check_value(f"data.figures.{source}.{field}", values[field], rule)
            continue
        check_value(key, get(key), rule)
    for key, (what, null) in NON_EMPTY.items():
        value = get(key)
        if value is None and null is None or value is not None and len(value) == 0:
            allowed = f"a non-empty list of {what}" + (f" or null (null: {null})" if null else "")
            raise ValueError(f"{key} must be {allowed}, got {value!r}")
    for cross in CROSS_CHECKS:
        problem = cross(get)
        if problem:
            raise ValueError(problem)


def check_value(key: str, value, rule: Rule) -> None:
    """Refuse `value` of setting `key` unless `rule` allows it."""
    if value is None and rule.null:
        return
    if isinstance(value, str) and value in rule.words:
        return
    items = list(value) if rule.each and isinstance(value, (list, tuple)) else [value]
    if rule.each and (not isinstance(value, (list, tuple)) or not items or len(items) != (rule.length or len(items))):
        items = [None]  # not a list of the right length: refused below as a whole
    numeric = [isinstance(v, numbers.Real) and not isinstance(v, bool) for v in items]
    if all(numeric) and all(rule.allows(v) for v in items):
        return
    meaning = f" ({rule.meaning})" if rule.meaning else ""
    if not all(numeric) and not rule.each:
        kinds = "a number" + "".join(f" or {w}" for w in rule.words) + (" or null" if rule.null else "")
        raise ValueError(f"{key} must be {kinds}, got {value!r}: {rule.describe()}{meaning}")
    raise ValueError(f"{key} must be {rule.describe()}, got {value!r}{meaning}")


def check_target_lengths(max_length: int, target_config, target: str) -> None:
    """Refuse a `data.max_length` past the target's positions (its config's max_position_embeddings, where it has
    one): a longer sequence would be captured at positions the target was never trained on."""
    positions = getattr(target_config, "max_position_embeddings", None)
    if positions is None and hasattr(target_config, "get_text_config"):
        positions = getattr(target_config.get_text_config(), "max_position_embeddings", None)
    if isinstance(positions, int) and max_length > positions:
        raise ValueError(
            f"data.max_length must be at most the target's {positions} positions (max_position_embeddings of "
            f"{target}'s config), got {max_length} (prompt + response tokens a sequence at most)"
        )
