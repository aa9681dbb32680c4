"""Stochastic rounding's random bytes: a hash of each element, no key to thread."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def salt_of(seed: int, index: int) -> int:
    """What tells apart the draws of two residuals, or of two seeds."""
    return (seed * 0x9E3779B1 + index * 0x85EBCA77 + 0x165667B1) % 2**32


def random_bytes(values: jnp.ndarray, salt: int) -> jnp.ndarray:
    """One uniform random byte per element: a hash of the element's bits and position.

    Elementwise, so it fuses into the codes' computation and each shard hashes its
    own elements (a key from a hash of the whole residual would be a reduction over
    every shard). The mix is Wellons' `lowbias32`, whose output bits are near
    independent of each input bit.
    """
    position = lax.iota(jnp.uint32, values.size).reshape(values.shape)
    h = lax.bitcast_convert_type(values, jnp.uint32) + position * jnp.uint32(0x27D4EB2F)
    h = h ^ jnp.uint32(salt)
    for shift, multiplier in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        h = (h ^ (h >> jnp.uint32(shift))) * jnp.uint32(multiplier)
    h = h ^ (h >> jnp.uint32(16))
    return (h >> jnp.uint32(24)).astype(jnp.uint8)
