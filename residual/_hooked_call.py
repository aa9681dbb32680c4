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
from ._policy import FunctionHooks, Policy
from ._record import Record, record
from ._residuals import (
    OWNED_NAME,
    Analysis,
    InputKind,
    Residual,
    backward_jaxpr,
    trace_residuals,
)
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
        policies = [
            None if residual.owned_by_inner else _policy_for(residual, base)
            for residual in analysis.residuals
        ]
        derived = _derivable(analysis.residuals, policies) if not higher_order else set()
        plans, stored = [], []
        to_pack = {} if higher_order else {
            r.info.index: p for r, p in zip(analysis.residuals, policies)
            if p is not None and not r.owned_by_inner and r.info.index not in derived
            and not getattr(p, "recompute", False)
        }
        packed_early: dict[int, _Packed] = {}
        if to_pack and not in_scan:
            values = _run_forward(analysis, xs, to_pack, stored, packed_early)
        else:
            values = jp.jaxpr_as_fun(analysis.closed)(*xs)
        outs, residuals = values[: analysis.num_outputs], values[analysis.num_outputs :]
        # Once anything is packed the program is no longer JAX's own: views of
        # kept-alive inputs (`ws[i]`) are then re-taken in the backward, not stored.
        views = {} if higher_order or not any(
            p is not None for p, r in zip(policies, analysis.residuals) if not r.owned_by_inner
        ) else _views_of_inputs(analysis, input_kinds, in_scan)
        stored_inputs: dict[int, int] = {}  # input index -> position in `stored`
        for value, residual, policy in zip(residuals, analysis.residuals, policies):
            if residual.owned_by_inner:
                plans.append(_Raw(len(stored)))
                stored.append(value)
                continue
            if residual.info.index in derived:
                plan = _Derived(*residual.derivation)
            elif policy is None and residual.info.index in views:
                chain, j = views[residual.info.index]
                if j not in stored_inputs:
                    stored_inputs[j] = len(stored)
                    stored.append(xs[j])
                    _tag_owned(_Raw(len(stored) - 1), True, stored)
                plan = _View(chain, stored_inputs[j])
            elif policy is None:
                plan = _Raw(len(stored))
                if residual.input_index is not None:
                    stored_inputs.setdefault(residual.input_index, len(stored))
                    # The input itself: a `cond` that forwards it in one branch fills
                    # the residual with zeros in the others, which recomputation
                    # (reading it as the input) must not see.
                    value = xs[residual.input_index]
                stored.append(value)
            elif getattr(policy, "recompute", False):
                plan = _Recompute()
            elif higher_order:
                plan = _Raw(len(stored))
                stored.append(_round_trip_straight_through(policy, value, residual.info))
            elif residual.info.index in packed_early:
                plan = packed_early[residual.info.index]
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
                     stored_inputs=stored_inputs,
                     backward=backward_jaxpr(analysis, residuals, outs))
        return outs, stored

    def bwd(stored, cts):
        analysis: Analysis = state["analysis"]
        plans, recompute = state["plans"], state["recompute"]
        restored: dict[int, Any] = {}

        def restore(i: int, tie):
            """Residual `i`, restored where the backward first reads it."""
            if i in restored:
                return restored[i]
            plan, info = plans[i], analysis.residuals[i].info
            if isinstance(plan, _Recompute):
                inputs = [stored[state["stored_inputs"][j]] for j in recompute.needed_inputs]
                restored.update(recompute(inputs, cts))
            elif isinstance(plan, _Derived):
                restored[i] = plan.restore(lambda j: restore(j, tie))
            elif isinstance(plan, _View):
                restored[i] = plan.restore(stored, tie)
            elif isinstance(plan, _Packed):
                arrays = plan.stored(stored)
                changed = [k for k, (_, p) in enumerate(plan.positions) if p not in plan.unchanged]
                for k, array in zip(changed, _after([arrays[k] for k in changed], tie)):
                    arrays[k] = array
                restored[i] = plan.restore(arrays, info)
            else:
                restored[i] = plan.restore(stored, info)
            return restored[i]

        return tuple(_run_backward(state["backward"], len(plans), restore, list(cts)))

    run.defvjp(fwd, bwd)
    return run(*inputs)


