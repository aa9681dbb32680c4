"""Guards for every JAX internal `residual` uses: a JAX release that changes one fails here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from residual import _jax_private as jp


def test_differentiation_mode_tells_the_traces_apart():
    modes = []

    def probe(x):
        modes.append(jp.differentiation_mode([x]))
        return jnp.sum(jnp.sin(x))

    x = jnp.ones(3)
    probe(x)
    jax.jit(probe)(x)
    jax.grad(probe)(x)
    jax.jvp(probe, (x,), (x,))
    jax.linearize(probe, x)
    jax.vmap(jax.grad(probe))(jnp.ones((2, 3)))
    jax.jit(jax.grad(probe))(x)
    assert modes == [None, None, "reverse", "forward", "forward", "reverse", "reverse"]


def test_bind_equation_keeps_name_stack_and_source():
    def f(x):
        with jax.named_scope("outer"):
            return jnp.sin(x)

    closed = jax.make_jaxpr(f)(1.0)
    (eqn,) = closed.jaxpr.eqns
    assert jp.scope_names(eqn) == ["outer"]
    assert jp.user_source(eqn).startswith("test_jax_private.py:")

    def rebound(x):
        return jp.bind_equation(eqn, [x])[0]

    (again,) = jax.make_jaxpr(rebound)(1.0).jaxpr.eqns
    assert again.primitive.name == "sin" and jp.scope_names(again) == ["outer"]


def test_dce_slices_the_jaxpr():
    closed = jax.make_jaxpr(lambda x, y: (jnp.sin(x), jnp.cos(y) * 2))(1.0, 2.0)
    jaxpr, used_inputs = jp.dce(closed.jaxpr, [False, True])
    assert used_inputs == [False, True]
    assert {e.primitive.name for e in jaxpr.eqns} == {"cos", "mul"}


def test_jaxpr_types_and_helpers():
    def f(x):
        return lax.scan(lambda c, _: (c * 2.0, None), x, None, length=2)

    closed = jax.make_jaxpr(f)(1.0)
    assert isinstance(closed, jp.ClosedJaxpr) and isinstance(closed.jaxpr, jp.Jaxpr)
    (scan,) = closed.jaxpr.eqns
    body = scan.params["jaxpr"]
    assert {"jaxpr", "num_consts", "num_carry", "length", "reverse", "unroll"} <= set(scan.params)
    assert any(isinstance(v, jp.Literal) for e in body.jaxpr.eqns for v in e.invars)
    assert jp.jaxpr_as_fun(closed)(3.0)[0] == 12.0
    assert jp.is_extended_dtype(jax.random.key(0).dtype) and not jp.is_extended_dtype(jnp.float32)
    with jax.named_scope("here"):
        assert jp.current_scope_names()[-1:] == ("here",)


def test_varying_axes_inside_and_outside_shard_map():
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    spec = jax.sharding.PartitionSpec
    seen = {}

    def probe(x, w):
        seen["x"], seen["w"] = jp.varying_axes(x), jp.varying_axes(w)
        return x

    jax.jit(jax.shard_map(probe, mesh=mesh, in_specs=(spec("data"), spec()),
                          out_specs=spec("data")))(jnp.ones(4), jnp.ones(4))
    assert seen == {"x": frozenset({"data"}), "w": frozenset()}
    assert jp.varying_axes(jnp.ones(3)) == frozenset()


def test_is_staged_under_jit_and_scan_not_under_eager_grad_or_vmap():
    seen = []

    def probe(x):
        seen.append(jp.is_staged())
        return x * x

    probe(1.0)
    jax.grad(probe)(1.0)
    jax.grad(jax.grad(probe))(1.0)
    jax.vmap(probe)(jnp.ones(2))
    assert seen == [False] * 4
    seen.clear()
    jax.jit(probe)(1.0)
    jax.jit(jax.grad(probe))(2.0)
    jax.make_jaxpr(probe)(jnp.ones(3))  # another shape: jit's trace is not reused
    lax.scan(lambda c, _: (probe(c), None), 1.0, None, length=2)
    assert seen == [True] * 4
