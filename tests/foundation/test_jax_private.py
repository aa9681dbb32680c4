"""Guards for every JAX internal `residual` uses: a JAX release that changes one fails here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

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


def test_scan_parts_split_operands_and_read_the_body():
    def f(k, c, xs):
        return lax.scan(lambda c, x: (c * k + x, jnp.sin(c)), c, xs, reverse=True, unroll=2)

    closed = jax.make_jaxpr(f)(2.0, 1.0, jnp.ones(3))
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive is jp.scan_p]
    assert eqn.primitive.name == "scan"
    scan = jp.scan_parts(eqn)
    assert (scan.num_consts, scan.num_carry, scan.length) == (1, 1, 3)
    assert scan.reverse is True and scan.unroll == 2
    assert isinstance(scan.body, jp.ClosedJaxpr)
    assert len(scan.body.jaxpr.invars) == len(eqn.invars) == 3
    assert len(scan.body.jaxpr.outvars) == len(eqn.outvars) == 2
    assert jp.jaxpr_as_fun(scan.body)(2.0, 1.0, 5.0)[0] == 7.0


def test_loops_name_scan_and_while():
    def f(x):
        y = lax.fori_loop(0, lax.convert_element_type(x, jnp.int32), lambda i, c: c * 2.0, x)
        return lax.scan(lambda c, _: (c + 1.0, None), y, None, length=3)[0]

    closed = jax.make_jaxpr(f)(1.0)
    assert [e.primitive.name for e in closed.jaxpr.eqns if e.primitive in jp.LOOPS] == [
        "while", "scan"]


def test_cond_call_and_checkpoint_bodies():
    def f(x):
        y = lax.cond(x > 0, jnp.sin, jnp.cos, x)
        y = jax.jit(lambda a: a * 3.0)(y)
        policy = jax.checkpoint_policies.nothing_saveable
        return jax.checkpoint(lambda a: jnp.exp(a), prevent_cse=False, policy=policy)(y)

    eqns = jax.make_jaxpr(f)(1.0).jaxpr.eqns
    (cond,) = [e for e in eqns if e.primitive is jp.cond_p]
    branches = jp.cond_branches(cond)
    assert len(branches) == 2 and all(isinstance(b, jp.ClosedJaxpr) for b in branches)
    assert [e.primitive.name for b in branches for e in b.jaxpr.eqns] == ["cos", "sin"]
    (call,) = [e for e in eqns if e.primitive in jp.CALLS]
    assert jp.jaxpr_as_fun(jp.call_body(call))(2.0)[0] == 6.0
    assert jp.single_body(call) is jp.call_body(call).jaxpr
    (remat,) = [e for e in eqns if jp.kind(e) in jp.REMATS]
    parts = jp.remat_parts(remat)
    # `jax_remat3` spells `nothing_saveable` as no policy: recompute everything.
    assert parts.prevent_cse is False
    assert parts.policy in (jax.checkpoint_policies.nothing_saveable, None)
    assert [e.primitive.name for e in parts.body.jaxpr.eqns] == ["exp"]
    assert jp.sub_jaxprs(remat) == [parts.body.jaxpr]
    assert len(jp.sub_jaxprs(cond)) == 2


def test_primitive_sets_match_what_jax_emits():
    def f(x, ws):
        y = jnp.tanh(x)
        ws_t = [w.T for w in ws]  # unstack (jax 0.11 on) or slice + squeeze, then transpose
        z = checkpoint_name(y.reshape(2, 2)[:1] * 2.0, "tag")
        return y, ws_t, z, lax.reduce_precision(y, exponent_bits=5, mantissa_bits=10)

    eqns = jax.make_jaxpr(f)(jnp.ones(4), jnp.ones((2, 3, 3))).jaxpr.eqns
    prims = {e.primitive for e in eqns}
    views = {e.primitive.name for e in eqns if e.primitive in jp.VIEWS}
    assert {"transpose", "reshape", "slice"} <= views
    assert "unstack" in views or "squeeze" in views
    (name,) = [e for e in eqns if jp.kind(e) in jp.NAMES]
    assert jp.checkpoint_name_of(name) == "tag"
    assert any(p in jp.IDENTITIES for p in prims)  # reduce_precision
    assert any(p in jp.CHEAP and p.name == "mul" for p in prims)
    # What tanh's derivative saves is cheap to derive again, on every release.
    saved = jax.make_jaxpr(lambda x: jax.tree.leaves(jax.vjp(jnp.tanh, x)[1]))(jnp.ones(3))
    producers = {v: e for e in saved.jaxpr.eqns for v in e.outvars}
    assert any(producers[v].primitive in jp.CHEAP for v in saved.jaxpr.outvars
               if v in producers), saved
    # A `cond` fills another branch's residual with a filler.
    res = jax.make_jaxpr(lambda x: jax.tree.leaves(
        jax.vjp(lambda a: lax.cond(a > 0, jnp.sin, lambda b: b * 2.0, a), x)[1]))(1.0)
    (cond,) = [e for e in res.jaxpr.eqns if e.primitive is jp.cond_p]
    fillers = [e for b in jp.cond_branches(cond) for e in b.jaxpr.eqns if e.primitive in jp.FILLERS]
    assert fillers and all(f.primitive.name in {"empty", "empty2"} for f in fillers)
    assert jp.broadcast_in_dim_p.name == "broadcast_in_dim"


def test_jaxpr_types_and_helpers():
    closed = jax.make_jaxpr(lambda x: x * 4.0)(3.0)
    assert isinstance(closed, jp.ClosedJaxpr) and isinstance(closed.jaxpr, jp.Jaxpr)
    assert any(isinstance(v, jp.Literal) for e in closed.jaxpr.eqns for v in e.invars)
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


def _traced_here(x):
    return jnp.tanh(x)


def test_source_frames_lists_the_callers_innermost_first():
    eqn = jax.make_jaxpr(lambda x: _traced_here(x))(1.0).jaxpr.eqns[0]
    if eqn.primitive.name != "tanh":  # a `jit`-wrapped `tanh`: look inside
        eqn = jp.call_body(eqn).jaxpr.eqns[0]
    frames = jp.source_frames(eqn)
    assert frames[0][0] == __file__ and frames[0][2] == "_traced_here"
    assert frames[1][2] == "test_source_frames_lists_the_callers_innermost_first.<locals>.<lambda>"
    assert all(isinstance(line, int) for _, line, _ in frames)
    assert jp.frame_label(*frames[0]) == jp.user_source(eqn)
    assert jp.user_source(eqn).endswith("(_traced_here)")


def test_library_frames_are_hidden_and_scope_names_kept_as_given():
    # Imported here: the top of this file is edited in parallel.
    import os
    import traceback

    import pytest

    import residual

    # `hide_from_tracebacks` (run on import): a trace-time error under `jit(grad)`
    # ends in the user's code, with no `residual/` frame left in between.
    g = residual.with_hooks(lambda x: jnp.sum(jnp.sin(x)), lambda x: x, lambda p: p[:1])
    with pytest.raises(residual.HookError) as err:
        jax.jit(jax.grad(g))(jnp.ones(3))
    files = [frame.filename for frame in traceback.extract_tb(err.value.__traceback__)]
    assert __file__ in files
    assert not [f for f in files if f"{os.sep}residual{os.sep}" in f], files

    # `jax.named_scope` keeps the name object it is given on every equation's name
    # stack: hook markers are `str`s that carry their hooks through traces.
    class Tagged(str):
        pass

    name = Tagged("tagged")

    def f(x):
        with jax.named_scope(name):
            return jnp.sin(x) * 2

    closed = jax.make_jaxpr(f)(1.0)
    assert all(jp.scope_names(e)[-1] is name for e in closed.jaxpr.eqns)


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


def test_stack_axis_finds_the_transpose_of_unstack():
    # The backward of `unstack` stacks the cotangents of its slices.
    def f(ws):
        a, b, c = lax.unstack(ws, axis=1)
        return jnp.sum(a * b * c)

    backward = jax.make_jaxpr(jax.grad(f))(jnp.ones((2, 3)))
    stacks = [e for e in backward.jaxpr.eqns if jp.stack_axis(e) is not None]
    assert [jp.stack_axis(e) for e in stacks] == [1]
    assert len(stacks[0].invars) == 3
    assert jp.stack_axis(jax.make_jaxpr(jnp.sin)(1.0).jaxpr.eqns[0]) is None


def test_checkpoint_and_names_are_known_under_every_upgrade_flag(upgrade_flag):
    def f(x):
        y = checkpoint_name(jnp.sin(x), "act")
        return jax.checkpoint(lambda a: jnp.exp(a) * 2.0, prevent_cse=False)(y)

    eqns = jax.make_jaxpr(f)(1.0).jaxpr.eqns
    (name,) = [e for e in eqns if jp.kind(e) in jp.NAMES]
    assert jp.checkpoint_name_of(name) == "act"
    (remat,) = [e for e in eqns if jp.kind(e) in jp.REMATS]
    parts = jp.remat_parts(remat)
    assert parts.prevent_cse is False
    assert [e.primitive.name for e in parts.body.jaxpr.eqns] == ["exp", "mul"]
    assert jp.single_body(remat) is parts.body.jaxpr
    if upgrade_flag == "jax_remat3":
        assert name.primitive is jp.call_hi_primitive_p
        assert remat.primitive is jp.call_hi_primitive_p


def test_custom_derivative_bodies_are_found_under_every_upgrade_flag(upgrade_flag):
    @jax.custom_vjp
    def g(x):
        return jnp.sin(x)

    g.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, t: (c * t,))

    @jax.custom_jvp
    def h(x):
        return jnp.tanh(x)

    h.defjvp(lambda p, t: (jnp.tanh(p[0]), t[0] * (1 - jnp.tanh(p[0]) ** 2)))
    eqns = jax.make_jaxpr(lambda x: h(g(x)))(1.0).jaxpr.eqns
    assert len(eqns) == 2
    bodies = [[e.primitive.name for sub in jp.sub_jaxprs(eqn) for e in sub.eqns] for eqn in eqns]
    assert "sin" in bodies[0] and "tanh" in bodies[1], bodies
    # The primal's body, which takes the equation's operands: what a residual made
    # inside it is traced back through.
    assert [e.primitive.name for e in jp.single_body(eqns[1]).eqns] == ["tanh"]

def test_optimized_cost_analysis_reads_a_compiled_program():
    # On CPU the compiler's own analysis exists: the generic one of the same optimized
    # program counts the same FLOPs and bytes.
    compiled = jax.jit(lambda a: jnp.tanh(a @ a)).lower(jnp.ones((64, 64))).compile()
    own = compiled.cost_analysis()
    own = own[0] if isinstance(own, list) else own
    generic = jp.optimized_cost_analysis(compiled)
    assert generic["flops"] == own["flops"] >= 2 * 64**3
    assert generic["bytes accessed"] == own["bytes accessed"] > 0


def test_compile_with_dumps_writes_the_buffer_assignment_and_live_ranges():
    # XLA names its dumps and lays out their text per release: the parsed program's
    # arguments must come to the compiler's own argument bytes, and every buffer
    # live at some position of the program's order.
    from residual._inspect import buffers as _buffers

    x = jnp.ones((256, 128))
    lowered = jax.jit(jax.grad(lambda x: jnp.sum(jnp.tanh(x) ** 2))).lower(x)
    compiled, texts = jp.compile_with_dumps(lowered)
    assert set(texts) == set(jp.DUMPS) and all(texts.values())
    program = _buffers.parse(texts["module"], texts["assignment"], texts["live_ranges"])
    arguments = [b for b in program.buffers if b.role == "argument"]
    assert sum(b.bytes for b in arguments) == compiled.memory_analysis().argument_size_in_bytes
    assert [(b.shape.split("{")[0], b.op_name) for b in arguments] == [("f32[256,128]", "x")]
    assert program.order and all(0 <= b.start <= b.end <= len(program.order)
                                 for b in program.buffers)
    # Source lines come through the module's stack frame tables.
    assert any(b.op_name.startswith("jit(") and b.stack and b.stack[0].startswith(__file__)
               for b in program.buffers)
    assert program.live_bytes().max() > 0
