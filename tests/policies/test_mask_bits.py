"""The masks `Quantize` and `Cast` store as bits: exact, an eighth of the bytes, packed
along an axis that keeps a TPU's tiles full, and only beside floats they pack."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual
from residual import policies as rp
from residual._info import ResidualInfo
from residual.policies.mask_bits import MaskBits
from tests.helpers import normalized_relu_convs, relative_error


def relu_layers(ws, x):
    def layer(h, w):
        return jax.nn.relu(h @ w), None

    h, _ = jax.lax.scan(layer, x, ws)
    return jnp.sum(jnp.tanh(h) ** 2)


def _conv_args():
    k = jax.random.split(jax.random.key(0), 3)
    ws = [jax.random.normal(k[i], (3, 3, 16, 16)) / 12 for i in range(2)]
    return ws, jax.random.normal(k[2], (8, 16, 16, 16))


def _masks(report):
    return [r for r in report.rows if r.primitive == "gt" and r.nbytes >= 8]


def _keeping_masks(policy):
    """`policy`, but with the masks kept as they are."""
    return rp.select([(rp.where(dtype=jnp.bool_), rp.Identity())], default=policy)


@pytest.mark.parametrize("policy", [rp.Cast(jnp.bfloat16), rp.Quantize(bits=8)], ids=repr)
def test_relu_masks_are_stored_as_bits_exactly(policy):
    ws, x = _conv_args()
    report = residual.inspect(normalized_relu_convs, ws, x, policy=policy, compiled=False)
    masks = _masks(report)
    assert len(masks) == 2, report
    for mask in masks:
        assert mask.how == "packed" and mask.stored_bytes == mask.nbytes // 8, report
    expected = jax.jit(jax.grad(residual.with_hooks(normalized_relu_convs,
                                                    policy=_keeping_masks(policy))))(ws, x)
    for grad in (jax.grad, lambda f: jax.jit(jax.grad(f))):
        got = grad(residual.with_hooks(normalized_relu_convs, policy=policy))(ws, x)
        # The masks are exact: XLA only sums in another order.
        assert relative_error(got, expected) <= 1e-6


def test_bits_round_trip_in_a_scan_under_vmap_and_at_second_order():
    k = jax.random.split(jax.random.key(1), 3)
    ws = jax.random.normal(k[0], (3, 64, 64)) / 8
    x = jax.random.normal(k[1], (4, 32, 64))
    policy = rp.Quantize(bits=8, min_bytes=0)
    report = residual.inspect(relu_layers, ws, x[0], policy=policy, compiled=False)
    assert [m.how for m in _masks(report)] == ["packed"], report
    hooked, keeping = (residual.with_hooks(relu_layers, policy=p)
                       for p in (policy, _keeping_masks(policy)))

    def per_example(f):
        return jax.jit(jax.vmap(jax.grad(f), in_axes=(None, 0)))(ws, x)

    assert relative_error(per_example(hooked), per_example(keeping)) <= 1e-6
    # A Hessian-vector product: the derivative of the backward, masks and all.
    v = jax.random.normal(k[2], ws.shape)

    def hvp(f):
        return jax.jvp(jax.grad(f), (ws, x[0]), (v, jnp.zeros_like(x[0])))[1]

    assert relative_error(hvp(hooked), hvp(keeping)) <= 1e-5


@pytest.mark.parametrize(("shape", "packed"), [
    ((32, 64, 64, 32), (4, 64, 64, 32)),  # the leading axis: a TPU's tiles stay full
    ((4096, 32), (512, 32)),
    ((6, 20, 16), (6, 20, 2)),
    ((5, 3), (1, 3)),  # no axis of whole bytes: the longest, padded
])
def test_bits_are_packed_along_the_first_axis_of_whole_bytes(shape, packed):
    info = ResidualInfo(0, shape, np.dtype(bool), primitive="gt")
    policy = MaskBits().resolve(info)
    mask = jax.random.bernoulli(jax.random.key(0), 0.5, shape)
    stored = policy.pack(mask, info)
    assert stored.shape == packed and stored.dtype == jnp.uint8
    assert jnp.array_equal(policy.unpack(stored, info), mask)


def test_masks_on_several_devices_kept_alive_or_of_floats_are_left_alone():
    mask = ResidualInfo(0, (64, 64), np.dtype(bool), primitive="gt")
    sharded = dataclasses.replace(mask, devices=8)
    assert MaskBits().resolve(sharded) is None
    assert rp.Quantize(bits=8, min_bytes=0).resolve(sharded) is None
    assert rp.Cast(jnp.bfloat16).resolve(sharded) is None
    assert MaskBits().resolve(dataclasses.replace(mask, kept_alive=True)) is None
    assert MaskBits().resolve(dataclasses.replace(mask, dtype=np.dtype(np.float32))) is None


def test_quantize_stores_masks_as_bits_from_min_bytes_on():
    small = ResidualInfo(0, (64, 64), np.dtype(bool), primitive="gt")
    assert rp.Quantize(bits=8).resolve(small) is None  # 4 KiB: under the default 16 KiB
    assert isinstance(rp.Quantize(bits=8, min_bytes=0).resolve(small), MaskBits)
    assert isinstance(rp.Cast(jnp.bfloat16).resolve(small), MaskBits)


def relu_layers_summed_in_float32(ws, x):
    for w in ws:
        x = jax.nn.relu(x @ w)
    return jnp.sum(x.astype(jnp.float32) ** 2)


def test_masks_alone_are_not_packed_by_a_float_policy():
    # A bfloat16 ReLU MLP under `Cast(jnp.bfloat16)`: its floats are as narrow already,
    # and the loss's float32 `2 x` is recomputed, so only the masks would be packed;
    # the program stays JAX's own instead.
    ws = jax.random.normal(jax.random.key(0), (3, 64, 64)).astype(jnp.bfloat16) / 8
    x = jax.random.normal(jax.random.key(1), (32, 64)).astype(jnp.bfloat16)
    policy = rp.Cast(jnp.bfloat16, elementwise="recompute")
    report = residual.inspect(relu_layers_summed_in_float32, ws, x, policy=policy,
                              compiled=False)
    assert "packed" not in {r.how for r in report.rows}, report
    assert _masks(report), report
    # Beside a float it packs, the masks are bits.
    report = residual.inspect(relu_layers_summed_in_float32, ws, x,
                              policy=rp.Cast(jnp.bfloat16, elementwise="pack"),
                              compiled=False)
    assert {m.how for m in _masks(report)} == {"packed"}, report


def test_a_chain_passes_masks_on_as_bits_exactly():
    # Exact, the mask is never derived again from the lossy floats beside it.
    mask = ResidualInfo(0, (64, 64), np.dtype(bool), primitive="gt")
    chain = rp.Chain(rp.Quantize(bits=8, min_bytes=0), rp.Offload())
    resolved = chain.resolve(mask)
    assert resolved.lossless and isinstance(resolved.policies[0], MaskBits)
    ws, x = _conv_args()
    report = residual.inspect(normalized_relu_convs, ws, x, policy=chain, compiled=False)
    assert {m.how for m in _masks(report)} == {"packed"}, report
