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

from .._engine.ordering import in_device_memory, several_devices
from .._info import ResidualInfo
from .._policy import Policy, check_bool, check_int
from ._defaults import worth_packing

_FP8 = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
_FORMATS = ("int", *_FP8)
_BITS = (8, 4, 2)
_GRIDS = ("auto", "uniform")
# The zero-point byte of a group on the square grid: never a zero point (see
# `_encode_zero`).
_SQUARE = 255


@dataclasses.dataclass(frozen=True)
class Quantize(Policy):
    """Stores floating-point residuals as low-bit codes with a scale per group.

    Each residual is cut into groups of at most `group_size` consecutive elements
    along one axis: the last axis when `group_size` divides it; for a shorter last
    axis, an earlier axis that `group_size` divides (else one group per row); a
    longer one is cut into near-equal groups, padded with a few zeros. No scale ever
    spans the whole tensor, and codes keep the residual's layout (sharded
    activations stay sharded). With `format="int"`, a group spanning $[lo, hi]$ is
    stored as codes of the nearest of $2^b$ evenly spaced values $(c - z) s$ (affine
    quantization: a scale $s$ and a zero point $z$ per group), packed into
    `uint8`: one code per byte for `bits=8`, two for 4, four for 2. With 8-bit codes
    the grid spans $[\\min(lo, 0), \\max(hi, 0)]$ with zero among its values. At 4
    and 2 bits the grid spans about $[lo, hi]$ itself: the zero point may be a fraction
    of a code (1/8 at 4 bits) where the group has both signs, and lie beyond the codes
    where it has one sign and stays away from zero (a GELU's gate, `tanh` outputs
    near 1), so no value moves by more than about $(hi - lo) / (2 (2^b - 1))$ (more,
    at 4 bits, for a group farther from zero than 4 times its range). Groups
    reaching zero from one side (a causal mask, ReLU, probabilities) keep zero as a
    code: their zeros stay exactly zero. With an fp8 `format`,
    $x / s$ is stored in JAX's float8 dtype, $s = m / \\max_\\text{fp8}$.

    - Memory per element, float32 residual, group 64, float32 scales: int8 1.08 B
      (0.27x), int4 0.58 B (0.14x), 2-bit 0.33 B (0.08x), fp8 1.06 B.
    - Row statistics are stored as they are: a residual whose last axis has size 1,
      what a reduction with `keepdims=True` leaves (softmax row sums
      `[batch, heads, queries, 1]` from `jax.nn.softmax` and
      `jax.nn.dot_product_attention`, LayerNorm/RMSNorm statistics
      `[batch, tokens, 1]`). Each scales a whole row in the backward and they can
      span orders of magnitude across rows (causal row sums run from 1 to the
      sequence length), while they take `1 / row length` of the memory of the rows
      they summarize.
    - Non-finite values: scales only look at finite values, so a NaN or Inf never
      changes any other group. A group holding one is marked (negative scale),
      keeps code 0 for them and gives them back as NaN (an Inf comes back as NaN
      too: the gradient still shows the divergence at the same position); its
      finite values use the $2^b - 1$ codes of a grid centred on zero. fp8 keeps
      non-finite values as the fp8 dtype does (`e5m2` keeps Inf; `e4m3` has no Inf
      and gives NaN).
    - `grid="auto"` (the default; 4- and 2-bit codes): a group of values none of
      them negative whose mean is below a quarter of its largest, $m$ (softmax
      probabilities, `exp` outputs, squares, ReLU outputs: mostly small next to a
      few large ones), is stored on a square grid instead, values $s c^2$ for codes
      $c = 0 .. 2^b - 1$ with $s = m / (2^b - 1)^2$: steps grow from $s$ near zero to
      about $2m / (2^b - 1)$ at the top. For such a group that quarter is where the
      square grid's mean squared error, about $4 \bar{x} / m$ times the uniform
      grid's, drops below it. Zero stays a code, and the zero-point byte marks the
      group (255). `grid="uniform"` keeps every group on the evenly spaced grid;
      8-bit codes always use it.
    - `stochastic=True` (integer formats) rounds up with probability equal to the
      fractional part, so the dequantized value is unbiased. Each element's draw is a
      hash of its own bits, its position, `seed` and the residual's index: the same
      inputs give the same draws (reproducible), new activations give new draws (it
      varies from step to step), nobody threads keys through the model, and no shard
      of a sharded residual waits for another's.

    Built-in defaults: only floating-point residuals of at least `min_bytes` that are
    not kept alive anyway (`ResidualInfo.kept_alive`: weights, loop-invariant
    operands) and are not row statistics are quantized. Residuals already in host
    memory (offloaded by a `jax.checkpoint` policy inside the hooked function) are
    stored as they are: XLA does not compute on them there. To quantize and offload,
    chain the two in that order, `Chain(Quantize(...), Offload())`.

    Args:
        bits: 8, 4 or 2 for `format="int"`; 8 for fp8.
        format: `"int"`, `"fp8_e4m3"` or `"fp8_e5m2"`.
        group_size: the most elements one scale covers (default 64).
        stochastic: unbiased stochastic rounding instead of round-to-nearest.
        scale_dtype: `jnp.float32` or `jnp.bfloat16`.
        seed: base seed of stochastic rounding.
        min_bytes: residuals smaller than this (per iteration) are stored as they are:
            they cost little, and they are where quantization hurts most.
        grid: `"auto"` (a square grid for the groups it suits, 4- and 2-bit codes) or
            `"uniform"` (evenly spaced values only).

    Raises:
        TypeError: a field of the wrong type (`bits=4.0`, `stochastic="yes"`, `seed="a"`,
            `grid=None`; `True` is not an int here).
        ValueError: an unsupported `bits`, `format`, `group_size`, `scale_dtype` or `grid`.

    Examples:
        >>> import jax, jax.numpy as jnp, residual
        >>> from residual import policies as rp
        >>> f = residual.with_hooks(lambda x: jnp.sum(jnp.tanh(x) ** 2), policy=rp.Quantize(bits=8))
        >>> g = jax.grad(f)(jnp.linspace(-1, 1, 128))

        Softmax probabilities are mostly small: 4-bit codes on the square grid keep
        them closer than the uniform grid does.

        >>> p = jax.nn.softmax(2 * jax.random.normal(jax.random.key(0), (64, 256)))
        >>> info = residual.ResidualInfo(index=0, shape=p.shape, dtype=p.dtype)
        >>> def error(policy):
        ...     q = policy.unpack(policy.pack(p, info), info)
        ...     return float(jnp.linalg.norm(q - p) / jnp.linalg.norm(p))
        >>> error(rp.Quantize(bits=4)) < 0.8 * error(rp.Quantize(bits=4, grid="uniform"))
        True

    References:
        Chen et al., "ActNN: Reducing Training Memory Footprint via 2-Bit Activation
        Compressed Training", ICML 2021. Liu et al., "GACT: Activation Compressed
        Training for Generic Network Architectures", ICML 2022.
    """

    # `pack` reads its input in a `lax.cond` (the NaN-safe branch) and outside it.
    reads_twice = True

    bits: int = 8
    format: str = "int"
    group_size: int = 64
    stochastic: bool = False
    scale_dtype: Any = jnp.float32
    seed: int = 0
    min_bytes: int = 16384
    grid: str = "auto"

    def __post_init__(self):
        # Types first, each naming its field: a float `bits` or a string `seed` would
        # otherwise fail only inside a trace, in a JAX message that names neither.
        for label in ("bits", "group_size", "seed", "min_bytes"):
            minimum = {"group_size": 1, "min_bytes": 0}.get(label)
            value = check_int("Quantize", label, getattr(self, label), minimum=minimum)
            object.__setattr__(self, label, value)
        object.__setattr__(self, "stochastic", check_bool("Quantize", "stochastic",
                                                          self.stochastic))
        _check_format(self.format, self.bits)
        _check_grid(self.grid)
        if self.format != "int" and self.stochastic:
            raise ValueError(
                "`stochastic=True` is implemented for `format='int'`; fp8 rounds to nearest."
            )
        object.__setattr__(self, "scale_dtype", _checked_scale_dtype(self.scale_dtype))

    def resolve(self, info: ResidualInfo) -> Policy | None:
        if not worth_packing(info) or info.nbytes < self.min_bytes:
            return None
        return None if _is_row_statistic(info.shape) else self

    def pack(self, x: jnp.ndarray, info: ResidualInfo) -> dict[str, jnp.ndarray] | jnp.ndarray:
        if not in_device_memory(x):
            # Already offloaded (a `jax.checkpoint` offloading policy inside the hooked
            # function): XLA cannot compute on host memory, and the device holds none
            # of it to save. Stored as it is.
            return x
        layout = _layout(x.shape, self.group_size)
        groups = layout.split(x.astype(jnp.float32))
        salt = _salt(self.seed, info.index) if self.stochastic else None
        if several_devices([x]):
            # Each group's range and NaN check are its own: a predicate over the whole
            # residual would be an all-reduce across the devices, in every step.
            packed = self._codes(groups, *_finite_ranges(groups, layout.reduced), salt,
                                 layout.reduced)
        else:
            packed = self._pack_one_device(groups, salt, layout.reduced)
        # Codes keep the residual's layout (`[..., last]`, or `[..., last * bits / 8]`
        # bytes, the last axis padded to whole groups when it must be) and scales
        # its axes with the grouped one divided by the group size: under `jit` with
        # sharded activations they stay sharded like the residual. Merging axes (a
        # flat `(groups, group_size)` or a `ravel`) would make XLA's partitioner
        # replicate a residual sharded along its last axis (tensor parallelism).
        codes = packed.pop("codes").reshape(layout.padded)
        if self.format == "int":
            codes = _pack_codes(codes, self.bits, layout.block)
        return {"codes": codes, **{k: v.squeeze(layout.reduced) for k, v in packed.items()}}

    def _pack_one_device(self, groups, salt, axis):
        """Codes and statistics, with one check of the whole residual for NaN and Inf
        (cheaper than per group, and on one device no other device waits for it)."""
        # Plain max and min read the data directly: no float temporary the size of
        # the residual. An Inf shows in them, a NaN only mostly: XLA's CPU reductions
        # may skip one, depending on where it lies, so the clean branch checks again.
        hi = jnp.max(groups, axis=axis, keepdims=True, initial=-jnp.inf)
        lo = jnp.min(groups, axis=axis, keepdims=True, initial=jnp.inf)
        clean = jnp.all(jnp.isfinite(hi) & jnp.isfinite(lo))
        # The `cond` is the only other reader of `groups`: more readers outside it
        # let XLA schedule several residuals' reductions early and keep their floats
        # alive together (in scanned layers).
        fast = functools.partial(self._pack_clean, salt=salt, axis=axis)
        slow = functools.partial(self._pack_any, salt=salt, axis=axis)
        return _cond(clean, fast, slow, groups, lo, hi)

    # XLA allocates the buffers of both branches for the conditional as a whole: a
    # float the size of the residual computed in the NaN-safe branch would count in
    # every call, clean data included. Both branches compute their codes into the
    # conditional's output, and their other values are per-group statistics.

    def _pack_clean(self, groups, lo, hi, salt, axis):
        """No NaN or Inf seen by max and min: every code is a value, unless a sum,
        which no NaN escapes whatever the order of its additions, shows one after all."""
        exact = functools.partial(_finite_range, axis=axis)
        check = jnp.isfinite(jnp.sum(groups))  # a finite sum that overflows costs time only
        lo, hi, broken = _cond(check, _as_they_are, exact, groups, lo, hi)
        return self._codes(groups, lo, hi, broken, salt, axis)

    def _pack_any(self, groups, lo, hi, salt, axis):
        """Some values are NaN or Inf: scales from the finite ones, code 0 for the rest."""
        return self._codes(groups, *_finite_range(groups, lo, hi, axis), salt, axis)

    @property
    def _square_grid(self) -> bool:
        """Whether some groups may go on the square grid (a static choice)."""
        return self.format == "int" and self.bits < 8 and self.grid == "auto"

    def _codes(self, groups, lo, hi, broken, salt, axis) -> dict[str, jnp.ndarray]:
        """Codes and per-group scales (and zero points) for groups spanning `[lo, hi]`.

        `lo` and `hi` from the finite values, both with the group axis kept (size 1),
        `axis` that of the groups' elements; `broken` marks the groups holding a NaN
        or Inf.
        """
        if self.format != "int":
            top = float(jnp.finfo(_FP8[self.format]).max)
            scale = _round_up(jnp.maximum(hi, -lo) / top, self.scale_dtype)
            safe = jnp.where(scale > 0, scale.astype(jnp.float32), 1.0)
            return {"codes": (groups / safe).astype(_FP8[self.format]), "scale": scale}
        top = 2**self.bits - 1
        half = 2 ** (self.bits - 1)
        zero, step = _zero_point(lo, hi, top)
        # Groups holding a NaN or Inf keep code 0 for those and put the finite values
        # on the 2^b - 1 codes of a grid centred on zero; a negative scale marks them.
        zero = jnp.where(broken, half, zero)
        step = jnp.where(broken, jnp.maximum(hi, -lo) / (half - 1), step)
        if self._square_grid:
            # None negative, mean below a quarter of the largest: values s * c^2.
            # A NaN makes the sum NaN and the group broken; neither is square.
            total = jnp.sum(groups, axis=axis, keepdims=True)
            square = ~broken & (lo >= 0) & (hi > 0) & (4 * total < hi * groups.shape[axis])
            step = jnp.where(square, hi / top**2, step)
        # Quantize with the scale as stored (rounded up, so the grid still covers the
        # group), so unpack sees exactly what pack used.
        scale = _round_up(step, self.scale_dtype)
        stored = scale.astype(jnp.float32)
        ratio = groups / jnp.where(stored > 0, stored, 1.0)
        position = ratio + zero  # in [0, 2^b - 1]
        # One random byte per element: 8 bits of noise keep the rounding unbiased to
        # within 1/512 of a step, at a quarter of the temporary of float noise.
        noise = None if salt is None else (
            _random_bytes(groups, salt).astype(jnp.float32) + 0.5) / 256
        rounded = jnp.round(position) if noise is None else jnp.floor(position + noise)
        if self._square_grid:
            rounded = jnp.where(square, _square_root_code(ratio, noise), rounded)
        codes = jnp.clip(rounded, jnp.where(broken, 1, 0), top)
        zero = _encode_zero(zero, top)
        if self._square_grid:
            zero = jnp.where(square, _SQUARE, zero)
        # Code 0 for a NaN or Inf (its position is NaN or clipped to an end): an
        # elementwise select, fused into the codes' own computation.
        codes = jnp.where(jnp.isfinite(groups), codes, 0).astype(jnp.uint8)
        return {"codes": codes, "scale": jnp.where(broken, -scale, scale),
                "zero": zero.astype(jnp.uint8)}

    def unpack(self, packed: dict[str, jnp.ndarray], info: ResidualInfo) -> jnp.ndarray:
        if not isinstance(packed, dict):
            return packed  # stored as it is by `pack`: it was in host memory
        layout = _layout(info.shape, self.group_size)
        scale = jnp.expand_dims(packed["scale"].astype(jnp.float32), layout.reduced)
        if self.format != "int":
            values = layout.split(packed["codes"].astype(jnp.float32)) * scale
            return layout.merge(values).astype(info.dtype)
        size = math.prod(layout.padded)
        codes = layout.split(_unpack_codes(packed["codes"], self.bits, size, layout.block))
        zero = jnp.expand_dims(packed["zero"], layout.reduced)
        # NaN marks compare the integer codes: comparing their float copy instead
        # changes the TPU compiler's fusions (v5e, scan MLP int8: 0.79x plain's peak
        # against 0.69x).
        floats = codes.astype(jnp.float32)
        grid = floats - _decode_zero(zero, 2**self.bits - 1)
        if self._square_grid:
            grid = jnp.where(zero == _SQUARE, floats * floats, grid)
        values = grid * jnp.abs(scale)
        values = jnp.where(jnp.signbit(scale) & (codes == 0), jnp.nan, values)
        return layout.merge(values).astype(info.dtype)


