"""`Quantize`: store residuals as 8-, 4- or 2-bit integer codes, or fp8, with per-group scales."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._info import ResidualInfo
from .._plans import in_device_memory
from .._policy import Policy, check_bool, check_int
from ._defaults import worth_packing

_FP8 = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
_FORMATS = ("int", *_FP8)
_BITS = (8, 4, 2)


@dataclasses.dataclass(frozen=True)
class Quantize(Policy):
    """Stores floating-point residuals as low-bit codes with one absmax scale per group.

    Each residual is cut into groups of `group_size` consecutive elements along its
    last axis (one group for the whole tensor when the last axis is not a multiple of
    `group_size`). With `format="int"`, a group with largest finite magnitude $m$ (its
    absmax scale) is stored as codes of the nearest of $2^b$ evenly spaced values from
    $-m$ to $m$, packed into `uint8`: one code per byte for `bits=8`, two for 4, four
    for 2. With an fp8 `format`, $x / s$ is stored in JAX's float8 dtype,
    $s = m / \\max_\\text{fp8}$.

    - Memory per element, float32 residual, group 64, float32 scales: int8 1.06 B
      (0.27x), int4 0.56 B (0.14x), 2-bit 0.31 B (0.08x), fp8 1.06 B.
    - Non-finite values: scales only look at finite values, so a NaN or Inf never
      changes any other group. A group holding one is marked (negative scale),
      keeps code 0 for them and gives them back as NaN (an Inf comes back as NaN
      too: the gradient still shows the divergence at the same position); its
      finite values use the $2^b - 1$ codes around zero. fp8 keeps non-finite values
      as the fp8 dtype does (`e5m2` keeps Inf; `e4m3` has no Inf and gives NaN).
    - `stochastic=True` (integer formats) rounds up with probability equal to the
      fractional part, so the dequantized value is unbiased. Its random key comes
      from `seed`, the residual's index and a cheap hash of the residual's bits: the
      same inputs give the same draws (reproducible), new activations give new draws
      (it varies from step to step), and nobody threads keys through the model.

    Built-in defaults: only floating-point residuals of at least `min_bytes` that are
    not kept alive anyway (`ResidualInfo.kept_alive`: weights, loop-invariant
    operands) are quantized. Residuals already in host memory (offloaded by a
    `jax.checkpoint` policy inside the hooked function) are stored as they are: XLA
    does not compute on them there. To quantize and offload, chain the two in that
    order, `Chain(Quantize(...), Offload())`.

    Args:
        bits: 8, 4 or 2 for `format="int"`; 8 for fp8.
        format: `"int"`, `"fp8_e4m3"` or `"fp8_e5m2"`.
        group_size: elements per scale along the last axis (default 64).
        stochastic: unbiased stochastic rounding instead of round-to-nearest.
        scale_dtype: `jnp.float32` or `jnp.bfloat16`.
        seed: base seed of stochastic rounding.
        min_bytes: residuals smaller than this (per iteration) are stored as they are:
            they cost little, and they are where quantization hurts most (the
            statistics of a normalization, `[batch, 1]`, quantized as one group, made
            int4 training diverge in `benchmarks/quality.py`).

    Raises:
        TypeError: a field of the wrong type (`bits=4.0`, `stochastic="yes"`, `seed="a"`;
            `True` is not an int here).
        ValueError: an unsupported `bits`, `format`, `group_size` or `scale_dtype`.

    Examples:
        >>> import jax, jax.numpy as jnp, residual
        >>> from residual import policies as rp
        >>> f = residual.with_hooks(lambda x: jnp.sum(jnp.tanh(x) ** 2), policy=rp.Quantize(bits=8))
        >>> g = jax.grad(f)(jnp.linspace(-1, 1, 128))

    References:
        Chen et al., "ActNN: Reducing Training Memory Footprint via 2-Bit Activation
        Compressed Training", ICML 2021. Liu et al., "GACT: Activation Compressed
        Training for Generic Network Architectures", ICML 2022.
    """

    bits: int = 8
    format: str = "int"
    group_size: int = 64
    stochastic: bool = False
    scale_dtype: Any = jnp.float32
    seed: int = 0
    min_bytes: int = 16384

    def __post_init__(self):
        # Types first, each naming its field: a float `bits` or a string `seed` would
        # otherwise fail only inside a trace, in a JAX message that names neither.
        for label in ("bits", "group_size", "seed", "min_bytes"):
            minimum = {"group_size": 1, "min_bytes": 0}.get(label)
            value = check_int("Quantize", label, getattr(self, label), minimum=minimum)
            object.__setattr__(self, label, value)
        object.__setattr__(self, "stochastic", check_bool("Quantize", "stochastic",
                                                          self.stochastic))
        if not isinstance(self.format, str):
            raise TypeError(
                f"`format` must be a string, one of {_FORMATS}, but got "
                f"{type(self.format).__name__}: {self.format!r}."
            )
        if self.format not in _FORMATS:
            raise ValueError(
                f"`format` must be one of {_FORMATS}, but got {self.format!r}."
            )
        if self.format == "int" and self.bits not in _BITS:
            raise ValueError(
                f"`bits` must be one of {_BITS} for integer codes, but got {self.bits!r}. "
                "Codes are packed into bytes, so the width must divide 8."
            )
        if self.format != "int" and self.bits != 8:
            raise ValueError(
                f"`format={self.format!r}` stores 8 bits per element, but got bits="
                f"{self.bits!r}. Use `bits=8`, or `format='int'` for 4 or 2 bits."
            )
        if self.format != "int" and self.stochastic:
            raise ValueError(
                "`stochastic=True` is implemented for `format='int'`; fp8 rounds to nearest."
            )
        try:
            scale = None if self.scale_dtype is None else np.dtype(self.scale_dtype)
        except TypeError:
            scale = None
        if scale is None:
            raise TypeError(
                f"`scale_dtype` must be a dtype, jnp.float32 or jnp.bfloat16, but got "
                f"{type(self.scale_dtype).__name__}: {self.scale_dtype!r}."
            )
        if scale not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
            raise ValueError(
                f"`scale_dtype` must be jnp.float32 or jnp.bfloat16, but got {self.scale_dtype!r}."
            )
        object.__setattr__(self, "scale_dtype", scale)

    def resolve(self, info: ResidualInfo) -> Policy | None:
        return self if worth_packing(info) and info.nbytes >= self.min_bytes else None

    def pack(self, x: jnp.ndarray, info: ResidualInfo) -> dict[str, jnp.ndarray] | jnp.ndarray:
        if not in_device_memory(x):
            # Already offloaded (a `jax.checkpoint` offloading policy inside the hooked
            # function): XLA cannot compute on host memory, and the device holds none
            # of it to save. Stored as it is.
            return x
        groups = _grouped(x.astype(jnp.float32), self.group_size)
        # Plain max and min read the data directly: no float temporary the size of
        # the residual (an absmax over `where(isfinite, abs, 0)` is one, on CPU).
        # A NaN or Inf shows in them; only then does the slower exact path run.
        hi = jnp.max(groups, axis=-1, initial=-jnp.inf)
        lo = jnp.min(groups, axis=-1, initial=jnp.inf)
        clean = jnp.isfinite(hi) & jnp.isfinite(lo) | (groups.shape[-1] == 0)
        # The key, not the noise, goes into the `cond`: an operand the size of the
        # residual would be materialized whole.
        key = _key(self.seed, info.index, x) if self.stochastic else None
        fast = functools.partial(self._pack_clean, key=key)
        slow = functools.partial(self._pack_any, key=key)
        pred, absmax = jnp.all(clean), jnp.maximum(hi, -lo)
        if isinstance(pred, jax.core.Tracer):
            codes, scale = lax.cond(pred, fast, slow, groups, absmax)
        else:  # eager: a `cond` of these fresh branches would be compiled anew per call
            codes, scale = (fast if pred else slow)(groups, absmax)
        # Codes keep the residual's layout (`[..., last]`, or `[..., last * bits / 8]`
        # bytes) and scales its leading axes (`[..., groups]`): under `jit` with
        # sharded activations they stay sharded like the residual. Merging axes (a
        # flat `(groups, group_size)` or a `ravel`) would make XLA's partitioner
        # replicate a residual sharded along its last axis (tensor parallelism).
        codes = codes.reshape(_codes_shape(x.shape, self.group_size))
        if self.format == "int":
            codes = _pack_codes(codes, self.bits)
        return {"codes": codes, "scale": scale}

    def _pack_clean(self, groups, absmax, key):
        """All values finite: every code is a value."""
        return self._codes(groups, absmax, jnp.zeros_like(absmax, dtype=bool), key)

    def _pack_any(self, groups, absmax, key):
        """Some values are NaN or Inf: scales from the finite ones, code 0 for the rest."""
        finite = jnp.isfinite(groups)
        absmax = jnp.max(jnp.where(finite, jnp.abs(groups), 0.0), axis=-1, initial=0.0)
        codes, scale = self._codes(groups, absmax, ~jnp.all(finite, axis=-1), key)
        if self.format == "int":
            codes = jnp.where(finite, codes, jnp.uint8(0))
        return codes, scale

    def _codes(self, groups, absmax, broken, key):
        if self.format != "int":
            top = float(jnp.finfo(_FP8[self.format]).max)
            scale = (absmax / top).astype(self.scale_dtype)
            safe = jnp.where(scale > 0, scale.astype(jnp.float32), 1.0)[..., None]
            return (groups / safe).astype(_FP8[self.format]), scale
        half = 2 ** (self.bits - 1)
        # Clean groups use all 2^b codes, on an even grid from -m to m. Groups holding
        # a NaN or Inf keep code 0 for those and put the finite values on the 2^b - 1
        # codes of a grid through zero; a negative scale marks them.
        steps = jnp.where(broken, half - 1, half - 0.5)
        # Quantize with the scale as stored, so unpack sees exactly what pack used.
        scale = (absmax / steps).astype(self.scale_dtype)
        step = scale.astype(jnp.float32)
        safe = jnp.where(step > 0, step, 1.0)[..., None]
        offset = jnp.where(broken, 0.0, half - 0.5)[..., None]
        position = groups / safe + offset  # in [-(half - 1), half - 1] or [0, 2^b - 1]
        if key is None:
            rounded = jnp.round(position)
        else:
            # One random byte per element: 8 bits of noise keep the rounding unbiased
            # to within 1/512 of a step, at a quarter of the temporary of float noise.
            bits = _random_bytes(key, position.shape)
            rounded = jnp.floor(position + (bits.astype(jnp.float32) + 0.5) / 256)
        low = jnp.where(broken, 1 - half, 0)[..., None]
        high = jnp.where(broken, half - 1, 2 * half - 1)[..., None]
        codes = jnp.clip(rounded, low, high) + jnp.where(broken, half, 0)[..., None]
        # NaN codes (non-finite inputs) become 0 in `_pack_any`; cast them safely here.
        codes = jnp.where(jnp.isnan(codes), 0, codes).astype(jnp.uint8)
        return codes, jnp.where(broken, -scale, scale)

    def unpack(self, packed: dict[str, jnp.ndarray], info: ResidualInfo) -> jnp.ndarray:
        if not isinstance(packed, dict):
            return packed  # stored as it is by `pack`: it was in host memory
        scale = packed["scale"].astype(jnp.float32)[..., None]
        shape = _group_shape(info.shape, self.group_size)
        if self.format != "int":
            values = packed["codes"].reshape(shape).astype(jnp.float32) * scale
            return values.reshape(info.shape).astype(info.dtype)
        half = 2 ** (self.bits - 1)
        broken = jnp.signbit(scale)
        codes = _unpack_codes(packed["codes"], self.bits, info.size).reshape(shape)
        position = codes.astype(jnp.float32) - jnp.where(broken, half, half - 0.5)
        values = position * jnp.abs(scale)
        values = jnp.where(broken & (codes == 0), jnp.nan, values)
        return values.reshape(info.shape).astype(info.dtype)


def _splits_last_axis(shape: tuple[int, ...], group_size: int) -> bool:
    return len(shape) >= 1 and shape[-1] % group_size == 0 and math.prod(shape) > 0


def _group_shape(shape: tuple[int, ...], group_size: int) -> tuple[int, ...]:
    """`[..., last // group_size, group_size]`, or `(1, size)`: one group for the tensor.

    Only the last axis is split, never merged with others: a residual sharded along
    any axis keeps its groups, scales and codes on the devices that hold it.
    """
    if _splits_last_axis(shape, group_size):
        return (*shape[:-1], shape[-1] // group_size, group_size)
    return (1, math.prod(shape))


def _grouped(x: jnp.ndarray, group_size: int) -> jnp.ndarray:
    return x.reshape(_group_shape(x.shape, group_size))


def _codes_shape(shape: tuple[int, ...], group_size: int) -> tuple[int, ...]:
    """The residual's own shape, or one flat axis for the per-tensor fallback."""
    return tuple(shape) if _splits_last_axis(shape, group_size) else (math.prod(shape),)


