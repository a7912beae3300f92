# Two entry points: `make demo` (the main job) and `make test` (the test suite).
# Each creates .venv at the repository root and installs what it needs.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found; install Python 3.11 or run make PYTHON=/path/to/python3.11"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[torch,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/remat demo

test: $(STAMP)
	$(PY) -m pytest -n 2 --timeout 900 -q

bench: $(STAMP)
	$(VENV)/bin/remat bench sweep
	$(VENV)/bin/remat bench max-batch

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
