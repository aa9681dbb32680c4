# `make demo` and `make test` each set themselves up from nothing: they create
# .venv when it is missing and install the package with its extras into it.
# `make test-jax` does the same for the other JAX releases, each in a venv of its own.
# .venv runs the newest JAX pip gives with the `tpu` and `cuda` extras, which needs
# Python 3.12; pyenv keeps it on these machines. Without it, .venv falls back to python3.
PYTHON312 ?= $(or $(lastword $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.12.*/bin/python)),$(shell command -v python3.12 2>/dev/null))
PYTHON ?= $(or $(PYTHON312),python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The other JAX releases `make test-jax` tests besides .venv's, and the Python each needs:
# the oldest, the middle, and the newest pip gives without the `tpu` and `cuda` extras.
# jax 0.12.1's libtpu and CUDA plugin are not on PyPI (2026-12-06), so .venv resolves
# 0.12.0.1; once they are, .venv-jax0121 repeats .venv and is to move to the next release.
JAX_VENVS := .venv-jax010 .venv-jax011 .venv-jax0121
jax_version.venv-jax010 := 0.10.2
jax_version.venv-jax011 := 0.11.2
jax_version.venv-jax0121 := 0.12.1
python.venv-jax010 := python3
python.venv-jax011 := $(or $(PYTHON312),python3.12)
python.venv-jax0121 := $(or $(PYTHON312),python3.12)
# The oldest flax each JAX release runs: the NNX tests run a second time on it, after
# the suite has run on the newest flax pip gives.
flax_oldest.venv := 0.12.10
flax_oldest.venv-jax010 := 0.12.7
flax_oldest.venv-jax011 := 0.12.10
flax_oldest.venv-jax0121 := 0.12.10
DEMO_STAMP := $(VENV)/.installed-demo
# pytest-xdist workers for the tests: one per core; `0` runs them in pytest's own process
# (as `make -j2 test-jax-compat` does in CI, where the two suites already share the cores).
PYTEST_WORKERS ?= auto

# Compiling for TPUs and GPUs that are not here (`target=`,
# tests/foundation/test_target.py): libtpu loads in one process at a time unless told
# otherwise (the suites of `make -j2 test-jax` run side by side), and JAX's CUDA plugin
# registers without a GPU once its runtime check is skipped. Nothing runs on those devices.
export ALLOW_MULTIPLE_LIBTPU_LOAD := 1
export JAX_SKIP_CUDA_CONSTRAINTS_CHECK := 1

.PHONY: demo test suite test-jax test-jax-compat suite-.venv-jax010 suite-.venv-jax011 suite-.venv-jax0121 suite-upgrade-flags lint docs bench bench-gpu clean

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

# On the older releases and under JAX's upgrade flags, the tests of what changes between
# JAX releases: the JAX internals the library uses, and the engine reading the jaxprs
# JAX traces, at every derivative order. The whole suite once more per release would
# take longer than CI's 90 minutes on its 2 cores.
COMPAT_TESTS := tests/foundation/test_jax_private.py tests/engine/test_transform.py \
	tests/engine/test_higher_order.py
define compat_suite
	@$(1)/bin/python -c "import jax, sys; print(f'== jax {jax.__version__}, Python {sys.version.split()[0]}, the JAX-dependent tests')"
	$(1)/bin/python -m pytest -n $(PYTEST_WORKERS) --durations=5 -m "not slow" $(COMPAT_TESTS)
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

# The JAX-dependent tests on the oldest and the middle JAX release and on .venv's once
# more with JAX's upgrade flags on (`make -j2 test-jax-compat PYTEST_WORKERS=0` runs them
# two at a time), then the whole suite on the newest release without the extras.
test-jax: test-jax-compat suite-.venv-jax0121

test-jax-compat: suite-.venv-jax010 suite-.venv-jax011 suite-upgrade-flags

suite-.venv-jax010: .venv-jax010/.installed
	$(call compat_suite,.venv-jax010)
	$(call flax_oldest,.venv-jax010)

suite-.venv-jax011: .venv-jax011/.installed
	$(call compat_suite,.venv-jax011)
	$(call flax_oldest,.venv-jax011)

# The newest release: the tests, doctests and multi-device tests, then the flax NNX
# tests on the oldest flax. This venv has no libtpu or CUDA plugin: the tests that
# compile for a TPU or a GPU skip, and the notebooks, one of which does, are left out.
suite-.venv-jax0121: .venv-jax0121/.installed
	@.venv-jax0121/bin/python -c "import jax, sys; print(f'== jax {jax.__version__}, Python {sys.version.split()[0]}, the tests')"
	.venv-jax0121/bin/python -m pytest -n $(PYTEST_WORKERS) --durations=5 residual tests docs
	.venv-jax0121/bin/python -m pytest tests/integration/multidevice
	$(call flax_oldest,.venv-jax0121)

# JAX's opt-in flags that are to become its defaults and that plain `jax.grad` can
# differentiate under (not `jax_scan3` yet): the day JAX flips one, these tests have
# passed. The whole suite runs each flag alone in tests/integration/test_upgrade_flags.py.
suite-upgrade-flags: export JAX_REMAT3 = 1
suite-upgrade-flags: export JAX_CUSTOM_VJP3 = 1
suite-upgrade-flags: export JAX_CUSTOM_JVP3 = 1
suite-upgrade-flags: $(STAMP)
	@echo "== JAX upgrade flags on: jax_remat3, jax_custom_vjp3, jax_custom_jvp3"
	$(call compat_suite,$(VENV))

$(JAX_VENVS:%=%/.installed): pyproject.toml
	test -x $(@D)/bin/python || $(python$(@D)) -m venv $(@D)
	$(@D)/bin/python -m pip install --quiet --upgrade pip
	$(@D)/bin/python -m pip install --quiet -e ".[test]" \
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