def _run_forward(analysis: Analysis, xs, to_pack: dict, stored: list, packed: dict) -> list:
    """The forward, packing each residual in `to_pack` as soon as it is computed.

    Packed at the end, XLA's scheduler may run a `pack` long after the value was
    computed (several layers later in an unrolled model), keeping the floats of
    all those layers alive at once. Here the rest of the forward reads each packed
    value through a `lax.cond` that takes the packed arrays as operands, so they
    are computed first, and the float can be freed after its last forward use.
    """
    jaxpr = analysis.closed.jaxpr
    waiting: dict[Any, list[int]] = {}
    for index, var in enumerate(jaxpr.outvars[analysis.num_outputs:]):
        if index in to_pack and not isinstance(var, jp.Literal):
            waiting.setdefault(var, []).append(index)
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, analysis.closed.consts))

    def computed(variables, values):
        for var, value in zip(variables, values):
            for index in waiting.pop(var, ()):
                packed[index] = _pack(to_pack[index], value, analysis.residuals[index].info, stored)
                value = _tie_forward(value, packed[index], stored)
            env[var] = value

    computed(jaxpr.invars, xs)
    for eqn in jaxpr.eqns:
        values = [v.val if isinstance(v, jp.Literal) else env[v] for v in eqn.invars]
        computed(eqn.outvars, jp.bind_equation(eqn, values))
    return [v.val if isinstance(v, jp.Literal) else env[v] for v in jaxpr.outvars]


def _tie_forward(value, plan: _Packed, stored: list):
    """`value`, through a `lax.cond` that also passes (so first computes) `plan`'s arrays."""
    changed = [p for _, p in plan.positions if p not in plan.unchanged]
    if (not changed or not value.size or jax.device_count() > 1
            or not jnp.issubdtype(value.dtype, jnp.inexact) or not _in_device_memory(value)
            or not all(_in_device_memory(stored[p]) for p in changed)):
        return value
    first = value.ravel()[0].astype(jnp.float32)
    arrays = [stored[p] for p in changed]
    value, arrays = lax.cond(first == first, _identity, _copy, (value, arrays))
    for p, array in zip(changed, arrays):
        stored[p] = array
    return value


def _run_backward(backward: jp.ClosedJaxpr, n_res: int, restore: Callable, cts: list) -> list:
    """Runs JAX's backward pass, restoring each residual just before its first use.

    Restoring them all up front would let XLA schedule every `unpack` (a dequantize,
    a copy back from host) early, so all float residuals would be live at once; tied
    to the values the backward has computed by then, each one is restored late.
    """
    jaxpr = backward.jaxpr
    lazy = {v: i for i, v in enumerate(jaxpr.invars[:n_res])}
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, backward.consts))
    env.update(zip(jaxpr.invars[n_res:], cts))

    def read(v, tie):
        if isinstance(v, jp.Literal):
            return v.val
        if v not in env:
            env[v] = restore(lazy[v], tie)
        return env[v]

    for eqn in jaxpr.eqns:
        known = [env[v] for v in eqn.invars if not isinstance(v, jp.Literal) and v in env]
        tie = next((x for x in known if x.size and jnp.issubdtype(x.dtype, jnp.inexact)), None)
        outs = jp.bind_equation(eqn, [read(v, tie) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs))
    return [read(v, None) for v in jaxpr.outvars]


def _after(arrays: list, tie) -> list:
    """`arrays`, through a `lax.cond` that XLA can neither fuse across nor run before `tie`.

    Without it XLA fuses `pack` into the backward, computing the packed form there
    from the float residual, which it then keeps alive: packing would cost memory
    instead of saving it. `optimization_barrier` does not prevent this on CPU (the
    pipeline strips barriers before fusion); XLA never fuses across a conditional.
    The predicate compares a float with itself (no simplifier may fold that, because
    of NaN): one element of `tie`, a value of the backward computed just before the
    residual is needed, so the copy, and `unpack` after it, wait for it.
    """
    # Offloaded arrays stay where they are: under `vmap` the `cond` becomes a select,
    # which cannot mix host and device memory.
    on_device = [i for i, a in enumerate(arrays) if a.size and _in_device_memory(a)]
    if not on_device:
        return arrays
    if len(on_device) < len(arrays):
        routed = _after([arrays[i] for i in on_device], tie)
        arrays = list(arrays)
        for i, value in zip(on_device, routed):
            arrays[i] = value
        return arrays
    if jax.device_count() > 1:
        # XLA's SPMD partitioner replicates what flows through a conditional, which
        # would all-gather sharded activations: with several devices, a barrier
        # (kept by the GPU pipeline) orders `unpack` after `tie` instead.
        if tie is None:
            return arrays
        return list(lax.optimization_barrier((arrays, tie))[0])
    # Only when nothing of the backward is at hand does the probe read the packed
    # data: XLA would compute that element from the float residual, keeping it alive.
    probe = tie if tie is not None else arrays[0]
    first = probe.ravel()[0].astype(jnp.float32)
    # The branches must differ: JAX inlines a `cond` whose branches are equal.
    return list(lax.cond(first == first, _identity, _copy, arrays))


