# Each target creates .venv if it is missing and installs the project into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
# make test runs the files on this many pytest-xdist workers (0: in one process). Two halve the
# suite's time on a 2-core machine: a test often waits (ranks starting, timeouts, sleeps).
TEST_WORKERS ?= 2
# The formats' reference writers and readers, for the tests (their own dependencies would pull
# another torch and cloud SDKs: what they import is in the test extra).
REFERENCE_READERS := mosaicml-streaming==0.13.0 megatron-core==0.16.1 webdataset==1.0.2 \
	litdata==0.2.76 lightning-utilities==0.15.3

.PHONY: demo test test-core bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[test,demo]' $(TORCH_PIN)
	$(PY) -m pip install --quiet --no-deps $(REFERENCE_READERS)
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/streamload demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=15

# The pure core alone (planning, codecs, config, state; no processes, no servers): seconds.
test-core: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider -m core

bench: $(VENV)/.installed
	$(PY) benchmarks/balance.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
