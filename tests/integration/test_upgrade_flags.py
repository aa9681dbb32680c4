"""Every feature with each of JAX's upgrade flags on alone (`jax_remat3`, ...).

The flags bind new primitives (`RematTraced`, `CheckpointName`, `CustomVJPTraced`) in
place of the ones a jaxpr held. Each test here compares the flag's run with plain
`jax.grad` under the same flag, and what `residual` sees with what it sees without it.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import residual
from residual import policies as rp

from ..helpers import mlp_params, relative_error

INT8 = rp.Quantize(bits=8, min_bytes=0)
BY_NAME = rp.select([(rp.where(name="act"), INT8)])


@jax.custom_vjp
def gelu(x):
    return jax.nn.gelu(x)


def _gelu_fwd(x):
    return jax.nn.gelu(x), (x,)


def _gelu_bwd(res, g):
    (x,) = res
    return (g * jax.grad(lambda t: jnp.sum(jax.nn.gelu(t)))(x),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)


@jax.custom_jvp
def softplus(x):
    return jnp.logaddexp(x, 0.0)


@softplus.defjvp
def _softplus_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return softplus(x), t * jax.nn.sigmoid(x)


def named_scan(ws, x):
    """A MaxText-style model: each layer's pre-activation tagged, as policies select it."""

    def layer(h, w):
        return jax.nn.gelu(checkpoint_name(h @ w, "act")), None

    h, _ = lax.scan(layer, x, ws)
    return jnp.sum(h**2)


SAVE_ACT = jax.checkpoint_policies.save_only_these_names("act")


def checkpointed(ws, x):
    """`jax.checkpoint` per layer saving the tagged values, a custom_vjp, a custom_jvp."""
    for w in ws:
        x = jax.checkpoint(lambda x, w: gelu(checkpoint_name(x @ w, "act")),
                           policy=SAVE_ACT)(x, w)
        x = softplus(x)
    return jnp.sum(x**2)


@contextlib.contextmanager
def flag_off(flag):
    jax.config.update(flag, False)
    try:
        yield
    finally:
        jax.config.update(flag, True)


MODELS = {"named scan": named_scan, "checkpoint, custom_vjp, custom_jvp": checkpointed}


def rows(f, policy, ws, x):
    return residual.inspect(f, ws, x, policy=policy, compiled=False).rows


@pytest.mark.parametrize("model", list(MODELS))
def test_names_select_the_same_residuals_with_the_flag(upgrade_flag, model):
    f = MODELS[model]
    ws, x = mlp_params(layers=3, width=32, batch=16)

    def seen():
        return sorted((r.primitive or "", r.name or "", r.how, r.shape, r.iterations)
                      for r in rows(f, BY_NAME, ws, x))

    got = seen()
    named = [r for r in got if r[1] == "act"]
    assert named and all(r[2] == "packed" for r in named), got
    # The flag changes the order in which JAX saves residuals, not what they are,
    # which op made them, their names, or what the policy does to them.
    with flag_off(upgrade_flag):
        assert got == seen()


@pytest.mark.parametrize("model", list(MODELS))
def test_gradients_with_the_flag_match_plain(upgrade_flag, model):
    f = MODELS[model]
    ws, x = mlp_params(layers=3, width=32, batch=16)
    expected = jax.grad(f)(ws, x)
    for policy, tolerance in ((rp.Identity(), 1e-6), (INT8, 0.01), (BY_NAME, 0.01)):
        got = jax.jit(jax.grad(residual.with_hooks(f, policy=policy)))(ws, x)
        assert relative_error(got, expected) < tolerance, (policy, upgrade_flag)
    # Around the hooked function too: a region the flag rebuilds as its own primitive.
    outer = jax.checkpoint(residual.with_hooks(f, policy=INT8))
    assert relative_error(jax.jit(jax.grad(outer))(ws, x), expected) < 0.01


def test_a_plan_keyed_by_name_applies_with_the_flag(upgrade_flag):
    ws, x = mlp_params(layers=3, width=128, batch=256)
    plan = residual.plan(named_scan, ws, x, budget=0.7)
    got = jax.jit(jax.grad(residual.with_hooks(named_scan, policy=plan)))(ws, x)
    assert relative_error(got, jax.grad(named_scan)(ws, x)) <= max(plan.grad_error * 2, 1e-6)
    applied = rows(named_scan, plan, ws, x)
    assert any(r.name == "act" and r.how != "kept" for r in applied), applied


def test_scan3_is_not_yet_differentiable():
    # The day `jax_scan3` can be differentiated, this fails: `_engine/rewrite.py` must then
    # learn to rebuild its `Scan3` bodies, and the flag joins `UPGRADE_FLAGS`.
    if not hasattr(jax.config, "jax_scan3"):
        pytest.skip(f"jax {jax.__version__} has no `jax_scan3`")
    ws, x = mlp_params(layers=2, width=8, batch=4)
    jax.config.update("jax_scan3", True)
    try:
        with pytest.raises(NotImplementedError, match="vjp_fwd"):
            jax.grad(named_scan)(ws, x)
    finally:
        jax.config.update("jax_scan3", False)
