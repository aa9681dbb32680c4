"""The custom VJP at the heart of `residual`: pack in the forward, unpack in the backward.

`hooked_call(fun, inputs, ...)` computes `fun(*inputs)` so that, when it is
differentiated in reverse mode, the forward runs `jax.vjp(fun)` (traced once to a
jaxpr by `trace_residuals`), applies each residual's policy, and stores only what
`pack` returned; the backward unpacks and calls the original VJP function on them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from . import _jax_private as jp
from ._errors import HookError
from ._info import ResidualInfo
from ._policy import Policy
from ._record import Record, record
from ._residuals import OWNED_NAME, Analysis, InputKind, Residual, trace_residuals
from ._scope import resolve_entry


def hooked_call(
    fun: Callable[..., Sequence[Any]],
    inputs: Sequence[Any],
    input_kinds: Sequence[InputKind],
    base: Policy | None,
    *,
    scope_prefix: Sequence[str] = (),
    iterations: int | None = None,
) -> list[Any]:
    """`fun(*inputs)` (a flat list of arrays in, a flat list out), with hooked residuals.

    `base` applies to residuals produced outside any `saved_tensors_hooks` region
    inside `fun`; inside one, the innermost region's hooks apply. `iterations` is the
    number of times the residuals are stored when `fun` is a scan body (the product
    of the lengths of the scans around it), `None` outside scans.
    """
    in_scan = iterations is not None
    state: dict[str, Any] = {}

    @jax.custom_vjp
    def run(*xs):
        return list(fun(*xs))

    def fwd(*xs):
        # Values that are themselves being differentiated mean a higher-order
        # derivative: see `_straight_through`.
        higher_order = jp.differentiation_mode(xs) is not None
        analysis = trace_residuals(
            fun, xs, input_kinds, scope_prefix=scope_prefix, in_scan=in_scan
        )
        values = jp.jaxpr_as_fun(analysis.closed)(*xs)
        outs, residuals = values[: analysis.num_outputs], values[analysis.num_outputs :]
        plans, stored = [], []
        stored_inputs: dict[int, int] = {}  # input index -> position in `stored`
        for value, residual in zip(residuals, analysis.residuals):
            if residual.owned_by_inner:
                plans.append(_Raw(len(stored)))
                stored.append(value)
                continue
            policy = _policy_for(residual, base)
            if policy is None:
                plan = _Raw(len(stored))
                if residual.input_index is not None:
                    stored_inputs.setdefault(residual.input_index, len(stored))
                stored.append(value)
            elif getattr(policy, "recompute", False):
                plan = _Recompute()
            elif higher_order:
                plan = _Raw(len(stored))
                stored.append(_round_trip_straight_through(policy, value, residual.info))
            else:
                plan = _pack(policy, value, residual.info, stored)
            plans.append(plan)
            _tag_owned(plan, residual.info.kept_alive, stored)
            # A scan body's sliced or loop-invariant operand, stored as it is, is
            # the scan's operand: the enclosing call sees and reports it.
            if not (in_scan and residual.info.kept_alive and isinstance(plan, _Raw)):
                record(Record(residual.info, policy, plan.nbytes(stored, residual.info),
                              iterations or 1))
        recompute = None
        if any(isinstance(p, _Recompute) for p in plans):
            recompute = _PlannedRecompute(analysis, plans)
            for i in recompute.needed_inputs:
                if i not in stored_inputs:
                    stored_inputs[i] = len(stored)
                    stored.append(xs[i])
                    _tag_owned(_Raw(len(stored) - 1), input_kinds[i].kept_alive, stored)
        state.update(analysis=analysis, plans=plans, recompute=recompute,
                     stored_inputs=stored_inputs)
        return outs, stored

    def bwd(stored, cts):
        analysis: Analysis = state["analysis"]
        plans, recompute = state["plans"], state["recompute"]
        if recompute is not None:
            inputs = [stored[state["stored_inputs"][i]] for i in recompute.needed_inputs]
            recomputed = recompute(inputs, cts)
        residuals = [
            recomputed[residual.info.index] if isinstance(plan, _Recompute)
            else plan.restore(stored, residual.info)
            for plan, residual in zip(plans, analysis.residuals)
        ]
        vjp = jax.tree.unflatten(analysis.vjp_treedef, residuals)
        return tuple(vjp(list(cts)))

    run.defvjp(fwd, bwd)
    return run(*inputs)


def _policy_for(residual: Residual, base: Policy | None) -> Policy | None:
    if not residual.hookable:
        return None
    entry = residual.markers[-1] if residual.markers else base
    policy = resolve_entry(entry)
    return None if policy is None else policy.resolve(residual.info)


class _Raw:
    """Stored as it is."""

    def __init__(self, position: int):
        self.position = position

    def positions_in_stored(self):
        return [self.position]

    def restore(self, stored, info):
        return stored[self.position]

    def nbytes(self, stored, info):
        return info.nbytes


class _Recompute:
    """Not stored: recomputed in the backward from the function's inputs."""

    def positions_in_stored(self):
        return []

    def nbytes(self, stored, info):
        return 0


