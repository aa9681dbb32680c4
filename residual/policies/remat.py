"""`Remat`: store nothing, recompute in the backward."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .._info import ResidualInfo
from .._policy import Policy


@dataclasses.dataclass(frozen=True)
class Remat(Policy):
    """Stores nothing for the residuals it is chosen for; the backward recomputes them.

    Only the slice of the forward that produces those residuals is recomputed, from the
    hooked function's inputs (for a scan body: its carry, slice and loop-invariant
    operands, as `jax.checkpoint` on the body would). Gradients equal plain
    `jax.grad`'s. Combined with `residual.policies.select`, it expresses what
    `jax.checkpoint` policies do (keep `dot_general` outputs, recompute the rest) and
    more: choices by scope, size, dtype or name.

    Residuals that are inputs of the hooked function are kept: recomputing them is
    impossible and storing them costs nothing extra.

    Examples:
        >>> import jax, jax.numpy as jnp, residual
        >>> from residual import policies as rp
        >>> f = residual.with_hooks(lambda x: jnp.sum(jnp.tanh(jnp.sin(x))), policy=rp.Remat())
        >>> jax.grad(f)(jnp.ones(3)).shape
        (3,)
    """

    recompute = True
    lossless = True

    def resolve(self, info: ResidualInfo) -> Policy | None:
        return None if info.is_input else self

    def pack(self, x: jnp.ndarray, info: ResidualInfo):
        raise TypeError("`Remat` stores nothing; `with_hooks` recomputes its residuals.")

    def unpack(self, packed, info: ResidualInfo) -> jnp.ndarray:
        raise TypeError("`Remat` stores nothing; `with_hooks` recomputes its residuals.")
