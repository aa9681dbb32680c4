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

from . import _jax_private as jp
from ._info import ResidualInfo
from ._ordering import passed_after
from ._plans import (
    Derived,
    Packed,
    PlannedRecompute,
    Raw,
    Recompute,
    Saved,
    View,
    barrier_after,
    call_hook,
    checked,
    in_device_memory,
    pack,
    tag_owned,
)
from ._policy import FunctionHooks, Policy
from ._record import Record, record
from ._residuals import (
    Analysis,
    InputKind,
    Residual,
    backward_jaxpr,
    trace_residuals,
    value_describer,
)
from ._scope import resolve_entry
from .policies.select import warns_on_unmatched_rules


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
        # Python scalars (a float passed to `jax.grad`) reach the rule as JAX's typed
        # scalars, which are not arrays: hooks and the forward see arrays only.
        xs = tuple(_as_array(x) for x in xs)
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
        packed_early: dict[int, Packed] = {}
        # Once anything is packed the program is no longer JAX's own: views of
        # kept-alive inputs (`ws[i]`) are then re-taken in the backward, not stored.
        acting = not higher_order and any(
            p is not None for p, r in zip(policies, analysis.residuals) if not r.owned_by_inner
        )
        views = _views_of_inputs(analysis, input_kinds, in_scan) if acting else {}
        recompute = _plan_recompute(analysis, policies, derived | set(views), input_kinds, base,
                                    scope_prefix=scope_prefix, in_scan=in_scan)

        def store_saved(entry: Saved, value):
            """Stores a value recomputation starts from, as soon as the forward computes it."""
            if entry.policy is None:
                entry.plan = Raw(len(stored))
                stored.append(value)
            elif higher_order:
                entry.plan = Raw(len(stored))
                stored.append(_round_trip_straight_through(entry.policy, value,
                                                           entry.residual.info))
            else:
                entry.plan = pack(entry.policy, value, entry.residual.info, stored)
                if not in_scan:
                    value = _tie_forward(value, entry.plan, stored)
            tag_owned(entry.plan, False, stored)
            return value

        saved = {} if recompute is None else {
            entry.var: lambda value, entry=entry: store_saved(entry, value)
            for entry in recompute.saved
        }
        if (to_pack and not in_scan) or saved:
            values = _run_forward(analysis, xs, {} if in_scan else to_pack, stored,
                                  packed_early, saved)
        else:
            values = jp.jaxpr_as_fun(analysis.closed)(*xs)
        outs, residuals = values[: analysis.num_outputs], values[analysis.num_outputs :]
        stored_inputs: dict[int, int] = {}  # input index -> position in `stored`

        def store_input(j: int, kept_alive: bool) -> int:
            """Input `j`'s position in `stored`, storing it the first time it is asked for."""
            if j not in stored_inputs:
                stored_inputs[j] = len(stored)
                stored.append(xs[j])
                tag_owned(Raw(len(stored) - 1), kept_alive, stored)
            return stored_inputs[j]

        # Residuals stored as they are (masks, statistics) while others are packed: see
        # `_tied_raw`.
        tied_raw: set[int] = set()
        for value, residual, policy in zip(residuals, analysis.residuals, policies):
            if residual.owned_by_inner:
                plans.append(Raw(len(stored)))
                stored.append(value)
                continue
            if residual.info.index in derived:
                plan = Derived(*residual.derivation)
            elif residual.info.index in views and (
                    policy is None or getattr(policy, "recompute", False)):
                # Recomputing a view is re-taking it, inside the backward's conditional
                # (recomputed from the whole input, it would be a copy of the input).
                chain, j = views[residual.info.index]
                plan = View(chain, store_input(j, kept_alive=True), recomputed=policy is not None)
            elif policy is None:
                plan = Raw(len(stored))
                if residual.input_index is not None:
                    stored_inputs.setdefault(residual.input_index, len(stored))
                    # The input itself: a `cond` that forwards it in one branch fills
                    # the residual with zeros in the others, which recomputation
                    # (reading it as the input) must not see.
                    value = xs[residual.input_index]
                stored.append(value)
            elif getattr(policy, "recompute", False):
                plan = Recompute()
            elif higher_order:
                plan = Raw(len(stored))
                stored.append(_round_trip_straight_through(policy, value, residual.info))
            elif residual.info.index in packed_early:
                plan = packed_early[residual.info.index]
            else:
                plan = pack(policy, value, residual.info, stored)
            plans.append(plan)
            if (acting and not in_scan and isinstance(plan, Raw) and not residual.info.kept_alive
                    and residual.input_index is None):
                tied_raw.add(residual.info.index)
            tag_owned(plan, residual.info.kept_alive, stored)
            # A scan body's sliced or loop-invariant operand, stored as it is, is
            # the scan's operand: the enclosing call sees and reports it.
            if not (in_scan and residual.info.kept_alive and isinstance(plan, Raw)):
                record(Record(residual.info, policy, plan.nbytes(stored, residual.info),
                              iterations or 1, plan, analysis))
        if recompute is not None:
            for entry in recompute.saved:
                record(Record(entry.residual.info, entry.policy,
                              entry.plan.nbytes(stored, entry.residual.info), iterations or 1,
                              entry.plan, analysis))
            for i in recompute.needed_inputs:
                store_input(i, input_kinds[i].kept_alive)
        state.update(analysis=analysis, plans=plans, recompute=recompute,
                     stored_inputs=stored_inputs, tied_raw=tied_raw,
                     backward=backward_jaxpr(analysis, residuals, outs))
        return outs, stored

    def bwd(stored, cts):
        analysis: Analysis = state["analysis"]
        plans, recompute = state["plans"], state["recompute"]
        restored: dict[int, Any] = {}
        ordered = jp.is_staged()  # as in the forward

        def restore(i: int, tie):
            """Residual `i`, restored where the backward first reads it."""
            if i in restored:
                return restored[i]
            plan, info = plans[i], analysis.residuals[i].info
            if isinstance(plan, Recompute):
                part = recompute.slice_of[i]
                inputs = [read_source(source, tie) for source in part.sources]
                # Tied to the backward where it is needed, the recomputation can
                # neither merge with the forward nor be scheduled early.
                tie = tie if tie is not None else next(iter(jax.tree.leaves(cts)), None)
                restored.update(recompute.run(part, _after_if_arrays(inputs, tie)))
            elif isinstance(plan, Derived):
                restored[i] = plan.restore(lambda j: restore(j, tie))
            elif isinstance(plan, View):
                restored[i] = plan.restore(stored, tie)
            elif i in state["tied_raw"]:
                tie = tie if tie is not None else next(iter(jax.tree.leaves(cts)), None)
                restored[i] = _tied_raw(plan.restore(stored, info), tie)
            else:
                restored[i] = _restored(plan, info, stored, tie)
            return restored[i]

        def read_source(source: tuple, tie):
            """A value recomputation starts from (see `PlannedRecompute`)."""
            kind, key = source
            if kind == "input":
                return stored[state["stored_inputs"][key]]
            if kind == "residual":
                return restore(key, tie)
            if kind == "saved":
                entry = recompute.saved[key]
                return _restored(entry.plan, entry.residual.info, stored, tie)
            return key  # a constant

        return tuple(_run_backward(state["backward"], len(plans), restore, list(cts), ordered))

    run.defvjp(warns_on_unmatched_rules(fwd), bwd)
    return run(*inputs)


