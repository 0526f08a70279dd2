# Two commands are the whole set-up (each idempotent, installing what is missing into .venv):
#   make run    - set up, then start the service
#   make test   - set up, then lint and run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch comes first, pinned: on this kind of machine pip takes these builds from local disk.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1

.PHONY: setup run test lint bench clean browser
setup: $(VENV)/.installed browser

# Headless Chromium + ChromeDriver from Debian for the web-page test (skipped if not installable).
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      chromium chromium-driver >/dev/null) || echo "warning: chromium not installed"; \
	  else echo "note: install chromium and chromium-driver for the browser test"; fi; \
	fi

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
