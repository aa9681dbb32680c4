import os

# Compile-only targets (tests/foundation/test_target.py). libtpu lets one process load it
# at a time unless told otherwise, and every pytest-xdist worker loads it; nothing runs on
# those TPUs. JAX's CUDA plugin, finding no CUDA runtime on a machine without a GPU,
# registers (for compiling only) when its runtime check is skipped. Set before JAX loads
# either.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax
import pytest
from hypothesis import HealthCheck, Phase, settings


@pytest.fixture(autouse=True)
def _strict_dtype_promotion():
    """Strict promotion catches a hook or policy that changes dtypes by accident.

    Scoped to this folder's tests: the docs' doctests run third-party layers as users do,
    under JAX's default promotion.
    """
    with jax.numpy_dtype_promotion("strict"):
        yield

# JAX's opt-in flags that change what a jaxpr holds, each to become a default. CI runs
# the JAX-dependent tests (see the Makefile) a second time with them all on; tests taking
# `upgrade_flag` run with each one alone.
UPGRADE_FLAGS = ("jax_remat3", "jax_custom_vjp3", "jax_custom_jvp3")


@pytest.fixture(params=UPGRADE_FLAGS)
def upgrade_flag(request):
    """Each upgrade flag turned on alone, on the JAX releases that support it."""
    flag = request.param
    if not hasattr(jax.config, flag) or jax.__version_info__ < (0, 11):
        # jax 0.10's `jax_remat3` is an early form (it drops `prevent_cse`).
        pytest.skip(f"`{flag}` is supported from jax 0.11 on, not on {jax.__version__}")
    before = {f: getattr(jax.config, f) for f in UPGRADE_FLAGS if hasattr(jax.config, f)}
    for f in before:
        jax.config.update(f, f == flag)
    yield flag
    for f, value in before.items():
        jax.config.update(f, value)


# Property tests (tests/integration/test_fuzz.py): a bounded profile for CI, a long one on request
# with `RESIDUAL_FUZZ_PROFILE=long`. Programs are traced and compiled per example, so
# there is no per-example deadline.
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large]
# CI draws the same examples on every run (derandomize), so a red CI is reproducible
# and never depends on luck; it skips shrinking, which alone can take minutes per
# failure. The failing example is printed in full, and a local run draws the same one.
settings.register_profile(
    "ci", max_examples=20, deadline=None, suppress_health_check=_QUIET,
    derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
)
settings.register_profile(
    "long", max_examples=1000, deadline=None, suppress_health_check=_QUIET
)
# `debug`: report failures as found, without the (slow) search for a smaller example.
settings.register_profile(
    "debug", max_examples=30, deadline=None, suppress_health_check=_QUIET,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
settings.load_profile(os.environ.get("RESIDUAL_FUZZ_PROFILE", "ci"))
