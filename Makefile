# The two commands of the README, and what they need.
#   make run    run the main job (the bundled Gemma 3 270M on a ring of three local node processes)
#   make test   run the test suite
# Both set everything up first: a virtual environment in .venv, the patched engine (built once and cached,
# see scripts/build_engine.py), and primaplug itself.
#   GPU=cpu|cuda|metal  the engine's backend (default: $PRIMAPLUG_GPU, else metal on Apple silicon, else cpu)
#   PYTHON=...      the Python (3.11+) that creates .venv

PYTHON ?= python3
VENV   ?= .venv
GPU    ?= $(PRIMAPLUG_GPU)
PY     := $(VENV)/bin/python
PROMPT ?= The three primary colors are
STAMP  := $(VENV)/.primaplug-installed

.PHONY: run plan test test-slow rungs setup engine bench bench-testbed clean

run: setup
	$(PY) -m primaplug run --local-nodes 3 --scheduler even -p "$(PROMPT)" -n 48 --verify

plan: setup
	$(PY) -m primaplug plan --local-nodes 3

# the 20 slowest tests are listed at the end, to keep the suite inside its budget (12 minutes with a cold engine build).
# Two workers, a test file each at a time (pytest-xdist), the compute-bound files never two at once
# (tests/conftest.py, COMPUTE_BOUND): much of the suite waits (nodes starting, a lost node's timeout, heartbeats).
# The slow rung (the Docker image, minutes) is left out: `make test-slow` runs it.
test: setup
	$(PY) -m pytest -n 2 --dist loadgroup -m "not slow" --durations=20

test-slow: setup
	$(PY) -m pytest -m slow -v -rs

setup: engine $(STAMP)

$(PY):
	$(PYTHON) -c 'import sys; sys.exit("primaplug needs Python 3.11+, $(PYTHON) is %s" % sys.version.split()[0]) if sys.version_info < (3, 11) else None'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

engine: $(PY)
	$(PY) scripts/build_engine.py $(if $(GPU),--gpu $(GPU))

# primaplug and its dependencies (llama-cpp-python is not one of them: the engine above is primaplug's build of it,
# installed first so that its first use finds it)
$(STAMP): pyproject.toml | engine
	$(PY) -m pip install -q -e '.[test,dashboard]'
	touch $(STAMP)

bench: setup
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) benchmarks/windows_overhead.py
	$(PY) benchmarks/ring_overhead.py
	$(PY) benchmarks/scheduling_time.py

# the emulated home cluster: needs root (cgroups, dropping the page cache) and about half an hour
bench-testbed: setup
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) benchmarks/memory_testbed.py
	$(PY) benchmarks/halda_testbed.py

clean:
	rm -rf $(VENV) build *.egg-info

# the other platforms of the slow rung (scripts/rungs/, docs/platforms.md): Debian 13, aarch64 under qemu-user and a
# ring that mixes ARM and x86 (root: chroots), the engine with ASan/UBSan; each skips saying what it lacks
rungs: setup
	$(PY) -m pytest -m slow -v -rs tests/test_rungs.py
