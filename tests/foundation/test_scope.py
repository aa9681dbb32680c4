"""The hook scope stack: `saved_tensors_hooks`, `disable_saved_tensors_hooks` (Core 9, 10)."""

from __future__ import annotations

import functools
import gc
import threading
import weakref

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import residual
from residual._scope import _STACK, policy_of_marker
from tests.helpers import tree_allclose, tree_equal

X = jnp.linspace(0.1, 1.0, 6)


def _tagger(tag, seen):
    """Hooks that record `tag` for every residual they pack; values unchanged."""
    return (lambda x: seen.append(tag) or x), (lambda p: p)


def _scaled(factor):
    """Non-inverse hooks: the gradient tells which pair handled a residual."""
    return (lambda x: x * factor), (lambda p: p)


def test_scope_around_the_grad_call_applies_and_exits():
    f = residual.with_hooks(lambda a: jnp.sum(a * a))
    with residual.saved_tensors_hooks(*_scaled(2.0)):
        assert tree_equal(jax.grad(f)(X), 4 * X)
    assert tree_equal(jax.grad(f)(X), 2 * X)
    assert _STACK.get() == ()


def test_nested_scopes_innermost_wins_and_outer_resumes():
    # PyTorch's `..._should_use_inner`: grads 2*5*5*a then 2*3*3*b, via x*x where
    # each of the two saved x reads `factor * x`.
    f = residual.with_hooks(lambda a: jnp.sum(a * a))
    with residual.saved_tensors_hooks(*_scaled(3.0)):
        with residual.saved_tensors_hooks(*_scaled(5.0)):
            inner = jax.grad(f)(X)
        outer = jax.grad(f)(X)
    assert tree_allclose(inner, 2 * 5 * X) and tree_allclose(outer, 2 * 3 * X)


def test_regions_inside_jitted_code_scan_cond_and_inner_jit():
    seen = []

    @jax.jit
    def inner_jit(h):
        with residual.saved_tensors_hooks(*_tagger("inner_jit", seen)):
            return jnp.sin(h)

    def f(x):
        with residual.saved_tensors_hooks(*_tagger("region", seen)):
            h = jnp.exp(x)
        h = jnp.tanh(h)  # outside any region: the with_hooks hooks

        def body(c, _):
            with residual.saved_tensors_hooks(*_tagger("scan", seen)):
                c = jnp.cos(c)
            return c, None

        h, _ = lax.scan(body, h, None, length=2)

        def branch(h):
            with residual.saved_tensors_hooks(*_tagger("cond", seen)):
                return jnp.sin(h) * h

        h = lax.cond(True, branch, lambda h: h, h)
        return jnp.sum(inner_jit(h))

    g = residual.with_hooks(f, *_tagger("outer", seen))
    got = jax.jit(jax.grad(g))(X)
    assert tree_allclose(got, jax.grad(f)(X))
    assert {"region", "outer", "scan", "cond", "inner_jit"} <= set(seen), seen


def test_innermost_region_inside_function_beats_explicit_hooks():
    # A residual belongs to the region of the code that produced it: here cos(a),
    # produced by sin's derivative inside the region.
    def f(a):
        with residual.saved_tensors_hooks(*_scaled(5.0)):
            y = jnp.sin(a)
        return jnp.sum(y * 2.0)

    g = residual.with_hooks(f, *_scaled(3.0))
    assert tree_allclose(jax.grad(g)(X), 2.0 * 5 * jnp.cos(X))


def test_scope_is_restored_on_exceptions():
    with pytest.raises(ZeroDivisionError), residual.saved_tensors_hooks(*_scaled(2.0)):
        1 / 0  # noqa: B018
    assert _STACK.get() == ()

    def f(a):
        with residual.saved_tensors_hooks(*_scaled(2.0)):
            raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        jax.grad(residual.with_hooks(f))(X)
    assert _STACK.get() == ()
    assert tree_equal(jax.grad(residual.with_hooks(lambda a: jnp.sum(a * a)))(X), 2 * X)


