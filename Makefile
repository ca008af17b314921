# Each target creates .venv if it is missing and installs the project into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0

.PHONY: demo test bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[test,demo]' $(TORCH_PIN)
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/streamload demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider

bench: $(VENV)/.installed
	$(PY) benchmarks/balance.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
