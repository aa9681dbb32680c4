"""What the tools run a function by, and how they compare gradients.

`inspect` and `gradcheck` run a user's function forward and backward with a cotangent
of ones (`backward`), on arguments of arrays (`check_array_arguments`); `gradcheck`
and the planner compare gradients by relative error,
in two readings for two questions: whether any argument's gradient is off
(`worst_argument_error`, gradcheck's), and how far the whole gradient moves
(`whole_gradient_error`, the figure the planner's bound on error is about).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def backward(fn: Callable) -> Callable:
    """The forward and backward pass of `fn`, with a cotangent of ones."""

    def run(*args):
        out, vjp = jax.vjp(fn, *args)
        return vjp(jax.tree.map(jnp.ones_like, out))

    return run


def check_array_arguments(args: tuple, tool: str) -> None:
    """Refuses, naming the leaf and the fix, a positional argument holding what JAX
    cannot trace: a leaf that is neither a scalar nor has a shape and a dtype (an
    array, a `jax.ShapeDtypeStruct`), such as a model's activation function."""
    for i, arg in enumerate(args):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            if isinstance(leaf, bool | int | float | complex) or (
                    hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
                continue
            where = (f"holds {jax.tree_util.keystr(path)}, a" if path else "is a")
            raise TypeError(
                f"`{tool}` differentiates `f` with respect to every positional "
                f"argument, but argument {i} {where} {type(leaf).__name__}, not an "
                "array. Pass arrays alone and close over the rest: with equinox "
                "`params, static = eqx.partition(model, eqx.is_array)` and "
                "`lambda p, *a: f(eqx.combine(p, static), *a)`."
            )


def worst_argument_error(got: Sequence[Any], want: Sequence[Any]) -> float:
    """max over arguments of ||got - want|| / ||want||, each argument's gradients (a
    tuple of one pytree per argument) taken over its floating-point leaves together.

    Not leaf by leaf: a leaf whose true gradient is zero (a bias followed by a batch
    norm) has one of rounding noise, and noise over noise would read as 100%.
    """
    errors = []
    for g, e in zip(got, want):
        pairs = [(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(e))
                 if jnp.issubdtype(b.dtype, jnp.inexact)]
        if pairs:
            errors.append(whole_gradient_error(*zip(*pairs)))
    return max(errors, default=0.0)


def whole_gradient_error(got: Any, want: Any) -> float:
    """||got - want|| / ||want|| over all leaves together, in float64 (the absolute
    error where `want` is all zeros)."""
    got, want = ([_on_host(x) for x in jax.tree.leaves(tree)] for tree in (got, want))
    diff = sum(float(np.sum(np.abs(a - b) ** 2)) for a, b in zip(got, want))
    norm = sum(float(np.sum(np.abs(b) ** 2)) for b in want)
    return math.sqrt(diff / norm) if norm > 0 else math.sqrt(diff)


def _on_host(x: Any) -> np.ndarray:
    """The whole of `x` in float64 (complex128 if complex) on this host; in a multi-host
    run, an array sharded across hosts is gathered from all of them (every process
    calls this alike)."""
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x, np.complex128 if np.iscomplexobj(x) else np.float64)