def _check_format(code_format: Any, bits: int) -> None:
    """Raises unless `code_format` is one of `_FORMATS` and `bits` a width it stores."""
    _check_choice("format", code_format, _FORMATS)
    if code_format == "int" and bits not in _BITS:
        raise ValueError(
            f"`bits` must be one of {_BITS} for integer codes, but got {bits!r}. "
            "Codes are packed into bytes, so the width must divide 8."
        )
    if code_format != "int" and bits != 8:
        raise ValueError(
            f"`format={code_format!r}` stores 8 bits per element, but got bits="
            f"{bits!r}. Use `bits=8`, or `format='int'` for 4 or 2 bits."
        )


def _check_grid(grid: Any) -> None:
    """Raises unless `grid` is one of `_GRIDS`."""
    _check_choice("grid", grid, _GRIDS, ": 'auto' puts the groups it suits on a square "
                  "grid, 'uniform' keeps evenly spaced values")


def _check_choice(field: str, value: Any, choices: tuple[str, ...], why: str = "") -> None:
    """Raises unless `value`, the field `field`, is one of the strings `choices`."""
    if not isinstance(value, str):
        raise TypeError(
            f"`{field}` must be a string, one of {choices}, but got "
            f"{type(value).__name__}: {value!r}."
        )
    if value not in choices:
        raise ValueError(f"`{field}` must be one of {choices}, but got {value!r}{why}.")


