# flashdraft: prompts -> features -> drafter -> measured speedup.
# Hydra overrides pass through ARGS, e.g.  make train ARGS="train.lr=3e-4 train.epochs=2"
MODEL ?= smollm2-135m
PY ?= .venv/bin/python
ARGS ?=

.PHONY: setup features train eval gate export-gguf llamacpp bench-llamacpp quick full demo test lint clean wheelhouse

.venv/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	@touch $@

setup: .venv/.installed

# Wheels of every dependency but torch, at .venv's versions, for nodes with no index (scripts/setup.sh --wheelhouse
# DIR), for PYTHON_VERSION (default .venv's) on x86_64 Linux with glibc GLIBC or newer, into wheelhouse/cpXY/; and
# into wheelhouse/cpXY-smoke/ the ~44 MiB jobs/gpu_smoke.sh needs beside a machine's own torch (transformers included,
# for machines whose own is older than flashdraft needs; numpy left out).
# SET=smoke writes the smoke's alone:  make wheelhouse SET=smoke PYTHON_VERSION=3.12
SET ?= full
GLIBC ?= 2.28
PYTHON_VERSION ?= $(shell $(PY) -c 'import sys; print(f"{sys.version_info.major}.{sys.version_info.minor}")' 2>/dev/null)
WHEELHOUSE_DIR = wheelhouse/cp$(subst .,,$(PYTHON_VERSION))
ifeq ($(filter $(SET),full smoke),)
$(error SET=$(SET): use full or smoke)
endif
wheelhouse: setup
	$(if $(filter full,$(SET)),$(PY) scripts/wheelhouse.py $(WHEELHOUSE_DIR) --set full \
		--python-version $(PYTHON_VERSION) --glibc $(GLIBC))
	$(PY) scripts/wheelhouse.py $(WHEELHOUSE_DIR)-smoke --set smoke --python-version $(PYTHON_VERSION) \
		--glibc $(GLIBC) $(if $(filter full,$(SET)),--reuse $(WHEELHOUSE_DIR))

# CLUSTER=slurm submits `make features` and `make train` with sbatch (jobs/slurm_submit.sh: jobs/*.sbatch, log in
# logs/<job name>-<id>.out) on NODES nodes with CPUS_PER_NODE CPUs and GPUS_PER_NODE GPUs each (default: the most
# that NODES of the partition's nodes have), PARTITION and TIME if given, after job AFTER succeeds if given, with
# other sbatch options in SBATCH_ARGS (e.g. --account=me); what the partition cannot run is refused, naming the
# limit. CLUSTER=ray submits the capture to the Ray cluster at RAY_ADDRESS (jobs/ray_submit.sh); Ctrl-C stops the
# job and returns within STOP_WAIT seconds (default 20), whatever the job waits for. docs/cluster.md.
CLUSTER ?= local
NODES ?= 2
ifeq ($(filter $(CLUSTER),local slurm ray),)
$(error CLUSTER=$(CLUSTER): use local, slurm or ray)
endif

# $(call sbatch,JOB,ARGS): submit jobs/slurm_JOB.sbatch with Hydra overrides ARGS; print the job id and its log.
define sbatch
	@NODES='$(NODES)' CPUS_PER_NODE='$(CPUS_PER_NODE)' GPUS_PER_NODE='$(GPUS_PER_NODE)' PARTITION='$(PARTITION)' \
		TIME='$(TIME)' AFTER='$(AFTER)' SBATCH_ARGS='$(SBATCH_ARGS)' bash jobs/slurm_submit.sh $(1) $(2)
endef

# PROFILE=quick|full picks conf/profile/<name>.yaml: its data, train and eval groups, the drafter's block size and
# runs/<profile>-<model>; the held-out store it captures is the eval prompts' (the trainer's eval/* and the parity line).
ifdef PROFILE
PROFILE_ARG = profile=$(PROFILE)
endif

HELDOUT_ARGS = data=heldout 'features_dir=$${run_dir}/features-heldout'

