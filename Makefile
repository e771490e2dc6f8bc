# Everything installs itself into .venv; `make demo` and `make test` are the whole set-up.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tm-launch-installed

.PHONY: demo test test-all lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# Pinned CPU torch first (a local wheel here); never let pip resolve an unpinned torch.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,frameworks]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m tm_launch.local.demo

lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -q -m "not slow"

test-all: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/downtime.py

clean:
	rm -rf $(VENV) build *.egg-info
