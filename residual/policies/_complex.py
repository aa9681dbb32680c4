"""Complex residuals as real ones: what `Cast` and `Quantize` pack in their place.

A complex residual (the spectra of an FFT layer, a complex network's activations) is
packed as its real and imaginary parts, stacked on a new leading axis: the parts are
the floats the policy knows how to store, and the residual's own axes keep their
order, so a sharded residual stays sharded as it was.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

from .._info import ResidualInfo


def is_complex(info: ResidualInfo) -> bool:
    return jnp.issubdtype(info.dtype, jnp.complexfloating)


def part_dtype(dtype) -> np.dtype:
    """The dtype of a value's real and imaginary parts (the dtype itself if real)."""
    return np.finfo(dtype).dtype if jnp.issubdtype(dtype, jnp.complexfloating) else np.dtype(dtype)


def parts_info(info: ResidualInfo) -> ResidualInfo:
    """What the policy is told of the stacked parts: their shape and dtype."""
    return dataclasses.replace(info, shape=(2, *info.shape), dtype=part_dtype(info.dtype))


def parts(x: jnp.ndarray) -> jnp.ndarray:
    """`x`'s real and imaginary parts, stacked on a new leading axis."""
    return jnp.stack([jnp.real(x), jnp.imag(x)])


def from_parts(stacked: jnp.ndarray, info: ResidualInfo) -> jnp.ndarray:
    """The complex residual `info` describes, from its stacked parts."""
    real = stacked.astype(part_dtype(info.dtype))
    return lax.complex(real[0], real[1])


def widened(x: jnp.ndarray) -> jnp.ndarray:
    """`x` in float32, or complex64 if complex: where round-trip errors are measured."""
    return x.astype(jnp.complex64 if jnp.iscomplexobj(x) else jnp.float32)
