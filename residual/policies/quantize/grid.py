"""The grids codes stand for: zero points and steps, the square grid, scales as stored."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .layout import repeat
from .noise import random_bytes

# Zero-point bytes that are never a zero point (see `encode_zero`): a group on the
# square grid, and (below 8 bits, with byte scales) a group holding a NaN or Inf.
SQUARE = 255
BROKEN = 254


def zero_point(lo: jnp.ndarray, hi: jnp.ndarray, top: int):
    """The zero point `z` and the step `s` of the grid `(c - z) * s`, codes `c = 0..top`,
    that holds `[lo, hi]` with the least step.

    Affine quantization (as PyTorch's and TFLite's integer kernels). 8-bit codes take
    an integer `0 <= z <= top`: zero is a code. Below 8 bits `z` is one of the
    values `encode_zero` stores in a byte: fractions of a code within the codes
    (a group of both signs then uses about its own range, not `[lo, hi]` widened to
    a whole zero point), whole codes beyond them (a group of one sign away from
    zero). A group reaching zero from one side gets `z = 0` or `top`, so its zeros
    stay exact. Of the two representable zero points around the exact one, the one
    with the smaller step.
    """
    # A group of one value: its range widened to zero, which then lies at one end.
    constant = hi <= lo
    lo = jnp.where(constant, jnp.minimum(lo, 0.0), lo)
    hi = jnp.where(constant, jnp.maximum(hi, 0.0), hi)
    exact = top * -lo / jnp.where(hi > lo, hi - lo, 1.0)
    if top == 255:
        down = jnp.clip(jnp.floor(exact), 0, top)
        up = jnp.clip(jnp.ceil(exact), 0, top)
    else:
        fine = _fractions(top)
        within = (exact >= 0) & (exact <= top)
        # Beyond the codes, the whole zero point next to the exact one on the codes'
        # side: its grid holds the group (and still does where it is clipped).
        beyond = jnp.clip(jnp.where(exact < 0, jnp.ceil(exact), jnp.floor(exact)),
                          -_BEYOND, top + _BEYOND)
        down = jnp.where(within, jnp.floor(exact * fine) / fine, beyond)
        up = jnp.where(within, jnp.ceil(exact * fine) / fine, beyond)

    def step(zero):
        # The least step with (top - z) s >= hi and z s >= -lo: the grid's ends hold
        # the group's (a zero point beyond the codes leaves one bound to hold).
        above = jnp.where(zero < top, hi / jnp.where(zero < top, top - zero, 1.0), 0.0)
        below = jnp.where(zero > 0, -lo / jnp.where(zero > 0, zero, 1.0), 0.0)
        return jnp.maximum(above, below)

    step_down, step_up = step(down), step(up)
    return jnp.where(step_down <= step_up, down, up), jnp.minimum(step_down, step_up)


# Below 8 bits a zero point's byte holds one of: fractions `k / _fractions(top)` of a
# code from 0 up to `top + 1` (bytes 0..127), whole codes from -1 down to `-_BEYOND`
# (from `_NEGATIVE`: 128..190) and from `top + 1` up to `top + _BEYOND` (from
# `_POSITIVE`: 191..253); 255 is `SQUARE`.
_BEYOND = 63
_NEGATIVE = 128
_POSITIVE = _NEGATIVE + _BEYOND


def _fractions(top: int) -> int:
    return _NEGATIVE // (top + 1)


def encode_zero(zero: jnp.ndarray, top: int) -> jnp.ndarray:
    """The byte of a zero point from `zero_point`."""
    if top == 255:
        return zero.astype(jnp.uint8)
    within = (zero >= 0) & (zero < top + 1)
    byte = jnp.where(within, jnp.round(zero * _fractions(top)),
                     jnp.where(zero < 0, _NEGATIVE - 1 - zero, _POSITIVE - 1 + zero - top))
    return byte.astype(jnp.uint8)


def decode_zero(byte: jnp.ndarray, top: int) -> jnp.ndarray:
    """The zero point (float32) of an `encode_zero` byte."""
    value = byte.astype(jnp.float32)
    if top == 255:
        return value
    return jnp.where(value < _NEGATIVE, value / _fractions(top),
                     jnp.where(value < _POSITIVE, _NEGATIVE - 1 - value,
                               jnp.where(value == BROKEN, (top + 1) // 2,
                                         top + 1 + value - _POSITIVE)))


# Byte scales: a group's step is `S 2^(-k / _PER_OCTAVE)` for its byte `k`, `S` the
# largest step among the groups of its super-group (up to `SUPER` elements along the
# grouped axis: a TPU's 128 lanes), stored in bfloat16. 16 per octave put a step
# within 2.2% of the group's own, and reach down to 2^-16 of `S`. In a program over
# several devices, `SUPER_SHARDED`: a super-group split across two devices would
# take its largest step by an all-reduce, and tensor-parallel shards of 64 values
# (a width of 1024 over 16 chips) are common; a TPU pads the steps to 128 lanes
# either way.
_PER_OCTAVE = 16
SUPER = 128
SUPER_SHARDED = 64


def _powers(k: jnp.ndarray) -> jnp.ndarray:
    """`2^(-k / _PER_OCTAVE)` in float32, computed alike in `pack` and `unpack`."""
    return jnp.exp2(-k.astype(jnp.float32) / _PER_OCTAVE)


def _per_super(groups: int, size: int, span: int) -> int:
    """Groups per super-group along an axis of `groups` groups of `size`: the most
    that divide it and span at most `span` elements (one, for groups that long or
    an empty axis)."""
    most = max(span // size, 1)
    return max((d for d in range(1, min(most, groups) + 1) if groups % d == 0), default=1)


def _super_max(step, axis: int, per: int):
    """The largest of each `per` consecutive values of `step` along `axis`."""
    shape = step.shape
    split = (*shape[:axis], shape[axis] // per, per, *shape[axis + 1:])
    return jnp.max(step.reshape(split), axis=axis + 1)


def byte_scales(step, axis: int, size: int, up: bool, span: int):
    """Steps (one per group, `axis` counting the groups) as bytes under a bfloat16 step
    per super-group of up to `span` elements: `(bytes, super-group steps, steps as
    stored, floored)`, `floored` where a group's step is below the grid's least and
    takes that one.

    Rounding to nearest, each stored step is the grid's nearest, not the next one up:
    a step rounded up would put every group's extremes a fraction of a code inside
    its grid's ends, and rounding to nearest would then move them outward, all of
    them, every group (a 1% bias on a LayerNorm's output at 2.2% per step, against
    0.2% from the nearest step); the codes clip what a step rounded down leaves
    beyond the grid. Stochastic rounding (`up`) takes the next step up: it is
    unbiased only where nothing is clipped.
    """
    per = _per_super(step.shape[axis], size, span)
    top = round_up(_super_max(step, axis, per), np.dtype(jnp.bfloat16))
    full = repeat(top.astype(jnp.float32), axis, per)
    ratio = jnp.where(full > 0, step / jnp.where(full > 0, full, 1.0), 0.0)
    exact = -jnp.log2(jnp.maximum(ratio, 2.0**-20)) * _PER_OCTAVE
    k = jnp.clip(jnp.floor(exact) if up else jnp.round(exact), 0, 255).astype(jnp.uint8)
    stored = full * _powers(k)
    if up:  # the logarithm is approximate: never a step below the group's
        k = jnp.where(stored < step, k - 1, k)
        stored = full * _powers(k)
    return k, top, stored, (exact > 255.5) & (full > 0)


def byte_scale_values(scale, top, axis: int) -> jnp.ndarray:
    """The float32 steps of `byte_scales`' bytes and super-group steps."""
    per = scale.shape[axis] // max(top.shape[axis], 1)  # an empty residual: none
    return repeat(top.astype(jnp.float32), axis, per) * _powers(scale)


