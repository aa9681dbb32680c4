"""The ordering conditional: a real `cond` under `vmap`, and linear under `jvp`."""

import jax
import jax.numpy as jnp
import numpy as np

from residual._engine.ordering import passed_after


def _take_row(x):
    return x[1]


def test_vmap_keeps_one_conditional_and_no_select():
    def f(tie, x):
        return passed_after(tie[0], x * 2.0)

    ties, xs = jnp.ones((2, 3, 4)), jnp.arange(24.0).reshape(2, 3, 4)
    nested = jax.vmap(jax.vmap(f))
    text = str(jax.make_jaxpr(nested)(ties, xs))
    assert "cond[" in text and "select_n" not in text, text
    assert np.array_equal(nested(ties, xs), xs * 2.0)
    # Only the predicate batched, or only the operand.
    only_tie = jax.vmap(f, in_axes=(0, None))(ties[0], xs[0, 0])
    assert np.array_equal(only_tie, jnp.broadcast_to(2 * xs[0, 0], (3, 4)))
    assert np.array_equal(jax.vmap(f, in_axes=(None, 0))(ties[0, 0], xs[0]), xs[0] * 2.0)


def test_view_of_batched_and_unbatched_operands():
    source = jnp.arange(6.0).reshape(3, 2)
    ties = jnp.ones((4,))
    unbatched = jax.vmap(lambda t: passed_after(t, source, _take_row))(ties)
    assert np.array_equal(unbatched, jnp.broadcast_to(source[1], (4, 2)))
    sources = jnp.stack([source, -source])
    batched = jax.vmap(lambda t, s: passed_after(t, s, _take_row))(ties[:2], sources)
    assert np.array_equal(batched, sources[:, 1])


def test_jvp_is_the_view_of_the_tangent_and_zero_for_integers():
    x = jnp.arange(6.0).reshape(3, 2)
    out, tangent = jax.jvp(lambda x: passed_after(jnp.float32(1), x, _take_row), (x,), (x * 3,))
    assert np.array_equal(out, x[1]) and np.array_equal(tangent, 3 * x[1])
    ids = jnp.arange(6).reshape(3, 2)
    grad = jax.grad(lambda x: jnp.sum(passed_after(x[0, 0], (x, ids))[0] ** 2))(x)
    assert np.array_equal(grad, 2 * x)
    out, tangent = jax.jvp(lambda t: passed_after(t, ids, _take_row), (jnp.float32(1),),
                           (jnp.float32(1),))
    assert np.array_equal(out, ids[1]) and tangent.dtype == jax.dtypes.float0
