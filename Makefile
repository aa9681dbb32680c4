# `make demo` and `make test` each set themselves up from nothing: they create
# .venv when it is missing and install the package with its extras into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: demo test lint docs bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,docs,notebooks]"
	touch $(STAMP)

# The demo needs the package and its dependencies (jax, equinox, optax) only; pip shows
# its progress, since downloading jaxlib is most of a first run.
$(DEMO_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@echo "Installing residual with jax, equinox and optax into $(VENV) (first run only)"
	$(PY) -m pip install -e .
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(PY) -m residual demo

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict
	@echo "Built site/index.html. To browse while editing: $(PY) -m mkdocs serve"

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