def square_root_code(ratio: jnp.ndarray, noise: jnp.ndarray | None) -> jnp.ndarray:
    """The code `c` of `ratio` (a value over the scale, `>= 0`) on the grid `c^2`.

    Round to nearest: `c` when `(c - 1/2)^2 + 1/4 <= ratio < (c + 1/2)^2 + 1/4`, the
    midpoints of `c^2` and its neighbours. Stochastic (`noise` uniform in `(0, 1)`):
    up from `floor(sqrt(ratio))` with the probability that keeps the value unbiased,
    `(ratio - c^2) / (2c + 1)`.
    """
    ratio = jnp.maximum(ratio, 0.0)
    if noise is None:
        return jnp.floor(jnp.sqrt(jnp.maximum(ratio - 0.25, 0.0)) + 0.5)
    low = jnp.floor(jnp.sqrt(ratio))
    return low + (noise * (2 * low + 1) < ratio - low * low).astype(low.dtype)


def round_up(value: jnp.ndarray, dtype: np.dtype) -> jnp.ndarray:
    """`value` in `dtype`, never rounded below it (a grid must still cover its group)."""
    stored = value.astype(dtype)
    if stored.dtype == value.dtype:
        return stored
    return jnp.where(stored.astype(value.dtype) < value,
                     jnp.nextafter(stored, jnp.asarray(jnp.inf, dtype)), stored)


