# `make demo` and `make test` each set themselves up from nothing: they create
# .venv when it is missing and install the package with its extras into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,docs,notebooks]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m residual demo

lint: $(STAMP)
	$(PY) -m ruff check residual tests benchmarks

# The multi-device tests run in a process of their own: they simulate 8 CPU devices,
# which must be set before JAX starts.
test: lint $(STAMP)
	$(PY) -m pytest residual tests docs
	$(PY) -m pytest tests/multidevice
	$(PY) -m pytest --nbmake notebooks
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

bench: $(STAMP)
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/quality.py
	$(PY) benchmarks/speed.py

clean:
	rm -rf $(VENV) site .pytest_cache
