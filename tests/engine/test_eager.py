"""Hooked functions called as plain Python: scalars, Python control flow, eager memory.

Outside `jit`, `with_hooks(f)` must behave like `f` under plain eager `jax.grad`: the
same Python numbers are accepted, the same Python control flow works where hooks do
not need to trace it, and repeated calls do not grow the process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import residual
from residual import policies as rp
from tests.helpers import tree_allclose, tree_equal


def identity(x):
    return x


def _f(s):
    return jnp.sin(s) * s


# Python scalars as arguments and cotangents -------------------------------------------


@pytest.mark.parametrize("policy", [None, rp.Profile(), rp.Cast(jnp.bfloat16)])
def test_python_float_argument_reaches_hooks_as_an_array(policy):
    seen = []

    def pack(x):
        seen.append(x)
        return x

    g = (residual.with_hooks(_f, pack, identity) if policy is None
         else residual.with_hooks(_f, policy=policy))
    want = jax.grad(_f)(2.0)
    got = jax.grad(g)(2.0)
    if policy is None:
        assert seen and all(isinstance(x, jax.Array) for x in seen), seen
    assert tree_allclose(got, want, rtol=2e-2 if policy else None)
    assert tree_allclose(jax.grad(jax.grad(g))(2.0), jax.grad(jax.grad(_f))(2.0),
                         rtol=2e-2 if policy else None)
    assert tree_allclose(jax.jit(jax.grad(g))(2.0), jax.jit(jax.grad(_f))(2.0),
                         rtol=2e-2 if policy else None)


def test_python_int_and_float_arguments_with_value_and_grad():
    def f(x, n, scale):
        return jnp.sum(jnp.tanh(x) ** n) * scale

    g = residual.with_hooks(f, identity, identity)
    x = jnp.linspace(0.0, 1.0, 4)
    assert tree_equal(jax.value_and_grad(g)(x, 3, 0.5), jax.value_and_grad(f)(x, 3, 0.5))
    assert tree_equal(jax.grad(g, argnums=(0, 2))(x, 3, 0.5),
                      jax.grad(f, argnums=(0, 2))(x, 3, 0.5))


def test_python_float_cotangent_for_a_scalar_output():
    g = residual.with_hooks(_f, identity, identity)
    x = jnp.float32(0.3)
    (got,) = jax.vjp(g, x)[1](1.0)
    (want,) = jax.vjp(_f, x)[1](1.0)
    assert tree_equal(got, want)
    (got,) = jax.jit(lambda ct: jax.vjp(g, x)[1](ct))(1.0)
    assert tree_allclose(got, want)


def test_python_float_cotangent_in_a_tuple_output():
    def f(x):
        return jnp.sum(jnp.sin(x) * x), jnp.tanh(x)

    g = residual.with_hooks(f, policy=rp.Profile())
    x = jnp.linspace(0.0, 1.0, 3)
    cts = (1.0, jnp.ones(3))
    assert tree_equal(jax.vjp(g, x)[1](cts), jax.vjp(f, x)[1](cts))


def test_cotangent_of_the_wrong_dtype_is_refused_like_plain_jax():
    g = residual.with_hooks(lambda x: (x * x).astype(jnp.bfloat16), identity, identity)
    with pytest.raises(ValueError, match="expected bfloat16"):
        jax.vjp(g, jnp.float32(2.0))[1](1.0)


# Python control flow on concrete values ------------------------------------------------


def _branchy(x):
    if x > 0:  # a Python branch on the value: fine in eager mode
        return jnp.sin(x) * x
    return jnp.cos(x) * x


def _looped(x, n):
    return lax.fori_loop(0, n, lambda _, c: jnp.sin(c) * c, x)


@pytest.mark.parametrize("x", [0.5, -0.5])
def test_python_branch_on_a_value_without_hooks_behaves_like_f(x):
    x = jnp.float32(x)
    g = residual.with_hooks(_branchy)
    assert tree_equal(g(x), _branchy(x))
    assert tree_equal(jax.grad(g)(x), jax.grad(_branchy)(x))
    assert tree_equal(jax.grad(jax.grad(g))(x), jax.grad(jax.grad(_branchy))(x))


def test_python_branch_on_a_value_with_hooks_but_no_derivative_is_f():
    x = jnp.float32(0.5)
    assert tree_equal(residual.with_hooks(_branchy, identity, identity)(x), _branchy(x))


def test_python_branch_on_a_value_under_jit_fails_as_f_does():
    with pytest.raises(jax.errors.TracerBoolConversionError):
        jax.jit(jax.grad(_branchy))(1.0)
    with pytest.raises(jax.errors.TracerBoolConversionError, match="_branchy"):
        jax.jit(jax.grad(residual.with_hooks(_branchy)))(1.0)


@pytest.mark.parametrize("hooks", ["explicit", "scope"])
def test_python_branch_on_a_value_with_hooks_names_the_function_and_the_fix(hooks):
    x = jnp.float32(0.5)
    if hooks == "explicit":
        g, scope = residual.with_hooks(_branchy, identity, identity), None
    else:
        g, scope = residual.with_hooks(_branchy), residual.saved_tensors_hooks(
            identity, identity)
    message = (r"`with_hooks` traces `_branchy` .* needs the value of a traced array at "
               r"test_eager.py:\d+ \(`if x > 0:.*`\).*jax.lax.cond.*static_argnums")
    with pytest.raises(TypeError, match=message) as caught:
        if scope is None:
            jax.grad(g)(x)
        else:
            with scope:
                jax.grad(g)(x)
    assert "flat_f" not in str(caught.value)


def test_hook_scope_inside_an_untraceable_function_is_refused_not_ignored():
    def f(x):
        if x > 0:
            with residual.saved_tensors_hooks(identity, identity):
                return jnp.sin(x) * x
        return x

    with pytest.raises(RuntimeError, match=r"scope was entered inside `.*f`.*could not trace"):
        jax.grad(residual.with_hooks(f))(jnp.float32(0.5))


@pytest.mark.parametrize("hooks", [None, (identity, identity), rp.Cast(jnp.bfloat16)])
def test_fori_loop_with_concrete_integer_bounds(hooks):
    if hooks is None:
        g = residual.with_hooks(_looped)
    elif isinstance(hooks, residual.Policy):
        g = residual.with_hooks(_looped, policy=hooks)
    else:
        g = residual.with_hooks(_looped, *hooks)
    x, n = jnp.float32(0.5), jnp.int32(3)
    rtol = 2e-2 if isinstance(hooks, residual.Policy) else None
    assert tree_allclose(jax.grad(g)(x, n), jax.grad(_looped)(x, n), rtol=rtol)
    assert tree_allclose(jax.grad(g)(x, 3), jax.grad(_looped)(x, 3), rtol=rtol)
    # Under `jit` the bound is traced, and reverse mode refuses the loop as for `f`.
    with pytest.raises(ValueError, match="Reverse-mode differentiation does not work"):
        jax.jit(jax.grad(g))(x, n)


def test_concrete_integer_used_as_a_size_and_an_index():
    def f(x, n):
        return jnp.sum(jnp.tanh(x[:n]) ** 2) + x[n] * jnp.ones(int(n)).sum()

    x = jnp.linspace(0.0, 1.0, 5)
    g = residual.with_hooks(f, identity, identity)
    assert tree_equal(jax.grad(g)(x, jnp.int32(3)), jax.grad(f)(x, jnp.int32(3)))


# Memory of repeated eager calls --------------------------------------------------------

_EAGER_CALLS = """
import os, sys
import jax, jax.numpy as jnp
import residual
from residual import policies as rp