def _checked_scale_dtype(scale_dtype: Any) -> np.dtype:
    """`scale_dtype` as a NumPy dtype; raises unless it is float32 or bfloat16."""
    try:
        scale = None if scale_dtype is None else np.dtype(scale_dtype)
    except TypeError:
        scale = None
    if scale is None:
        raise TypeError(
            f"`scale_dtype` must be a dtype, jnp.float32 or jnp.bfloat16, but got "
            f"{type(scale_dtype).__name__}: {scale_dtype!r}."
        )
    if scale not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
        raise ValueError(
            f"`scale_dtype` must be jnp.float32 or jnp.bfloat16, but got {scale_dtype!r}."
        )
    return scale


def _cond(pred, true_fun, false_fun, *operands):
    """`lax.cond` when tracing; eagerly, the branch itself (a `cond` of fresh branches
    would be compiled anew on every call)."""
    if isinstance(pred, jax.core.Tracer):
        return lax.cond(pred, true_fun, false_fun, *operands)
    return (true_fun if pred else false_fun)(*operands)


def _as_they_are(groups, lo, hi):
    """All values finite: the groups' ranges as they are, no group broken."""
    del groups
    return lo, hi, jnp.zeros_like(hi, dtype=bool)


def _finite_range(groups, lo, hi, axis):
    """Some values are NaN or Inf: the groups' ranges over their finite values and
    zero, and which groups hold a non-finite value.

    One reduction whose reducer skips non-finite values itself, reading `groups` as
    they are. XLA's CPU backend runs plain min and max reductions in kernels that
    take no fused producer, so `where(isfinite(groups), groups, 0)` before them
    would be a float temporary the size of the residual; and a NaN can escape them.
    """
    del lo, hi  # they saw the non-finite values

    def finite_or_zero(v):
        return jnp.where(jnp.isfinite(v), v, 0.0)

    def reducer(a, b):
        (a_lo, a_hi, a_bad), (b_lo, b_hi, b_bad) = a, b
        # `bad` stays non-finite once any value was.
        bad = jnp.where(jnp.isfinite(a_bad) & jnp.isfinite(b_bad), 0.0, jnp.nan)
        return (jnp.minimum(finite_or_zero(a_lo), finite_or_zero(b_lo)),
                jnp.maximum(finite_or_zero(a_hi), finite_or_zero(b_hi)), bad)

    zero = jnp.zeros((), groups.dtype)
    lo, hi, bad = lax.reduce((groups,) * 3, (zero,) * 3, reducer, (axis,))
    # XLA takes `zero` for the reducer's identity, which it is not: it may leave it
    # out, and a group of one element comes back as that element, reducer unapplied.
    # So the results are filtered once more.
    lo = jnp.minimum(finite_or_zero(lo), 0.0)
    hi = jnp.maximum(finite_or_zero(hi), 0.0)
    return tuple(jnp.expand_dims(v, axis) for v in (lo, hi, ~jnp.isfinite(bad)))


