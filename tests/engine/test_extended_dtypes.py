"""Extended dtypes (typed PRNG keys, `float0`) pass through untouched and are reported."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import residual
from residual import ResidualInfo
from residual import policies as rp
from tests.helpers import relative_error, tree_equal

# policy, relative gradient error bound (0: bit-identical to plain `jax.grad`).
POLICIES = [
    (rp.Identity(), 0.0),
    (rp.Remat(), 0.0),
    (rp.Offload(), 0.0),
    (rp.Profile(), 0.0),
    (rp.Cast(jnp.bfloat16), 1e-2),
    (rp.Quantize(bits=8, min_bytes=0), 2e-2),
    (rp.Quantize(bits=4, stochastic=True, min_bytes=0), 4e-1),
    (rp.Quantize(format="fp8_e4m3", min_bytes=0), 1e-1),
    (rp.Chain(rp.Quantize(bits=8, min_bytes=0), rp.Offload()), 2e-2),
    (rp.select([(rp.where(dtype=jnp.floating), rp.Quantize(min_bytes=0))],
               default=rp.Remat()), 2e-2),
]
IDS = [repr(p)[:30] for p, _ in POLICIES]
# Identity, Remat, int8 and a select mixing Quantize and Remat: one of each way a
# residual can go (stored as is, recomputed, packed), for the costlier models.
SOME = [POLICIES[i] for i in (0, 1, 5, 9)]
SOME_IDS = [IDS[i] for i in (0, 1, 5, 9)]


def dropout_in_checkpoint(w, x, key):
    """A `jax.checkpoint` region taking a key (`nnx.remat`, `hk.remat` over dropout)."""

    def body(h, k):
        keep = jax.random.bernoulli(k, 0.9, h.shape)
        return jnp.tanh(jnp.where(keep, h, 0.0) / 0.9)

    h = jax.checkpoint(body)(x @ w, key)
    return jnp.sum(jnp.sin(h) * h)


def key_as_residual(w, x, key):
    """The derived key itself is saved for the backward (a key-typed residual)."""
    k = jax.random.fold_in(key, 1)
    h = jax.checkpoint(lambda h, k: jnp.sin(h) * jax.random.normal(k, h.shape))(x @ w, k)
    return jnp.sum(h * h)


def scan_over_split_keys(ws, x, key):
    """A `lax.scan` slicing split keys (`nnx.scan` over split rngs, `hk.layer_stack`)."""

    def layer(h, wk):
        w, k = wk
        h = jnp.tanh(h @ w)
        keep = jax.random.bernoulli(k, 0.9, h.shape)
        return jnp.where(keep, h, 0.0) / 0.9, None

    h, _ = lax.scan(layer, x, (ws, jax.random.split(key, ws.shape[0])))
    return jnp.sum(h**2)


def _args(layers=None):
    shape = (64, 64) if layers is None else (layers, 64, 64)
    w = jax.random.normal(jax.random.key(1), shape) / 8
    x = jax.random.normal(jax.random.key(2), (16, 64))
    return w, x, jax.random.key(0)


def _check(got, expected, bound):
    if bound == 0.0:
        assert tree_equal(got, expected)
    else:
        assert relative_error(got, expected) <= bound


def test_identity_hooks_on_a_checkpoint_taking_a_key_are_bit_identical():
    def f(x, key):
        keep = lambda x, k: jnp.where(jax.random.bernoulli(k, 0.9, x.shape), x, 0.0)  # noqa: E731
        return jnp.sum(jax.checkpoint(lambda x, k: jnp.tanh(keep(x, k)))(x, key))

    _, x, key = _args()
    got = jax.grad(residual.with_hooks(f, lambda a: a, lambda a: a))(x, key)
    assert tree_equal(got, jax.grad(f)(x, key))


@pytest.mark.parametrize(("policy", "bound"), POLICIES, ids=IDS)
def test_every_policy_passes_a_key_residual_through(policy, bound):
    _check_policy(key_as_residual, policy, bound)


@pytest.mark.parametrize(("policy", "bound"), SOME, ids=SOME_IDS)
def test_policies_on_a_checkpoint_taking_a_key(policy, bound):
    _check_policy(dropout_in_checkpoint, policy, bound)


def _check_policy(f, policy, bound):
    args = _args()
    expected = jax.jit(jax.grad(f, (0, 1)))(*args)
    _check(jax.jit(jax.grad(residual.with_hooks(f, policy=policy), (0, 1)))(*args), expected,
           bound)


@pytest.mark.parametrize(("policy", "bound"), SOME, ids=SOME_IDS)
def test_policies_on_a_scan_over_split_keys(policy, bound):
    args = _args(layers=3)
    expected = jax.jit(jax.grad(scan_over_split_keys, (0, 1)))(*args)
    got = jax.jit(jax.grad(residual.with_hooks(scan_over_split_keys, policy=policy), (0, 1)))(
        *args)
    _check(got, expected, bound)


def test_inspect_reports_a_key_by_its_key_data_bytes():
    w, x, key = _args()
    report = residual.inspect(key_as_residual, w, x, key, policy=rp.Quantize(min_bytes=0))
    keys = [r for r in report.rows if r.dtype == "key<fry>"]
    data = jax.random.key_data(key)
    assert [(r.shape, r.nbytes, r.stored_bytes, r.policy) for r in keys] == [
        ((), data.nbytes, data.nbytes, "-")
    ]
    assert "key<fry>" in str(report) and "key&lt;fry&gt;" in report._repr_html_()


def test_inspect_under_remat_of_a_scan_slicing_keys():
    report = residual.inspect(scan_over_split_keys, *_args(layers=3), policy=rp.Remat())
    assert report.totals["stored_bytes"] < report.totals["residual_bytes"]
    assert report.totals["peak_ratio"] <= 1.0


def test_gradcheck_with_a_key_argument():
    result = residual.gradcheck(dropout_in_checkpoint, *_args(),
                                policy=rp.Quantize(bits=8, min_bytes=0))
    assert result.ok and result.finite_differences is None and len(result.residuals) == 4
    assert residual.gradcheck(key_as_residual, *_args(), pack=lambda a: a,
                              unpack=lambda a: a).grad_rel_error == 0.0


def test_gradcheck_finite_differences_leave_the_key_alone():
    with jax.enable_x64(True):
        w, x, key = (a.astype(jnp.float64) for a in _args()[:2]), None, jax.random.key(0)
        w, x = w
        result = residual.gradcheck(key_as_residual, w[:8, :8], x[:4, :8], key,
                                    policy=rp.Identity())
    assert result.ok and result.finite_differences is True


def test_info_of_extended_dtypes():
    key = jax.random.key(0, impl="rbg")
    info = ResidualInfo(index=3, shape=(5,), dtype=key.dtype, primitive="random_split")
    assert info.nbytes == 5 * jax.random.key_data(key).nbytes
    assert info.describe().startswith("residual #3 key<rbg>[5] (output of `random_split`")
    zero = ResidualInfo(index=0, shape=(4, 2), dtype=jax.dtypes.float0)
    assert zero.nbytes == 0 and zero.describe().startswith("residual #0 float0[4, 2]")
    assert not rp.where(dtype=jnp.floating, min_bytes=1)(info)
    assert ResidualInfo(0, (2, 3), np.dtype(np.float32)).nbytes == 24
