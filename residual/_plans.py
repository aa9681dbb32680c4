"""How a residual is kept from the forward to the backward: one plan per residual.

`hooked_call` chooses a plan for each residual in the forward and asks it for the
residual again in the backward: `Raw` stores it as it is, `Packed` stores what
`pack` returned and calls `unpack`, `Derived` recomputes a cheap function of other
residuals, `View` re-takes a slice of a kept-alive input, and `Recompute` (with
`PlannedRecompute`, the slice of the forward it runs) stores nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from . import _jax_private as jp
from ._errors import HookError
from ._info import ResidualInfo
from ._ordering import passed_after
from ._policy import Policy
from ._residuals import OWNED_NAME, Analysis


def in_device_memory(array) -> bool:
    space = getattr(jax.typeof(array), "memory_space", None)
    return space is None or space == jax.memory.Space.Device


class Raw:
    """Stored as it is."""

    def __init__(self, position: int):
        self.position = position

    def positions_in_stored(self):
        return [self.position]

    def restore(self, stored, info):
        return stored[self.position]

    def nbytes(self, stored, info):
        return info.nbytes


class Recompute:
    """Not stored: recomputed in the backward from the function's inputs."""

    def positions_in_stored(self):
        return []

    def nbytes(self, stored, info):
        return 0


class View:
    """Not stored: a view (`ws[i]`) of an input that stays alive, re-taken in the backward.

    XLA materializes `ws[i]` as a copy; stored, that copy lives from the forward to
    the backward (as it does without hooks). Re-taken inside a conditional tied to
    the backward (see `_hooked_call._after`), it lives only around its use, and XLA
    cannot merge it with the forward's copy.
    """

    def __init__(self, chain, position: int):
        self.chain, self.position = chain, position

    def positions_in_stored(self):
        return []

    def nbytes(self, stored, info):
        return info.nbytes  # reported as stored as it is: the input it views is

    def restore(self, stored, tie):
        def take(x):
            for eqn, k in self.chain:  # output k: `unstack` has one per slice
                x = jp.bind_equation(eqn, [x])[k]
            return x

        source = stored[self.position]
        if tie is None or not in_device_memory(source):
            return take(source)
        if jax.device_count() > 1:
            return take(barrier_after([source], tie)[0])
        return passed_after(tie, source, take)


class Derived:
    """Not stored: a cheap elementwise function of other residuals, recomputed from them.

    JAX's residuals often include both `y` and `1 - y` (tanh's derivative). XLA
    stores only `y` without hooks, fusing `1 - y` into the backward; packing both
    would store twice as much as needed. So the backward derives it from the
    restored `y` instead.
    """

    def __init__(self, eqn, operands):
        self.eqn, self.operands = eqn, operands

    def positions_in_stored(self):
        return []

    def nbytes(self, stored, info):
        return 0

    def restore(self, residual):
        values = [residual(o) if isinstance(o, int) else o.value for o in self.operands]
        return jp.bind_equation(self.eqn, values)[0]


class Packed:
    """Stored as the arrays of `pack`'s result; its static parts stay in Python."""

    def __init__(self, policy, treedef, leaves, positions, unchanged):
        self.policy, self.treedef, self.leaves, self.positions = (
            policy, treedef, leaves, positions
        )
        self.unchanged = unchanged  # positions holding the residual itself, unchanged

    def positions_in_stored(self):
        return [position for _, position in self.positions]

    def nbytes(self, stored, info):
        return sum(stored[p].size * stored[p].dtype.itemsize for p in self.positions_in_stored())

    def stored(self, stored) -> list:
        """This residual's arrays among `stored`, in `positions` order."""
        return [stored[position] for _, position in self.positions]

    def restore(self, arrays, info):
        leaves = list(self.leaves)
        for (leaf_index, _), array in zip(self.positions, arrays):
            leaves[leaf_index] = array
        packed = jax.tree.unflatten(self.treedef, leaves)
        value = call_hook("unpack", self.policy.unpack, packed, info)
        return checked(value, info)


