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

# kvpress beside kvtier (the [compare] extra) needs transformers<5.3: an environment of its own, pinned the same way.
COMPARE ?= .venv-compare
COMPARE_STAMP := $(COMPARE)/.installed

$(COMPARE_STAMP): requirements-compare.lock requirements-data.txt pyproject.toml
	python3 -m venv $(COMPARE)
	$(COMPARE)/bin/python -m pip install -q --upgrade "pip>=24" "setuptools>=70" wheel
	$(COMPARE)/bin/python -m pip install -q --no-deps --no-build-isolation -r requirements-compare.lock
	$(COMPARE)/bin/python -m pip install -q --no-deps -r requirements-data.txt
	$(COMPARE)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(COMPARE_STAMP)

.PHONY: venv run test test-nightly bench-gpu compare-env test-compare
venv: $(STAMP)
compare-env: $(COMPARE_STAMP)

# The default recipe (about a minute on 2 cores): ASPE's perplexity, and its attention against exact
# attention at every step (cache.fidelity: attention-mass recall, output error).
run: $(STAMP)
	$(VENV)/bin/kvtier-run $(ARGS)

# The suite in WORKERS processes (pytest-xdist; CI has 2 cores): 6-18 minutes of pytest on 2 cores, by the box.
WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n $(WORKERS) $(ARGS)

test-nightly: $(STAMP)
	$(PY) -m pytest -q -m nightly $(ARGS)

# The kvpress tests (they skip in .venv): a press through the study harness on SmolLM2, kvpress's own pipeline.
test-compare: $(COMPARE_STAMP)
	$(COMPARE)/bin/python -m pytest -q -p no:cacheprovider tests/test_kvpress_study.py $(ARGS)
