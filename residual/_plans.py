"""How a residual is kept from the forward to the backward: one plan per residual.

`hooked_call` chooses a plan for each residual in the forward and asks it for the
residual again in the backward: `Raw` stores it as it is, `Packed` stores what
`pack` returned and calls `unpack`, `Derived` recomputes a cheap function of other
residuals, `View` re-takes a slice of a kept-alive input, and `Recompute` (with
`PlannedRecompute`, the slices of the forward it runs) stores nothing.
"""

from __future__ import annotations

import dataclasses
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
from ._residuals import OWNED_NAME, Analysis, Residual


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
    """Not stored: recomputed in the backward from the nearest stored values."""

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

    def __init__(self, chain, position: int, recomputed: bool = False):
        self.chain, self.position = chain, position
        self.recomputed = recomputed  # chosen for recomputation, which re-taking it is

    def positions_in_stored(self):
        return []

    def nbytes(self, stored, info):
        # Unless recomputed, reported as stored as it is: the input it views is.
        return 0 if self.recomputed else info.nbytes

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


@dataclasses.dataclass(eq=False)
class Saved:
    """A value of the forward that is not a residual, stored for recomputation to start from."""

    var: Any
    residual: Residual  # the value described as a residual would be
    policy: Policy | None  # `None`: stored as it is
    plan: Raw | Packed | None = None  # how the forward stored it


@dataclasses.dataclass(eq=False)
class Slice:
    """Equations of the forward recomputed together, and where their inputs come from."""

    eqns: list
    inputs: list  # the variables the slice reads
    sources: list  # for each input: ("input", j), ("residual", i), ("saved", k), ("const", c)
    outputs: list  # (residual index, variable)


class PlannedRecompute:
    """The slices of the forward that produce the residuals marked `Recompute`.

    As `jax.checkpoint` recomputes from what its policy saves, a slice starts from the
    nearest values that are stored: the function's inputs, residuals kept or packed
    (unpacked in the backward), and the forward's other values that the policy does
    not mark for recomputation, which are then stored for it (`saved`, chosen by
    `keep`). A `Remat` region thus recomputes from its boundary. Slices that share no
    equation are recomputed separately, each where the backward first needs one of
    its residuals, so a model unrolled in Python recomputes layer by layer instead of
    running the whole forward again at the start of the backward.

    `keep(var, index)` says whether a value on a slice is stored: `(residual,
    policy)` to store it (`policy` packs it; `None` keeps it as it is), `None` to
    recompute it too. `index` numbers the stored values after the residuals.
    """

    def __init__(self, analysis: Analysis, recomputed: set[int], keep: Callable):
        jaxpr = analysis.closed.jaxpr
        residual_vars = jaxpr.outvars[analysis.num_outputs:]
        inputs_at = {v: j for j, v in enumerate(jaxpr.invars)}
        consts = dict(zip(jaxpr.constvars, analysis.closed.consts))
        self.saved: list[Saved] = []
        sources: dict[Any, tuple] = {}
        for i, (var, residual) in enumerate(zip(residual_vars, analysis.residuals)):
            # A residual that is an input reads as the input: where a `cond` forwards
            # it from one branch only, the residual itself is zeros in the others.
            if (i not in recomputed and not isinstance(var, jp.Literal)
                    and residual.input_index is None):
                sources.setdefault(var, ("residual", i))

        def source(var) -> tuple | None:
            """Where the backward reads `var`; `None` when it is recomputed."""
            if var not in sources:
                if var in inputs_at:
                    sources[var] = ("input", inputs_at[var])
                elif var in consts:
                    sources[var] = ("const", consts[var])
                else:
                    kept = keep(var, len(analysis.residuals) + len(self.saved))
                    if kept is None:
                        return None
                    sources[var] = ("saved", len(self.saved))
                    self.saved.append(Saved(var, *kept))
            return sources[var]

        recomputed_vars = [residual_vars[i] for i in sorted(recomputed)]
        needed = {v for v in recomputed_vars
                  if v not in sources and v not in inputs_at and v not in consts}
        producer = {v: k for k, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
        parent: dict[int, int] = {}  # union-find over equation numbers

        def root(k: int) -> int:
            while parent.setdefault(k, k) != k:
                parent[k] = parent[parent[k]]
                k = parent[k]
            return k

        region = []
        for k in reversed(range(len(jaxpr.eqns))):  # consumers before producers
            eqn = jaxpr.eqns[k]
            if not any(v in needed for v in eqn.outvars):
                continue
            region.append(k)
            root(k)
            for v in eqn.invars:
                if isinstance(v, jp.Literal) or (v not in needed and source(v) is not None):
                    continue
                needed.add(v)
                parent[root(producer[v])] = root(k)

        slices: dict[Any, Slice] = {}
        for k in reversed(region):
            part = slices.setdefault(root(k), Slice([], [], [], []))
            part.eqns.append(jaxpr.eqns[k])
            for v in jaxpr.eqns[k].invars:
                if not isinstance(v, jp.Literal) and v not in needed and v not in part.inputs:
                    part.inputs.append(v)
                    part.sources.append(sources[v])
        self.slice_of: dict[int, Slice] = {}
        for i, var in zip(sorted(recomputed), recomputed_vars):
            if var in needed:
                part = slices[root(producer[var])]
            else:  # stored anyway (an input, another residual's value)
                part = Slice([], [var], [source(var)], [])
            part.outputs.append((i, var))
            self.slice_of[i] = part
        self.needed_inputs = sorted({
            s[1] for part in self.slice_of.values() for s in part.sources if s[0] == "input"
        })

    def run(self, part: Slice, inputs: list) -> dict[int, Any]:
        """The residuals `part` produces, from the values of its inputs."""
        env = dict(zip(part.inputs, inputs))
        for eqn in part.eqns:
            values = [v.val if isinstance(v, jp.Literal) else env[v] for v in eqn.invars]
            env.update(zip(eqn.outvars, jp.bind_equation(eqn, values)))
        return {i: env[var] for i, var in part.outputs}


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
