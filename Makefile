# Two commands are the whole set-up (each idempotent, installing what is missing into .venv):
#   make run    - set up, then start the service
#   make test   - set up, then lint and run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch comes first, pinned: on this kind of machine pip takes these builds from local disk.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1

.PHONY: setup run test lint bench clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch, torchvision" 2>/dev/null || $(PY) -m pip install $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

lint: setup
	$(VENV)/bin/ruff check .

test: setup lint
	$(PY) -m pytest

run: setup
	$(VENV)/bin/vit-service up

bench: setup
	$(PY) benchmarks/bench_models.py

clean:
	rm -rf $(VENV) build *.egg-info
