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

# Debian tools the checks use (each skipped with a note if not installable): headless Chromium +
# ChromeDriver for the web-page test, docker-compose to validate docker/compose.yaml, hey, the
# compiled load generator of benchmarks/bench_serving.py, and PostgreSQL, of which the jobs
# tests start a private server (Debian keeps its programs in /usr/lib/postgresql/<version>/bin).
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null \
	    || ! command -v docker-compose >/dev/null || ! command -v hey >/dev/null \
	    || ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      chromium chromium-driver docker-compose hey postgresql >/dev/null) \
	      || echo "warning: chromium/docker-compose/hey/postgresql not installed"; \
	  else echo "note: install chromium, chromium-driver, docker-compose, hey and postgresql for all checks"; fi; \
	fi

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch, torchvision" 2>/dev/null || $(PY) -m pip install $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e '.[dev,ray,postgres]'
	touch $@

DOCKERFILES := docker/Dockerfile docker/Dockerfile.cuda docker/testing/postgres.Dockerfile
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/hadolint $(DOCKERFILES)
	$(VENV)/bin/shellcheck docker/*.sh docker/testing/*.sh benchmarks/*.sh .ci/run
	@if command -v docker-compose >/dev/null; then \
	  docker-compose -f docker/compose.yaml --profile gpu --profile ray config -q && echo "compose.yaml: valid"; \
	elif [ -n "$$REQUIRE_COMPOSE_CHECK" ]; then echo "docker-compose is missing"; exit 1; \
	else echo "note: docker-compose not installed, compose.yaml not validated"; fi

test: setup lint
	$(PY) -m pytest

run: setup
	$(VENV)/bin/vit-service up

bench: setup
	$(PY) benchmarks/bench_models.py

clean:
	rm -rf $(VENV) build *.egg-info
