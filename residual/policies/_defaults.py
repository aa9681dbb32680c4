"""The residuals built-in policies leave alone unless told otherwise."""

from __future__ import annotations

import jax.numpy as jnp

from .._info import ResidualInfo


def worth_packing(info: ResidualInfo) -> bool:
    """A real or complex floating-point residual whose storage packing can actually shrink.

    Not floating point (integers, booleans, indices): packing would change values
    that are not meant to be approximated (boolean masks are stored as bits,
    exactly, by `MaskBits`). Kept alive anyway (an input of the
    outermost hooked function, such as a weight, or a scan body's loop-invariant or
    sliced operand): storing a packed copy would add memory, not save it. Already in
    host memory: packing would bring it back to the device to compute on it, and
    store the packed copy there.
    """
    return (jnp.issubdtype(info.dtype, jnp.inexact) and not info.kept_alive
            and not info.in_host_memory)