def test_hooks_are_bound_at_trace_time():
    unpacked = []
    f = residual.with_hooks(lambda a: jnp.sum(jnp.sin(a)))
    with residual.saved_tensors_hooks(lambda x: x * 4, lambda p: unpacked.append(1) or p / 4):
        _, vjp = jax.vjp(f, X)
    assert tree_allclose(vjp(jnp.ones(()))[0], jnp.cos(X))
    assert unpacked, "the vjp function made inside the scope used its unpack"


def test_another_thread_never_sees_this_threads_hooks():
    seen = []
    f = residual.with_hooks(lambda a: jnp.sum(jnp.sin(a)))
    entered, done = threading.Event(), threading.Event()
    result = {}

    def other():
        entered.wait()
        result["grad"] = jax.grad(f)(X)
        result["stack"] = _STACK.get()
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with residual.saved_tensors_hooks(*_tagger("main", seen)):
        entered.set()
        done.wait(timeout=60)
    thread.join()
    assert result["stack"] == () and seen == []
    assert tree_equal(result["grad"], jnp.cos(X))


def test_jit_traced_under_one_scope_retraces_under_another():
    traces = []
    f = residual.with_hooks(lambda a: jnp.sum(a * a))

    @jax.jit
    def step(x):
        traces.append(1)
        return jax.grad(f)(x)

    with residual.saved_tensors_hooks(*_scaled(2.0)):
        a = step(X)
    with residual.saved_tensors_hooks(*_scaled(3.0)):
        b = step(X)
    c = step(X)
    with residual.saved_tensors_hooks(*_scaled(3.0)):
        pass
    assert tree_allclose(a, 4 * X) and tree_allclose(b, 6 * X) and tree_allclose(c, 2 * X)
    assert len(traces) == 3
    step(X)
    assert len(traces) == 3  # same scope again: cached


def test_policy_scope_equal_values_share_the_jit_cache():
    traces = []
    f = residual.with_hooks(lambda a: jnp.sum(jnp.sin(a)))

    @jax.jit
    def step(x):
        traces.append(1)
        return jax.grad(f)(x)

    for _ in range(3):
        with residual.saved_tensors_hooks(policy=residual.policies.Remat()):
            step(X)
    assert len(traces) == 1


# disable_saved_tensors_hooks: PyTorch's test_disabling_saved_tensor_hooks{,_nested}


def test_disable_refuses_hooks_inside_and_restores():
    with residual.disable_saved_tensors_hooks("no hooks please"):
        with pytest.raises(RuntimeError, match="no hooks please"):
            with residual.saved_tensors_hooks(lambda x: x, lambda p: p):
                pass
        with pytest.raises(RuntimeError, match="no hooks please"):
            jax.grad(residual.with_hooks(lambda a: jnp.sum(a * a), lambda x: x, lambda p: p))(X)
    with residual.saved_tensors_hooks(lambda x: x, lambda p: p):
        pass
    assert _STACK.get() == ()


def test_disable_while_hooks_are_active_raises():
    with residual.saved_tensors_hooks(lambda x: x, lambda p: p):
        with pytest.raises(RuntimeError, match="disabled here"):
            with residual.disable_saved_tensors_hooks("disabled here"):
                pass
        assert len(_STACK.get()) == 1


def test_disable_nested_inner_message_wins():
    with residual.disable_saved_tensors_hooks("outer message"):
        with residual.disable_saved_tensors_hooks("inner message"):
            with pytest.raises(RuntimeError, match="inner message"):
                residual.saved_tensors_hooks(lambda x: x, lambda p: p).__enter__()
        with pytest.raises(RuntimeError, match="outer message"):
            residual.saved_tensors_hooks(lambda x: x, lambda p: p).__enter__()
    assert _STACK.get() == ()


