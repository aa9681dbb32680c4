"""`Remat`: store nothing, recompute in the backward."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .._info import ResidualInfo
from .._policy import Policy


@dataclasses.dataclass(frozen=True)
class Remat(Policy):
    """Stores nothing for the residuals it is chosen for; the backward recomputes them.

    Only the slice of the forward that produces those residuals is recomputed, from
    the nearest values that are stored, as `jax.checkpoint` recomputes from what its
    policy saves: the hooked function's inputs (for a scan body: its carry, slice and
    loop-invariant operands), residuals kept or packed (recomputed from their unpacked
    value), and the forward's other values that the policy does not also choose
    `Remat` for, which are stored for it (and reported by `residual.inspect` after the
    residuals). Each slice runs where the backward first needs it, so keeping
    something per layer recomputes layer by layer; whole-function `Remat()` recomputes
    from the inputs, like `jax.checkpoint` around the whole function, but never runs a
    loop again: a scan's body recomputes per iteration, and what a scan or a
    `while` computes is stored where a slice needs it. Gradients equal
    plain `jax.grad`'s when what is kept is stored as it is. Combined with
    `residual.policies.select`, it expresses what `jax.checkpoint` policies do (keep
    `dot_general` outputs, recompute the rest) and more: choices by scope, size, dtype
    or name, and values kept packed (int8 matmul outputs, the rest recomputed).

    Residuals that are inputs of the hooked function are kept: recomputing them is
    impossible and storing them costs nothing extra.

    Examples:
        >>> import jax, jax.numpy as jnp, residual
        >>> from residual import policies as rp
        >>> f = residual.with_hooks(lambda x: jnp.sum(jnp.tanh(jnp.sin(x))), policy=rp.Remat())
        >>> jax.grad(f)(jnp.ones(3)).shape
        (3,)
        >>> keep_dots = rp.select([(rp.where(primitive="dot_general"), rp.Identity())],
        ...                       default=rp.Remat())  # per layer: from each matmul output
        >>> mlp = residual.with_hooks(lambda w, x: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w)),
        ...                           policy=keep_dots)
        >>> jax.grad(mlp)(jnp.eye(2), jnp.ones((1, 2))).shape
        (2, 2)
    """

    recompute = True
    lossless = True

    def resolve(self, info: ResidualInfo) -> Policy | None:
        return None if info.is_input else self

    def pack(self, x: jnp.ndarray, info: ResidualInfo):
        raise TypeError("`Remat` stores nothing; `with_hooks` recomputes its residuals.")

    def unpack(self, packed, info: ResidualInfo) -> jnp.ndarray:
        raise TypeError("`Remat` stores nothing; `with_hooks` recomputes its residuals.")


@dataclasses.dataclass(frozen=True)
class RematWhereSmaller(Remat):
    """`Remat` where recomputing stores fewer bytes, else `instead`.

    Recomputing a residual can mean storing the values it is recomputed from (a
    `tanh` output recomputed from its matmul's output, which nothing else stores):
    where a slice of the forward would store at least as many bytes as the residuals
    it recomputes, those residuals are stored by `instead`. `recomputes_through`
    names the primitives it may run again (None: any); what another equation
    computes (a matmul, a whole scan) is stored, where the slice needs it, as the
    residuals it feeds.
    """

    instead: Policy = dataclasses.field(default_factory=Remat)
    recomputes_through: frozenset[str] | None = None

    def __repr__(self) -> str:  # the primitives are long and always the policy's own
        return f"RematWhereSmaller(instead={self.instead!r})"
