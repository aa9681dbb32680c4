"""Sharded training steps under policies: same gradients, same shardings, no new collectives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import residual
from residual import collectives
from residual import policies as rp

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

POLICIES = [rp.Quantize(bits=8), rp.Remat(), rp.Cast(jnp.bfloat16)]
# Int4 packs two codes per byte: within a group, so on the device that holds it.
PACKING = [rp.Quantize(bits=8), rp.Quantize(bits=4), rp.Cast(jnp.bfloat16),
           rp.Quantize(bits=4, group_size=16, scale_dtype=jnp.uint8)]


def mlp(params, x):
    h = x
    for w in params:
        h = jnp.tanh(h @ w)
    return jnp.mean(h**2)


def scanned_mlp(ws, x):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    return jnp.mean(h**2)


def _setup(layout, batch=64, width=512):
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    k1, k2 = jax.random.split(jax.random.key(0))
    # Width 512 over 4 model shards: 128 columns each, two groups of 64 per shard.
    params = [jax.random.normal(k, (width, width)) / 22 for k in jax.random.split(k1, 3)]
    x = jax.random.normal(k2, (batch, width))
    if layout == "data":
        w_spec, x_spec = P(), P(("data", "model"), None)
    else:  # tensor parallel: weights split over "model", batch over "data"
        w_spec, x_spec = P(None, "model"), P("data", None)
    params = [jax.device_put(w, NamedSharding(mesh, w_spec)) for w in params]
    x = jax.device_put(x, NamedSharding(mesh, x_spec))
    return mesh, params, x


SMALL_BATCH_GAP = pytest.mark.xfail(
    strict=True,
    reason=(
        "Known gap, documented in docs/multi-device.md: at a small batch XLA merges "
        "plain jax.grad's forward and backward all-gathers of an activation into one; "
        "with hooks the activation is packed before the gather, stored sharded (1/4 of "
        "the memory) and gathered again in the backward."
    ),
)
# Batch 1024 is where plain `jax.grad` itself gathers again in the backward.
LAYOUTS = [("data", 64), ("tensor", 1024), pytest.param(("tensor", 64), marks=SMALL_BATCH_GAP)]


@pytest.mark.parametrize("layout", ["data", "tensor"])
@pytest.mark.parametrize("policy", POLICIES, ids=repr)
def test_sharded_step_matches_one_device_and_plain_shardings(layout, policy):
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


@pytest.mark.parametrize(("layout", "batch"), [("data", 64), ("tensor", 64), ("tensor", 1024)])
@pytest.mark.parametrize("policy", [rp.Remat()], ids=repr)
def test_no_all_gather_of_activations_with_remat(layout, batch, policy):
    _checkcollectives(layout, batch, policy)


@pytest.mark.parametrize("layout_batch", LAYOUTS, ids=lambda lb: f"{lb[0]}-batch{lb[1]}")
@pytest.mark.parametrize("policy", PACKING, ids=repr)
def test_no_all_gather_of_activations(layout_batch, policy):
    _checkcollectives(*layout_batch, policy)


def _checkcollectives(layout, batch, policy):
    _, params, x = _setup(layout, batch)
    hooked = jax.jit(jax.grad(residual.with_hooks(mlp, policy=policy))).lower(
        params, x).compile()
    plain = jax.jit(jax.grad(mlp)).lower(params, x).compile()
    got, expected = collectives(hooked), collectives(plain)
    assert got["all-gather"] <= expected["all-gather"], (got, expected)
    # Each group's NaN check is its own: no all-reduce of a predicate over the shards.
    assert got["all-reduce"] == expected["all-reduce"], (got, expected)
    assert got["all-to-all"] <= expected["all-to-all"]


@pytest.mark.parametrize("bits", [4, 2])
def test_byte_scales_keep_to_shards_of_64_columns(bits):
    # Width 256 over 4 model shards: 64 columns, two groups of 32. Super-groups of 128
    # values would span two shards, and their largest step would be an all-reduce.
    _, params, x = _setup("tensor", 1024, width=256)
    policy = rp.Quantize(bits=bits)
    hooked = jax.jit(jax.grad(residual.with_hooks(mlp, policy=policy))).lower(params, x)
    plain = jax.jit(jax.grad(mlp)).lower(params, x)
    assert collectives(hooked.compile()) == collectives(plain.compile())
    got, expected = (jax.jit(jax.grad(f))(params, x)
                     for f in (residual.with_hooks(mlp, policy=policy), mlp))
    for g, e in zip(got, expected):
        assert g.sharding.is_equivalent_to(e.sharding, g.ndim)
        assert _relative(g, e) < (0.06 if bits == 4 else 0.25)


@pytest.mark.parametrize("layout", ["data", "tensor"])
@pytest.mark.parametrize("memory_kind", ["pinned_host", "unpinned_host"])
def test_eager_offload_brings_each_shard_back_where_it_was(layout, memory_kind):
    _, params, x = _setup(layout)
    got = jax.grad(residual.with_hooks(mlp, policy=rp.Offload(memory_kind)))(params, x)
    expected = jax.grad(mlp)(params, x)
    for g, e in zip(got, expected):
        assert g.sharding.is_equivalent_to(e.sharding, g.ndim)
        assert g.sharding.memory_kind == "device"
        assert _relative(g, e) < 1e-6


@pytest.mark.parametrize("policy", [rp.Quantize(bits=8), rp.Offload()], ids=repr)
def test_a_scanned_tensor_parallel_step_issues_plains_collectives_per_step(policy):
    mesh, params, x = _setup("tensor", 512, width=256)
    ws = jax.device_put(jnp.stack(params), NamedSharding(mesh, P(None, None, "model")))

    plain = jax.jit(jax.grad(scanned_mlp)).lower(ws, x).compile()
    hooked = jax.jit(jax.grad(residual.with_hooks(scanned_mlp, policy=policy))).lower(
        ws, x).compile()
    # The loops run once a layer: each collective in them, once a trip.
    per_step = collectives(plain, per_step=True)
    assert per_step == {k: 3 * n for k, n in collectives(plain).items()}
    assert collectives(hooked, per_step=True) == per_step


@pytest.mark.parametrize("policy", [rp.Remat(), rp.select([(rp.where(in_scan=True), rp.Remat())])],
                         ids=["Remat", "Remat per layer"])
def test_a_scanned_fsdp_step_recomputing_each_layer_matches_plain(policy):
    # Each layer's recomputation is tied to the backward by the carry alone: its
    # weights, split over the devices, are read as they are (not through a barrier).
    mesh = Mesh(np.array(jax.devices()), ("data",))
    _, params, x = _setup("data", batch=64, width=256)
    ws = jax.device_put(jnp.stack([np.asarray(w) for w in params]),
                        NamedSharding(mesh, P(None, "data")))
    x = jax.device_put(np.asarray(x), NamedSharding(mesh, P("data")))

    plain = jax.jit(jax.grad(scanned_mlp, (0, 1)))
    hooked = jax.jit(jax.grad(residual.with_hooks(scanned_mlp, policy=policy), (0, 1)))
    for g, e in zip(hooked(ws, x), plain(ws, x)):
        assert g.sharding.is_equivalent_to(e.sharding, g.ndim)
        assert _relative(g, e) < 1e-5
    assert (collectives(hooked.lower(ws, x).compile(), per_step=True)
            == collectives(plain.lower(ws, x).compile(), per_step=True))


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


@pytest.mark.parametrize("policy", PACKING, ids=repr)
def test_explicit_axes_pack_the_resharded_activation_without_new_gathers(policy):
    # With `Explicit` axes the model gathers the activation itself (`reshard`): that
    # value is the residual, packed gathered, and the backward needs no new gather.
    from jax.sharding import AxisType, reshard

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"),
                axis_types=(AxisType.Explicit,) * 2)
    _, params, x = _setup("tensor")
    params = [jax.device_put(np.asarray(w), NamedSharding(mesh, P(None, "model")))
              for w in params]
    x = jax.device_put(np.asarray(x), NamedSharding(mesh, P("data", None)))

    def explicit_mlp(params, x):
        h = x
        for w in params:
            h = jnp.tanh(reshard(h, P("data", None)) @ w)
        return jnp.mean(h**2)

    with jax.set_mesh(mesh):
        plain = jax.jit(jax.grad(explicit_mlp)).lower(params, x).compile()
        hooked = jax.jit(jax.grad(residual.with_hooks(explicit_mlp, policy=policy))).lower(
            params, x).compile()
    got, expected = collectives(hooked), collectives(plain)
    assert got["all-gather"] <= expected["all-gather"], (got, expected)
    for g, e in zip(hooked.output_shardings, plain.output_shardings):
        assert g.spec == e.spec


@pytest.mark.parametrize("policy", [rp.Quantize(bits=8), rp.Remat()], ids=repr)
def test_tensor_parallel_inside_shard_map(policy):
    # Megatron-style: each device holds 128 columns of every weight and gathers the
    # activation itself. The gathered activation is the residual, packed per device.
    mesh, params, x = _setup("tensor", batch=256)
    params, x = [np.asarray(w) for w in params], np.asarray(x)

    def loss(params, x):
        h = x
        for w in params:
            if h.shape[-1] != w.shape[0]:
                h = jax.lax.all_gather(h, "model", axis=1, tiled=True)
            h = jnp.tanh(h @ w)
        return jnp.mean(h**2)

    def step(grad_of):
        def per_shard(params, x):
            g = grad_of(loss)(params, x)
            return jax.tree.map(lambda t: jax.lax.pmean(t, "data"), g)

        specs = dict(mesh=mesh, in_specs=(P(None, "model"), P("data", None)),
                     out_specs=P(None, "model"))
        return jax.jit(jax.shard_map(per_shard, **specs))

    hooked = step(lambda f: jax.grad(residual.with_hooks(f, policy=policy)))
    plain = step(jax.grad)
    got, expected = hooked(params, x), plain(params, x)
    for g, e in zip(got, expected):
        assert g.sharding.is_equivalent_to(e.sharding, g.ndim)
        assert _relative(g, e) < (1e-5 if policy.lossless else 5e-2)
    counts = collectives(hooked.lower(params, x).compile())
    assert counts == collectives(plain.lower(params, x).compile())


@pytest.mark.parametrize("pin_memory", [False, True], ids=["default", "pinned"])
def test_save_on_cpu_with_several_devices(pin_memory):
    _, params, x = _setup("tensor")
    hooked = jax.grad(residual.with_hooks(mlp))
    expected = jax.jit(jax.grad(mlp))(params, x)
    with residual.save_on_cpu(pin_memory=pin_memory):
        for grad in (hooked, jax.jit(hooked)):
            got = grad(params, x)
            for g, e in zip(got, expected):
                assert g.sharding.is_equivalent_to(e.sharding, g.ndim)
                assert g.sharding.memory_kind == "device"
                assert _relative(g, e) < 1e-5
        program = jax.jit(hooked).lower(params, x).compile()
    plain = jax.jit(jax.grad(mlp)).lower(params, x).compile()
    assert collectives(program)["all-gather"] <= collectives(plain)["all-gather"]


def test_plan_of_sharded_arguments_budgets_per_device_memory():
    _, params, x = _setup("tensor", 1024)
    plan = residual.plan(mlp, params, x, budget=0.95)
    step = jax.jit(jax.grad(residual.with_hooks(mlp, policy=plan)))
    plain = jax.jit(jax.grad(mlp))
    per_device = residual.Memory.of(step.lower(params, x).compile()).peak
    assert plan.memory == per_device <= 0.95 * plan.plain_memory
    # The table lists residuals whole, as traced; memory is the compiled per-device one.
    assert {d.shape for d in plan.decisions} == {(1024, 512)}
    assert plan.plain_memory == residual.Memory.of(plain.lower(params, x).compile()).peak
    one_device = [np.asarray(w) for w in params], np.asarray(x)
    assert plan.plain_memory < 0.75 * residual.Memory.of(plain.lower(*one_device).compile()).peak
    got, expected = step(params, x), plain(params, x)
    for g, e in zip(got, expected):
        assert g.sharding.is_equivalent_to(e.sharding, g.ndim)
    assert _relative(np.concatenate([np.ravel(g) for g in got]),
                     np.concatenate([np.ravel(e) for e in expected])) <= plan.max_grad_error
