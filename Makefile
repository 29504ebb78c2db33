# The two set-up commands of the README: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
HOST   ?= 127.0.0.1
PORT   ?= 8080
PYTEST_ARGS ?=

.PHONY: serve test check lint format bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# One stamp per extra: reinstall only when pyproject.toml changes.
$(VENV)/.stamp-%: pyproject.toml | $(PY)
	$(PIP) install --quiet -e '.[$*]'
	touch $@

serve: $(VENV)/.stamp-demo
	$(VENV)/bin/barrel serve --host $(HOST) --port $(PORT) \
		--model demo=$$($(PY) -m barrel.store.bundled qwen2.5-coder-0.5b)

# instructor pins jiter<0.15, which no openai>=3.31 accepts: it is installed without its
# pins, beside the test extra (which carries its other needs).
INSTRUCTOR := instructor==1.17.0
$(VENV)/.stamp-test: pyproject.toml | $(PY)
	$(PIP) install --quiet -e '.[test]'
	$(PIP) install --quiet --no-deps '$(INSTRUCTOR)'
	touch $@

test: $(VENV)/.stamp-test
	$(PY) -m pytest $(PYTEST_ARGS)

# The edit loop: every test that needs no real model and is not a long run (markers set
# in tests/conftest.py and on the long tests).
check: $(VENV)/.stamp-test
	$(PY) -m pytest -m "not real_model and not slow" $(PYTEST_ARGS)

lint: $(VENV)/.stamp-dev
	$(VENV)/bin/ruff check barrel tests bench
	$(VENV)/bin/ruff format --check barrel tests bench
	$(VENV)/bin/mypy

format: $(VENV)/.stamp-dev
	$(VENV)/bin/ruff check --fix barrel tests bench
	$(VENV)/bin/ruff format barrel tests bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