def _restored(plan: Raw | Packed, info: ResidualInfo, stored: list, tie):
    """A stored value as the backward reads it: a packed one unpacked after `tie`."""
    if not isinstance(plan, Packed):
        return plan.restore(stored, info)
    arrays = plan.stored(stored)
    changed = [k for k, (_, p) in enumerate(plan.positions) if p not in plan.unchanged]
    for k, array in zip(changed, _after([arrays[k] for k in changed], tie)):
        arrays[k] = array
    return plan.restore(arrays, info)


def _plan_recompute(analysis: Analysis, policies, other: set[int], input_kinds, base,
                    *, scope_prefix, in_scan: bool) -> PlannedRecompute | None:
    """What the residuals chosen for recomputation are recomputed from, if there are any.

    Residuals in `other` are restored otherwise (derived from others, views re-taken).

    A value on the way from stored values to such a residual is offered to the policy
    as a residual would be: where the policy would keep or pack it, it is stored and
    the recomputation starts there; where it too is for recomputation (or is a view
    of an input that stays alive, or no array a policy sees), it is recomputed.
    """
    recomputed = {
        r.info.index for r, p in zip(analysis.residuals, policies)
        if not r.owned_by_inner and r.info.index not in other
        and getattr(p, "recompute", False)
    }
    if not recomputed:
        return None
    describe = value_describer(analysis, input_kinds, scope_prefix=scope_prefix,
                               in_scan=in_scan)

    def keep(var, index: int):
        residual = describe(var, index)
        if not residual.hookable or residual.info.kept_alive:
            return None
        policy = _policy_for(residual, base)
        return None if getattr(policy, "recompute", False) else (residual, policy)

    return PlannedRecompute(analysis, recomputed, keep)


