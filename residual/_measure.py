"""What the tools run a function by, and how they compare gradients.

`inspect` and `gradcheck` run a user's function forward and backward with a cotangent
of ones (`backward`); `gradcheck` and the planner compare gradients by relative error,
in two readings for two questions: whether any argument's gradient is off
(`worst_argument_error`, gradcheck's), and how far the whole gradient moves
(`whole_gradient_error`, the figure the planner's bound on error is about).
"""

from __future__ import annotations

import math
from collections.abc import Callable
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


def worst_argument_error(got: Any, want: Any) -> float:
    """max over floating-point leaves of ||got - want|| / ||want||."""
    errors = [
        float(jnp.linalg.norm((g - e).ravel()) / (jnp.linalg.norm(e.ravel()) + 1e-30))
        for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want))
        if jnp.issubdtype(e.dtype, jnp.inexact)
    ]
    return max(errors, default=0.0)


def whole_gradient_error(got: Any, want: Any) -> float:
    """||got - want|| / ||want|| over all leaves together, in float64 (the absolute
    error where `want` is all zeros)."""
    diff = sum(float(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
               for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    norm = sum(float(np.sum(np.asarray(b, np.float64) ** 2)) for b in jax.tree.leaves(want))
    return math.sqrt(diff / norm) if norm > 0 else math.sqrt(diff)
