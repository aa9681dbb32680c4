"""Gradient error against plain `jax.grad`, as the benchmarks report it."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def relative_error(got, expected) -> float:
    """`|got - expected| / |expected|` over all leaves of two gradient trees."""
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(expected))
    num = sum(jnp.sum((a - b) ** 2) for a, b in pairs)
    den = sum(jnp.sum(b**2) for b in jax.tree.leaves(expected))
    return float(jnp.sqrt(num / den))
