# flashdraft: prompts -> features -> drafter -> measured speedup.
# Hydra overrides pass through ARGS, e.g.  make train ARGS="train.lr=3e-4 train.epochs=2"
MODEL ?= smollm2-135m
PY ?= .venv/bin/python
ARGS ?=

.PHONY: setup features train eval quick full demo test clean

.venv/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	@touch $@

setup: .venv/.installed

features: setup
	$(PY) -m pipeline model=$(MODEL) $(DATA_ARG) $(PROFILE_ARGS) $(ARGS)
ifdef PROFILE
	$(PY) -m pipeline model=$(MODEL) $(PROFILE_ARGS) data=heldout 'features_dir=$${run_dir}/features-heldout' $(ARGS)
endif

train: setup
	$(PY) -m trainer model=$(MODEL) $(DATA_ARG) $(PROFILE_ARGS) $(ARGS)

eval: setup
	$(PY) -m harness model=$(MODEL) $(DATA_ARG) $(PROFILE_ARGS) $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf runs outputs multirun

# Profiles for the embedded default: PROFILE=quick (9-20 min on 2 cores, README) or full (~1 h capture + ~1 h
# training on Intel; 1 h 41 min in all on an AMD EPYC Zen 5, README) picks data=, train= and eval= of that name and runs in runs/<profile>-<model>.
ifdef PROFILE
PROFILE_ARGS = train=$(PROFILE) eval=$(PROFILE) run_dir=runs/$(PROFILE)-$(MODEL)
DATA_ARG = data=$(PROFILE)
endif

# The README's first command: set up, then the whole loop on the quick profile, results table at the end.
quick: setup
	$(MAKE) --no-print-directory features train eval PROFILE=quick

full: setup
	$(MAKE) --no-print-directory features train eval PROFILE=full

demo: quick