def fp8_codes(groups, lo, hi, layout, fp8: np.dtype,
              scale_dtype: np.dtype) -> dict[str, jnp.ndarray]:
    """fp8 codes `x / s` and the scale `s` of each group, `s = max|x| / max_fp8`."""
    top = float(jnp.finfo(fp8).max)
    scale = round_up(jnp.maximum(hi, -lo) / top, scale_dtype)
    safe = jnp.where(scale > 0, scale.astype(jnp.float32), 1.0)
    return {"codes": (groups / layout.spread(safe)).astype(fp8), "scale": scale}


def int_codes(groups, lo, hi, broken, layout, *, bits: int, scale_dtype: np.dtype,
              square_grid: bool, salt: int | None, super_span: int) -> dict[str, jnp.ndarray]:
    """`bits`-bit codes (one per byte), scales and zero-point bytes of the groups of
    `layout` spanning `[lo, hi]` (per group, as `Layout.reduce` gives them); `broken`
    groups hold a NaN or Inf, `square_grid` lets the groups it suits take the square
    grid, `salt` (or None) seeds stochastic rounding, byte scales take a bfloat16 step
    per `super_span` elements."""
    spread = layout.spread
    top = 2**bits - 1
    half = 2 ** (bits - 1)
    zero, step = zero_point(lo, hi, top)
    # Groups holding a NaN or Inf keep code 0 for those and put the finite values
    # on the 2^b - 1 codes of a grid centred on zero; a negative scale marks them.
    zero = jnp.where(broken, half, zero)
    step = jnp.where(broken, jnp.maximum(hi, -lo) / (half - 1), step)
    if square_grid:
        # None negative, mean below a quarter of the largest: values s * c^2.
        # A NaN makes the sum NaN and the group broken; neither is square.
        total = layout.reduce(groups, jnp.zeros((), groups.dtype), lax.add)
        square = ~broken & (lo >= 0) & (hi > 0) & (4 * total < hi * layout.size)
        step = jnp.where(square, hi / top**2, step)
    # Quantize with the scale as stored, so unpack sees exactly what pack used: a
    # float scale rounded up (the grid still covers the group), a byte scale as
    # `byte_scales` chooses it.
    byte = scale_dtype == np.dtype(jnp.uint8)
    if byte:
        scale, largest, stored, floored = byte_scales(step, layout.axis, layout.size,
                                                      up=salt is not None, span=super_span)
        statistics = {"scale": scale, "super_scale": largest}
        # A group below 2^-16 of its super-group's largest step: a whole zero point
        # within the codes, so its values, far below the step, come back as zero
        # rather than a fraction of that step.
        zero = jnp.where(floored, jnp.clip(jnp.round(zero), 0, top), zero)
    else:
        scale = round_up(step, scale_dtype)
        stored = scale.astype(jnp.float32)
        statistics = {"scale": jnp.where(broken, -scale, scale)}
    ratio = groups * spread(1.0 / jnp.where(stored > 0, stored, 1.0))
    position = ratio + spread(zero)  # in [0, 2^b - 1]
    # One random byte per element: 8 bits of noise keep the rounding unbiased to
    # within 1/512 of a step, at a quarter of the temporary of float noise.
    noise = None if salt is None else (
        random_bytes(groups, salt).astype(jnp.float32) + 0.5) / 256
    rounded = jnp.round(position) if noise is None else jnp.floor(position + noise)
    if square_grid:
        rounded = jnp.where(spread(square), square_root_code(ratio, noise), rounded)
    codes = jnp.clip(rounded, spread(jnp.where(broken, 1, 0)), top)
    zero = encode_zero(zero, top)
    if square_grid:
        zero = jnp.where(square, SQUARE, zero)
    if byte:  # byte scales carry no sign: the zero point marks the group
        zero = jnp.where(broken, BROKEN, zero)
    # Code 0 for a NaN or Inf (its position is NaN or clipped to an end): an
    # elementwise select, fused into the codes' own computation.
    codes = jnp.where(jnp.isfinite(groups), codes, 0).astype(jnp.uint8)
    return {"codes": codes, **statistics, "zero": zero.astype(jnp.uint8)}


def int_values(codes, zero, scale, layout, bits: int, square_grid: bool) -> jnp.ndarray:
    """The float32 values of `int_codes`' codes (`layout.padded`), zero-point bytes and
    scales (per group); NaN where a broken group has code 0."""
    spread = layout.spread
    # NaN marks compare the integer codes: comparing their float copy instead
    # changes the TPU compiler's fusions (v5e, scan MLP int8: 0.79x plain's peak
    # against 0.69x).
    floats = codes.astype(jnp.float32)
    grid = floats - spread(decode_zero(zero, 2**bits - 1))
    if square_grid:
        grid = jnp.where(spread(zero == SQUARE), floats * floats, grid)
    values = grid * spread(jnp.abs(scale))
    broken = jnp.signbit(scale)
    if bits < 8:
        broken = broken | (zero == BROKEN)
    return jnp.where(spread(broken) & (codes == 0), jnp.nan, values)
