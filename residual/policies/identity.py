"""`Identity`: store the residual as it is."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .._info import ResidualInfo
from .._policy import Policy


@dataclasses.dataclass(frozen=True)
class Identity(Policy):
    """Stores every residual unchanged: `pack` and `unpack` are the identity.

    Gradients are plain `jax.grad`'s, from the same operations: bit-identical run one
    operation at a time, but in loops and `lax.cond` (docs/limitations.md); compiled,
    XLA may sum a reduction in another order, a difference in the last bits. The compiled program
    stores what plain `jax.grad`'s does. Useful as the "keep" branch of `select`, and
    as a baseline.

    Examples:
        >>> import jax, jax.numpy as jnp, residual
        >>> from residual import policies as rp
        >>> f = residual.with_hooks(lambda x: jnp.sum(jnp.sin(x)), policy=rp.Identity())
        >>> jax.grad(f)(jnp.zeros(2))
        Array([1., 1.], dtype=float32)
    """

    lossless = True

    def resolve(self, info: ResidualInfo) -> Policy | None:
        return None  # stored as it is: nothing to pack

    def pack(self, x: jnp.ndarray, info: ResidualInfo) -> jnp.ndarray:
        return x

    def unpack(self, packed: jnp.ndarray, info: ResidualInfo) -> jnp.ndarray:
        return packed