def _tied_raw(value, tie):
    """A residual stored as it is, read in the backward after `tie`, while others are packed.

    Read straight from the forward's value, XLA merges the backward's work on it
    with the forward's: the full-size broadcast of a batch norm's per-channel scale
    was computed once and kept alive from the forward to the backward, one float
    per layer (a CNN under int8: 0.84x plain's temp memory, 0.70x tied).
    """
    return _after_if_arrays([value], tie)[0]


def _after_if_arrays(values: list, tie) -> list:
    """`_after` for the numeric arrays among `values`; constants and keys pass as they are."""
    arrays = [i for i, v in enumerate(values)
              if isinstance(v, jax.Array) and not jp.is_extended_dtype(v.dtype)]
    values = list(values)
    if tie is None or not arrays:
        return values
    for i, value in zip(arrays, _after([values[i] for i in arrays], tie)):
        values[i] = value
    return values


def _run_forward(analysis: Analysis, xs, to_pack: dict, stored: list, packed: dict,
                 saved: dict | None = None) -> list:
    """The forward, packing each residual in `to_pack` as soon as it is computed.

    `saved` maps other variables to a function that stores their value when it is
    computed and returns the value the rest of the forward reads.

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
                packed[index] = pack(to_pack[index], value, analysis.residuals[index].info, stored)
                value = _tie_forward(value, packed[index], stored)
            if saved and var in saved:
                value = saved[var](value)
            env[var] = value

    computed(jaxpr.invars, xs)
    for eqn in jaxpr.eqns:
        values = [v.val if isinstance(v, jp.Literal) else env[v] for v in eqn.invars]
        computed(eqn.outvars, jp.bind_equation(eqn, values))
    return [v.val if isinstance(v, jp.Literal) else env[v] for v in jaxpr.outvars]


def _tie_forward(value, plan: Packed, stored: list):
    """`value`, through a `lax.cond` that also passes (so first computes) `plan`'s arrays."""
    changed = [p for _, p in plan.positions if p not in plan.unchanged]
    if (not changed or not value.size or jax.device_count() > 1 or not jp.is_staged()
            or not jnp.issubdtype(value.dtype, jnp.inexact) or not in_device_memory(value)
            or not all(in_device_memory(stored[p]) for p in changed)):
        return value
    arrays = [stored[p] for p in changed]
    value, arrays = passed_after(value, (value, arrays))
    for p, array in zip(changed, arrays):
        stored[p] = array
    return value


