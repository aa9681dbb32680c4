# `make demo` and `make test` each set themselves up from nothing: they create
# .venv when it is missing and install the package with its extras into it.
# `make test-jax` does the same for the newer JAX releases, each in a venv of its own.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# jax 0.11 and 0.12 need Python 3.12; pyenv keeps it on these machines.
PYTHON312 ?= $(or $(lastword $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.12.*/bin/python)),python3.12)
# The JAX releases `make test-jax` tests besides .venv's (the newest for Python 3.11).
JAX_VENVS := .venv-jax011 .venv-jax012
jax_version.venv-jax011 := 0.11.2
jax_version.venv-jax012 := 0.12.0.1
# The oldest flax each JAX release runs: the NNX tests run a second time on it, after
# the suite has run on the newest flax pip gives.
flax_oldest.venv := 0.12.7
flax_oldest.venv-jax011 := 0.12.10
flax_oldest.venv-jax012 := 0.12.10
DEMO_STAMP := $(VENV)/.installed-demo
# pytest-xdist workers for the tests: one per core; `0` runs them in pytest's own process
# (as `make -j2 test-jax` does in CI, where the two suites already share the cores).
PYTEST_WORKERS ?= auto

# Compiling for TPUs and GPUs that are not here (`target=`,
# tests/foundation/test_target.py): libtpu loads in one process at a time unless told
# otherwise (the suites of `make -j2 test-jax` run side by side), and JAX's CUDA plugin
# registers without a GPU once its runtime check is skipped. Nothing runs on those devices.
export ALLOW_MULTIPLE_LIBTPU_LOAD := 1
export JAX_SKIP_CUDA_CONSTRAINTS_CHECK := 1

.PHONY: demo test suite test-jax suite-.venv-jax011 suite-.venv-jax012 flax-oldest-.venv-jax012 suite-upgrade-flags lint docs bench bench-gpu clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,docs,notebooks,tpu,cuda]"
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(VENV)/flax-oldest "flax==$(flax_oldest$(VENV))"
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

test: suite
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

# The whole suite on one venv's JAX: lint, tests and doctests, the multi-device tests
# (in a process of their own: they simulate 8 CPU devices, set before JAX starts), and
# the notebooks.
define suite
	@$(1)/bin/python -c "import jax, sys; print(f'== jax {jax.__version__}, Python {sys.version.split()[0]}')"
	$(1)/bin/python -m ruff check residual tests benchmarks
	$(1)/bin/python -m pytest -n $(PYTEST_WORKERS) --durations=15 residual tests docs
	$(1)/bin/python -m pytest tests/integration/multidevice
	$(1)/bin/python -m pytest --nbmake notebooks
endef

# The suite less the tests marked slow (15 s or more each: property tests, other
# libraries' whole models), the compile-only tests of tests/foundation/test_target.py,
# the docs' examples and the notebooks, for the JAX
# release between the oldest and the newest and for the upgrade flags: the whole suite
# four times over takes longer than CI's 90 minutes on its 2 cores. The second
# argument narrows the tests run (all of `residual` and `tests` when empty).
define quick_suite
	@$(1)/bin/python -c "import jax, sys; print(f'== jax {jax.__version__}, Python {sys.version.split()[0]}, tests not marked slow')"
	$(1)/bin/python -m pytest -n $(PYTEST_WORKERS) --durations=15 -m "not slow" \
		--ignore=tests/foundation/test_target.py $(or $(2),residual tests)
	$(1)/bin/python -m pytest tests/integration/multidevice
endef

# Then the flax NNX tests once more, on the oldest flax this JAX runs.
define flax_oldest
	PYTHONPATH=$(1)/flax-oldest $(1)/bin/python -c "import flax; print(f'== flax {flax.__version__}')"
	PYTHONPATH=$(1)/flax-oldest $(1)/bin/python -m pytest -n $(PYTEST_WORKERS) -k nnx \
		tests/engine/test_nnx.py tests/integration/test_libraries.py docs/guides/flax-nnx.md
endef

suite: $(STAMP)
	$(call suite,$(VENV))
	$(call flax_oldest,$(VENV))

# The suite on every other supported JAX release (the whole suite on the newest, the
# quick one on the release between), and the quick one once more on the newest with
# JAX's upgrade flags on; `make -j2 test-jax` runs them two at a time.
# The newest's oldest-flax run is a target of its own, so that it takes whichever lane
# frees first.
test-jax: suite-.venv-jax012 suite-.venv-jax011 suite-upgrade-flags flax-oldest-.venv-jax012

suite-.venv-jax011: .venv-jax011/.installed
	$(call quick_suite,.venv-jax011)
	$(call flax_oldest,.venv-jax011)

suite-.venv-jax012: .venv-jax012/.installed
	$(call suite,.venv-jax012)

flax-oldest-.venv-jax012: .venv-jax012/.installed
	$(call flax_oldest,.venv-jax012)

# JAX's opt-in flags that are to become its defaults and that plain `jax.grad` can
# differentiate under (not `jax_scan3` yet): the day JAX flips one, the quick suite has
# passed.
# The flags change what JAX traces, not which flax runs: the oldest flax is tested
# without them. What they change is the jaxpr the engine reads, so the quick suite's
# tests of the engine, the integrations, the policies' gradients and the JAX
# internals run under them; the tools' and Quantize's own tests and the doctests,
# which reach JAX through the same engine, run on the suites above only (CI's two
# lanes share two cores within its 90 minutes).
suite-upgrade-flags: export JAX_REMAT3 = 1
suite-upgrade-flags: export JAX_CUSTOM_VJP3 = 1
suite-upgrade-flags: export JAX_CUSTOM_JVP3 = 1
suite-upgrade-flags: .venv-jax012/.installed
	@echo "== JAX upgrade flags on: jax_remat3, jax_custom_vjp3, jax_custom_jvp3"
	$(call quick_suite,.venv-jax012,tests/engine tests/foundation tests/integration tests/policies/test_policies.py)

$(JAX_VENVS:%=%/.installed): pyproject.toml
	test -x $(@D)/bin/python || $(PYTHON312) -m venv $(@D)
	$(@D)/bin/python -m pip install --quiet --upgrade pip
	$(@D)/bin/python -m pip install -e ".[test,notebooks,tpu,cuda]" \
		"jax==$(jax_version$(@D))" "jaxlib==$(jax_version$(@D))"
	$(@D)/bin/python -m pip install --quiet --no-deps --upgrade --target $(@D)/flax-oldest \
		"flax==$(flax_oldest$(@D))"
	touch $@

bench: $(STAMP)
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/quality.py
	$(PY) benchmarks/speed.py

# On a machine with a GPU: memory, step time, offload bandwidth and a profile (docs/gpu.md).
bench-gpu: $(STAMP)
	$(PY) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) $(JAX_VENVS) site .pytest_cache
