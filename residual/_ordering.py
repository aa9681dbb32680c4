"""A conditional that orders work and blocks fusion, and stays a conditional under `vmap`.

`residual` passes values through `lax.cond(first == first, fn, copy of fn, operands)`:
XLA never fuses across a conditional, and it cannot run one before its predicate is
computed: `first` is one element of a value, the tie (see
docs/xla-and-packed-residuals.md). Under `vmap` the predicate is batched and JAX
turns the `cond` into a `select` that computes both branches: the copy is made and
neither tie holds. Here the batching rule folds the predicate into one scalar for
the whole batch and keeps the conditional.

Both branches return the same values, so the predicate only orders the work: no
result depends on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def passed_after(tie, operands, fn: Callable | None = None) -> Any:
    """`fn(operands)` (identity by default), computed after the array `tie`, unfused.

    The predicate reads one element of `tie`. `fn` must be linear (a view: a slice, a
    reshape) and work on one example: under `vmap` it is vmapped when an operand is
    batched.
    """
    first = tie.ravel()[0].astype(jnp.float32)

    @jax.custom_batching.custom_vmap
    def conditional(first, operands):
        apply = fn or (lambda x: x)
        # The branches must differ: JAX inlines a `cond` whose branches are equal.
        return lax.cond(first == first, apply, lambda x: _copy(apply(x)), operands)

    @conditional.def_vmap
    def batched(axis_size, in_batched, first, operands):
        first_batched, operands_batched = in_batched
        if first_batched:
            # One predicate for the whole batch. Should the sum be NaN (a NaN, or
            # infinities of both signs), the copy branch runs: the same values.
            first = jnp.sum(first)
        batched_leaves = jax.tree.leaves(operands_batched)
        if fn is None or not any(batched_leaves):
            out = passed_after(first, operands, fn)
            return out, operands_batched if fn is None else jax.tree.map(lambda _: False, out)
        axes = jax.tree.map(lambda b: 0 if b else None, operands_batched)
        per_example = jax.vmap(fn, in_axes=(axes,), axis_size=axis_size)
        out = passed_after(first, operands, per_example)
        return out, jax.tree.map(lambda _: True, out)

    # `custom_vmap` has no reverse-mode rule; the result is linear in `operands`.
    @jax.custom_jvp
    def differentiable(first, operands):
        return conditional(first, operands)

    @differentiable.defjvp
    def _jvp(primals, tangents):
        first, operands = primals
        _, operand_tangents = tangents
        out = differentiable(first, operands)
        if fn is None:
            return out, operand_tangents
        # A view of integers (token ids, say) has float0 tangents, which `fn` can't slice.
        if not all(jnp.issubdtype(x.dtype, jnp.inexact) for x in jax.tree.leaves(operands)):
            return out, jax.tree.map(lambda o: np.zeros(o.shape, jax.dtypes.float0), out)
        return out, fn(operand_tangents)

    return differentiable(first, operands)
