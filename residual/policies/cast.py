"""`Cast`: store residuals in a narrower floating-point dtype."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._info import ResidualInfo
from .._policy import Policy
from . import _fusion
from ._complex import from_parts, is_complex, part_dtype, parts
from ._defaults import worth_packing
from ._lanes import stored_shape
from .mask_bits import MASK_BITS


@dataclasses.dataclass(frozen=True)
class Cast(Policy):
    """Stores floating-point residuals in `dtype` and casts them back in the backward.

    `Cast(jnp.bfloat16)` halves the memory of float32 residuals with a relative error
    of about $2^{-8}$ per value; `jnp.float16` keeps more mantissa but overflows
    above 65504; the float8 dtypes quarter it with much larger error (prefer
    `Quantize(format="fp8_e4m3")`, which scales per group first). Residuals already
    as narrow as `dtype`, non-floating ones, those kept alive anyway (see
    `ResidualInfo.kept_alive`) and those already in host memory are stored unchanged;
    boolean masks (a ReLU's) are stored as bits beside the floats it casts
    (`MaskBits`).
    A complex residual is stored as its real and imaginary parts in `dtype`.

    In a program for a TPU (`elementwise="auto"`, the default), the residuals of
    elementwise chains (`tanh`, GELU's terms, a loss's `2 * x`) are recomputed in the
    backward from the values they are computed from, as the TPU compiler's fusion
    does, wherever that stores fewer bytes: cast one by one, each would be a stored
    array the compiler itself does not keep (an unrolled 8-layer GELU MLP, f32, batch
    4,096, on v5e: 1.83x plain's peak cast one by one, 0.98x recomputed).
    `elementwise="pack"` casts every residual, `"recompute"` recomputes them on every
    backend. In a program for one TPU, a residual whose minor axis leaves the chip's
    128-lane tiles part empty (attention heads of 64, 32 channels) is stored with its
    minor axes merged (`[batch, seq, 4, 64]` as `[batch, seq, 256]`), where plain
    `jax.grad` keeps it in its matmul's layout, unpadded (the unrolled flax NNX
    transformer, 32 sequences of 256 on v5e: 1.06x plain's peak with the heads
    padded 2x, 0.92x merged).

    Args:
        dtype: a floating-point dtype, e.g. `jnp.bfloat16`.
        elementwise: `"auto"` (recompute on a TPU, else cast), `"pack"` or
            `"recompute"`.

    Raises:
        TypeError: `dtype` is not a floating-point dtype, or `elementwise` not a string.
        ValueError: `elementwise` is not one of `"auto"`, `"pack"`, `"recompute"`.

    Examples:
        >>> import jax, jax.numpy as jnp, residual
        >>> from residual import policies as rp
        >>> loss = lambda x: jnp.sum(jnp.sin(x) ** 2)
        >>> f = residual.with_hooks(loss, policy=rp.Cast(jnp.bfloat16))
        >>> g = jax.grad(f)(jnp.linspace(0, 1, 4))
    """

    dtype: Any
    elementwise: str = "auto"

    def __post_init__(self):
        try:
            # `np.dtype(None)` is float64: a forgotten argument, not a choice.
            dtype = None if self.dtype is None else np.dtype(self.dtype)
        except TypeError:
            dtype = None
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"`Cast(dtype)` needs a floating-point dtype such as jnp.bfloat16, but got "
                f"{self.dtype!r}. To store integers or codes use `Quantize(bits=...)`."
            )
        object.__setattr__(self, "dtype", dtype)
        _fusion.check_elementwise(self.elementwise, auto="recomputes them on a TPU and "
                                  "casts them elsewhere")

    def resolve(self, info: ResidualInfo) -> Policy | None:
        if info.dtype == np.dtype(bool):
            return MASK_BITS.resolve(info)
        narrower = np.dtype(self.dtype).itemsize < part_dtype(info.dtype).itemsize
        if not (worth_packing(info) and narrower):
            return None
        return _fusion.resolved(self, info, _fusion.recomputes(self.elementwise,
                                                               auto=_fusion.for_a_tpu()))

    def pack(self, x: jnp.ndarray, info: ResidualInfo) -> jnp.ndarray:
        if is_complex(info):
            return parts(x).astype(self.dtype)
        return x.reshape(stored_shape(info)).astype(self.dtype)

    def unpack(self, packed: jnp.ndarray, info: ResidualInfo) -> jnp.ndarray:
        if is_complex(info):
            return from_parts(packed, info)
        return packed.astype(info.dtype).reshape(info.shape)
