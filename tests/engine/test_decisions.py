"""Decisions: every residual gets one, and reports name it by the decision's own word."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import residual
from residual import policies as rp
from tests.helpers import (
    mlp_params,
    relative_error,
    scan_mlp,
    tree_allclose,
    tree_equal,
    unrolled_mlp,
)


@dataclasses.dataclass(frozen=True)
class _RecomputeAll(residual.Policy):
    """A user's own policy that stores nothing, declared by its `recompute` attribute."""

    recompute = True
    lossless = True


def test_a_users_policy_with_recompute_set_is_recomputed_like_remat():
    ws, x = mlp_params(3, 8, 4)
    hooked = residual.with_hooks(unrolled_mlp, policy=_RecomputeAll())
    assert tree_equal(jax.grad(hooked)(ws, x), jax.grad(residual.with_hooks(
        unrolled_mlp, policy=rp.Remat()))(ws, x))
    assert tree_allclose(jax.grad(hooked)(ws, x), jax.grad(unrolled_mlp)(ws, x))
    report = residual.inspect(unrolled_mlp, ws, x, policy=_RecomputeAll(), compiled=False)
    assert {row.how for row in report.rows} <= {"recomputed", "view", "kept"}
    assert "recomputed" in {row.how for row in report.rows}


def test_each_decision_reports_its_word():
    # Per tanh layer: a weight slice (a view of `ws`), a matmul operand, a tanh output
    # and its derivative (`1 - y`, or `1 - y**2` from jax 0.11 on); `x` is kept as it is.
    ws, x = mlp_params(3, 8, 4)
    words = {
        rp.Identity(): {"kept"},
        rp.Quantize(bits=8, min_bytes=0): {"kept", "packed", "derived", "view"},
        rp.Remat(): {"kept", "recomputed", "view"},
    }
    for policy, expected in words.items():
        report = residual.inspect(unrolled_mlp, ws, x, policy=policy, compiled=False)
        hows = [row.how for row in report.rows]
        assert set(hows) == expected, policy
        assert hows.count("view") == (3 if "view" in expected else 0)


def test_constants_a_derivative_saves_are_derived_not_packed():
    # relu's derivative saves full-size zeros built from a literal: packing them would
    # quantize a constant and report it as stored.
    ws, x = mlp_params(2, 64, 64)

    def relu_mlp(ws, x):
        for w in ws:
            x = jax.nn.relu(x @ w)
        return (x**2).sum()

    policy = rp.Quantize(bits=8, min_bytes=0)
    report = residual.inspect(relu_mlp, ws, x, policy=policy, compiled=False)
    zeros = [row for row in report.rows if row.primitive == "broadcast_in_dim"]
    assert len(zeros) == 2
    assert all(row.how == "derived" and row.stored_bytes == 0 for row in zeros)
    identity = residual.inspect(relu_mlp, ws, x, policy=rp.Identity(), compiled=False)
    assert [row.how for row in identity.rows if row.primitive == "broadcast_in_dim"] == [
        "kept", "kept"]
    hooked = jax.grad(residual.with_hooks(relu_mlp, policy=policy))(ws, x)
    assert relative_error(hooked, jax.grad(relu_mlp)(ws, x)) < 1e-2


def _scanned_transposed(ws_t, x):
    """A scanned tanh MLP whose layers keep their weights transposed: `h @ w.T`."""
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w.T), None), x, ws_t)
    return jnp.sum(h**2)


def test_a_scan_body_takes_views_of_its_weights_again():
    # Stored, the loop would stack a copy of the transposed weights, which the call around
    # the scan would pack: the backward would multiply by quantized weights.
    ws, x = mlp_params(3, 64, 32)
    policy = rp.Quantize(bits=8, min_bytes=0)
    report = residual.inspect(_scanned_transposed, ws, x, policy=policy, compiled=False)
    assert [row.how for row in report.rows if row.shape[-2:] == (64, 64)] == ["kept"]
    # The body packs its activations (and derives tanh's factor where JAX saves 1 - y).
    assert {row.how for row in report.rows if row.section} <= {"packed", "derived"}
    hooked = jax.grad(residual.with_hooks(_scanned_transposed, policy=policy),
                      argnums=(0, 1))(ws, x)
    assert relative_error(hooked, jax.grad(_scanned_transposed, argnums=(0, 1))(ws, x)) < 2e-2
    # The same layers with their weights as they are: the same packed activations.
    untransposed = jax.grad(residual.with_hooks(scan_mlp, policy=policy), argnums=(0, 1))(
        jnp.swapaxes(ws, 1, 2), x)
    assert tree_allclose((jnp.swapaxes(hooked[0], 1, 2), hooked[1]), untransposed,
                         rtol=1e-5, atol=1e-6)


def _linear_recurrence(params, x):
    """An LRU/S5-style layer: `h[t] = a[t] * h[t-1] + b[t]` by `lax.associative_scan`,
    whose derivative stores literals (the zeros it pads with) among its residuals."""
    wa, wb = params
    a, b = jax.nn.sigmoid(x @ wa), x @ wb

    def combine(left, right):
        return right[0] * left[0], right[0] * left[1] + right[1]

    _, h = jax.lax.associative_scan(combine, (a, b), axis=0)
    return jax.numpy.sum(jax.numpy.tanh(h) ** 2)


@pytest.mark.parametrize("policy", [rp.Identity(), rp.Remat(), rp.Quantize(bits=8, min_bytes=0)],
                         ids=["identity", "remat", "int8"])
def test_residuals_that_are_literals_are_decided(policy):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = (jax.random.normal(k1, (16, 16)) / 4, jax.random.normal(k2, (16, 16)) / 4)
    x = jax.random.normal(k3, (8, 16))
    want = jax.grad(_linear_recurrence)(params, x)
    got = jax.jit(jax.grad(residual.with_hooks(_linear_recurrence, policy=policy)))(params, x)
    if policy.lossless:
        assert tree_allclose(got, want)
    else:
        assert relative_error(got, want) < 0.02