def test_disable_region_inside_function_keeps_residuals_unhooked():
    seen = []

    def f(a):
        with residual.disable_saved_tensors_hooks("protected"):
            y = jnp.sin(a)
        return jnp.sum(y)

    assert tree_equal(jax.grad(residual.with_hooks(f))(X), jnp.cos(X))
    assert seen == []


# Lifetime: hooks live while a scope, a traced function or a jit cache refers to them.


class _Held:
    """Stands for what a hook's closure holds (a model, a buffer)."""


def test_hooks_and_their_closures_are_freed_after_their_scopes():
    f = residual.with_hooks(lambda a: jnp.sum(jnp.sin(a) ** 2))
    step = jax.jit(jax.grad(f))

    def region(a, pack, unpack):
        with residual.saved_tensors_hooks(pack, unpack):
            return jnp.sum(jnp.tanh(a) ** 2)

    held = []
    for i in range(20):
        obj = _Held()
        held.append(weakref.ref(obj))
        pack, unpack = (lambda v, obj=obj: v * 2), (lambda p, obj=obj: p / 2)
        with residual.saved_tensors_hooks(pack, unpack):
            # A few calls under the scope: each new scope recompiles every operation.
            if i < 3:
                jax.grad(f)(X)
                step(X)
        inner = residual.with_hooks(functools.partial(region, pack=pack, unpack=unpack))
        jax.grad(inner)(X)
        if i < 3:
            jax.jit(jax.grad(inner))(X)
        del obj, pack, unpack, inner
    gc.collect()
    assert [r for r in held if r() is not None] == []


def test_hooks_of_a_region_live_as_long_as_a_cached_trace_names_them():
    # The inner `jit` is traced once; later traces of the hooked function reuse its
    # jaxpr, whose name stack is all that refers to the region's hooks.
    seen = []

    @jax.jit
    def inner(a):
        with residual.saved_tensors_hooks(lambda v: seen.append(1) or v * 2, lambda p: p):
            return jnp.sum(jnp.sin(a))

    for k in range(3):
        gc.collect()
        g = jax.grad(residual.with_hooks(lambda a: inner(a) * 1.0))(X)
        assert tree_allclose(g, 2 * jnp.cos(X))  # `cos`, packed doubled
        assert len(seen) == k + 1


def test_a_marker_whose_hooks_are_gone_is_an_error_not_silence():
    with pytest.raises(RuntimeError, match=r"marks a `saved_tensors_hooks` region whose hooks "
                                           r"no longer exist.*Trace it again"):
        policy_of_marker("residual-hooks-987654321")


def test_save_on_cpu_stores_in_pinned_memory_where_the_device_has_no_pageable_memory():
    from residual.policies.offload import host_memory_kind

    # JAX's CUDA backend: "device" and "pinned_host" only (seen on an H200, jax 0.11.2).
    gpu, cpu = ["device", "pinned_host"], ["device", "pinned_host", "unpinned_host"]
    assert host_memory_kind(False, gpu) == host_memory_kind(True, gpu) == "pinned_host"
    assert host_memory_kind(False, cpu) == "unpinned_host"
    assert host_memory_kind(True, cpu) == "pinned_host"
    kinds = [m.kind for m in jax.devices()[0].addressable_memories()]
    with residual.save_on_cpu() as scope:
        assert scope._entry.memory_kind == host_memory_kind(False, kinds)


def test_equal_hooks_made_again_each_step_share_the_jit_cache():
    # The jit key holds no hooks, yet equal ones made afresh still hit the cache.
    class Model:
        def pack(self, v):
            return v

        def unpack(self, p):
            return p

    model, traces = Model(), []
    f = residual.with_hooks(lambda a: jnp.sum(jnp.sin(a)))

    @jax.jit
    def step(x):
        traces.append(1)
        return jax.grad(f)(x)

    for scope in (lambda: residual.saved_tensors_hooks(model.pack, model.unpack),
                  residual.save_on_cpu):
        for _ in range(3):
            with scope():
                step(X)
            gc.collect()
    assert len(traces) == 2
