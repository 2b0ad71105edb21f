# The two commands of the README. Each sets itself up on a fresh machine with only Python.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# IMPORTANT: torch is pinned; an unpinned torch pulls a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: demo test setup lint clean

$(VENV)/.ready: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q $(TORCH)
	$(VPY) -m pip install -q -e '.[test,demo]'
	touch $@

setup: $(VENV)/.ready

demo: setup
	$(VPY) examples/demo.py

test: setup
	$(VPY) -m pytest -q tests

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) checkpoints demo-out
