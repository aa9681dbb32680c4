"""Derivatives of every order through hooked functions, against plain JAX.

Value-preserving hooks must give exact derivatives of every order; lossy ones give
straight-through derivatives: each `unpack(pack(x))` round trip has the derivative of
the identity, so the only error is that of the stored values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import residual
from residual import policies as rp
from tests.helpers import relative_error, tree_allclose


def identity(x):
    return x


def _to_bits(x):
    return lax.bitcast_convert_type(x, jnp.int32)


def _from_bits(bits):
    return lax.bitcast_convert_type(bits, jnp.float32)


# name -> (pack, unpack) or policy, and whether the round trip preserves values.
HOOKS = {
    "identity": ((identity, identity), True),
    "profile": (rp.Profile(), True),
    # Keeps every value but, through integers, has a zero derivative: only a
    # straight-through round trip gives the right higher derivatives.
    "bitcast": ((_to_bits, _from_bits), True),
    "cast_bf16": (rp.Cast(jnp.bfloat16), False),
    "quantize_int8": (rp.Quantize(bits=8, min_bytes=0), False),
}

# Relative error a lossy round trip of the residuals explains: bf16 keeps 8 bits of
# mantissa (2^-9 per value); int8 codes of a group span twice its absmax in 255 steps.
LOSSY_TOLERANCE = {"cast_bf16": 2e-2, "quantize_int8": 3e-2}

FUNCTIONS = {
    "cube": lambda s: s * s * s,
    "tanh": jnp.tanh,
    "exp_exp": lambda s: jnp.exp(s) * jnp.exp(s),
    "sin_cos": lambda s: jnp.sin(s) * jnp.cos(s),
    "sin_squared": lambda s: jnp.sin(s) ** 2,
}

X = jnp.linspace(0.1, 1.2, 8)


def hooked(f, name):
    hooks, _ = HOOKS[name]
    if isinstance(hooks, residual.Policy):
        return residual.with_hooks(f, policy=hooks)
    return residual.with_hooks(f, *hooks)


def nth_derivative(f, order):
    """The elementwise `order`-th derivative of an elementwise `f`, by nested `jax.grad`."""
    for _ in range(order):
        f = jax.grad(lambda x, f=f: jnp.sum(f(x)))
    return f


def assert_matches(got, want, hooks, what=""):
    if HOOKS[hooks][1]:
        assert tree_allclose(got, want), (what, got, want)
    else:
        error = relative_error(got, want)
        assert error < LOSSY_TOLERANCE[hooks], (what, error)


def all_functions(xs):
    """Function `i` of `FUNCTIONS` on row `i` of `xs`: one trace and compilation for all."""
    return jnp.stack([f(x) for f, x in zip(FUNCTIONS.values(), xs)])


@pytest.mark.parametrize("hooks", HOOKS)
@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_nested_grad_of_every_order_matches_plain_jax(order, hooks):
    xs = jnp.stack([X] * len(FUNCTIONS))
    want = jax.jit(nth_derivative(all_functions, order))(xs)
    got = jax.jit(nth_derivative(hooked(all_functions, hooks), order))(xs)
    for name, g, w in zip(FUNCTIONS, got, want):
        assert_matches(g, w, hooks, name)


def test_third_derivative_of_a_cube_at_a_python_float():
    g = residual.with_hooks(lambda s: s * s * s, identity, identity)
    assert float(jax.grad(jax.grad(jax.grad(g)))(0.7)) == pytest.approx(6.0)
    p = residual.with_hooks(lambda s: s * s * s, policy=rp.Profile())
    assert float(jax.grad(jax.grad(jax.grad(p)))(0.7)) == pytest.approx(6.0)


def _mixed(x):
    return jnp.sum(jnp.sin(x) * jnp.exp(x[::-1]) + jnp.tanh(x) ** 2)


@pytest.mark.parametrize("hooks", ["identity", "bitcast", "cast_bf16", "quantize_int8"])
@pytest.mark.parametrize(
    "transform",
    [
        jax.hessian,
        lambda f: jax.jacfwd(jax.hessian(f)),
        lambda f: jax.jacrev(jax.hessian(f)),
        lambda f: jax.jacfwd(jax.jacfwd(jax.jacrev(jax.grad(f)))),
        lambda f: jax.jacrev(jax.jacrev(jax.grad(f))),
    ],
    ids=["hessian", "jacfwd_hessian", "jacrev_hessian", "fwd_fwd_rev_rev", "rev_rev_rev"],
)
def test_jacobians_of_every_order_match_plain_jax(transform, hooks):
    want = jax.jit(transform(_mixed))(X)
    got = jax.jit(transform(hooked(_mixed, hooks)))(X)
    assert_matches(got, want, hooks)


def _attention(gain, x, w):
    """Layer norm with a gain, then one head of softmax attention, summed."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    h = (x - mean) * lax.rsqrt(var + 1e-5) * gain
    q, k, v = h @ w[0], h @ w[1], h @ w[2]
    attention = jax.nn.softmax(q @ k.T / jnp.sqrt(jnp.float32(q.shape[-1])), axis=-1)
    return jnp.sum(jnp.tanh(attention @ v))


