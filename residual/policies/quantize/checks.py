"""Quantize's arguments, checked as the policy is built: each error names its field."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from ..._policy import check_choice

FP8 = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
FORMATS = ("int", *FP8)
BITS = (8, 4, 2)
GRIDS = ("auto", "uniform")


def check_format(code_format: Any, bits: int) -> None:
    """Raises unless `code_format` is one of `FORMATS` and `bits` a width it stores."""
    check_choice("format", code_format, FORMATS)
    if code_format == "int" and bits not in BITS:
        raise ValueError(
            f"`bits` must be one of {BITS} for integer codes, but got {bits!r}. "
            "Codes are packed into bytes, so the width must divide 8."
        )
    if code_format != "int" and bits != 8:
        raise ValueError(
            f"`format={code_format!r}` stores 8 bits per element, but got bits="
            f"{bits!r}. Use `bits=8`, or `format='int'` for 4 or 2 bits."
        )


def check_grid(grid: Any) -> None:
    """Raises unless `grid` is one of `GRIDS`."""
    check_choice("grid", grid, GRIDS, ": 'auto' puts the groups it suits on a square "
                  "grid, 'uniform' keeps evenly spaced values")


def checked_scale_dtype(scale_dtype: Any) -> np.dtype:
    """`scale_dtype` as a NumPy dtype; raises unless it is float32, bfloat16 or uint8."""
    try:
        scale = None if scale_dtype is None else np.dtype(scale_dtype)
    except TypeError:
        scale = None
    if scale is None:
        raise TypeError(
            f"`scale_dtype` must be a dtype, jnp.float32, jnp.bfloat16 or jnp.uint8, but got "
            f"{type(scale_dtype).__name__}: {scale_dtype!r}."
        )
    if scale not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.uint8)):
        raise ValueError(
            f"`scale_dtype` must be jnp.float32, jnp.bfloat16 or jnp.uint8, but got "
            f"{scale_dtype!r}."
        )
    return scale


def check_byte_scales(scale_dtype: np.dtype, code_format: str, bits: int) -> None:
    """Raises for byte scales (`jnp.uint8`) on codes other than 4- and 2-bit integers."""
    if scale_dtype == np.dtype(jnp.uint8) and (code_format != "int" or bits == 8):
        raise ValueError(
            "`scale_dtype=jnp.uint8` (byte scales under a bfloat16 scale per 128 values) "
            f"is for 4- and 2-bit integer codes, but got format={code_format!r}, "
            f"bits={bits!r}. Use jnp.float32 or jnp.bfloat16 scales, or format='int' "
            "with bits=4 or 2."
        )
