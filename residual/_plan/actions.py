"""The actions a plan chooses from, by name, and the policy that carries out each."""

from __future__ import annotations

import functools

from .._policy import Policy
from .._target import Target, resolve
from ..policies.named import named

# The actions a plan may choose, by the name plans store (JSON stays readable and stable).
ACTIONS = ("keep", "bf16", "int8", "int4", "remat", "offload")
LOSSLESS = {"keep", "remat", "offload"}

# Residuals smaller than this (per iteration) are kept: they cost little to store, and
# they are where quantization hurts most (the built-in `Quantize` default).
MIN_BYTES = 16384

# Round-trip error of each lossy action when no values are at hand (arguments given as
# `jax.ShapeDtypeStruct`): relative RMS error on Gaussian data, `Quantize`'s default
# groups (int8: 64, float32 scales; int4: 32, byte scales).
NOMINAL_ERROR = {"bf16": 1.2e-3, "int8": 5.5e-3, "int4": 7.9e-2}


@functools.cache
def policy_of(action: str) -> Policy | None:
    """The policy value that carries out `action` (`None` stores the residual as it is)."""
    return None if action == "keep" else named(action)


def offload_available(where: Target | None = None) -> bool:
    """Whether the default device (or the target's) has host memory apart from its own
    (not on CPU)."""
    device = (where or resolve(None)).devices[0]
    kinds = [m.kind for m in device.addressable_memories()]
    return device.platform != "cpu" and "pinned_host" in kinds
