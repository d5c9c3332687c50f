# flashdraft: prompts -> features -> drafter -> measured speedup.
# Hydra overrides pass through ARGS, e.g.  make train ARGS="train.lr=3e-4 train.epochs=2"
MODEL ?= smollm2-135m
PY ?= .venv/bin/python
ARGS ?=

.PHONY: setup features train eval quick full demo test lint clean

.venv/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	@touch $@

setup: .venv/.installed

# PROFILE=quick|full picks conf/profile/<name>.yaml: its data, train and eval groups, the drafter's block size and
# runs/<profile>-<model>; the held-out store it captures is the eval prompts' (the trainer's eval/* and the parity line).
ifdef PROFILE
PROFILE_ARG = profile=$(PROFILE)
endif

features: setup
	$(PY) -m pipeline model=$(MODEL) $(PROFILE_ARG) $(ARGS)
ifdef PROFILE
	$(PY) -m pipeline model=$(MODEL) $(PROFILE_ARG) data=heldout 'features_dir=$${run_dir}/features-heldout' $(ARGS)
endif

train: setup
	$(PY) -m trainer model=$(MODEL) $(PROFILE_ARG) $(ARGS)

eval: setup
	$(PY) -m harness model=$(MODEL) $(PROFILE_ARG) $(ARGS)

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