def _finite_ranges(groups, axis):
    """Each group's range over its finite values (`lo`, `hi`, the group axis kept),
    and which groups hold a NaN or Inf (`broken`); `lo = hi = 0` for a group with no
    finite value.

    One reduction whose reducer reads `groups` as they are and skips non-finite values
    itself: XLA's CPU backend runs plain min and max reductions in kernels that take
    no fused producer, so `where(isfinite(groups), groups, inf)` before them would be
    a float temporary the size of the residual; and a NaN can escape them.
    """

    def finite_or(v, other):
        return jnp.where(jnp.isfinite(v), v, other)

    def reducer(a, b):
        (a_lo, a_hi, a_bad), (b_lo, b_hi, b_bad) = a, b
        # `bad` stays non-finite once any value was.
        bad = jnp.where(jnp.isfinite(a_bad) & jnp.isfinite(b_bad), 0.0, jnp.nan)
        return (jnp.minimum(finite_or(a_lo, jnp.inf), finite_or(b_lo, jnp.inf)),
                jnp.maximum(finite_or(a_hi, -jnp.inf), finite_or(b_hi, -jnp.inf)), bad)

    inits = tuple(jnp.array(v, groups.dtype) for v in (jnp.inf, -jnp.inf, 0.0))
    lo, hi, bad = lax.reduce((groups,) * 3, inits, reducer, (axis,))
    # XLA may leave the identities out: a group of one element comes back as that
    # element, reducer unapplied. A group without a finite value has lo > hi.
    kept = jnp.isfinite(lo) & jnp.isfinite(hi)
    lo, hi = jnp.where(kept, lo, 0.0), jnp.where(kept, hi, 0.0)
    return tuple(jnp.expand_dims(v, axis) for v in (lo, hi, ~jnp.isfinite(bad) | ~kept))


