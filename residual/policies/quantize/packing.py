"""Codes of 4 and 2 bits packed into bytes, and unpacked, without moving data between devices."""

from __future__ import annotations

import jax.numpy as jnp


def pack_codes(codes: jnp.ndarray, bits: int, block: int) -> jnp.ndarray:
    """Packs `8 // bits` codes per byte along the last axis, in blocks of `block` codes:
    byte `j` of a block holds code `j` of each of the block's `8 // bits` consecutive
    parts, the first part in the low bits.

    Parts, not neighbours: neighbours need a `[..., last / 2, 2]` array, which a TPU
    lays out in whole 128-lane tiles (64 times its bytes when unpacking). Blocks, not
    the whole axis: a block is one quantization group, which lies on one device when
    the last axis is sharded, so packing moves no data between devices. Along the last
    axis when its length is a multiple of `8 // bits` (no axis is merged); flattened
    and padded otherwise.
    """
    per_byte = 8 // bits
    if per_byte == 1:
        return codes
    if codes.ndim < 1 or codes.shape[-1] % per_byte:
        codes = jnp.pad(codes.ravel(), (0, -codes.size % per_byte))
    block = _block(codes.shape[-1], block, per_byte)
    blocks = codes.reshape(*codes.shape[:-1], codes.shape[-1] // block, block)
    part = block // per_byte
    packed = blocks[..., :part]
    for i in range(1, per_byte):
        packed = packed | (blocks[..., i * part:(i + 1) * part] << jnp.uint8(i * bits))
    return packed.reshape(*codes.shape[:-1], codes.shape[-1] // per_byte).astype(jnp.uint8)


def unpack_codes(packed: jnp.ndarray, bits: int, size: int, block: int) -> jnp.ndarray:
    """Codes from `pack_codes`: `[..., last]` along the last axis, or flat."""
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    last = packed.shape[-1] * per_byte
    if packed.size * per_byte != size:  # flattened and padded
        block = last
    part = _block(last, block, per_byte) // per_byte
    blocks = packed.reshape(*packed.shape[:-1], packed.shape[-1] // part, part)
    mask = jnp.uint8(2**bits - 1)
    parts = [(blocks >> jnp.uint8(i * bits)) & mask for i in range(per_byte)]
    codes = jnp.concatenate(parts, axis=-1).reshape(*packed.shape[:-1], last)
    return codes if codes.size == size else codes.reshape(-1)[:size]


def _block(last: int, block: int, per_byte: int) -> int:
    """`block` where it cuts `last` in whole blocks of whole parts, else `last`."""
    return block if block % per_byte == 0 and last % block == 0 else last
