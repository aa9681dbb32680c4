"""Bad input gets a clear error, early, and leaves nothing broken behind."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual
from residual import policies as rp
from residual._scope import _STACK

X = jnp.linspace(0.1, 1.0, 4)


def _loss(x):
    return jnp.sum(jnp.sin(x) ** 2)


def _still_works():
    assert _STACK.get() == ()
    g = jax.grad(residual.with_hooks(_loss, lambda x: x * 4, lambda p: p / 4))(X)
    np.testing.assert_allclose(g, jax.grad(_loss)(X), rtol=1e-6)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: residual.with_hooks(_loss, 3, lambda p: p), TypeError,
         r"`pack` must be callable, but got int: 3"),
        (lambda: residual.with_hooks(_loss, lambda x: x), TypeError,
         r"got `pack` without `unpack`.*Pass `unpack` too"),
        (lambda: residual.with_hooks(_loss, unpack=lambda p: p), TypeError,
         r"got `unpack` without `pack`"),
        (lambda: residual.with_hooks(_loss, lambda x: x, lambda p: p, policy=rp.Remat()),
         TypeError, r"takes either `pack` and `unpack` or `policy`, not both"),
        (lambda: residual.with_hooks(_loss, policy=lambda x: x), TypeError,
         r"`policy` must be a `residual.Policy`.*got function"),
        (lambda: residual.with_hooks("loss"), TypeError,
         r"`with_hooks` wraps a function, but got str"),
        (lambda: residual.saved_tensors_hooks(), TypeError,
         r"`saved_tensors_hooks` needs hooks"),
        (lambda: residual.disable_saved_tensors_hooks(3), TypeError,
         r"`error_message` must be a str"),
        (lambda: rp.select([rp.Remat()]), TypeError, r"rule 0 of `select` must be a"),
        (lambda: rp.select([(rp.where(), "remat")]), TypeError,
         r"the policy must be a `residual.Policy`"),
        (lambda: rp.where(min_bytes=10, max_bytes=1), ValueError, r"nothing would match"),
        (lambda: rp.Chain(rp.Remat()), TypeError, r"two or more policies"),
        (lambda: rp.Offload("gpu_memory"), ValueError,
         r"`memory_kind` must be a host memory.*\['device', 'pinned_host', 'unpinned_host'\]"),
    ],
)
def test_bad_arguments_fail_at_construction(call, error, message):
    with pytest.raises(error, match=message):
        call()
    _still_works()


def test_unpack_returning_numpy_of_wrong_dtype():
    g = residual.with_hooks(_loss, lambda x: x, lambda p: np.zeros((4,), np.float64))
    with pytest.raises(residual.HookError, match=r"returned float64\[4\] instead of float32\[4\]"):
        jax.grad(g)(X)
    _still_works()


def test_integer_inputs_differentiated_give_jax_own_error():
    n = jnp.arange(3)
    with pytest.raises(TypeError) as plain:
        jax.grad(lambda n: jnp.sum(n * 2.0))(n)
    with pytest.raises(TypeError) as hooked:
        jax.grad(residual.with_hooks(lambda n: jnp.sum(n * 2.0), lambda x: x, lambda p: p))(n)
    assert str(hooked.value) == str(plain.value)
    _still_works()


def test_scope_exited_out_of_order():
    outer = residual.saved_tensors_hooks(lambda x: x, lambda p: p)
    inner = residual.saved_tensors_hooks(lambda x: x * 2, lambda p: p)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match=re.escape("exited out of order")):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    # The stack still holds `outer` (its exit failed); leave it properly.
    assert len(_STACK.get()) == 1
    _STACK.set(())
    _still_works()


def test_hook_raising_keeps_its_type_and_the_next_call_works():
    def pack(x):
        raise ZeroDivisionError("inside pack")

    with pytest.raises(ZeroDivisionError, match="inside pack"):
        jax.jit(jax.grad(residual.with_hooks(_loss, pack, lambda p: p)))(X)
    _still_works()


def test_unhashable_static_values_in_pack_results_are_fine_under_jit():
    # Static parts of `pack`'s result stay in Python at trace time: any object works.
    def pack(x):
        return {"data": x, "meta": [1, {"unhashable": []}]}

    g = jax.jit(jax.grad(residual.with_hooks(_loss, pack, lambda p: p["data"])))
    np.testing.assert_allclose(g(X), jax.grad(_loss)(X), rtol=1e-6)


def test_unhashable_policy_in_a_scope():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Listy(residual.Policy):
        levels: list

        def pack(self, x, info):
            return x

        def unpack(self, packed, info):
            return packed

    with pytest.raises(TypeError, match=r"Hooks must be hashable.*Make policy fields tuples"):
        with residual.saved_tensors_hooks(policy=Listy([1, 2])):
            pass
    _still_works()
