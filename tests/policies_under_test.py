"""Every kind of policy the library takes, for the shared contract in `test_policies.py`:
each built-in, plain `pack`/`unpack` hooks, a policy a user writes, and a saved plan."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

import residual
from residual import policies as rp
from residual._policy import FunctionHooks


def _negate(x):
    return -x


@dataclasses.dataclass(frozen=True)
class Half(residual.Policy):
    """A user's own policy, as the `Policy` docstring writes one: floats in float16."""

    def resolve(self, info):
        return self if jnp.issubdtype(info.dtype, jnp.floating) else None

    def pack(self, x, info):
        return x.astype(jnp.float16)

    def unpack(self, packed, info):
        return packed.astype(info.dtype)


# policy, relative gradient error bound on the small MLPs (0: bit-identical).
POLICIES = [
    (rp.Identity(), 0.0),
    (rp.Remat(), 1e-6),
    (rp.Offload(), 0.0),
    (rp.Profile(), 0.0),
    (rp.Cast(jnp.bfloat16), 1e-2),
    (rp.Quantize(bits=8, min_bytes=0), 1e-2),
    (rp.Quantize(bits=4, min_bytes=0), 2e-1),
    (rp.Quantize(bits=8, min_bytes=0, elementwise="recompute"), 1e-2),
    (rp.Quantize(bits=4, stochastic=True, min_bytes=0), 3e-1),
    (rp.Quantize(bits=2, min_bytes=0), 1.0),
    (rp.Quantize(format="fp8_e4m3", min_bytes=0), 1e-1),
    (rp.Quantize(format="fp8_e5m2", min_bytes=0), 2e-1),
    # Elementwise residuals recomputed where that stores less, the rest through the chain.
    (rp.Chain(rp.Quantize(bits=8, min_bytes=0, elementwise="recompute"), rp.Offload()), 1e-2),
    # Keeps the tanh outputs (the tanh MLPs save no `dot_general` output), recomputes the rest.
    (rp.select([(rp.where(primitive="tanh"), rp.Identity())], default=rp.Remat()), 1e-6),
    (rp.select([(rp.where(min_bytes=1024), rp.Quantize(bits=8, min_bytes=0))]), 1e-2),
    # What `with_hooks(f, pack, unpack)` makes of plain hooks: every array, inputs too.
    (FunctionHooks(_negate, _negate), 0.0),
    (Half(), 1e-2),
    # A plan as saved by `Plan.to_json` and loaded back: the residuals it does not list
    # are recomputed in scan bodies, stored as they are elsewhere.
    (residual.Plan.from_json(
        '{"format": "residual.Plan", "version": 1, "decisions": [], "recompute_scans": true}'),
     1e-6),
]
IDS = [repr(p)[:30] for p, _ in POLICIES]
