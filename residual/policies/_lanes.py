"""A shape a TPU lays out without padding its lanes, for residuals stored as they are."""

from __future__ import annotations

from .._info import ResidualInfo
from . import _fusion

# A TPU tiles the two minor axes of every array: 128 lanes by 8 rows of 32-bit words
# (16 of bf16); a minor axis of 64 (an attention head) fills half of each tile.
LANES = 128
ROWS = 8


def stored_shape(info: ResidualInfo) -> tuple[int, ...]:
    """The shape to store `info`'s residual in: its own, or on one TPU with its minor
    axes merged where that fills whole 128-lane tiles and its own minor axis does not
    (heads `[batch, seq, 4, 64]` as `[batch, seq, 256]`: half the bytes; plain `jax.grad`
    keeps them in the matmul's layout, unpadded). Not on several devices: a merge with
    a sharded axis could move data between them."""
    shape = tuple(info.shape)
    if not shape or shape[-1] % LANES == 0 or info.devices > 1 or not _fusion.for_a_tpu():
        return shape
    lanes = 1
    for start in reversed(range(1, len(shape))):
        lanes *= shape[start]
        if lanes % LANES == 0:
            # The axis before the merged ones becomes the rows: whole tiles of them.
            return (*shape[:start], lanes) if shape[start - 1] % ROWS == 0 else shape
    return shape
