# gptflow — the README's commands. `make run` and `make test` work on a fresh clone.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
# Installed only when pyproject.toml or constraints.txt changed since the last install.
STAMP := $(VENV)/.installed
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
export PATH := $(BIN):$(PATH)
# make run/test never touch the network for models or tokenizers.
export HF_HUB_OFFLINE := 1
PROFILE ?= profiles/local
# e.g. https://download.pytorch.org/whl/cu126: torch from PyTorch's index (another CUDA build)
TORCH_INDEX ?=
SNAKEMAKE_ARGS ?=
PYTEST_ARGS ?=
# make test runs the suite on this many pytest-xdist workers (docs/development.md): one more than
# the 2-core machine's cores, so that a worker's waits (Slurm's queue, dockerd) leave no core idle;
# 0: serially
TEST_WORKERS ?= 3

.PHONY: setup run study ablation test test-changed lint format bench docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "setup: installing torch==2.13.0, then gptflow with torch pinned (constraints.txt)"
	$(PIP) install torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -c constraints.txt -e '.[test]'
	@touch $@

run: setup
	snakemake --profile $(PROFILE) $(SNAKEMAKE_ARGS)
	gptflow summary

# A study on this machine: 3 model sizes x 2 learning rates on the embedded corpus, compared in
# results/studies/stdlib-sweep/study.html (docs/studies.md)
study: setup
	snakemake study --profile $(PROFILE) $(SNAKEMAKE_ARGS) --configfile config/config.yaml config/examples/studies/cpu-sweep.yaml
	gptflow summary

# A data ablation: raw vs exact dedup vs exact + minhash + filters on Debian's copyright files,
# compared on the same held-out text in results/studies/copyright-ablation/ (docs/data-quality.md)
ablation: setup
	snakemake study --profile $(PROFILE) $(SNAKEMAKE_ARGS) --configfile config/config.yaml config/examples/studies/data-ablation.yaml
	gptflow summary

test: setup
	@# pytest exit 5 ("no tests collected") is a failure too, and says so.
	pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS) || { rc=$$?; [ $$rc -ne 5 ] || echo "make test: pytest collected no tests" >&2; exit $$rc; }

# The test files that name what changed since BASE (default: the last commit, so uncommitted
# work): the loop between commits. tests/support/changed.py says how files map to tests;
# `make test` stays the whole suite.
BASE ?= HEAD
test-changed: setup
	@tests="$$(python -m tests.support.changed $(BASE))"; \
	if [ -z "$$tests" ]; then echo "make test-changed: no test names what changed since $(BASE)"; \
	else echo "make test-changed:" $$tests; pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS) $$tests; fi

lint: setup
	ruff check src tests workflow bench
	ruff format --check src tests workflow bench
	snakefmt --check Snakefile rules
	snakemake --lint --profile $(PROFILE)

format: setup
	ruff check --fix src tests workflow bench
	ruff format src tests workflow bench
	snakefmt Snakefile rules

bench: setup
	python bench/run.py
	python bench/train.py
	python bench/async_save.py
	python bench/download.py
	python bench/tokenization.py
	python bench/blend_index.py
	python bench/plan.py
	python bench/quality.py
	python bench/minhash_scale.py
	python bench/parallel.py
	python bench/import_megatron.py
	python bench/autotune.py

# The documentation site (docs/, README.md, config/README.md, profiles/README.md), built
# strictly: a broken link or a page in no table of contents fails (docs/conf.py,
# tests/unit/test_docs.py)
docs: setup
	sphinx-build -W --keep-going -n -q -c docs -b html . docs/_build/html
	@echo "docs: docs/_build/html/index.html"

clean:
	rm -rf results logs .snakemake docs/_build
