"""Shared test helpers: tolerances per dtype, tree comparisons, small models."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import residual
from residual._placement import platform_family

# The running backend as `residual`'s reports name it: "cpu", "gpu" or "tpu".
RUNNING_PLATFORM = platform_family(jax.default_backend())


@dataclasses.dataclass(frozen=True)
class Negate(residual.Policy):
    """Lossless, but not the identity: the engine packs activations, leaves weights."""

    lossless = True

    def resolve(self, info):
        return None if info.kept_alive else self

    def pack(self, x, info):
        return -x

    def unpack(self, packed, info):
        return -packed


def xfail_on_gpu(reason: str):
    """A memory bound or a name set on XLA:CPU's programs, measured to miss on a GPU's for
    `reason` (docs/gpu.md, "The test suite on a GPU"): expected to fail there."""
    return pytest.mark.xfail(RUNNING_PLATFORM == "gpu", reason=f"on a GPU: {reason}",
                             strict=False)


# Why CPU-set memory bounds miss on a GPU, as measured compiling the tests for an H100.
SPLIT_K_SCRATCH = ("at the test's small shapes the GPU compiler's split-K matmul scratch, "
                   "not the stored residuals, fills most of the temp memory")
LEANER_GPU_BASELINE = ("the GPU's plain program stores only the matmul outputs (the "
                       "elementwise ops fused into them), a leaner baseline than XLA:CPU's")


TOLERANCES = {
    jnp.dtype(jnp.float64): 1e-12,
    jnp.dtype(jnp.float32): 1e-5,
    jnp.dtype(jnp.bfloat16): 2e-2,
    jnp.dtype(jnp.float16): 2e-3,
}


def tree_allclose(a, b, *, rtol=None, atol=None) -> bool:
    """Same structure and all leaves close, with per-dtype default tolerances."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        tol = TOLERANCES.get(jnp.dtype(x.dtype), 0.0)
        r = tol if rtol is None else rtol
        t = tol if atol is None else atol
        if not np.allclose(x.astype(np.float64), y.astype(np.float64), rtol=r, atol=t,
                           equal_nan=True):
            return False
    return True


def tree_equal(a, b) -> bool:
    """Bit-for-bit equality of two pytrees of arrays."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(
        np.asarray(x).dtype == np.asarray(y).dtype
        and np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def same_as_plain(got, expected) -> bool:
    """The hooked program's values against plain's: bit for bit on XLA:CPU; on a GPU
    within float32 rounding (relative L2 error 1e-6), since XLA:GPU may choose other
    kernels, summing in another order, for the hooked program (seen on an H200 for a
    flax NNX transformer whose hooks change no value)."""
    if RUNNING_PLATFORM == "gpu":
        return (jax.tree.structure(got) == jax.tree.structure(expected)
                and relative_l2(got, expected) <= 1e-6)
    return tree_equal(got, expected)


def relative_error(approx, exact) -> float:
    """max over leaves of ||approx - exact|| / ||exact||."""
    errs = [
        float(jnp.linalg.norm((x - y).ravel()) / (jnp.linalg.norm(y.ravel()) + 1e-30))
        for x, y in zip(jax.tree.leaves(approx), jax.tree.leaves(exact))
    ]
    return max(errs)


def relative_l2(got, expected) -> float:
    """||got - expected|| / ||expected|| over all leaves together."""
    num = sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(jax.tree.leaves(got),
                                                            jax.tree.leaves(expected)))
    den = sum(float(jnp.sum(b**2)) for b in jax.tree.leaves(expected))
    return (num / den) ** 0.5


def scan_mlp(ws, x):
    """A tanh MLP as a `lax.scan` over stacked layer weights."""

    def layer(h, w):
        return jnp.tanh(h @ w), None

    h, _ = lax.scan(layer, x, ws)
    return jnp.sum(h**2)


def unrolled_mlp(ws, x):
    """The same MLP unrolled in a Python loop."""
    for w in ws:
        x = jnp.tanh(x @ w)
    return jnp.sum(x**2)


def normalized_relu_convs(ws, x):
    """Convolutions (NHWC), each with a batch norm and a ReLU, whose mask `x > 0` is a
    residual per layer."""
    for w in ws:
        h = lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        h = (h - h.mean((0, 1, 2))) * lax.rsqrt(h.var((0, 1, 2)) + 1e-5)
        x = jax.nn.relu(h)
    return jnp.mean(x**2)


def mlp_params(layers=4, width=16, batch=8, seed=0, dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(seed))
    ws = jax.random.normal(k1, (layers, width, width), dtype) / jnp.sqrt(width).astype(dtype)
    x = jax.random.normal(k2, (batch, width), dtype)
    return ws, x


def peak_bytes(fn, *args) -> int:
    """The compiled `fn(*args)`'s peak memory (`residual.Memory.peak`), as plans report it."""
    return residual.compiled_memory(fn, *args).peak


def beyond_bytes(fn, *args) -> int:
    """The compiled `fn(*args)`'s peak memory beyond its arguments and outputs
    (`residual.Memory.beyond`): the activations and residuals policies act on."""
    return residual.compiled_memory(fn, *args).beyond


def compiled_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def offloading_y(x):
    """`jax.checkpoint` offloads `y` inside the hooked function: that residual reaches
    the hooks in host memory, where XLA cannot compute."""
    offload_y = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["y"],
        offload_src="device", offload_dst="pinned_host",
    )

    def f(x):
        y = jax.ad_checkpoint.checkpoint_name(jnp.sin(x) * 2, "y")
        return jnp.sum(jnp.tanh(y) ** 2)

    return jax.checkpoint(f, policy=offload_y)(x)
