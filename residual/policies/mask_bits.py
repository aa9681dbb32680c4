"""How `Quantize` and `Cast` store boolean masks: as bits, eight to a byte."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from .._info import ResidualInfo
from .._policy import Policy


@dataclasses.dataclass(frozen=True)
class MaskBits(Policy):
    """Stores a boolean mask as bits, eight to a byte, exactly.

    A ReLU saves the mask `x > 0` for its backward, one byte per element: as many
    bytes as the int8 codes of the activation it gates. `Quantize` and `Cast` store
    such masks with this policy, but only beside floats they pack (`beside_floats`):
    packing masks alone took a TPU above plain's peak (v5e, jax 0.12.0.1: the flax
    Linen CNN 3.12x, an unrolled bf16 ReLU MLP 1.07x), so where a program would
    pack nothing else, its masks are kept as they are and it stays JAX's own.

    Bits are packed along the first axis whose length is a multiple of 8, leading
    axes first: a TPU tiles the last two axes of an array, and a narrow one packed
    (a CNN's 32 channels, 4 bytes) would be padded to a whole tile. Where no axis
    is, along the longest, padded to a multiple of 8. Masks of a program partitioned
    over several devices (`ResidualInfo.devices`) are kept: on an 8-device
    tensor-parallel ReLU MLP, packed, XLA's sharding propagation split a weight's
    gradient by rows instead of plain's columns.
    """

    lossless = True
    beside_floats = True

    def resolve(self, info: ResidualInfo) -> Policy | None:
        is_mask = info.dtype == np.dtype(bool) and info.size >= 8
        if not is_mask or info.kept_alive or info.in_host_memory or info.devices > 1:
            return None
        return self

    def pack(self, x: jnp.ndarray, info: ResidualInfo) -> jnp.ndarray:
        return jnp.packbits(x, axis=_axis(info.shape), bitorder="little")

    def unpack(self, packed: jnp.ndarray, info: ResidualInfo) -> jnp.ndarray:
        axis = _axis(info.shape)
        bits = jnp.unpackbits(packed, axis=axis, count=info.shape[axis], bitorder="little")
        return bits.astype(bool)


MASK_BITS = MaskBits()


def _axis(shape: tuple[int, ...]) -> int:
    """The axis bits are packed along (see `MaskBits`)."""
    whole = [axis for axis, n in enumerate(shape) if n % 8 == 0]
    return whole[0] if whole else int(np.argmax(shape))
