"""Threads never share hooks; jitted steps do not retrace or leak; scope changes retrace."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np

import residual
from residual import policies as rp


def _loss(x):
    return jnp.sum(x * x)


def test_two_threads_tracing_with_different_scopes_at_once():
    barrier = threading.Barrier(2)
    results = {}

    def worker(name, factor):
        f = residual.with_hooks(_loss)

        def pack(x):
            barrier.wait(timeout=30)  # both threads are inside tracing now
            return x * factor

        with residual.saved_tensors_hooks(pack, lambda p: p):
            results[name] = jax.grad(f)(jnp.arange(1.0, 4.0))

    threads = [threading.Thread(target=worker, args=(n, f)) for n, f in (("a", 2.0), ("b", 3.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    x = jnp.arange(1.0, 4.0)
    # x * x saves x once per slot; each slot reads factor * x.
    np.testing.assert_allclose(results["a"], 2 * 2.0 * x)
    np.testing.assert_allclose(results["b"], 2 * 3.0 * x)


def test_jitted_step_does_not_retrace_or_grow_live_arrays():
    traces = []
    g = residual.with_hooks(_loss, policy=rp.Quantize(bits=8, min_bytes=0))

    @jax.jit
    def step(x):
        traces.append(1)
        return x - 0.01 * jax.grad(g)(x)

    x = jnp.ones((64, 64))
    x = step(x).block_until_ready()
    live = len(jax.live_arrays())
    for _ in range(100):
        x = step(x)
    x.block_until_ready()
    assert len(traces) == 1
    assert len(jax.live_arrays()) <= live


def test_policy_change_between_calls_is_honoured():
    traces = []
    f = residual.with_hooks(_loss)

    @jax.jit
    def step(x):
        traces.append(1)
        return jax.grad(f)(x)

    x = jnp.arange(1.0, 4.0)
    with residual.saved_tensors_hooks(lambda v: v * 2, lambda p: p):
        a = step(x)
    with residual.saved_tensors_hooks(policy=rp.Identity()):
        b = step(x)
    np.testing.assert_allclose(a, 4 * x)
    np.testing.assert_allclose(b, 2 * x)
    assert len(traces) == 2