class _Packed:
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

    def restore(self, stored, info):
        leaves = list(self.leaves)
        for leaf_index, position in self.positions:
            leaves[leaf_index] = stored[position]
        packed = jax.tree.unflatten(self.treedef, leaves)
        value = _call_hook("unpack", self.policy.unpack, packed, info)
        return _checked(value, info)


def _pack(policy: Policy, value, info: ResidualInfo, stored: list) -> _Packed:
    packed = _call_hook("pack", policy.pack, value, info)
    leaves, treedef = jax.tree.flatten(packed)
    positions, unchanged = [], set()
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, (jax.Array, np.ndarray)):
            if leaf is value:
                unchanged.add(len(stored))
            positions.append((i, len(stored)))
            stored.append(leaf if leaf is value else jnp.asarray(leaf))
            leaves[i] = None
    return _Packed(policy, treedef, leaves, positions, unchanged)


def _tag_owned(plan, kept_alive: bool, stored: list) -> None:
    """Tags what `plan` stored, so that an enclosing hooked call leaves it alone.

    An operand that stays alive anyway and is stored as it is stays untagged: the tag
    would hide from `lax.scan` that the residual is just its operand, and the scan
    would copy it. The enclosing call then sees it as its own value, which it is.
    """
    for position in plan.positions_in_stored():
        value = stored[position]
        if kept_alive and (isinstance(plan, _Raw) or position in plan.unchanged):
            continue
        stored[position] = checkpoint_name(value, OWNED_NAME)


def _round_trip_straight_through(policy: Policy, value, info: ResidualInfo):
    """Value of `unpack(pack(x))`, derivative of `x`.

    When the hooked function is differentiated more than once, the backward itself
    is differentiated, and with it the residuals. Rounding has a zero derivative, so
    differentiating through a lossy `pack` would make higher derivatives silently
    wrong (100% wrong for an int8 cast). As PyTorch restores the autograd history of
    an unpacked tensor, the round trip here is transparent to differentiation.
    """
    packed = _call_hook("pack", policy.pack, lax.stop_gradient(value), info)
    unpacked = _checked(_call_hook("unpack", policy.unpack, packed, info), info)
    return _straight_through(value, unpacked)


@jax.custom_jvp
def _straight_through(x, y):
    return y


@_straight_through.defjvp
def _straight_through_jvp(primals, tangents):
    return primals[1], tangents[0]


class _PlannedRecompute:
    """The slice of the forward that produces the residuals marked `_Recompute`."""

    def __init__(self, analysis: Analysis, plans):
        wanted = [isinstance(p, _Recompute) for p in plans]
        used = [False] * analysis.num_outputs + wanted
        self.jaxpr, used_inputs = jp.dce(analysis.closed.jaxpr, used)
        self.consts = analysis.closed.consts
        self.needed_inputs = [i for i, u in enumerate(used_inputs) if u]
        self.indices = [i for i, w in enumerate(wanted) if w]

    def __call__(self, inputs, cts) -> dict[int, Any]:
        # The barrier ties recomputation to the backward (it needs the cotangents),
        # so XLA can neither merge it with the forward nor schedule it early.
        inputs, _ = lax.optimization_barrier((list(inputs), list(cts)))
        values = jp.jaxpr_as_fun(jp.ClosedJaxpr(self.jaxpr, self.consts))(*inputs)
        return dict(zip(self.indices, values))



def _call_hook(which: str, hook: Callable, value, info: ResidualInfo):
    try:
        return hook(value, info)
    except HookError:
        raise
    except Exception as e:
        e.add_note(f"(raised by `{which}` for {info.describe()})")
        raise


def _checked(value, info: ResidualInfo):
    """`unpack`'s result, checked against the residual it stands for."""
    expected = f"{np.dtype(info.dtype).name}{list(info.shape)}"
    if isinstance(value, np.ndarray) and not isinstance(value, jax.Array):
        value = jnp.asarray(value) if value.dtype == info.dtype else value
    if not isinstance(value, jax.Array):
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
    return value
