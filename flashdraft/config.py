"""The typed settings of every stage: one dataclass per config group, each default stated once, here (the drafter's
geometry: DraftSpec's, flashdraft/spec.py; the held-out share: flashdraft/prompts.py).

Every entry point (`python -m pipeline | trainer | harness`) composes the whole of conf/config.yaml, so each
needs every group's schema; they live in the core because no stage may import another. The dataclasses are
plain and know nothing of Hydra: the entry points register them and convert the composed config once
(`entry.typed_config`); a stage's code gets instances, never a DictConfig. The yaml files under conf/ hold profiles
(values that differ from these defaults) and documentation of the choices.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, is_dataclass
from typing import Any

from flashdraft.prompts import DEFAULT_HELDOUT_FRACTION
from flashdraft.spec import DEFAULT_NUM_FEATURES, DraftSpec
from flashdraft.target.memory import DEFAULT_FRACTION

MISSING = "???"  # OmegaConf's marker of a value the yaml or the command line must give

# --- model (conf/model/*.yaml) ----------------------------------------------------------------


@dataclass
class ChatConfig:
    system_prompt: str | None = None  # None: the template's own default system prompt
    enable_thinking: bool | None = None  # passed to templates that know it (Qwen3); None: not a thinking model


@dataclass
class ModelConfig:
    """The target. `num_layers` and `hidden_size` serve estimates where the target's own config is out of reach."""

    name: str = MISSING
    target: str = MISSING  # a hub id, a local HF folder, or smollm2-135m (the embedded default)
    num_layers: int = MISSING
    hidden_size: int = MISSING
    dtype: str = "bfloat16"  # auto (bf16 on CUDA and on CPUs with fast bf16, else float32) | bfloat16 | float32
    chat: ChatConfig = field(default_factory=ChatConfig)


# --- drafter geometry (the `drafter` node of conf/config.yaml; profiles override it) -------------


@dataclass
class DrafterConfig:
    """The drafter's shape as asked for, defaults DraftSpec's: `DraftSpec.from_settings` makes the spec of it (the
    trainer's, and the harness's untrained drafter's)."""

    block_size: int = DraftSpec.block_size
    num_layers: int = DraftSpec.num_draft_layers
    # the target layers the drafter reads: the pipeline captures them, the trainer reads them from the stores (which
    # must hold them). None: the reference formula's `num_features` layers (flashdraft.spec.default_layer_ids) for the
    # pipeline, every layer the stores hold for the trainer
    layer_ids: list[int] | None = None
    num_features: int = DEFAULT_NUM_FEATURES
    intermediate_size: int | None = DraftSpec.intermediate_size  # None: the target's


# --- data: prompts -> features (conf/data/*.yaml; read by the pipeline) -------------------------


@dataclass
class SamplingConfig:
    """How the target writes responses (greedy unless do_sample)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off


@dataclass
class StoreConfig:
    """The feature store's layout (flashdraft.store.StoreLayout)."""

    dtype: str = "bfloat16"  # bfloat16 | float16 | float8_e4m3 (per-token scales) | float32
    codec: str = "blosc-zstd"  # blosc-zstd | blosc-lz4 | zstd | none
    clevel: int = 3
    chunk_tokens: int = 64  # inner chunk rows: the unit of a random read
    shard_tokens: int = 4096  # rows buffered per write (each array of a shard is one file, whatever its rows)
    teacher_topk: int = 0  # > 0: also keep the target's k most likely next tokens per token (train.soft_labels)
    # pca: store the captured layers' features projected to project_dims (an int, or H, 2H, 2.5H: times the
    # target's hidden size) by a basis fitted once per store on its first calibration_tokens tokens
    # (flashdraft.store.projection); null: the raw features. The drafter exports unchanged (fc folded with the basis).
    project: str | None = None
    project_dims: str = "2H"
    calibration_tokens: int = 32768


@dataclass
class SourceFigures:
    """What `estimate` takes a prompt source to be where its records cannot be read (a hub source offline)."""

    samples: int = MISSING  # records in the source, both splits
    prompt_tokens: float = MISSING  # mean rendered prompt, chat template included
    response_tokens: float = MISSING  # mean response (capped at max_new_tokens; expected_response_tokens wins)
    source: str = MISSING  # where each figure comes from: a dataset card, a paper section, or "assumption: why"


