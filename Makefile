# One command each: `make run` (the default recipe on SmolLM2) and `make test` (the CPU suite).
# Both create .venv from the pinned lock file on first use (no resolver: exact versions, --no-deps).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): requirements.lock requirements-data.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24" "setuptools>=70" wheel
	$(PY) -m pip install -q --no-deps --no-build-isolation -r requirements.lock
	$(PY) -m pip install -q --no-deps -r requirements-data.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

.PHONY: venv run test test-nightly bench-gpu
venv: $(STAMP)

# The default recipe (about a minute on 2 cores): ASPE's perplexity, and its attention against exact
# attention at every step (cache.fidelity: attention-mass recall, output error).
run: $(STAMP)
	$(VENV)/bin/kvtier-run $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(ARGS)

test-nightly: $(STAMP)
	$(PY) -m pytest -q -m nightly $(ARGS)
