"""How a residual of any shape is cut into groups along one axis, and put back."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp


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
