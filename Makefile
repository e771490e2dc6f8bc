# Everything installs itself into .venv; `make demo` and `make test` are the whole set-up.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tm-launch-installed
TITAN  := $(VENV)/.tm-launch-torchtitan-installed

.PHONY: demo test test-all test-torch lint bench clean slurm-deps

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# Pinned CPU torch first (a local wheel here); never let pip resolve an unpinned torch.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,frameworks]'
	touch $(STAMP)

# torchtitan for tests/e2e/test_torchtitan.py, in test-all only: it adds ~1.3 GB to the venv
# (triton alone ~0.9 GB, pyarrow, wandb, tensorboard) and minutes of download, which CI's
# `make test` (< 10 minutes, no slow tests) must not pay; without it those tests are skipped.
# The constraint keeps pip from resolving another torch (GBs of CUDA packages); triton has no
# dependencies of its own, and --no-deps makes sure it pulls nothing.
$(TITAN): $(STAMP)
	echo "torch==2.13.0" > $(VENV)/torch-constraint.txt
	$(PY) -m pip install -q -c $(VENV)/torch-constraint.txt -e '.[test,frameworks,torchtitan]'
	$(PY) -m pip install -q --no-deps triton==3.8.0
	touch $(TITAN)

demo: $(STAMP)
	$(PY) -m tm_launch.local.demo

lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -q -m "not slow"

# Debian's Slurm and munge for tests/e2e/test_slurm.py (a real three-node Slurm on loopback), in
# test-all only; it needs root for apt-get (and the test for slurmd), and without them the test is skipped.
slurm-deps:
	@if command -v slurmctld >/dev/null && command -v munged >/dev/null; then :; \
	elif [ "$$(id -u)" != 0 ]; then echo "slurm-deps: not root, so tests/e2e/test_slurm.py will be skipped (as root: apt-get install -y slurm-wlm munge)"; \
	else apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge; fi

test-all: $(TITAN) slurm-deps
	$(PY) -m pytest -q

# `make test-torch TORCH=2.15.0`: the fast tier (what `make test` runs) on another torch
# release, in a venv of its own (.venv-torch2.15.0; a CUDA wheel with its NVIDIA libraries is ~5 GB).
# The constraint keeps every later install on that torch. The releases tested are listed in
# docs/development.md; `make test` stays on 2.13.0.
TORCH  ?= 2.13.0
TVENV  := .venv-torch$(TORCH)
TPY    := $(TVENV)/bin/python

$(TVENV)/.tm-launch-installed: pyproject.toml
	test -x $(TPY) || $(PYTHON) -m venv $(TVENV)
	echo "torch==$(TORCH)" > $(TVENV)/torch-constraint.txt
	$(TPY) -m pip install -q torch==$(TORCH)
	$(TPY) -m pip install -q -c $(TVENV)/torch-constraint.txt -e '.[test,frameworks]'
	touch $@

test-torch: $(TVENV)/.tm-launch-installed
	nice -n 10 $(TPY) -m pytest -q -rf -m "not slow"

bench: $(STAMP)
	$(PY) bench/downtime.py

clean:
	rm -rf $(VENV) .venv-torch* build dist *.egg-info
