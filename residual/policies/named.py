"""Built-in policies by short name: the words plans store and the command line takes."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp

from .._policy import Policy
from .cast import Cast
from .offload import Offload
from .quantize import Quantize
from .remat import Remat

NAMED: dict[str, Callable[[], Policy]] = {
    "bf16": lambda: Cast(jnp.bfloat16),
    "int8": lambda: Quantize(bits=8),
    "int4": lambda: Quantize(bits=4),
    "int2": lambda: Quantize(bits=2),
    "fp8": lambda: Quantize(format="fp8_e4m3"),
    "remat": Remat,
    "offload": Offload,
}


def named(name: str) -> Policy:
    """The built-in policy called `name` (a key of `NAMED`)."""
    return NAMED[name]()
