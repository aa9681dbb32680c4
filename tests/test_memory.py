"""Memory claims, checked on compiled programs: temp bytes and the dtypes XLA stores."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

import residual
from residual import policies as rp
from tests.helpers import (
    compiled_text,
    mlp_params,
    scan_mlp,
    temp_bytes,
    tree_allclose,
    tree_equal,
    unrolled_mlp,
)

LOSSY = [rp.Cast(jnp.bfloat16), rp.Quantize(bits=8), rp.Quantize(bits=4), rp.Quantize(bits=2)]


@dataclasses.dataclass(frozen=True)
class _Negate(residual.Policy):
    """Lossless, but not the identity: the engine packs activations, leaves weights."""

    lossless = True

    def resolve(self, info):
        return None if info.kept_alive else self

    def pack(self, x, info):
        return -x

    def unpack(self, packed, info):
        return -packed


def _hooked_temp(model, policy, *args):
    return temp_bytes(jax.grad(residual.with_hooks(model, policy=policy)), *args)


@pytest.mark.parametrize("model", [scan_mlp, unrolled_mlp], ids=lambda m: m.__name__)
def test_identity_hooks_compile_to_plain_temp_memory(model):
    ws, x = mlp_params(layers=6, width=128, batch=256)
    assert _hooked_temp(model, rp.Identity(), ws, x) == temp_bytes(jax.grad(model), ws, x)


def test_scan_stores_int8_codes_per_layer_and_temp_memory_shrinks():
    ws, x = mlp_params(layers=6, width=128, batch=256)
    plain_text = compiled_text(jax.grad(scan_mlp), ws, x)
    assert re.search(r"f32\[6,256,128\]", plain_text)  # the float stack, without hooks
    g = jax.grad(residual.with_hooks(scan_mlp, policy=rp.Quantize(bits=8)))
    text = compiled_text(g, ws, x)
    assert re.search(r"[us]8\[6,256,128\]", text)  # int8 codes per layer, shaped like x
    assert not re.search(r"f32\[6,256,128\]", text)
    assert temp_bytes(g, ws, x) <= 0.45 * temp_bytes(jax.grad(scan_mlp), ws, x)


@pytest.mark.parametrize("policy", LOSSY, ids=repr)
def test_unrolled_mlp_lossy_policies_stay_well_below_plain(policy):
    # Was 1.66x plain for int8 before the engine kept XLA from fusing pack/unpack
    # across the storage; now about 0.53x (docs/xla-and-packed-residuals.md).
    ws, x = mlp_params(layers=6, width=128, batch=256)
    plain = temp_bytes(jax.grad(unrolled_mlp), ws, x)
    assert _hooked_temp(unrolled_mlp, policy, ws, x) <= 0.7 * plain


def test_unrolled_mlp_packs_each_layer_before_the_next_one_runs():
    # Packed after the whole forward, XLA scheduled layer 0's pack after layer 4
    # and held five float activations at once: 0.56x plain here, now about 0.41x.
    ws, x = mlp_params(layers=8, width=128, batch=512)
    plain = temp_bytes(jax.grad(unrolled_mlp), ws, x)
    assert _hooked_temp(unrolled_mlp, rp.Quantize(bits=8), ws, x) <= 0.5 * plain


def test_slices_of_stacked_weights_cost_no_more_than_without_hooks():
    # `ws[i]` is a copy in XLA. Stored as a residual it lived from the forward to the
    # backward; re-taken in the backward it lives around its use. Compared with the
    # same MLP taking a list of weights (no slices), with and without hooks.
    ws, x = mlp_params(layers=6, width=128, batch=256)

    def listed_mlp(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.sum(x**2)

    def cost_of_slices(policy):
        def grad(model):
            return jax.grad(model if policy is None else residual.with_hooks(model, policy=policy))

        return temp_bytes(grad(unrolled_mlp), ws, x) - temp_bytes(grad(listed_mlp), list(ws), x)

    plain = cost_of_slices(None)
    # Stored as residuals, the six float32 slices (64 KiB each) would add 384 KiB.
    assert cost_of_slices(rp.Quantize(bits=8)) <= plain
    assert cost_of_slices(rp.Cast(jnp.bfloat16)) < plain + ws[0].nbytes  # was plain + 4 slices


def test_views_of_every_kind_give_plain_gradients():
    # slice + squeeze, transpose, reshape: each chain is re-taken from the input.
    ws, x = mlp_params(layers=3, width=16, batch=8)

    def model(ws, x):
        x = jnp.tanh(x @ ws[0])
        x = jnp.tanh(x @ ws[1].T)
        x = jnp.tanh(x @ ws[2].reshape(4, 64).reshape(16, 16))
        return jnp.sum(x**2)

    expected = jax.grad(model, argnums=(0, 1))(ws, x)
    hooked = jax.grad(residual.with_hooks(model, policy=_Negate()), argnums=(0, 1))
    assert tree_equal(hooked(ws, x), expected)
    assert tree_equal(jax.jit(hooked)(ws, x), jax.jit(jax.grad(model, argnums=(0, 1)))(ws, x))
    batched = jax.vmap(hooked)(jnp.stack([ws, 2 * ws]), jnp.stack([x, x]))
    plain = jax.vmap(jax.grad(model, argnums=(0, 1)))(jnp.stack([ws, 2 * ws]), jnp.stack([x, x]))
    assert tree_equal(batched, plain)
    # Weights shared across the batch (per-example gradients): the views stay unbatched.
    xs = jnp.stack([x, 2 * x])
    per_example = jax.vmap(hooked, in_axes=(None, 0))(ws, xs)
    assert tree_equal(per_example, jax.vmap(jax.grad(model, argnums=(0, 1)), (None, 0))(ws, xs))
    # The stacked MLP, lossless, as well: exactly plain `jax.grad`.
    ws, x = mlp_params(layers=4, width=32, batch=16)
    hooked = jax.jit(jax.grad(residual.with_hooks(unrolled_mlp, policy=_Negate())))
    assert tree_equal(hooked(ws, x), jax.jit(jax.grad(unrolled_mlp))(ws, x))


@pytest.mark.parametrize("policy", [rp.Quantize(bits=8), rp.Cast(jnp.bfloat16)], ids=repr)
def test_vmap_of_grad_keeps_the_memory_saving(policy):
    # Per-example gradients (DP-SGD) and model ensembles: a `cond` with a batched
    # predicate would become a `select` that computes both branches and orders
    # nothing. Measured at 1.97x (per example) and 1.23x (ensemble) plain under int8
    # before the ordering conditionals got their own batching rule.
    ws, x = mlp_params(layers=6, width=128, batch=256)
    xs = jnp.stack([x, 0.5 * x, 2 * x, -x])

    def per_example(fn):
        return jax.vmap(jax.grad(fn, argnums=(0, 1)), in_axes=(None, 0))

    plain = temp_bytes(per_example(unrolled_mlp), ws, xs)
    hooked = per_example(residual.with_hooks(unrolled_mlp, policy=policy))
    assert temp_bytes(hooked, ws, xs) < 0.8 * plain
    ensemble = jax.vmap(jax.grad(residual.with_hooks(unrolled_mlp, policy=policy)))
    ensemble_plain = jax.vmap(jax.grad(unrolled_mlp))
    models = jnp.stack([ws, 2 * ws])
    assert temp_bytes(ensemble, models, xs[:2]) < 0.6 * temp_bytes(ensemble_plain, models, xs[:2])
    # Batched, each example gets exactly the gradient it gets alone.
    got = jax.jit(hooked)(ws, xs)
    alone = [jax.jit(jax.grad(residual.with_hooks(unrolled_mlp, policy=policy), (0, 1)))(ws, x)
             for x in xs]
    for i, expected in enumerate(alone):
        row = jax.tree.map(lambda g, i=i: g[i], got)
        assert tree_allclose(row, expected, rtol=1e-5, atol=1e-6)