def _is_row_statistic(shape: tuple[int, ...]) -> bool:
    """A trailing axis of size 1: what a reduction with `keepdims=True` leaves.

    Softmax row sums (`[batch, heads, queries, 1]`, from `jax.nn.softmax` and
    `jax.nn.dot_product_attention`) and normalization statistics (`[batch, tokens,
    1]`) each scale a whole row in the backward, and across rows they can span
    orders of magnitude (the causal row sums run from 1 to the sequence length). So
    `Quantize` stores them as they are: they take `1 / row length` of the memory of
    the rows they summarize.
    """
    return len(shape) >= 1 and shape[-1] == 1


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How a residual is cut into groups: `size` consecutive elements along `axis`.

    Only one axis is split (and the last one padded with zeros to whole groups when
    it must be), never merged with another: a residual sharded along any axis keeps
    its groups, scales and codes on the devices that hold it.
    """

    shape: tuple[int, ...]  # the residual's shape
    axis: int  # the axis the groups run along, in `padded`
    size: int  # elements per group
    pad: int  # zeros added at the end of the last axis

    @property
    def padded(self) -> tuple[int, ...]:
        """The codes' shape: the residual's, with the padding (a scalar as `(1,)`)."""
        shape = self.shape or (1,)
        return (*shape[:-1], shape[-1] + self.pad)

    @property
    def block(self) -> int:
        """Codes packed into bytes together (`_pack_codes`): a group when the groups run
        along the last axis, else the whole last axis."""
        padded = self.padded
        return self.size if self.axis == len(padded) - 1 else padded[-1]

    @property
    def reduced(self) -> int:
        """The axis of `split`'s result that holds one group's elements."""
        return self.axis + 1

    def split(self, x: jnp.ndarray) -> jnp.ndarray:
        """`x` (the residual, or the codes: `padded`'s size) with `axis` split in groups."""
        shape = self.padded
        if x.size != math.prod(shape):  # the residual itself, to be padded
            x = x.reshape(self.shape or (1,))
            x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, self.pad)])
        n = shape[self.axis] // self.size
        return x.reshape(*shape[: self.axis], n, self.size, *shape[self.axis + 1 :])

    def merge(self, groups: jnp.ndarray) -> jnp.ndarray:
        """The inverse of `split`: the residual's own shape, padding dropped."""
        x = groups.reshape(self.padded)
        if self.pad:
            x = x[..., : x.shape[-1] - self.pad]
        return x.reshape(self.shape)