def _pack_codes(codes: jnp.ndarray, bits: int) -> jnp.ndarray:
    """Packs `8 // bits` codes per byte, little end first, along the last axis.

    Along the last axis when its length is a multiple of `8 // bits` (no axis is
    merged, so sharded codes stay sharded); flattened and padded otherwise.
    """
    per_byte = 8 // bits
    if per_byte == 1:
        return codes
    if codes.ndim < 1 or codes.shape[-1] % per_byte:
        codes = jnp.pad(codes.ravel(), (0, -codes.size % per_byte))
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    shifts = jnp.arange(per_byte, dtype=jnp.uint8) * jnp.uint8(bits)
    return jnp.bitwise_or.reduce(grouped << shifts, axis=-1).astype(jnp.uint8)


def _unpack_codes(packed: jnp.ndarray, bits: int, size: int) -> jnp.ndarray:
    """Codes from `_pack_codes`: `[..., last]` along the last axis, or flat."""
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    shifts = jnp.arange(per_byte, dtype=jnp.uint8) * jnp.uint8(bits)
    mask = jnp.uint8(2**bits - 1)
    codes = (packed[..., None] >> shifts) & mask
    codes = codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)
    return codes if codes.size == size else codes.reshape(-1)[:size]


def _random_bytes(key: jax.Array, shape: tuple[int, ...]) -> jnp.ndarray:
    """Uniform random bytes, four from each 32-bit word the generator makes."""
    n = math.prod(shape)
    words = jax.random.bits(key, (-(-n // 4),), jnp.uint32)
    return lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)[:n].reshape(shape)


def _key(seed: int, index: int, x: jnp.ndarray) -> jax.Array:
    """A key that is the same for the same data and differs for new activations."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    digest = jnp.sum(bits * _odd_weights(bits.shape), dtype=jnp.uint32)
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), index), digest)


def _odd_weights(shape: tuple[int, ...]) -> jnp.ndarray:
    # Position-dependent odd multipliers, so permuted data hashes differently.
    n = math.prod(shape)
    return (jnp.arange(n, dtype=jnp.uint32) * jnp.uint32(2654435761) | jnp.uint32(1)).reshape(shape)
