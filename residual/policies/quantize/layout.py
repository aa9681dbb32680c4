"""How a residual of any shape is cut into groups along one axis, and put back."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class Layout:
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
        """Codes packed into bytes together (`pack_codes`): a group when the groups run
        along the last axis, else the whole last axis."""
        padded = self.padded
        return self.size if self.axis == len(padded) - 1 else padded[-1]

    def to_padded(self, x: jnp.ndarray) -> jnp.ndarray:
        """The residual in `padded`'s shape: zeros appended to its last axis."""
        x = x.reshape(self.shape or (1,))
        if self.pad:
            x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, self.pad)])
        return x

    def from_padded(self, x: jnp.ndarray) -> jnp.ndarray:
        """The inverse of `to_padded`: the residual's own shape, padding dropped."""
        if self.pad:
            x = x[..., : x.shape[-1] - self.pad]
        return x.reshape(self.shape)

    def reduce(self, operands, inits, computation):
        """Each group's reduction of `padded`-shaped `operands` (an array or a tuple of
        them, as `lax.reduce_window`): `axis` divided by `size`, the other axes kept.

        A window over the values as they lie, never a reshape into `[..., n, size]`:
        a TPU tiles the two minor axes, and a group axis of 64 there fills half of
        each 128-lane tile, so the reshaped float takes twice its bytes.
        """
        ndim = len(self.padded)
        window = tuple(self.size if i == self.axis else 1 for i in range(ndim))
        return lax.reduce_window(operands, inits, computation, window, window, "VALID")

    def spread(self, statistic: jnp.ndarray) -> jnp.ndarray:
        """Each group's `statistic` (as `reduce` gives it) repeated over its elements."""
        # A broadcast and a reshape that keeps the sharding of `axis` (under explicit
        # mesh axes `jnp.repeat` asks for an output sharding).
        grouped = jnp.expand_dims(statistic, self.axis + 1)
        shape = list(grouped.shape)
        shape[self.axis + 1] = self.size
        return jnp.broadcast_to(grouped, shape).reshape(self.padded)


def layout_of(shape: tuple[int, ...], group_size: int) -> Layout:
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
        return Layout(shape, axis, group_size, 0)
    if last < group_size:
        for earlier in reversed(range(axis)):
            if dims[earlier] and dims[earlier] % group_size == 0:
                return Layout(shape, earlier, group_size, 0)
        return Layout(shape, axis, last, 0)
    count = -(-last // group_size)
    size = -(-last // count)
    return Layout(shape, axis, size, count * size - last)
