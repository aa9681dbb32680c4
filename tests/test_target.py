"""Memory figures and compile-only targets: which field each backend fills, TPU and GPU
programs compiled on this machine, shardings mapped onto a slice, and the errors.

The TPU tests need libtpu (`residual[tpu]`), the GPU ones JAX's CUDA plugin and ptxas
(`residual[cuda]`); each skips, saying so, where its part is not installed.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import pytest

import residual
from residual import _target


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


needs_tpu = pytest.mark.skipif(
    not _installed("libtpu"), reason="libtpu is not installed (pip install 'residual[tpu]')")
needs_gpu = pytest.mark.skipif(
    not _installed("jax_plugins.xla_cuda12"),
    reason="JAX's CUDA plugin is not installed (pip install 'residual[cuda]')")


def _step(w, x):
    """A program with temporaries, arguments and outputs of known sizes (1 MiB each
    argument, 1 MiB out): a training step of a 3-layer tanh MLP."""
    def loss(w, x):
        for _ in range(3):
            x = jnp.tanh(x @ w)
        return jnp.sum(x**2)

    return w - 0.1 * jax.grad(loss)(w, x)


_ARGS = (jax.ShapeDtypeStruct((512, 512), jnp.float32),
         jax.ShapeDtypeStruct((512, 512), jnp.float32))


def _stats(target, donate=()):
    placed = _target.resolve(target).place(_ARGS)
    compiled = jax.jit(_step, donate_argnums=donate).lower(*placed).compile()
    return compiled.memory_analysis(), residual.Memory.of(compiled)


# Which field each backend fills ------------------------------------------------------------
# A JAX release that fills another field fails here, not silently in every figure.


@pytest.mark.parametrize("donate", [(), (0,)])
def test_cpu_peak_field_holds_arguments_and_outputs_only(donate):
    stats, memory = _stats("cpu", donate)
    args_outs = stats.argument_size_in_bytes + stats.output_size_in_bytes
    assert stats.argument_size_in_bytes == 2 * 2**20 and stats.output_size_in_bytes == 2**20
    assert stats.alias_size_in_bytes == (2**20 if donate else 0)
    assert stats.peak_memory_in_bytes == args_outs - stats.alias_size_in_bytes
    assert stats.temp_size_in_bytes >= 2**20  # the activations: three 1 MiB layers
    assert memory.peak == stats.peak_memory_in_bytes + stats.temp_size_in_bytes
    assert memory.beyond == stats.temp_size_in_bytes
    assert memory.platform == "cpu"


@needs_tpu
@pytest.mark.parametrize("donate", [(), (0,)])
def test_tpu_peak_field_is_the_peak_and_temp_field_is_not(donate):
    stats, memory = _stats("v5e", donate)
    args_outs = (stats.argument_size_in_bytes + stats.output_size_in_bytes
                 - stats.alias_size_in_bytes)
    # The buffer assignment's peak holds the activations; the temp field leaves them out.
    assert stats.peak_memory_in_bytes >= args_outs + 2**20 > args_outs + stats.temp_size_in_bytes
    assert memory.peak == stats.peak_memory_in_bytes and memory.platform == "tpu"
    assert memory.beyond == stats.peak_memory_in_bytes - args_outs


@needs_gpu
@pytest.mark.parametrize("donate", [(), (0,)])
def test_gpu_peak_field_is_arguments_outputs_and_temp(donate):
    stats, memory = _stats("h100", donate)
    assert stats.peak_memory_in_bytes == (
        stats.argument_size_in_bytes + stats.output_size_in_bytes
        - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
    assert stats.temp_size_in_bytes >= 2**20
    assert memory.peak == stats.peak_memory_in_bytes and memory.platform == "gpu"
    assert memory.beyond == stats.temp_size_in_bytes


def test_donation_counts_a_reused_buffer_once():
    # XLA:CPU moves the donated buffer's megabyte from arguments-and-outputs to temp: the
    # peak stays, as the buffer is counted once.
    plain, donated = _stats("cpu")[1], _stats("cpu", (0,))[1]
    assert donated.aliased == 2**20
    assert donated.peak == plain.peak
    assert donated.beyond == plain.beyond + 2**20


def test_memory_of_rejects_what_is_not_compiled():
    with pytest.raises(TypeError, match=r"expects a compiled program.*Lowered"):
        residual.Memory.of(jax.jit(jnp.sin).lower(1.0))
