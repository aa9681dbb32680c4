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
    VIEWS,
    Analysis,
    InputKind,
    Residual,
    backward_jaxpr,
    trace_residuals,
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

        def store_input(j: int, kept_alive: bool) -> int:
            """Input `j`'s position in `stored`, storing it the first time it is asked for."""
            if j not in stored_inputs:
                stored_inputs[j] = len(stored)
                stored.append(xs[j])
                tag_owned(Raw(len(stored) - 1), kept_alive, stored)
            return stored_inputs[j]

        for value, residual, policy in zip(residuals, analysis.residuals, policies):
            if residual.owned_by_inner:
                plans.append(Raw(len(stored)))
                stored.append(value)
                continue
            if residual.info.index in derived:
                plan = Derived(*residual.derivation)
            elif policy is None and residual.info.index in views:
                chain, j = views[residual.info.index]
                plan = View(chain, store_input(j, kept_alive=True))
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
            tag_owned(plan, residual.info.kept_alive, stored)
            # A scan body's sliced or loop-invariant operand, stored as it is, is
            # the scan's operand: the enclosing call sees and reports it.
            if not (in_scan and residual.info.kept_alive and isinstance(plan, Raw)):
                record(Record(residual.info, policy, plan.nbytes(stored, residual.info),
                              iterations or 1))
        recompute = None
        if any(isinstance(p, Recompute) for p in plans):
            recompute = PlannedRecompute(analysis, plans)
            for i in recompute.needed_inputs:
                store_input(i, input_kinds[i].kept_alive)
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
            if isinstance(plan, Recompute):
                inputs = [stored[state["stored_inputs"][j]] for j in recompute.needed_inputs]
                restored.update(recompute(inputs, cts))
            elif isinstance(plan, Derived):
                restored[i] = plan.restore(lambda j: restore(j, tie))
            elif isinstance(plan, View):
                restored[i] = plan.restore(stored, tie)
            elif isinstance(plan, Packed):
                arrays = plan.stored(stored)
                changed = [k for k, (_, p) in enumerate(plan.positions) if p not in plan.unchanged]
                for k, array in zip(changed, _after([arrays[k] for k in changed], tie)):
                    arrays[k] = array
                restored[i] = plan.restore(arrays, info)
            else:
                restored[i] = plan.restore(stored, info)
            return restored[i]

        return tuple(_run_backward(state["backward"], len(plans), restore, list(cts)))

    run.defvjp(warns_on_unmatched_rules(fwd), bwd)
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
                packed[index] = pack(to_pack[index], value, analysis.residuals[index].info, stored)
                value = _tie_forward(value, packed[index], stored)
            env[var] = value

    computed(jaxpr.invars, xs)
    for eqn in jaxpr.eqns:
        values = [v.val if isinstance(v, jp.Literal) else env[v] for v in eqn.invars]
        computed(eqn.outvars, jp.bind_equation(eqn, values))
    return [v.val if isinstance(v, jp.Literal) else env[v] for v in jaxpr.outvars]


def _tie_forward(value, plan: Packed, stored: list):
    """`value`, through a `lax.cond` that also passes (so first computes) `plan`'s arrays."""
    changed = [p for _, p in plan.positions if p not in plan.unchanged]
    if (not changed or not value.size or jax.device_count() > 1
            or not jnp.issubdtype(value.dtype, jnp.inexact) or not in_device_memory(value)
            or not all(in_device_memory(stored[p]) for p in changed)):
        return value
    arrays = [stored[p] for p in changed]
    value, arrays = passed_after(value, (value, arrays))
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
    producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    inputs_at = {v: i for i, v in enumerate(jaxpr.invars)}
    views = {}
    for index, var in enumerate(jaxpr.outvars[analysis.num_outputs:]):
        chain = []
        while not isinstance(var, jp.Literal) and var in producers:
            eqn = producers[var]
            # One operand: a `dynamic_slice` (which has index operands too) is stored.
            if eqn.primitive.name not in VIEWS or len(eqn.invars) != 1:
                break
            chain.append(eqn)
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
    packed = call_hook("pack", policy.pack, lax.stop_gradient(value), info)
    unpacked = checked(call_hook("unpack", policy.unpack, packed, info), info)
    return _straight_through(value, unpacked)


@jax.custom_jvp
def _straight_through(x, y):
    return y


@_straight_through.defjvp
def _straight_through_jvp(primals, tangents):
    return primals[1], tangents[0]

