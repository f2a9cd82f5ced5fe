# The README's two commands: `make demo` (the main job) and `make test` (the tests).
# Both create .venv and install everything on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# compile the simulator's numba kernels into their on-disk cache now (about 15 s), so the
	# first plan does not pay it (autoplace/planners/warmup.py)
	$(PY) -m autoplace.planners.warmup
	touch $@

.PHONY: demo test install bench
install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/autoplace demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(VENV)/bin/autoplace bench
