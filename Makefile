# flashdraft: prompts -> features -> drafter -> measured speedup.
# Hydra overrides pass through ARGS, e.g.  make train ARGS="train.lr=3e-4 train.epochs=2"
MODEL ?= smollm2-135m
PY ?= .venv/bin/python
ARGS ?=

.PHONY: setup features train eval demo test clean

.venv/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	@touch $@

setup: .venv/.installed

features: setup
	$(PY) -m pipeline model=$(MODEL) $(ARGS)

train: setup
	$(PY) -m trainer model=$(MODEL) $(ARGS)

eval: setup
	$(PY) -m harness model=$(MODEL) $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf runs outputs multirun

# The README's first command: set up, then the whole loop on a demo profile (minutes, not a useful drafter).
DEMO_DIR ?= runs/demo-$(MODEL)
demo: setup
	$(PY) -m pipeline model=$(MODEL) data=demo run_dir=$(DEMO_DIR) $(ARGS)
	$(PY) -m pipeline verify $(DEMO_DIR)/features
	$(PY) -m trainer model=$(MODEL) train=demo run_dir=$(DEMO_DIR) $(ARGS)
	$(PY) -m harness model=$(MODEL) eval=quick eval.allow_untrained=false run_dir=$(DEMO_DIR) $(ARGS)