def _in_device_memory(array) -> bool:
    space = getattr(jax.typeof(array), "memory_space", None)
    return space is None or space == jax.memory.Space.Device


def _identity(x):
    return x


def _copy(arrays):
    return jax.tree.map(jnp.copy, arrays)


def _derivable(residuals: Sequence[Residual], policies) -> set[int]:
    """Residuals to derive from others in the backward instead of storing them.

    Only for residuals a lossy policy would pack (plain hooks and lossless policies
    see every residual, as in PyTorch), and only from residuals that are stored.
    """
    candidates = {
        r.info.index for r, p in zip(residuals, policies)
        if r.derivation is not None and p is not None and not p.lossless
        and not isinstance(p, FunctionHooks) and not getattr(p, "recompute", False)
    }
    return {
        i for i in candidates
        if all(not isinstance(o, int) or (o not in candidates and not residuals[o].owned_by_inner
                                           and not getattr(policies[o], "recompute", False))
               for o in residuals[i].derivation[1])
    }


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


class _View:
    """Not stored: a view (`ws[i]`) of an input that stays alive, re-taken in the backward.

    XLA materializes `ws[i]` as a copy; stored, that copy lives from the forward to
    the backward (as it does without hooks). Re-taken inside a conditional tied to
    the backward (see `_after`), it lives only around its use, and XLA cannot merge
    it with the forward's copy.
    """

    def __init__(self, chain, position: int):
        self.chain, self.position = chain, position

    def positions_in_stored(self):
        return []

    def nbytes(self, stored, info):
        return info.nbytes  # reported as stored as it is: the input it views is

    def restore(self, stored, tie):
        def take(x):
            for eqn in self.chain:
                x = jp.bind_equation(eqn, [x])[0]
            return x

        source = stored[self.position]
        if tie is None or not _in_device_memory(source):
            return take(source)
        if jax.device_count() > 1:
            return take(lax.optimization_barrier((source, tie))[0])
        first = tie.ravel()[0].astype(jnp.float32)
        return lax.cond(first == first, take, lambda x: jnp.copy(take(x)), source)


def _views_of_inputs(analysis: Analysis, input_kinds, in_scan: bool) -> dict:
    """{residual index: (view equations, input index)} for views of kept-alive inputs."""
    if in_scan:
        return {}
    jaxpr = analysis.closed.jaxpr
    producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    inputs_at = {v: i for i, v in enumerate(jaxpr.invars)}
    views = {}
    for index, var in enumerate(jaxpr.outvars[analysis.num_outputs:]):
        chain = []
        while not isinstance(var, jp.Literal) and var in producers:
            eqn = producers[var]
            if eqn.primitive.name not in _VIEW_PRIMITIVES or len(eqn.invars) != 1:
                break
            chain.append(eqn)
            var = eqn.invars[0]
        if chain and not isinstance(var, jp.Literal) and var in inputs_at:
            j = inputs_at[var]
            if input_kinds[j].kept_alive:
                views[index] = (tuple(reversed(chain)), j)
    return views


_VIEW_PRIMITIVES = {"slice", "squeeze", "reshape", "expand_dims", "transpose"}


class _Derived:
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

    def stored(self, stored) -> list:
        """This residual's arrays among `stored`, in `positions` order."""
        return [stored[position] for _, position in self.positions]

    def restore(self, arrays, info):
        leaves = list(self.leaves)
        for (leaf_index, _), array in zip(self.positions, arrays):
            leaves[leaf_index] = array
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
