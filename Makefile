# Tandem: `make test` is the README's test command and what .ci/run calls.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tandem-installed
PYTEST_ARGS ?=
# Python keeps the project's compiled modules in __pycache__ unless PYTHONDONTWRITEBYTECODE is set,
# as some sandboxes and CI images set it: then every process a run or the suite starts (hundreds
# in `make test`) compiles the project's modules again, about a CPU-second each (measured here).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install sandbox-deps browser-deps test test-fast test-gpu wheelhouse bench lint docs clean train-math train-math-moe train-code train-code-agent train-agent

install: $(STAMP)

# Idempotent: re-runs only when the package metadata changes.
$(STAMP): setup.cfg pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	@$(MAKE) --no-print-directory sandbox-deps browser-deps
	@touch $(STAMP)

# Best effort: bubblewrap isolates generated code in the reward sandbox. Without root + apt
# the sandbox falls back to rlimits and says so in every verdict.
sandbox-deps:
	@if command -v bwrap >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing bubblewrap (code sandbox isolation)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap; } >/dev/null 2>&1 \
	    || echo "warning: could not install bubblewrap; the code sandbox will use rlimits only"; \
	else echo "note: no bubblewrap and no root+apt; the code sandbox will use rlimits only"; fi

# Best effort: headless Chromium opens the HTML run report in a test (a screenshot that must
# show the figure). Without it that one test is skipped, saying why.
browser-deps:
	@if command -v chromium-headless-shell >/dev/null 2>&1 || command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing chromium-headless-shell (the report's browser test)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium-headless-shell; } >/dev/null 2>&1 \
	    || echo "warning: could not install chromium-headless-shell; the report's browser test will be skipped"; \
	else echo "note: no headless Chromium and no root+apt; the report's browser test will be skipped"; fi

# Everything: tests/unit and tests/integration (real processes, HTTP, the local SLURM cluster
# when root can start it). The CI command.
# TEST_WORKERS: pytest-xdist workers (tests/support/worker_groups.py says what shares one); 0 runs
# everything in this process.
TEST_WORKERS ?= 2
# The slowest tests, listed at the end of every run (CI's log included); PYTEST_ARGS comes after,
# so a --durations of its own wins. TEST_DURATIONS=0 lists every test.
TEST_DURATIONS ?= 30
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=$(TEST_DURATIONS) $(PYTEST_ARGS)

# The unit tier only: no processes, no sockets (tests/unit/conftest.py refuses them); about a
# minute on 2 cores.
test-fast: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests/unit $(PYTEST_ARGS)

# The GPU tier (tests/gpu, marker `gpu`): one GPU, <= 8 minutes; every test skips, saying why,
# where CUDA is not available. It installs nothing by default (a GPU node's torch is its own,
# never `make install`'s CPU build); WHEELHOUSE=DIR first installs the project from a bundle made
# by `make wheelhouse`, with no package index (docs/cluster.md). GPU_PYTHON: the interpreter that
# holds the node's torch.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
test-gpu:
	$(if $(WHEELHOUSE),$(GPU_PYTHON) slurm/wheelhouse.py install --wheelhouse $(WHEELHOUSE) &&) \
	  $(GPU_PYTHON) -m pytest -q tests/gpu -m gpu $(PYTEST_ARGS)

# An offline install bundle for GPU nodes, built here (needs a package index): the project's wheel
# and its dependencies for the node's Python and platform, without torch and without what the
# node lists in NODE_HAS (a file of names, e.g. its `pip freeze`). Into WHEELHOUSE (.wheelhouse/).
# EXTRAS: the project's extras to bundle and install too (EXTRAS=trackers: TensorBoard and W&B,
# which the shipped tiny configs name).
PYTHON_VERSION ?= 3.12
PLATFORM ?= manylinux_2_28_x86_64
wheelhouse: install
	$(PY) slurm/wheelhouse.py build --out $(or $(WHEELHOUSE),.wheelhouse) --python-version $(PYTHON_VERSION) \
	  --platform $(PLATFORM) $(if $(NODE_HAS),--node-has $(NODE_HAS)) $(if $(EXTRAS),--extras $(EXTRAS))

# Results go to benchmarks/runs/<time>/ (not committed); BENCH_ARGS="--record" rewrites the
# committed benchmarks/results/ the docs cite, BENCH_ARGS="--quick protocol" checks one runs.
bench: install
	$(PY) -m benchmarks $(BENCH_ARGS)

# The embedded default runs: warm the tiny model up once (cached in .cache/), then run RL.
# EXP=path.yaml runs another experiment file; ARGS="trainer.total_steps=10" adds overrides;
# SFT_ARGS="--steps 100" passes options to the warm-up (`tandem sft --help`).
# Each run gets its own directory, runs/<name>-<timestamp>, and runs/<name>-latest names the
# newest (what the README's `tandem report --exp runs/math-latest` reads), whether it finished or not.
RUN_ID := $(shell date +%Y%m%d-%H%M%S)
# $(call rl_run,NAME,CONFIG): `tandem run` into runs/NAME-RUN_ID, then point runs/NAME-latest at it.
rl_run = $(VENV)/bin/tandem run $(or $(EXP),$(2)) experiment.exp_dir=runs/$(1)-$(RUN_ID) $(ARGS); rc=$$?; \
	if [ -d runs/$(1)-$(RUN_ID) ]; then ln -sfn $(1)-$(RUN_ID) runs/$(1)-latest; fi; exit $$rc

train-math: install
	$(VENV)/bin/tandem sft --task math --out .cache/tiny-math-sft $(SFT_ARGS)
	$(call rl_run,math,configs/math-tiny.yaml)

# Mixture of experts: a tiny Qwen3-MoE (8 experts, top 2) with rollout routing replay on (docs/megatron.md).
train-math-moe: install
	$(VENV)/bin/tandem sft --task math --arch qwen3_moe --out .cache/tiny-math-moe-sft $(SFT_ARGS)
	$(call rl_run,math-moe,configs/math-moe-tiny.yaml)

train-code: install
	$(VENV)/bin/tandem sft --task code --out .cache/tiny-code-sft $(SFT_ARGS)
	$(call rl_run,code,configs/code-tiny.yaml)

# Multi-turn: programs revised from execution feedback on the visible examples (rollout/code_feedback.py).
train-code-agent: install
	$(VENV)/bin/tandem sft --task code-agent --out .cache/tiny-code-agent-sft $(SFT_ARGS)
	$(call rl_run,code-agent,configs/code-agent-tiny.yaml)

# An agent with a tool: the calculator math agent (rollout/agents/calculator.py; docs/agents.md).
train-agent: install
	$(VENV)/bin/tandem sft --task agent-math --out .cache/tiny-agent-math-sft $(SFT_ARGS)
	$(call rl_run,agent,configs/agent-math-tiny.yaml)

lint: install
	$(PY) -m ruff check .

# Regenerates docs/configuration.md from the config dataclasses (a test checks it is current).
docs: install
	$(VENV)/bin/tandem config docs > docs/configuration.md

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