def pack(policy: Policy, value, info: ResidualInfo, stored: list) -> Packed:
    packed = call_hook("pack", policy.pack, value, info)
    leaves, treedef = jax.tree.flatten(packed)
    positions, unchanged = [], set()
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, (jax.Array, np.ndarray)):
            if leaf is value:
                unchanged.add(len(stored))
            positions.append((i, len(stored)))
            stored.append(leaf if leaf is value else jnp.asarray(leaf))
            leaves[i] = None
    return Packed(policy, treedef, leaves, positions, unchanged)


def tag_owned(plan, kept_alive: bool, stored: list) -> None:
    """Tags what `plan` stored, so that an enclosing hooked call leaves it alone.

    An operand that stays alive anyway and is stored as it is stays untagged: the tag
    would hide from `lax.scan` that the residual is just its operand, and the scan
    would copy it. The enclosing call then sees it as its own value, which it is.
    """
    for position in plan.positions_in_stored():
        value = stored[position]
        if kept_alive and (isinstance(plan, Raw) or position in plan.unchanged):
            continue
        stored[position] = checkpoint_name(value, OWNED_NAME)


class PlannedRecompute:
    """The slice of the forward that produces the residuals marked `Recompute`."""

    def __init__(self, analysis: Analysis, plans):
        wanted = [isinstance(p, Recompute) for p in plans]
        used = [False] * analysis.num_outputs + wanted
        self.jaxpr, used_inputs = jp.dce(analysis.closed.jaxpr, used)
        self.consts = analysis.closed.consts
        self.needed_inputs = [i for i, u in enumerate(used_inputs) if u]
        self.indices = [i for i, w in enumerate(wanted) if w]

    def __call__(self, inputs, cts) -> dict[int, Any]:
        # The barrier ties recomputation to the backward (it needs the cotangents),
        # so XLA can neither merge it with the forward nor schedule it early.
        inputs = barrier_after(list(inputs), next(iter(jax.tree.leaves(cts)), None))
        values = jp.jaxpr_as_fun(jp.ClosedJaxpr(self.jaxpr, self.consts))(*inputs)
        return dict(zip(self.indices, values))


def call_hook(which: str, hook: Callable, value, info: ResidualInfo):
    try:
        return hook(value, info)
    except HookError:
        raise
    except Exception as e:
        e.add_note(f"(raised by `{which}` for {info.describe()})")
        raise


def checked(value, info: ResidualInfo):
    """`unpack`'s result, checked against the residual it stands for."""
    expected = f"{np.dtype(info.dtype).name}{list(info.shape)}"
    if not isinstance(value, (jax.Array, np.ndarray)):
        raise HookError(
            f"`unpack` must return an array of shape {info.shape} and dtype "
            f"{np.dtype(info.dtype).name} for {info.describe()}, but it returned "
            f"{type(value).__name__}: {value!r:.80}. Return the restored array."
        )
    if value.shape != info.shape or value.dtype != info.dtype:
        got = f"{np.dtype(value.dtype).name}{list(value.shape)}"
        hint = ""
        if value.dtype != info.dtype and not jnp.issubdtype(value.dtype, jnp.floating):
            hint = " Did `unpack` forget to dequantize?"
        elif value.dtype != info.dtype:
            hint = " Cast it back with `.astype(info.dtype)`."
        elif value.shape != info.shape:
            hint = (
                " A shape that merely broadcasts would give a silently wrong gradient;"
                " restore the exact shape."
            )
        raise HookError(
            f"`unpack` must return an array of shape {info.shape} and dtype "
            f"{np.dtype(info.dtype).name} for {info.describe()}, but it returned "
            f"{got} instead of {expected}.{hint}"
        )
    return jnp.asarray(value)


def barrier_after(values: list, tie) -> list:
    """`values`, which XLA may not compute before `tie`, through an optimization barrier.

    Inside `shard_map` a barrier's outputs vary over every manual mesh axis any of
    its operands varies over: a value that is invariant where `tie` varies would
    change type, and the backward's equations (a `pvary` of it, say) would refuse
    it. Only values that vary over the same axes as `tie` are tied to it.
    """
    if tie is None:
        return values
    axes = jp.varying_axes(tie)
    tied = [i for i, v in enumerate(values) if jp.varying_axes(v) == axes]
    if not tied:
        return values
    out, _ = lax.optimization_barrier(([values[i] for i in tied], tie))
    values = list(values)
    for i, value in zip(tied, out):
        values[i] = value
    return values