@dataclass
class DataConfig:
    name: str = MISSING
    sources: list[str] = field(default_factory=lambda: ["humaneval", "mtbench"])
    path: str | None = None  # data=local: the user's .jsonl or .parquet file
    split: str | None = "train"  # train | heldout | None (all): held-out prompts stay for the harness
    limit: Any = None  # records per source: a number for all, a {source: number} map, or None (all)
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION
    mode: str = "regenerate"  # regenerate: the target writes the responses | capture: the records carry them
    # regenerate mode: all: every user turn answered in order against the target's own earlier answers, one sequence
    # a conversation (pipeline/turns.py) | single: the record's final user turn only (later followups dropped)
    turns: str = "all"
    # the template's enable_thinking per prompt (Qwen3): a drafter serves well only in the modes it was trained on.
    # None: model.chat.enable_thinking for every prompt | on | off | mixed: thinking_share of the prompts on, each
    # prompt's mode drawn from a hash of its seq_id (a rerun or resume picks the same); shards record each mode
    thinking: str | None = None
    thinking_share: float = 0.5
    max_new_tokens: int = 512
    max_length: int = 3072  # prompt + response tokens
    max_prompt_tokens: int = 2048  # longer prompts are rejected
    expected_response_tokens: int | None = None  # for `estimate` (None: max_new_tokens / 2, or the source's figures)
    # per source, for `estimate` without its records: {source: SourceFigures' fields}, checked by `source_figures`
    # (a plain dict: OmegaConf cannot take a new entry of a dict of dataclasses from the command line)
    figures: dict[str, Any] = field(default_factory=dict)
    capture_tokens_per_s: float = 250.0  # stored tokens one GPU captures a second, for `estimate`'s GPU-hours
    # rows decoding together (a row that ends takes the next prompt); auto: as many as the free GPU memory holds at
    # max_length each (flashdraft.target.memory; the worker prints the arithmetic), 8 on a CPU
    batch_size: Any = "auto"
    # tokens one prefill holds (rows x longest, padding included): capture mode batches by it, and on a GPU the
    # prompts joining a regenerate decode prefill in groups of at most it; auto: from the free GPU memory in capture
    # mode, 16384 otherwise (on a CPU, regenerate: the joining prompts prefill together, unsplit)
    prefill_tokens: Any = "auto"
    # threads writing shards off the decode loop, 0: written in the decode loop; auto: on a GPU every CPU thread of
    # the worker but the decode loop's, on a CPU 0 (torch's threads decode on every core)
    writer_threads: Any = "auto"
    # read each decode step's results while the next one runs, so the host's bookkeeping overlaps the device's work:
    # auto (on CUDA; on a CPU the host is the device) | on | off (each step read before the next is launched)
    overlap: Any = "auto"
    # the decode's device-to-host copies staged through fresh host buffers (pinned on CUDA) behind an event, so that
    # they queue behind the device's work: auto (on CUDA) | on (on a CPU: plain copies, the same code path) | off
    staged_copies: Any = "auto"
    gpu_memory_fraction: float = DEFAULT_FRACTION  # of the GPU memory free after the target loads, what auto fills
    shard_size: int = 32  # prompts per fleet task = per store shard
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    store: StoreConfig = field(default_factory=StoreConfig)


def thinking_setting(value, key: str, choices: tuple[str, ...]) -> str | None:
    """`data.thinking` / `eval.thinking` as one of `choices` (None: the model's chat default). A yaml `on`/`off` or
    `true`/`false` may arrive as a boolean, or as its text through a str field."""
    text = {"true": "on", "false": "off", "none": None, "null": None}.get(str(value).lower(), str(value).lower())
    if value is None or text is None:
        return None
    if text not in choices:
        raise ValueError(f"{key} must be one of {list(choices)} or null, got {value!r}")
    return text


SWITCH_WORDS = {"auto": None, "on": True, "true": True, "yes": True, "off": False, "false": False, "no": False}


def switch_setting(value, key: str) -> bool | None:
    """An auto | on | off setting as None (auto: the caller resolves it by device) or a boolean. A yaml or command
    line `on`/`off`/`true`/`false` may arrive as a boolean or as its text."""
    word = str(value).lower()
    if word not in SWITCH_WORDS:
        raise ValueError(f"{key} must be auto, on or off, got {value!r}")
    return SWITCH_WORDS[word]