features: setup
ifeq ($(CLUSTER),slurm)
	$(call sbatch,capture,model=$(MODEL) $(PROFILE_ARG) $(ARGS))
	$(if $(PROFILE),$(call sbatch,capture,model=$(MODEL) $(PROFILE_ARG) $(HELDOUT_ARGS) $(ARGS)))
else ifeq ($(CLUSTER),ray)
	bash jobs/ray_submit.sh model=$(MODEL) $(PROFILE_ARG) $(ARGS)
	$(if $(PROFILE),bash jobs/ray_submit.sh model=$(MODEL) $(PROFILE_ARG) $(HELDOUT_ARGS) $(ARGS))
else
	$(PY) -m pipeline model=$(MODEL) $(PROFILE_ARG) $(ARGS)
	$(if $(PROFILE),$(PY) -m pipeline model=$(MODEL) $(PROFILE_ARG) $(HELDOUT_ARGS) $(ARGS))
endif

train: setup
ifeq ($(CLUSTER),slurm)
	$(call sbatch,train,model=$(MODEL) $(PROFILE_ARG) $(ARGS))
else ifeq ($(CLUSTER),ray)
	$(error make train runs here or on Slurm (CLUSTER=slurm); a Ray cluster runs the capture only)
else
	$(PY) -m trainer model=$(MODEL) $(PROFILE_ARG) $(ARGS)
endif

eval: setup
	$(PY) -m harness model=$(MODEL) $(PROFILE_ARG) $(ARGS)

# The overfit gate (gate/, issue #48): capture gate.sequences prompts in-process, train a drafter on them
# until its training tau nears the block size, export it, serve those prompts greedily in each engine of ENGINES
# (harness, reference, llamacpp: the drafter and target as GGUF through llama-speculative-simple's draft-dflash, where
# `make llamacpp` has cached a build, refused otherwise; its rounds are also set against the harness's); each must
# commit >= gate.threshold x block size tokens a round, else it prints the first short round and exits 1.
# ARGS="gate.plant=labels+1" (or layers-1) plants a known mismatch, which must fail it.
#   make gate ARGS="drafter.num_layers=2"      make gate ENGINES=harness,reference,llamacpp ARGS="drafter.num_layers=2"
ENGINES ?= harness,reference
gate: setup
	$(PY) -m gate model=$(MODEL) 'gate.engines=[$(ENGINES)]' $(ARGS)

# The drafter (DRAFTER, default the profile's run: runs/$(PROFILE or quick)-$(MODEL)/drafter) and its target as GGUF
# with llama.cpp's own converter, into GGUF_DIR (default: gguf/ next to the drafter), weights as GGUF_TYPE (f32 keeps
# the harness's). `make llamacpp` builds llama.cpp from the llama-cpp-python sdist once into the cache (minutes).
# Both run harness/llamacpp.py (llama.cpp's build, GGUF conversion and serving).
GGUF_TYPE ?= f32
export-gguf: setup
	$(PY) -m harness.llamacpp export-gguf $(or $(DRAFTER),runs/$(or $(PROFILE),quick)-$(MODEL)/drafter) \
		--target $(MODEL) --outtype $(GGUF_TYPE) $(if $(GGUF_DIR),--out $(GGUF_DIR))

llamacpp: setup
	$(PY) -m harness.llamacpp build

# The drafter served in llama.cpp against its plain decoding, its n-gram modes and the harness, with the parity
# check (benchmarks/bench_llamacpp.py; builds llama.cpp and converts the GGUFs first when needed).
bench-llamacpp: setup
	$(PY) benchmarks/bench_llamacpp.py --model $(MODEL) \
		--drafter $(or $(DRAFTER),runs/$(or $(PROFILE),quick)-$(MODEL)/drafter) $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

clean:
	rm -rf runs outputs multirun

# The README's first command: set up, then the whole loop on the quick profile, results table at the end.
quick: setup
	$(MAKE) --no-print-directory features train eval PROFILE=quick

full: setup
	$(MAKE) --no-print-directory features train eval PROFILE=full

demo: quick
