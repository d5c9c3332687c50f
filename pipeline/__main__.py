"""`python -m pipeline [overrides]`: capture target features into the store at `features_dir`.

python -m pipeline model=smollm2-135m data.limit=8          # capture (resumes if rerun)
python -m pipeline estimate data=nemotron model=qwen3-8b     # bytes, shards, files, GPU-hours (offline too)
python -m pipeline verify runs/smollm2-135m/features        # check a store; exit 1 on a problem
python -m pipeline repair runs/smollm2-135m/features        # drop listed shards missing or damaged (rerun recaptures)
python -m pipeline transcode SRC DST dtype=fp8 project=pca project_dims=2H   # a copy in another dtype / projected
python -m pipeline paths run_dir=/shared/runs/qwen3-8b       # where a cluster job writes; exit 1 if relative
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

# RAY_AUTH_MODE is the user's: a local instance (pipeline/localray.py) defaults it, a cluster driver follows theirs
for _k, _v in (("HF_HUB_ETAG_TIMEOUT", "10"), ("HF_HUB_DOWNLOAD_TIMEOUT", "10")):
    os.environ.setdefault(_k, _v)

import hydra  # noqa: E402
from hydra.errors import HydraException  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from entry import compose, register_configs, typed_config  # noqa: E402
from entry.ranges import check_target_lengths  # noqa: E402
from flashdraft.config import Config, DataConfig, source_figures, switch_setting, thinking_setting  # noqa: E402
from flashdraft.prompts import PromptSourceUnavailable  # noqa: E402
from flashdraft.spec import capture_layer_ids, check_layer_ids, default_layer_ids  # noqa: E402
from flashdraft.store import StoreError, StoreLayout, verify_store  # noqa: E402
from flashdraft.store.lock import writer_lock  # noqa: E402
from flashdraft.store.projection import split_store_options  # noqa: E402
from flashdraft.store.repair import drop_damaged_shards  # noqa: E402
from pipeline.fleet import FleetConfig, local_gpus, run_fleet  # noqa: E402
from pipeline.job import (  # noqa: E402
    estimate,
    figures_row,
    load_records,
    open_store,
    sampled_row,
    source_limit,
    target_config,
)
from pipeline.settings import CaptureSettings  # noqa: E402


def captured_layer_ids(cfg: Config, offline_ok: bool = False) -> list[int]:
    """The target layers the capture stores: the ones the drafter reads (`drafter.layer_ids`, else the reference
    formula's `drafter.num_features`). With `offline_ok` (estimates) a target whose config cannot be read is taken
    at the model yaml's word (`num_layers`). Where the config is read, data.max_length is checked against the
    target's positions too (entry.ranges.check_target_lengths)."""
    m, d = cfg.model, cfg.drafter
    try:
        config = target_config(m.target, cfg.trust_remote_code)
    except OSError:
        if not offline_ok:
            raise
        return check_layer_ids(d.layer_ids or default_layer_ids(m.num_layers, d.num_features), m.num_layers)
    check_target_lengths(cfg.data.max_length, config, m.target)
    return capture_layer_ids(config, d.num_features, d.layer_ids)


def auto_or_int(value, key: str) -> int | str:
    """A setting that takes a number or `auto`, as CaptureSettings holds it."""
    if str(value) == "auto":
        return "auto"
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be a number or auto, got {value!r}") from None


def settings_from(cfg: Config, offline_ok: bool = False) -> CaptureSettings:
    m, d = cfg.model, cfg.data
    return CaptureSettings(
        target=m.target,
        layer_ids=tuple(captured_layer_ids(cfg, offline_ok)),
        dtype=m.dtype,
        device=cfg.device,
        mode=d.mode,
        turns=d.turns,
        max_new_tokens=d.max_new_tokens,
        max_length=d.max_length,
        max_prompt_tokens=d.max_prompt_tokens,
        batch_size=auto_or_int(d.batch_size, "data.batch_size"),
        prefill_tokens=auto_or_int(d.prefill_tokens, "data.prefill_tokens"),
        writer_threads=auto_or_int(d.writer_threads, "data.writer_threads"),
        overlap=switch_setting(d.overlap, "data.overlap"),
        staged_copies=switch_setting(d.staged_copies, "data.staged_copies"),
        gpu_memory_fraction=d.gpu_memory_fraction,
        sampling=d.sampling,
        seed=cfg.seed,
        system_prompt=m.chat.system_prompt,
        **thinking_settings(m.chat.enable_thinking, d.thinking, d.thinking_share),
        trust_remote_code=cfg.trust_remote_code,
        torch_threads=int(max(1, cpus_per_actor(cfg)[0])),
    )


def cpus_per_actor(cfg: Config) -> tuple[float, str]:
    """(cluster.cpus_per_actor, why): as set, or auto: where the capture runs on this machine's GPUs, its CPUs shared
    by one actor a GPU (the decode loop takes one, the shard writers the others: data.writer_threads auto); on a CPU,
    or on a Ray cluster (whose nodes this machine does not know: conf/cluster/ray.yaml and slurm.yaml set it), 1.
    (A value that is neither was refused at the entry: entry.ranges.)"""
    value = cfg.cluster.cpus_per_actor
    if str(value) != "auto":
        return float(value), "cluster.cpus_per_actor"
    if cfg.cluster.ray_address:
        return 1.0, "cluster.cpus_per_actor=auto on a Ray cluster (cluster.ray_address set)"
    gpus = local_gpus(cfg.device)
    if not gpus:
        return 1.0, "cluster.cpus_per_actor=auto on CPU"
    cpus = len(os.sched_getaffinity(0))
    return float(max(1, cpus // gpus)), f"cluster.cpus_per_actor=auto: {cpus} CPUs shared by {gpus} GPU(s)' actors"


def thinking_settings(enable_thinking, thinking, share) -> dict:
    """CaptureSettings' enable_thinking and thinking_share from model.chat.enable_thinking and data.thinking."""
    mode = thinking_setting(thinking, "data.thinking", ("on", "off", "mixed"))
    if mode == "mixed":
        return {"enable_thinking": enable_thinking, "thinking_share": float(share)}
    return {"enable_thinking": enable_thinking if mode is None else mode == "on", "thinking_share": None}


def fleet_from(cfg: Config) -> FleetConfig:
    c = cfg.cluster
    cpus, why = cpus_per_actor(cfg)
    if why != "cluster.cpus_per_actor":
        print(f"{cpus:g} CPUs a capture actor: {why}", file=sys.stderr, flush=True)
    return FleetConfig(
        num_actors=auto_or_int(c.num_actors, "cluster.num_actors"),
        cpus_per_actor=cpus,
        gpus_per_actor="auto" if str(c.gpus_per_actor) == "auto" else float(c.gpus_per_actor),
        ray_address=c.ray_address,
        shard_size=cfg.data.shard_size,
        max_attempts=c.max_attempts,
        object_store_mb=c.object_store_mb,
    )


def records_from(cfg: Config, counts: dict | None = None):
    d = cfg.data
    return load_records(d.sources, split=d.split, limit=d.limit, heldout_fraction=d.heldout_fraction, counts=counts)


def split_words(split: str | None) -> str:
    """`data.split` as the summary says it: "train split", "all records"."""
    return "all records" if split in (None, "all") else f"{split} split"


OUTPUTS = ("features_dir", "run_dir")  # the store, and where Hydra logs the run
SHARED_PATHS = (
    "a Ray job runs in a copy of the working tree uploaded to the cluster, so each node would write into its own "
    "copy and actors on other nodes would not find the store; give absolute paths on a filesystem every node sees, "
    "e.g. run_dir=/shared/runs/{model} (features_dir defaults to its features/) or features_dir=/shared/..."
)


def refuse_relative_outputs(cfg: Config) -> None:
    relative = [f"{k}={getattr(cfg, k)}" for k in OUTPUTS if not os.path.isabs(getattr(cfg, k))]
    if relative:
        verb = "is" if len(relative) == 1 else "are"
        raise ValueError(f"{', '.join(relative)} {verb} relative: " + SHARED_PATHS.format(model=cfg.model.name))


def in_uploaded_copy() -> bool:
    """Whether this process is a Ray job whose working dir Ray uploaded (`ray job submit --working-dir`): its cwd is
    a copy of the tree on one node, gone when the job ends."""
    job = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    return bool((job.get("runtime_env") or {}).get("working_dir"))


def store_path(cfg: Config) -> str:
    """`features_dir` as every worker reads it: absolute (Ray workers start in their node's own directory, not in
    this process's), and refused where relative in an uploaded copy (`in_uploaded_copy`)."""
    if in_uploaded_copy():
        refuse_relative_outputs(cfg)
    return os.path.abspath(cfg.features_dir)


def capture_command(cfg: Config) -> int:
    features_dir = store_path(cfg)
    settings = settings_from(cfg)  # the target's config read and checked before the store is touched
    with writer_lock(features_dir):  # before anything touches the store: one capture writes it at a time
        counts = {}
        records, rejects = records_from(cfg, counts)
        print(
            f"{len(records)} prompts ({split_words(cfg.data.split)}) from {list(cfg.data.sources)}: "
            f"{counts['read']} read, {len(rejects)} rejected on load (duplicates included), "
            f"{counts['outside split']} outside the split"
        )
        writer = open_store(features_dir, settings, sources=cfg.data.sources, store_options=asdict(cfg.data.store))
        summary = run_fleet(
            features_dir,
            records,
            settings,
            writer,
            fleet_from(cfg),
            load_rejects=rejects,
            load_counts=counts,
            split=cfg.data.split,
        )
    print("\n".join(summary.lines()))
    return 0 if summary.ok else 1


def estimate_rows(cfg: Config, settings: CaptureSettings) -> list[dict]:
    """Per source, what the estimate takes it to be: its records sampled where they load (the hub reachable, a
    file, an embedded source), else its `data.figures` entry; a source with neither is refused by name."""
    d = cfg.data
    figures = source_figures(d.figures)
    rows = []
    for source in map(str, d.sources):
        cap = source_limit(d.sources, d.limit, source)
        try:
            records, _ = load_records([source], split=d.split, limit=cap, heldout_fraction=d.heldout_fraction)
        except PromptSourceUnavailable as e:
            if source not in figures:
                raise PromptSourceUnavailable(
                    f"{e}. An estimate without its records needs its figures, and data.figures has none for "
                    f"{source!r}: pass +data.figures.{source}='{{samples: N, prompt_tokens: P, response_tokens: R, "
                    f"source: where they come from}}' or add them to conf/data/{d.name}.yaml"
                ) from e
            rows.append(
                figures_row(
                    source,
                    figures[source],
                    split=d.split,
                    heldout_fraction=d.heldout_fraction,
                    cap=cap,
                    max_new_tokens=d.max_new_tokens,
                    expected_response_tokens=d.expected_response_tokens,
                )
            )
            continue
        rows.append(sampled_row(source, records, settings, d.expected_response_tokens))
    return rows


RATE_NOTE = (
    "the default is an assumption, not a measurement: Hugging Face generate at data.batch_size 8 of an 8B target on "
    "one H100; a serving engine's responses captured with data.mode=capture run far faster"
)


def estimate_command(cfg: Config) -> int:
    settings = settings_from(cfg, offline_ok=True)
    rows = estimate_rows(cfg, settings)
    d = cfg.data
    options, _ = split_store_options(asdict(d.store), settings.layer_ids, cfg.model.hidden_size)
    layout = StoreLayout(settings.layer_ids, cfg.model.hidden_size, **options)
    rate = d.capture_tokens_per_s
    e = estimate(
        rows,
        layout,
        max_length=d.max_length,
        shard_size=d.shard_size,
        capture_tokens_per_s=rate,
        store_path=cfg.features_dir,
    )
    for r in rows:
        print(
            f"{r['source']}: {r['prompts']:,} prompts x ({r['prompt_tokens']:,.0f} prompt + "
            f"{r['response_tokens']:,.0f} response) tokens [{r['origin']}]"
        )
    print(
        f"= {e['prompts']:,} prompts ({split_words(d.split)}), {e['tokens']:,} tokens "
        f"(mean {e['mean_prompt_tokens']:,.0f} prompt + {e['mean_response_tokens']:,.0f} response; "
        f"at most data.max_length {d.max_length} a sequence)\n"
        f"x {len(layout.layer_ids)} layers {list(layout.layer_ids)} x {layout.hidden_size} hidden "
        "(+ input id, loss mask; fp8 + a float32 scale a layer), uncompressed upper bound:"
    )
    for dtype, x in e["by_dtype"].items():
        print(f"  {dtype:<12} {x['bytes_per_token']:>7,} bytes/token = {tb(x['bytes'])}")
    if e["projected"]:
        print(
            "projected (data.store.project=pca data.store.project_dims=r: r features a token, one fp8 scale a token; "
            "the exported drafter is unchanged):"
        )
    for (label, r, dtype), x in e["projected"].items():
        name = f"r={label} ({r:,})"
        print(f"  {name:<16} {dtype:<12} {x['bytes_per_token']:>7,} bytes/token = {tb(x['bytes'])}")
    print(
        f"shards: {e['shards']:,} (data.shard_size {d.shard_size} prompts, about {e['shard_tokens']:,} tokens a shard)"
    )
    for dtype, x in e["by_dtype"].items():
        print(
            f"files ({dtype}): {x['files_per_shard']:,} a shard (1 group + {x['arrays']} arrays x (1 zarr.json + "
            f"1 data file)) = {x['files']:,} in all"
        )
    print(f"GPU-hours: {e['gpu_hours']:,.0f} at data.capture_tokens_per_s {rate:g} tokens/s a GPU")
    if rate == DataConfig.capture_tokens_per_s:
        print(f"  ({RATE_NOTE})")
    verdict = "fits" if e["fits"] else "DOES NOT FIT"
    what = f"{layout.dtype}, projected to {layout.project_dims} dims" if layout.project_dims else layout.dtype
    print(f"free disk at {cfg.features_dir}: {tb(e['free_bytes'])}; the {what} store {verdict}")
    return 0 if e["fits"] else 1


def tb(b: float) -> str:
    return f"{b / 1e12:,.2f} TB" if b >= 1e12 else f"{b / 1e9:,.2f} GB"


def verify_command(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m pipeline verify STORE_DIR", file=sys.stderr)
        return 2
    problems, stats = verify_store(argv[0])
    if problems:
        print(f"{argv[0]}: {len(problems)} problem(s)", file=sys.stderr)
        for p in problems[:50]:
            print("  " + p, file=sys.stderr)
        return 1
    print(
        f"{argv[0]}: OK - {stats['shards']} shards, {stats['sequences']} sequences, {stats['tokens']} tokens, "
        f"{stats['bytes_on_disk'] / 2**20:.1f} MiB ({stats['bytes_on_disk'] / max(1, stats['tokens']):.0f} bytes/token)"
    )
    return 0


def repair_command(argv: list[str]) -> int:
    """Drop the manifest entries of listed shards missing or damaged on disk (every chunk checked, as verify does),
    moving a damaged one's folder into the store's damaged/; the next capture recaptures their prompts."""
    if len(argv) != 1:
        print("usage: python -m pipeline repair STORE_DIR", file=sys.stderr)
        return 2
    try:
        dropped = drop_damaged_shards(argv[0], progress=sys.stderr.isatty())
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for e in dropped:
        print(f"dropped {e['name']} ({e['sequences']} sequences, {len(e.get('rejects', []))} rejects): {e['why']}")
        if e["moved_to"]:
            print(f"  its folder moved to {e['moved_to']} (delete it once it has served)")
    print(
        f"{argv[0]}: {len(dropped)} shard entr{'y' if len(dropped) == 1 else 'ies'} dropped"
        + ("; run the same capture command again to recapture their prompts" if dropped else ", nothing to repair")
    )
    return 0


TRANSCODE_USAGE = (
    "usage: python -m pipeline transcode SRC DST [dtype=bf16|fp16|fp8|fp32] [project=pca] [project_dims=2H] "
    "[calibration_tokens=32768] [basis=OTHER_PROJECTED_STORE]"
)
TRANSCODE_OPTIONS = ("dtype", "project", "project_dims", "calibration_tokens", "basis")


def transcode_command(argv: list[str]) -> int:
    """Rewrite a raw store in another dtype and/or projected (`flashdraft.store.transcode`); the same command run
    again finishes a copy it left partial. The options' values are checked by the transcode, naming the key."""
    from collections import Counter

    from flashdraft.store.transcode import transcode

    if len(argv) < 2 or any("=" not in a for a in argv[2:]):
        print(TRANSCODE_USAGE, file=sys.stderr)
        return 2
    pairs = [a.split("=", 1) for a in argv[2:]]
    opts = dict(pairs)
    unknown = set(opts) - set(TRANSCODE_OPTIONS)
    twice = sorted(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
    if unknown or twice:
        what = f"unknown option(s) {sorted(unknown)}" if unknown else f"option(s) given twice: {twice}"
        print(f"error: {what}\n{TRANSCODE_USAGE}", file=sys.stderr)
        return 2
    try:
        manifest = transcode(argv[0], argv[1], **opts)
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    c, proj = manifest["counts"], manifest.get("projection")
    what = f"projected to {proj['dims']} dims (basis {proj['sha256'][:12]})" if proj else "raw features"
    print(f"{argv[1]}: {c['sequences']} sequences, {c['tokens']} tokens, {manifest['dtype']}, {what}; complete")
    return 0


def paths_command(overrides: list[str]) -> int:
    """Print the output paths the overrides give; exit 1 naming any relative one (or a bad override).
    `jobs/ray_submit.sh` asks before it submits. The config is composed without a Hydra run: nothing is written."""
    try:
        cfg = typed_config(compose(overrides))
        print("\n".join(f"{k}={getattr(cfg, k)}" for k in OUTPUTS))
        refuse_relative_outputs(cfg)
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _hydra(command):
    register_configs()

    @hydra.main(config_path="../conf", config_name="config", version_base=None)
    def entry(cfg: DictConfig) -> None:
        try:
            code = command(typed_config(cfg))  # typed once, here; unknown keys are refused by name
        except (PromptSourceUnavailable, StoreError, FileNotFoundError, ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            code = 1
        if code:
            sys.exit(code)

    return entry


def main() -> None:
    argv = sys.argv[1:]
    if argv and argv[0] == "verify":
        sys.exit(verify_command(argv[1:]))
    if argv and argv[0] == "repair":
        sys.exit(repair_command(argv[1:]))
    if argv and argv[0] == "transcode":
        sys.exit(transcode_command(argv[1:]))
    if argv and argv[0] == "paths":
        sys.exit(paths_command(argv[1:]))
    command = capture_command
    if argv and argv[0] in ("estimate", "capture"):
        command = estimate_command if argv[0] == "estimate" else capture_command
        sys.argv = [sys.argv[0], *argv[1:]]
    _hydra(command)()


if __name__ == "__main__":
    main()
