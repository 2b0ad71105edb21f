# The two commands of the README. Each sets itself up on a fresh machine with only Python.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# IMPORTANT: torch is pinned; an unpinned torch pulls a multi-GB CUDA build. Pinned, it is
# still the build the index serves for that version: a CPU wheel where the index has one (as
# on the machines this project is built on), the CUDA build from the public index on Linux.
# Choose another with TORCH, e.g. TORCH="torch==2.13.0 --index-url <PyTorch's CPU wheel index>".
TORCH ?= torch==2.13.0

.PHONY: demo test setup lint clean

$(VENV)/.torch: Makefile
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q $(TORCH)
	touch $@

# The demo needs the library and matplotlib; the tests need much more (DeepSpeed, moto, ...).
$(VENV)/.demo: $(VENV)/.torch pyproject.toml
	$(VPY) -m pip install -q -e '.[demo]'
	touch $@

# torchtitan without its dependencies (its `datasets` pin and s3fs want different fsspecs): the
# test extra has those the integration needs (docs/torchtitan.md).
TORCHTITAN ?= torchtitan==0.3.0

$(VENV)/.ready: $(VENV)/.torch pyproject.toml
	$(VPY) -m pip install -q -e '.[test,demo]'
	$(VPY) -m pip install -q --no-deps $(TORCHTITAN)
	touch $@

setup: $(VENV)/.ready

demo: $(VENV)/.demo
	$(VPY) examples/demo.py

# Three workers on two cores: many tests wait (on subprocesses, timeouts, a lease to expire)
# rather than compute. A file is the unit a worker takes (module fixtures are built once),
# the slowest first (tests/conftest.py).
test: setup
	$(VPY) -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder tests

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) checkpoints demo-out