def _layout(shape: tuple[int, ...], group_size: int) -> _Layout:
    """Groups of at most `group_size` elements along one axis, for any shape.

    - The last axis, in groups of `group_size`, when it divides the axis (the usual
      case: hidden sizes, heads, sequence lengths).
    - A last axis shorter than a group (`[batch, seq, 3]`): an earlier axis that
      `group_size` divides, if any, else one group per row.
    - A longer last axis that `group_size` does not divide (`197` tokens, a `1000`
      class vocabulary): cut into as few near-equal groups as fit in `group_size`,
      the axis padded with fewer zeros than there are groups.

    So a scale never spans more than `group_size` values, and never the whole tensor.
    """
    shape = tuple(shape)
    dims = shape or (1,)
    last, axis = dims[-1], len(dims) - 1
    if last % group_size == 0:
        return _Layout(shape, axis, group_size, 0)
    if last < group_size:
        for earlier in reversed(range(axis)):
            if dims[earlier] and dims[earlier] % group_size == 0:
                return _Layout(shape, earlier, group_size, 0)
        return _Layout(shape, axis, last, 0)
    count = -(-last // group_size)
    size = -(-last // count)
    return _Layout(shape, axis, size, count * size - last)


def _zero_point(lo: jnp.ndarray, hi: jnp.ndarray, top: int):
    """The zero point `z` and the step `s` of the grid `(c - z) * s`, codes `c = 0..top`,
    that holds `[lo, hi]` with the least step.

    Affine quantization (as PyTorch's and TFLite's integer kernels). 8-bit codes take
    an integer `0 <= z <= top`: zero is a code. Below 8 bits `z` is one of the
    values `_encode_zero` stores in a byte: fractions of a code within the codes
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
# `_POSITIVE`: 191..253); 255 is `_SQUARE`.
_BEYOND = 63
_NEGATIVE = 128
_POSITIVE = _NEGATIVE + _BEYOND


def _fractions(top: int) -> int:
    return _NEGATIVE // (top + 1)


def _encode_zero(zero: jnp.ndarray, top: int) -> jnp.ndarray:
    """The byte of a zero point from `_zero_point`."""
    if top == 255:
        return zero.astype(jnp.uint8)
    within = (zero >= 0) & (zero < top + 1)
    byte = jnp.where(within, jnp.round(zero * _fractions(top)),
                     jnp.where(zero < 0, _NEGATIVE - 1 - zero, _POSITIVE - 1 + zero - top))
    return byte.astype(jnp.uint8)


def _decode_zero(byte: jnp.ndarray, top: int) -> jnp.ndarray:
    """The zero point (float32) of an `_encode_zero` byte."""
    value = byte.astype(jnp.float32)
    if top == 255:
        return value
    return jnp.where(value < _NEGATIVE, value / _fractions(top),
                     jnp.where(value < _POSITIVE, _NEGATIVE - 1 - value,
                               top + 1 + value - _POSITIVE))


def _square_root_code(ratio: jnp.ndarray, noise: jnp.ndarray | None) -> jnp.ndarray:
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


def _round_up(value: jnp.ndarray, dtype: np.dtype) -> jnp.ndarray:
    """`value` in `dtype`, never rounded below it (a grid must still cover its group)."""
    stored = value.astype(dtype)
    if stored.dtype == value.dtype:
        return stored
    return jnp.where(stored.astype(value.dtype) < value,
                     jnp.nextafter(stored, jnp.asarray(jnp.inf, dtype)), stored)


def _pack_codes(codes: jnp.ndarray, bits: int, block: int) -> jnp.ndarray:
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


def _unpack_codes(packed: jnp.ndarray, bits: int, size: int, block: int) -> jnp.ndarray:
    """Codes from `_pack_codes`: `[..., last]` along the last axis, or flat."""
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


def _salt(seed: int, index: int) -> int:
    """What tells apart the draws of two residuals, or of two seeds."""
    return (seed * 0x9E3779B1 + index * 0x85EBCA77 + 0x165667B1) % 2**32


def _random_bytes(values: jnp.ndarray, salt: int) -> jnp.ndarray:
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