def _run_backward(
    backward: jp.ClosedJaxpr, n_res: int, restore: Callable, cts: list, ordered: bool
) -> list:
    """Runs JAX's backward pass, restoring each residual just before its first use.

    Restoring them all up front would let XLA schedule every `unpack` (a dequantize,
    a copy back from host) early, so all float residuals would be live at once; tied
    to the values the backward has computed by then, each one is restored late.
    Unless `ordered`, there is no such tie (`None`): restored where first used.
    """
    jaxpr = backward.jaxpr
    lazy = {v: i for i, v in enumerate(jaxpr.invars[:n_res])}
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, backward.consts))
    # `jax.vjp`'s function accepts Python scalars as cotangents of scalar outputs.
    env.update((v, _as_array(ct, v.aval.dtype)) for v, ct in zip(jaxpr.invars[n_res:], cts))

    def read(v, tie):
        if isinstance(v, jp.Literal):
            return v.val
        if v not in env:
            env[v] = restore(lazy[v], tie)
        return env[v]

    for eqn in jaxpr.eqns:
        known = [env[v] for v in eqn.invars if not isinstance(v, jp.Literal) and v in env]
        tie = next((x for x in known if x.size and jnp.issubdtype(x.dtype, jnp.inexact)),
                   None) if ordered else None
        outs = jp.bind_equation(eqn, [read(v, tie) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs))
    return [read(v, None) for v in jaxpr.outvars]


def _as_array(x, dtype=None):
    """`x` as a JAX array (of `dtype` if given), when it is a Python or NumPy scalar."""
    if isinstance(x, jax.Array) or (isinstance(x, np.ndarray) and x.dtype == jax.dtypes.float0):
        return x
    return jnp.asarray(x, dtype=dtype)


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
    if not jp.is_staged():
        # Ordering is for compiled programs: in eager mode each operation runs on its
        # own, and the conditionals would be compiled anew on every call.
        return arrays
    # Only device arrays go through the conditional: offloaded ones stay on the host.
    on_device = [i for i, a in enumerate(arrays) if a.size and in_device_memory(a)]
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
        return barrier_after(arrays, tie)
    # Only when nothing of the backward is at hand does the probe read the packed
    # data: XLA would compute that element from the float residual, keeping it alive.
    probe = tie if tie is not None else arrays[0]
    return list(passed_after(probe, arrays))


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


def _views_of_inputs(analysis: Analysis, input_kinds, in_scan: bool) -> dict:
    """{residual index: (view equations, input index)} for views of kept-alive inputs."""
    if in_scan:
        return {}
    jaxpr = analysis.closed.jaxpr
    producers = {v: (eqn, k) for eqn in jaxpr.eqns for k, v in enumerate(eqn.outvars)}
    inputs_at = {v: i for i, v in enumerate(jaxpr.invars)}
    views = {}
    for index, var in enumerate(jaxpr.outvars[analysis.num_outputs:]):
        chain = []
        while not isinstance(var, jp.Literal) and var in producers:
            eqn, k = producers[var]
            # One operand: a `dynamic_slice` (which has index operands too) is stored.
            if eqn.primitive not in jp.VIEWS or len(eqn.invars) != 1:
                break
            chain.append((eqn, k))
            var = eqn.invars[0]
        if chain and not isinstance(var, jp.Literal) and var in inputs_at:
            j = inputs_at[var]
            if input_kinds[j].kept_alive:
                views[index] = (tuple(reversed(chain)), j)
    return views


def _round_trip_straight_through(policy: Policy, value, info: ResidualInfo):
    """Value of `unpack(pack(x))`, derivative of `x`.

    When the hooked function is differentiated more than once, the backward itself
    is differentiated, and with it the residuals. Rounding has a zero derivative, so
    differentiating through a lossy `pack` would make higher derivatives silently
    wrong (100% wrong for an int8 cast). As PyTorch restores the autograd history of
    an unpacked tensor, the round trip here is transparent to differentiation.
    """
    # `stop_gradient` of a traced Python scalar is the scalar itself: hooks see arrays.
    packed = call_hook("pack", policy.pack, _as_array(lax.stop_gradient(value)), info)
    unpacked = checked(call_hook("unpack", policy.unpack, packed, info), info)
    return _straight_through(value, unpacked)


@jax.custom_jvp
def _straight_through(x, y):
    return y


@_straight_through.defjvp
def _straight_through_jvp(primals, tangents):
    return _straight_through(*primals), tangents[0]

