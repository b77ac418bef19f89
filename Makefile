# Two entry points: `make lab` and `make test`. Everything else is set-up they share.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: lab test setup browser servers fixtures lint bench samples screenshots docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch pinned to the CPU build pip chooses, so that the package's range does not pull a CUDA build, installed with the
# package and its extras by uv when it installs (seconds instead of pip's minute), else by pip: see scripts/setup_venv.sh.
$(STAMP): $(BIN)/python pyproject.toml scripts/setup_venv.sh
	bash scripts/setup_venv.sh $(VENV) "$(TORCH_SPEC)" notebook,dev
	touch $(STAMP)

setup: $(STAMP)

# Debian's chromium for the JupyterLab browser tests (never `playwright install`).
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	      || echo "warning: could not install chromium; browser tests will be skipped"; \
	  else echo "warning: no chromium and no root apt-get; browser tests will be skipped"; fi; \
	fi

# Debian's nginx: a real range server for the remote-checkpoint tests (run in the foreground by the tests).
servers:
	@if [ ! -x /usr/sbin/nginx ] && ! command -v nginx >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null) \
	      || echo "warning: could not install nginx; remote HTTP tests will be skipped"; \
	  else echo "warning: no nginx and no root apt-get; remote HTTP tests will be skipped"; fi; \
	fi

lab: setup
	$(BIN)/jupyter lab --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root,)

# The tool-made fixtures the tests read are committed (tests/fixtures/: real DeepSpeed ZeRO and Megatron TP/PP runs, and
# llama.cpp's converter outputs and mergekit's merges as digests and small files), each with a MANIFEST.json naming the script, the tool
# versions and the digests. `make fixtures` rebuilds them with the real tools (DeepSpeed and megatron-core in their own
# venvs under .cache/fixtures/: transformers imports deepspeed when present; the GGUF tests rerun with llama.cpp's
# converter) and checks that the rebuild holds what is committed. After a deliberate change,
# `python scripts/make_{deepspeed,megatron,mergekit}_fixtures.py --commit` / `make_gguf_references.py --commit` replace it.
fixtures: setup
	$(BIN)/python scripts/make_deepspeed_fixtures.py
	$(BIN)/python scripts/make_megatron_fixtures.py
	$(BIN)/python scripts/make_gguf_references.py
	$(BIN)/python scripts/make_mergekit_fixtures.py
	WB_FIXTURES_REBUILT=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/system/test_fixtures_committed.py

# pytest in two processes (pytest-xdist), the notebooks (nbval) in the same session. Tests marked `serial` (they
# measure a peak RSS, or start torchrun, servers or a browser: see tests/conftest.py) form one xdist group, so they run
# one after another on one worker while the other worker runs the rest; each notebook's cells form a group too (one
# kernel, in order).
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider --timeout=300
NBVAL := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg
test: setup browser servers
	$(BIN)/ruff check workbench tests benchmarks scripts
	$(PYTEST) -n 2 --dist loadgroup $(NBVAL) tests notebooks

# The documentation site from docs/ and the docstrings (mkdocs-material + mkdocstrings), in strict mode: a broken
# link, a page missing from the nav or an API name that does not resolve fails. `make test` builds it too, in
# tests/test_docs_site.py (into a temporary folder, so the checkout stays clean); site/ is gitignored.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet -d site

# Refresh the README's widget pictures (docs/*.png) from the browser tests; `make test` writes them to a temp folder.
screenshots: setup browser
	WORKBENCH_SCREENSHOTS=$(CURDIR)/docs $(BIN)/python -m pytest -q -p no:cacheprovider --timeout=300 tests/browser

lint: setup
	$(BIN)/ruff check workbench tests benchmarks scripts

# d9d is a peer measured by the benchmark, not a dependency: --no-deps keeps it off our torch.
bench: setup
	-$(BIN)/pip install -q --no-deps d9d
	-$(BIN)/pip install -q pydantic
	$(BIN)/python benchmarks/run.py $(BENCH_ARGS)

samples: setup
	$(BIN)/python scripts/make_samples.py

clean:
	rm -rf $(VENV) build *.egg-info
