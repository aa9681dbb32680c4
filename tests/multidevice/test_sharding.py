"""Sharded training steps under policies: same gradients, same shardings, no new all-gathers."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import residual
from residual import policies as rp

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

POLICIES = [rp.Quantize(bits=8), rp.Remat(), rp.Cast(jnp.bfloat16)]


def mlp(params, x):
    h = x
    for w in params:
        h = jnp.tanh(h @ w)
    return jnp.mean(h**2)


def _setup(layout):
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    k1, k2 = jax.random.split(jax.random.key(0))
    # Width 512 over 4 model shards: 128 columns each, two groups of 64 per shard.
    params = [jax.random.normal(k, (512, 512)) / 22 for k in jax.random.split(k1, 3)]
    x = jax.random.normal(k2, (64, 512))
    if layout == "data":
        w_spec, x_spec = P(), P(("data", "model"), None)
    else:  # tensor parallel: weights split over "model", batch over "data"
        w_spec, x_spec = P(None, "model"), P("data", None)
    params = [jax.device_put(w, NamedSharding(mesh, w_spec)) for w in params]
    x = jax.device_put(x, NamedSharding(mesh, x_spec))
    return mesh, params, x


def _collectives(text: str) -> dict[str, int]:
    return {op: len(re.findall(rf"= [^=]*\b{op}(-start)?\(", text))
            for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute")}


TENSOR_PARALLEL_GAP = pytest.mark.xfail(
    strict=True,
    reason=(
        "Known gap, documented in docs/multi-device.md: with weights split over 'model', "
        "XLA packs the activation before the forward's all-gather and stores it sharded "
        "(1/4 of the memory), so the backward all-gathers it again."
    ),
)
LAYOUTS = ["data", pytest.param("tensor", marks=TENSOR_PARALLEL_GAP)]


@pytest.mark.parametrize("layout", ["data", "tensor"])
@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_sharded_step_matches_one_device_and_plain_shardings(layout, policy):
    if layout == "tensor" and isinstance(policy, rp.Quantize):
        pytest.xfail("Known gap (docs/multi-device.md): reshaping a model-sharded residual "
                     "into groups loses the weight gradients' sharding (replicated).")
    _, params, x = _setup(layout)
    hooked = jax.jit(jax.grad(residual.with_hooks(mlp, policy=policy)))
    plain = jax.jit(jax.grad(mlp))
    got, expected = hooked(params, x), plain(params, x)
    single = jax.jit(jax.grad(residual.with_hooks(mlp, policy=policy)))(
        [np.asarray(w) for w in params], np.asarray(x))
    for g, e, s in zip(got, expected, single):
        assert g.sharding.is_equivalent_to(e.sharding, g.ndim)
        # Sharded matmuls sum in another order, which can flip a rounding: the same
        # policy on one device agrees to far below the quantization error.
        assert _relative(g, s) < (1e-5 if policy.lossless else 2e-2)
        assert _relative(g, e) < (1e-5 if policy.lossless else 5e-2)


def _relative(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("layout", ["data", "tensor"])
@pytest.mark.parametrize("policy", [rp.Remat()], ids=repr)
def test_no_all_gather_of_activations_with_remat(layout, policy):
    _check_collectives(layout, policy)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("policy", [rp.Quantize(bits=8), rp.Cast(jnp.bfloat16)], ids=repr)
def test_no_all_gather_of_activations(layout, policy):
    _check_collectives(layout, policy)


def _check_collectives(layout, policy):
    _, params, x = _setup(layout)
    text = jax.jit(jax.grad(residual.with_hooks(mlp, policy=policy))).lower(
        params, x).compile().as_text()
    plain = jax.jit(jax.grad(mlp)).lower(params, x).compile().as_text()
    got, expected = _collectives(text), _collectives(plain)
    assert got["all-gather"] <= expected["all-gather"], (got, expected)
    assert got["all-to-all"] <= expected["all-to-all"]


def test_inside_shard_map():
    mesh, params, x = _setup("data")
    params = [np.asarray(w) for w in params]

    def per_shard(params, x):
        g = jax.grad(residual.with_hooks(mlp, policy=rp.Quantize(bits=8)))(params, x)
        return jax.tree.map(lambda t: jax.lax.pmean(t, ("data", "model")), g)

    def per_shard_plain(params, x):
        g = jax.grad(mlp)(params, x)
        return jax.tree.map(lambda t: jax.lax.pmean(t, ("data", "model")), g)

    specs = dict(mesh=mesh, in_specs=(P(), P(("data", "model"))), out_specs=P())
    got = jax.jit(jax.shard_map(per_shard, **specs))(params, x)
    expected = jax.jit(jax.shard_map(per_shard_plain, **specs))(params, x)
    for g, e in zip(got, expected):
        rel = np.linalg.norm(np.asarray(g) - np.asarray(e)) / np.linalg.norm(np.asarray(e))
        assert rel < 5e-2