def source_figures(figures: dict) -> dict[str, SourceFigures]:
    """`DataConfig.figures` (a plain mapping) as SourceFigures; an unknown or missing field is refused by name."""
    out = {}
    for source, values in figures.items():
        key = f"data.figures.{source}"
        if not isinstance(values, dict):
            raise ValueError(f"{key} must be a mapping of {list(SourceFigures.__dataclass_fields__)}, got {values!r}")
        fig = checked_settings(values, SourceFigures, key)
        missing = [k for k in SourceFigures.__dataclass_fields__ if getattr(fig, k) == MISSING]
        if missing:
            raise ValueError(f"{key} lacks {missing}")
        out[str(source)] = fig
    return out


# --- cluster (conf/cluster/*.yaml) --------------------------------------------------------------


@dataclass
class ClusterConfig:
    name: str = "local"
    ray_address: str | None = None  # None: start a local Ray; auto: join the cluster this node belongs to
    # capture workers (0: in-process, no Ray); auto: one per GPU where the capture runs on GPUs, else 1
    num_actors: Any = "auto"
    gpus_per_actor: Any = "auto"  # auto: 1 where the capture runs on GPUs, else 0
    # auto: where the capture runs on this machine's GPUs, its CPUs shared by one actor a GPU (the shard writers take
    # all of an actor's CPUs but the decode loop's); on a CPU 1
    cpus_per_actor: Any = "auto"
    max_attempts: int = 3  # a shard failing this often is reported, not retried
    object_store_mb: int = 256


# --- train (conf/train/*.yaml; read by the trainer) ---------------------------------------------


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled (the WANDB_MODE variable wins)
    project: str = "flashdraft"
    entity: str | None = None
    name: str | None = None


@dataclass
class TrainConfig:
    """How a drafter is trained (its shape is `DrafterConfig`; its target layers come from the feature stores).
    The defaults are the paper's recipe; conf/config.yaml links the paths, seed and device to the root's."""

    stores: list[str] = MISSING  # feature store paths
    out_dir: str = MISSING  # checkpoints/, metrics.jsonl, wandb/
    drafter_dir: str | None = None  # a copy of the latest exported drafter, read by the harness
    # also export each drafter in the peer's format (vLLM's speculators, flashdraft.speculators_format) at
    # <drafter>-speculators beside it, the target named as its verifier
    export_speculators: bool = False
    target: str = MISSING  # the target the stores were captured from (a hub id, a folder, smollm2-135m)
    eval_stores: list[str] | None = None  # held-out stores for eval/* (None: a hashed held-out part of `stores`)
    init: str = "random"  # random | target (draft layers start as the target's top layers) | a drafter folder
    num_anchors: int = 512  # blocks per sequence per epoch
    gamma: float | None = None  # loss decay exp(-(k-1)/gamma); None: the paper's for the block size
    soft_labels: float = 0.0  # weight of the target's top-k distribution in the labels (0: the paper's hard labels)
    loss_vocab: int = 0  # > 0: the training softmax over the k most frequent response tokens (+ the batch's labels)
    max_length: int = 3072
    token_budget: int = 16384  # padded tokens (context + blocks) per micro-batch
    grad_accum: int = 1
    epochs: int = 6
    max_steps: int | None = None
    lr: float = 6e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    zero_stage: int = 2
    dtype: str = "auto"  # auto (bf16 on GPU; on a CPU the faster of bf16 and fp32, timed) | bfloat16 | float32
    device: str = "auto"  # auto | cpu | cuda
    attention: str = "auto"  # auto (flex on GPU, dense on CPU) | flex | dense
    compile: str = "auto"  # torch.compile the drafter: auto (on GPU) | true | false
    # dense attention's key/value heads (flashdraft.model._dense_attention): auto (expanded on GPU, where SDPA's
    # memory-efficient kernel takes a mask but not grouped heads; grouped on CPU) | grouped | expanded
    dense_kv_heads: str = "auto"
    dist_backend: str = "auto"  # torch.distributed's: auto (gloo on CPU, cpu:gloo,cuda:nccl on GPU) | a backend string
    pin_memory: str = "auto"  # loader batches pinned, for asynchronous copies to the GPU: auto (on GPU) | true | false
    ce_chunk: int = 1024  # loss rows a chunk: the logits of one chunk are the loss's peak memory
    loader_workers: int = 4  # threads building micro-batches ahead
    prefetch: int = 4  # micro-batches built ahead
    checkpoint_every: int = 1000  # steps (0: only at the end)
    keep_checkpoints: int = 3
    eval_every: int = 500  # steps (0: only at the end)
    eval_batches: int = 8
    heldout_fraction: float = 0.02  # the hashed held-out part of `stores` when there are no eval_stores
    # steps between logged rows; the loop waits for the device only at those steps (and at eval and checkpoint
    # steps): one collective and one copy of the steps' sums, where non-finite losses are found too
    log_every: int = 1
    seed: int = 0
    resume: bool = True  # continue from the latest checkpoint in out_dir
    # stop once a step's training tau (sum over ranks) reaches this many tokens (None: train every planned step); the
    # overfit gate (gate/, `make gate`) stops near the block size with it. Set, every step is logged (log_every is
    # taken as 1): each step's tau is then on the host
    stop_tau: float | None = None
    stop_steps: int = 1  # ... on this many steps in a row (a step's tau is measured before its own update)
    check_target: bool = True  # refuse stores captured from another target (config and tokenizer hashes)
    # the stores' checksums before step 1: full (every inner chunk, the work split over the ranks) | sample (every
    # shard's attributes and every array's index, `verify_sample` of the inner chunks) | off. sample by default: full
    # reads every byte of the store at every start and resume, which grows with the store; sample finds what damages
    # whole files (truncation, a missing file, a bad index) in time independent of the chunks' bytes, and a chunk it
    # did not read still stops the read that meets it, naming store, shard, array, rows and sequence (at most the
    # steps since the last checkpoint lost). Small stores (conf/train/cpu.yaml) take full.
    verify_store: str = "sample"
    verify_sample: float = 0.01  # sample: the share of each array's inner chunks read (at least one a shard)
    progress: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)


