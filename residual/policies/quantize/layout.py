"""How a residual of any shape is cut into groups along one axis, and put back."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from .._lanes import LANES


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
    windows: bool = False  # reduce over windows of the values as they lie (TPU)
    whole_axis: bool = False  # with windows, a group as long as the last axis: reduce over it

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

    def group(self, x: jnp.ndarray) -> jnp.ndarray:
        """The residual as `reduce` and `spread` see it: in `padded`'s shape, and with
        `axis` split into `[n, size]` groups unless `windows`."""
        x = x.reshape(self.shape or (1,))
        if self.pad:
            x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, self.pad)])
        return x if self.windows else x.reshape(self._split)

    def regroup(self, codes: jnp.ndarray) -> jnp.ndarray:
        """Codes (of `padded`'s size) as `group` gives the values."""
        return codes.reshape(self.padded if self.windows else self._split)

    def ungroup(self, values: jnp.ndarray) -> jnp.ndarray:
        """The inverse of `group`: the residual's own shape, padding dropped."""
        x = values.reshape(self.padded)
        if self.pad:
            x = x[..., : x.shape[-1] - self.pad]
        return x.reshape(self.shape)

    def reduce(self, operands, inits, computation):
        """Each group's reduction of `group`'s values (an array or a tuple of them, as
        `lax.reduce`): one value per group, the group axis kept (size 1) unless `windows`.

        With `windows`, a window over the values as they lie, never a reshape into
        `[..., n, size]`: a TPU tiles the two minor axes, and a group axis of 64 there
        fills half of each 128-lane tile, so the reshaped float takes twice its bytes.
        Elsewhere the reshape is free, and XLA:CPU and XLA:GPU fuse the grouped
        computation better (an H100 transformer's int8 peak, 0.37x plain's against
        0.44x by windows). With `whole_axis`, a group as long as the last axis is
        reduced over it: a window that wide leaves a minor axis of 1, which a TPU pads
        to 128 lanes.
        """
        if self._whole:
            # The flax Linen CNN's 32 channels in groups of 32, byte scales, on v5e:
            # int4 1.45x plain's peak reduced over the axis, 4.47x over windows, whose
            # statistics are padded 128x (`Quantize` asks for it with byte scales only).
            if isinstance(operands, tuple):
                reduced = lax.reduce(operands, inits, computation, (self.axis,))
                return tuple(jnp.expand_dims(r, self.axis) for r in reduced)
            inits = jnp.asarray(inits, operands.dtype)
            return jnp.expand_dims(lax.reduce(operands, inits, computation, (self.axis,)),
                                   self.axis)
        if self.windows:
            ndim = len(self.padded)
            window = tuple(self.size if i == self.axis else 1 for i in range(ndim))
            return lax.reduce_window(operands, inits, computation, window, window, "VALID")
        axis = self.axis + 1
        if isinstance(operands, tuple):
            reduced = lax.reduce(operands, inits, computation, (axis,))
            return tuple(jnp.expand_dims(r, axis) for r in reduced)
        plain = {lax.max: jnp.max, lax.min: jnp.min, lax.add: jnp.sum}[computation]
        return plain(operands, axis=axis, keepdims=True, initial=inits)

    def spread(self, statistic: jnp.ndarray) -> jnp.ndarray:
        """Each group's `statistic` (as `reduce` gives it) over its elements."""
        if not self.windows or self._whole:
            return statistic  # broadcasts against the groups
        return repeat(statistic, self.axis, self.size)

    def stored(self, statistic: jnp.ndarray) -> jnp.ndarray:
        """A statistic as stored: one value per group, `axis` divided by `size`."""
        return statistic if self.windows else statistic.squeeze(self.axis + 1)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of a statistic as `stored` gives it."""
        shape = list(self.padded)
        shape[self.axis] //= self.size
        return tuple(shape)

    def unstored(self, statistic: jnp.ndarray) -> jnp.ndarray:
        """The inverse of `stored`."""
        return statistic if self.windows else jnp.expand_dims(statistic, self.axis + 1)

    @property
    def _whole(self) -> bool:
        """Whether `whole_axis` applies: one group spans the last axis (`[..., 32]` in
        groups of 32), reduced over it rather than over a window."""
        last = len(self.padded) - 1
        return (self.windows and self.whole_axis and self.axis == last
                and self.padded[last] == self.size)

    @property
    def _split(self) -> tuple[int, ...]:
        shape = self.padded
        n = shape[self.axis] // self.size
        return (*shape[: self.axis], n, self.size, *shape[self.axis + 1 :])


def repeat(x: jnp.ndarray, axis: int, times: int) -> jnp.ndarray:
    """Each element of `x` `times` times along `axis`: a broadcast and a reshape, which
    keep the sharding of `axis` (under explicit mesh axes `jnp.repeat` asks for an
    output sharding)."""
    grouped = jnp.expand_dims(x, axis + 1)
    shape = list(grouped.shape)
    shape[axis + 1] = times
    merged = list(x.shape)
    merged[axis] *= times
    return jnp.broadcast_to(grouped, shape).reshape(merged)


def layout_of(shape: tuple[int, ...], group_size: int, windows: bool = False,
              rows: bool = False, whole_axis: bool = False) -> Layout:
    """Groups of at most `group_size` elements along one axis, for any shape.

    - The last axis, in groups of `group_size`, when it divides the axis (the usual
      case: hidden sizes, heads, sequence lengths).
    - A last axis shorter than a group (`[batch, seq, 3]`): an earlier axis that
      `group_size` divides, if any, else one group per row.
    - A longer last axis that `group_size` does not divide (`197` tokens, a `1000`
      class vocabulary): cut into as few near-equal groups as fit in `group_size`,
      the axis padded with fewer zeros than there are groups.

    So a scale never spans more than `group_size` values, and never the whole tensor.
    `windows` and `whole_axis`: see `Layout.reduce`. `rows`: groups run down the
    second-to-last axis instead (`group_size` rows of one column: one feature across
    tokens) where `group_size` divides it and whole 128-lane tiles fill the last one
    (`fits_rows`): a TPU then keeps the statistics lane-dense and spreads them over
    their groups with a reshape that moves no data.
    """
    shape = tuple(shape)
    if rows and fits_rows(shape, group_size):
        return Layout(shape, len(shape) - 2, group_size, 0)
    dims = shape or (1,)
    last, axis = dims[-1], len(dims) - 1
    if last % group_size == 0:
        return Layout(shape, axis, group_size, 0, windows, whole_axis)
    if last < group_size:
        for earlier in reversed(range(axis)):
            if dims[earlier] and dims[earlier] % group_size == 0:
                return Layout(shape, earlier, group_size, 0, windows, whole_axis)
        return Layout(shape, axis, last, 0, windows, whole_axis)
    count = -(-last // group_size)
    size = -(-last // count)
    return Layout(shape, axis, size, count * size - last, windows, whole_axis)


def fits_rows(shape: tuple[int, ...], group_size: int, devices: int = 1) -> bool:
    """Whether `layout_of(..., rows=True)` groups `shape` down its rows. (Groups of
    one run nowhere: their statistics, shaped as the residual, would not tell `unpack`
    which way byte scales' super-groups ran.)

    With `devices` > 1, only where the rows split over any number of them that divides
    `devices` in whole groups: however the rows are sharded, no group spans two
    devices, and no statistic needs a collective."""
    return (group_size > 1 and len(shape) >= 2 and shape[-2] % (group_size * devices) == 0
            and shape[-1] % LANES == 0)
