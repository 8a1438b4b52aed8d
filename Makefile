# The two commands of the README, and what they need.
#   make run    run the main job (the bundled Gemma 3 270M on a ring of three local node processes)
#   make test   run the test suite
# Both set everything up first: a virtual environment in .venv, the patched engine (built once and cached,
# see scripts/build_engine.py), and primaplug itself.
#   GPU=cuda|metal  build the engine for a GPU backend (default cpu)
#   PYTHON=...      the Python (3.11+) that creates .venv

PYTHON ?= python3
VENV   ?= .venv
GPU    ?= cpu
PY     := $(VENV)/bin/python
PROMPT ?= The three primary colors are
STAMP  := $(VENV)/.primaplug-installed

.PHONY: run test setup engine bench clean

run: setup
	$(PY) -m primaplug run --local-nodes 3 -p "$(PROMPT)" -n 48 --verify

test: setup
	$(PY) -m pytest

setup: engine $(STAMP)

$(PY):
	$(PYTHON) -c 'import sys; sys.exit("primaplug needs Python 3.11+, $(PYTHON) is %s" % sys.version.split()[0]) if sys.version_info < (3, 11) else None'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

engine: $(PY)
	$(PY) scripts/build_engine.py --gpu $(GPU)

# primaplug and its dependencies; the engine is installed first so that pip finds its pin satisfied
$(STAMP): pyproject.toml | engine
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

bench: setup
	$(PY) benchmarks/windows_overhead.py
	$(PY) benchmarks/ring_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