# --- eval (conf/eval/*.yaml; read by the harness) -----------------------------------------------


@dataclass
class EvalConfig:
    """What `python -m harness` measures and how (the quick profile's values; `eval=full|paper` override some).
    conf/config.yaml links its paths, seed and device to the root's; built directly, they are given."""

    name: str = "quick"
    prompts: list[str] = field(default_factory=lambda: ["humaneval", "mtbench"])  # flashdraft.prompts sources
    split: str = "heldout"  # heldout | train | all
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION  # the share of each source held out (data=heldout reads it)
    limit: int | None = 4  # prompts per source (None: all)
    # all: a multi-turn record's later user turns (MT-Bench's second questions) are each measured after the target's
    # own plain answer to the turn before (harness/evaluate.py) | single: the first turn only
    turns: str = "all"
    max_new_tokens: int = 64
    # the template's enable_thinking (Qwen3): None: model.chat.enable_thinking | on | off | both: every prompt in
    # each mode, the report giving tau per mode (a drafter accepts well only in the modes it was trained on)
    thinking: str | None = None
    temperature: float = 0.0  # 0: greedy, outputs compared token for token with plain decoding
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    # the block the loop runs: None: the drafter's; 1: plain decoding; at most the drafter's (refused above it)
    block_size: int | None = None
    drafter: str | None = None  # the exported drafter folder
    allow_untrained: bool = True  # no drafter at `drafter`: measure a random one, flagged loudly
    # exact verification (flashdraft/target/exact.py): on: every method runs the target made exact, so greedy outputs
    # must equal plain decoding's token for token (the lossless check) | off: every method runs the target's own
    # kernels, the speed a user gets (greedy outputs may part at a near-tie; the report gives where, as information)
    # | auto: on when greedy, off when sampling. The speed table compares each method with plain in the same mode.
    exact: str = "auto"
    # the methods compared, by name (harness/methods.py); None: every method of that table. The tree, lookup and
    # datastore methods are greedy only; plain_as_loaded: a second copy of the target without exact verification,
    # beside the exact one (eval.exact=off leaves it out: plain is then that already)
    methods: list[str] | None = None
    prompt_lookup_num_tokens: int = 10  # prompt_lookup, and the most tokens a lookup or datastore round verifies
    draft_cutoff: float = 0.0  # dflash: verify the drafts of cumulative draft probability >= this (0: all)
    tree_size: int = 7  # dflash_tree (and the lookup methods' tree): candidates verified a round
    tree_branching: int = 4  # ... candidate tokens a block position
    draft_vocab: int = 8192  # drafts score only this many most frequent response tokens (FR-Spec; 0: all words)
    draft_vocab_store: str | None = None  # the store they are counted in (eval prompts left out)
    lookup_ngram: int = 3  # dflash_lookup: verify what followed the newest this-many tokens where they occurred before
    datastore: str | None = None  # dflash_datastore: the training store whose responses it continues
    datastore_ngram: int = 4  # ... the newest this-many tokens
    datastore_min_ngram: int = 2  # ... backing off to as few as this many
    datastore_min_count: int = 2  # ... with a continuation seen at least this often (and in at least half the cases)
    resume: bool = True  # prompts runs.jsonl holds under the same settings are not run again
    warmup: bool = True  # one short untimed run per method first
    num_threads: int | None = None  # torch CPU threads (None: torch's default)
    seed: int = 0
    out_dir: str = MISSING
    metrics: str | None = None  # the trainer's log: training.png and train/serve parity
    replay_store: str | None = None  # the eval prompts' store: served-order replay