def rss_mb():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

def mlp(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w)
    return jnp.sum(x ** 2)

ws = jnp.ones((3, 16, 16)) / 16
x = jnp.ones((8, 16))
grads = {{
    "hooks": jax.grad(residual.with_hooks(mlp, lambda t: t * 2, lambda p: p / 2)),
    "cast": jax.grad(residual.with_hooks(mlp, policy=rp.Cast(jnp.bfloat16))),
    "quantize": jax.grad(residual.with_hooks(mlp, policy=rp.Quantize(bits=4, min_bytes=0))),
}}
for name, grad in grads.items():
    for _ in range(10):  # warm up: the first calls fill JAX's caches
        grad(ws, x).block_until_ready()
    before = rss_mb()
    for _ in range({calls}):
        grad(ws, x).block_until_ready()
    print(name, rss_mb() - before)
"""


def test_repeated_eager_calls_keep_memory_bounded():
    # An eager call that compiled its ordering conditionals anew each time would leave
    # one program per call in JAX's caches: about 14 MB per call here.
    calls = 50
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_EAGER_CALLS.format(calls=calls))],
        capture_output=True, text=True, check=True, env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    growth = dict(line.split() for line in result.stdout.splitlines())
    for name, mb in growth.items():
        # Plain eager `jax.grad` grows by a few KB per call; allow 0.2 MB per call.
        assert float(mb) < 0.2 * calls, (name, mb)