@functools.cache
def _attention_inputs():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    gain = 1 + 0.1 * jax.random.normal(k1, (6,))
    x = jax.random.normal(k2, (4, 6))
    w = jax.random.normal(k3, (3, 6, 6)) / jnp.sqrt(6.0)
    return gain, x, w


def _third_order_along(loss, v):
    """The gradient of `v . H(gain) . v`, H the Hessian: three reverse-mode passes."""
    def curvature(gain, x, w):
        hv = jax.grad(lambda g: jnp.vdot(jax.grad(loss)(g, x, w), v))(gain)
        return jnp.vdot(hv, v)

    return jax.grad(curvature)


@pytest.mark.parametrize("hooks", ["identity", "cast_bf16"])
def test_attention_second_and_third_order_match_plain_jax(hooks):
    gain, x, w = _attention_inputs()
    f = hooked(_attention, hooks)
    hessian = jax.jit(jax.hessian(f))(gain, x, w)
    assert_matches(hessian, jax.jit(jax.hessian(_attention))(gain, x, w), hooks)
    v = jnp.linspace(-1.0, 1.0, 6)
    assert_matches(jax.jit(_third_order_along(f, v))(gain, x, w),
                   jax.jit(_third_order_along(_attention, v))(gain, x, w), hooks)



def _mlp(w, x):
    return jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w) ** 2)


# Each traces the hooked call afresh, out of the outer derivative's sight (but for
# `jax.checkpoint` under `jax_custom_vjp3`, which hands the hooks the derivative).
WRAPPERS = {
    "jit": jax.jit,
    "checkpoint": jax.checkpoint,
    "cond": lambda g: lambda w, x: lax.cond(True, g, lambda w, x: 0.0 * jnp.sum(w), w, x),
}


@pytest.mark.parametrize("wrap", WRAPPERS.values(), ids=WRAPPERS.keys())
def test_a_higher_derivative_through_packed_residuals_it_cannot_see_is_refused(wrap):
    w = jax.random.normal(jax.random.key(0), (8, 8)) / 3
    x = jax.random.normal(jax.random.key(1), (4, 8))
    want = jax.hessian(_mlp)(w, x)
    for policy in (rp.Quantize(bits=8, min_bytes=0), rp.Offload()):
        g = residual.with_hooks(_mlp, policy=policy)
        if wrap is jax.checkpoint and getattr(jax.config, "jax_custom_vjp3", False):
            assert relative_error(jax.hessian(wrap(g))(w, x), want) < 0.05
        else:
            with pytest.raises(ValueError, match=r"is being differentiated again.*jax\.hessian"):
                jax.hessian(wrap(g))(w, x)
        # Seen by the hooks, the same derivative round-trips each residual.
        assert relative_error(jax.jit(jax.hessian(g))(w, x), want) < 0.05
    for policy in (rp.Identity(), rp.Remat()):  # nothing packed: exact as before
        got = jax.hessian(wrap(residual.with_hooks(_mlp, policy=policy)))(w, x)
        assert tree_allclose(got, want, rtol=1e-5, atol=1e-6)


OFFLOAD_NAMED = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=["matmul"],
    offload_src="device", offload_dst="pinned_host")


def _offloading_blocks(w, x):
    """Two blocks whose `jax.checkpoint` policy offloads each matmul's output to the host."""

    @functools.partial(jax.checkpoint, policy=OFFLOAD_NAMED)
    def block(h):
        return jnp.tanh(checkpoint_name(h @ w, "matmul"))

    return jnp.sum(block(block(x)) ** 2)



@pytest.mark.parametrize("policy", [rp.Offload(), rp.Quantize(bits=8, min_bytes=0)],
                         ids=["offload", "int8"])
def test_hessian_vector_products_of_residuals_a_checkpoint_offloaded(policy):
    w = jax.random.normal(jax.random.key(0), (16, 16)) / 4
    x = jax.random.normal(jax.random.key(1), (8, 16))
    v = jax.random.normal(jax.random.key(2), (16, 16))

    def hvp(f):
        return jax.jit(lambda w: jax.jvp(lambda w: jax.grad(f)(w, x), (w,), (v,))[1])

    want = hvp(_offloading_blocks)(w)
    got = hvp(residual.with_hooks(_offloading_blocks, policy=policy))(w)
    assert relative_error(got, want) < (1e-6 if policy.lossless else 0.05)