# --- gate (the root node `gate`; read by the gate package, `make gate`) -------------------------------


GATE_PLANTS = ("labels+1", "layers-1")
GATE_ENGINES = ("harness", "reference", "llamacpp")


@dataclass
class GateConfig:
    """The overfit gate: capture `sequences` prompts' responses, train a drafter on them until its training tau is
    near the block size, export it, serve those prompts greedily in each engine; each must commit at least
    `threshold` x block size tokens a round. `plant` puts a known train/serve mismatch in, to see the gate fail."""

    # prompts captured, trained on and served (data.limit; the first of data.sources' split). Every anchor of every
    # sequence trains in each step, so a CPU step costs about sequences x max_new_tokens blocks of the whole softmax
    sequences: int = 2
    max_new_tokens: int = 48  # response tokens each, at capture and when served
    max_steps: int = 400  # training steps at most
    # stop training once a step's training tau reaches this share of the block size (1: every position of every block
    # right; at 0.99 = 15.84/16 the embedded default served 13.43, one block of six wrong at a doubled newline) ...
    train_tau: float = 1.0
    # ... on this many steps in a row: a step's tau is its weights' before its update, which may undo it (one step
    # at 15.91/16 exported a drafter the embedded default served at 10.44)
    stable_steps: int = 3
    threshold: float = 0.9  # each engine must commit at least this share of the block size a round (its tau)
    # null | labels+1: train each block position on the token after its own (a label offset) | layers-1: serve the
    # drafter with every target layer id one lower than it was trained on (a layer-id offset at serve time)
    plant: str | None = None
    engines: list[str] = field(default_factory=lambda: ["harness", "reference"])  # of GATE_ENGINES
    # store, training run, drafter and report: a folder the gate made (cleared at each run) or a new or empty one
    out_dir: str = "${run_dir}/gate"


# --- the root ---------------------------------------------------


@dataclass
class Config:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    train: TrainConfig = MISSING
    eval: EvalConfig = MISSING
    cluster: ClusterConfig = MISSING
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    seed: int = 0
    run_dir: str = "runs/${model.name}"
    features_dir: str = "${run_dir}/features"
    drafter_dir: str = "${run_dir}/drafter"
    eval_dir: str = "${run_dir}/eval"
    device: str = "auto"  # auto | cpu | cuda
    trust_remote_code: bool = False


def unknown_settings(values: dict, schema: type) -> list[str]:
    """The dotted keys of `values` (a plain mapping) that the dataclass `schema` has no field for. Hydra's
    `+key=value` adds such keys to a structured config, and `OmegaConf.to_object` would drop them silently."""
    hints = typing.get_type_hints(schema)
    unknown = []
    for key, value in values.items():
        if key not in hints:
            unknown.append(key)
        elif isinstance(value, dict) and is_dataclass(hints[key]):
            unknown += [f"{key}.{sub}" for sub in unknown_settings(value, hints[key])]
    return sorted(unknown)


def checked_settings(values: dict, schema: type, group: str):
    """A plain mapping as a `schema` instance; keys it does not know (a retired option, a typo) are refused by name."""
    refuse_unknown(values, schema, group)
    return schema(**values)


def refuse_unknown(values: dict, schema: type, group: str) -> None:
    """Refuse, by name, the keys of `values` that `schema` does not know (`group`: where they sit, "" for the root)."""
    unknown = unknown_settings(values, schema)
    if unknown:
        where = f"{group}.* in conf/" if group else "conf/"
        raise ValueError(f"unknown {group + ' ' if group else ''}settings {unknown} ({where} or on the command line)")
