"""The custom VJP at the heart of `residual`: pack in the forward, unpack in the backward.

`hooked_call(fun, inputs, ...)` computes `fun(*inputs)` so that, when it is
differentiated in reverse mode, the forward runs `jax.vjp(fun)` (traced once to a
jaxpr by `trace_residuals`), decides each residual's fate (`decide.decide`), and
stores what the decisions store; the backward runs JAX's backward jaxpr, restoring
each residual where it is first needed. See `_engine/README.md` for the data flow.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import _jax_private as jp
from .._policy import FORWARD_WRAPPERS, Policy
from .._scope import innermost_policy
from .decide import decide, stores_as_jax_does
from .decisions import Decision, as_array
from .recompute import RecomputePlan
from .record import Record, record
from .residuals import Analysis, InputKind, Residual, backward_jaxpr, trace_residuals
from .stacking import Stacks
from .storage import Handoff, Restores, Stores

_HIGHER_ORDER = contextvars.ContextVar("residual_higher_order", default=False)


def differentiated_again() -> bool:
    """Whether the forward being traced is itself differentiated (a higher derivative).

    A scan body's hooks cannot tell: JAX traces the body's forward once, with tracers
    of the scan's own, and differentiates that jaxpr again later, through the stored
    residuals as they were packed (rounding's zero derivative; a value in host memory
    where a cotangent must be on the device). The hooked call around the scan can, and
    says so here for the time its forward is traced.
    """
    return _HIGHER_ORDER.get()


def hooked_call(
    fun: Callable[..., Sequence[Any]],
    inputs: Sequence[Any],
    input_kinds: Sequence[InputKind],
    base: Policy | None,
    *,
    scope_prefix: Sequence[str] = (),
    iterations: int | None = None,
    in_region: bool = False,
) -> list[Any]:
    """`fun(*inputs)` (a flat list of arrays in, a flat list out), with hooked residuals.

    `base` applies to residuals produced outside any `saved_tensors_hooks` region
    inside `fun`; inside one, the innermost region's hooks apply. `iterations` is the
    number of times the residuals are stored when `fun` is a scan body (the product
    of the lengths of the scans around it), `None` outside scans. `in_region`: `base`
    is the policy of a region around `fun` (a scan's body), for the records.
    """
    in_scan = iterations is not None
    # The forward's handoff to the backward, which JAX calls with the stored arrays only.
    handoff: list[Handoff] = []

    @jax.custom_vjp
    def run(*xs):
        return list(fun(*xs))

    def fwd(*xs):
        # Python scalars (a float passed to `jax.grad`) reach the rule as JAX's typed
        # scalars, which are not arrays: hooks and the forward see arrays only.
        xs = tuple(as_array(x) for x in xs)
        # Values that are themselves being differentiated mean a higher-order
        # derivative: see `decisions.RoundTrip`, and `differentiated_again` for scans.
        higher_order = jp.differentiation_mode(xs) is not None
        token = _HIGHER_ORDER.set(_HIGHER_ORDER.get() or higher_order)
        try:
            return _forward(xs, higher_order)
        finally:
            _HIGHER_ORDER.reset(token)

    def _forward(xs, higher_order):
        analysis = trace_residuals(
            fun, xs, input_kinds, scope_prefix=scope_prefix, in_scan=in_scan
        )
        decisions, recompute = decide(
            analysis, input_kinds, base, higher_order=higher_order,
            scope_prefix=scope_prefix, in_scan=in_scan,
        )
        stores = Stores(xs, in_scan=in_scan)
        outs, residuals = _run_forward(analysis, decisions, recompute, stores)
        for value, residual, decision in zip(residuals, analysis.residuals, decisions):
            if residual.info.index not in stores.slots:
                decision.store(stores, residual, value)
        _record_all(analysis, decisions, recompute, stores, iterations,
                    base if in_region else None)
        if recompute is not None:
            for j in recompute.needed_inputs:
                stores.input(j, input_kinds[j].kept_alive)
        handoff[:] = [Handoff(analysis, tuple(decisions), recompute, stores.slots,
                              stores.input_positions,
                              backward_jaxpr(analysis, residuals, outs),
                              frozenset(j for j, k in enumerate(input_kinds) if k.kept_alive))]
        return outs, stores.storage.arrays

    def bwd(stored, cts):
        restores = Restores(handoff[0], stored, cts)
        return tuple(_run_backward(restores, list(cts), ordered=jp.is_staged()))

    run.defvjp(functools.reduce(lambda rule, wrap: wrap(rule), FORWARD_WRAPPERS, fwd), bwd)
    return run(*inputs)


def _run_forward(analysis: Analysis, decisions: Sequence[Decision],
                 recompute: RecomputePlan | None, stores: Stores) -> tuple[list, list]:
    """The forward's outputs and residuals, storing each packed one as soon as it is computed.

    Packed at the end, XLA's scheduler may run a `pack` long after the value was
    computed (several layers later in an unrolled model), keeping the floats of
    all those layers alive at once. Here the forward is run equation by equation and
    the rest of it reads each packed value after its packed arrays (see
    `ordering.ordered`), so the float can be freed after its last forward use.
    Values stored for recomputation are stored as soon as they are computed too.
    A scan body packs after its forward: the loop boundary already orders it.
    """
    jaxpr = analysis.closed.jaxpr
    residuals = analysis.residuals
    early: dict[Any, list[tuple[Residual, Decision]]] = {}
    for var, residual, decision in zip(jaxpr.outvars[analysis.num_outputs:], residuals,
                                       decisions):
        if decision.early and not stores.in_scan and not isinstance(var, jp.Literal):
            early.setdefault(var, []).append((residual, decision))
    for entry in () if recompute is None else recompute.saved:
        early.setdefault(entry.var, []).append((entry.residual, entry.decision))
    if early:
        values = _interpret(analysis.closed, stores.inputs, early, stores)
    else:
        values = jp.jaxpr_as_fun(analysis.closed)(*stores.inputs)
    # An output the trace made a constant (`jnp.array(False)` returned as an aux value)
    # comes from the jaxpr as a literal, a Python or typed scalar: an array of its type.
    outputs = [as_array(v) for v in values[: analysis.num_outputs]]
    return outputs, values[analysis.num_outputs :]


def _interpret(closed: jp.ClosedJaxpr, xs: Sequence[Any],
               early: dict[Any, list[tuple[Residual, Decision]]], stores: Stores) -> list:
    """Evaluates `closed`, storing the values of `early`'s variables when computed."""
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts))

    def computed(variables: Sequence[Any], values: Sequence[Any]) -> None:
        for var, value in zip(variables, values):
            for residual, decision in early.get(var, ()):
                value = decision.store(stores, residual, value)
            env[var] = value

    computed(jaxpr.invars, xs)
    for eqn in jaxpr.eqns:
        values = [v.val if isinstance(v, jp.Literal) else env[v] for v in eqn.invars]
        computed(eqn.outvars, jp.bind_equation(eqn, values))
    return [v.val if isinstance(v, jp.Literal) else env[v] for v in jaxpr.outvars]


def _record_all(analysis: Analysis, decisions: Sequence[Decision],
                recompute: RecomputePlan | None, stores: Stores,
                iterations: int | None, region: Policy | None) -> None:
    """Reports every residual this call owns, then the values stored for recomputation;
    `region`: the policy of a region around the call, which chose its base."""
    in_scan = iterations is not None
    entries = [(r, d) for r, d in zip(analysis.residuals, decisions) if d.reported
               # A scan body's sliced or loop-invariant operand, stored as it is, is
               # the scan's operand: the enclosing call sees and reports it.
               and not (in_scan and r.info.kept_alive and d.as_is)]
    entries += [] if recompute is None else [(e.residual, e.decision) for e in recompute.saved]
    for residual, decision in entries:
        info = residual.info
        nbytes = decision.nbytes(stores.storage, stores.slots.get(info.index), info)
        record(Record(info, decision.policy, nbytes, iterations or 1, decision, analysis,
                      region=innermost_policy(residual.region_policies, region)))


def _run_backward(restores: Restores, cts: list, *, ordered: bool) -> list:
    """Runs JAX's backward pass, restoring each residual just before its first use.

    Restoring them all up front would let XLA schedule every `unpack` (a dequantize,
    a copy back from host) early, so all float residuals would be live at once; tied
    to the values the backward has computed by then, each one is restored late.
    Unless `ordered`, there is no such tie (`None`): restored where first used.
    A value the backward computes from constants alone (the zeros that a `select`'s
    transpose fills in) is no tie: XLA folds the conditional's predicate and removes
    it, and with it the order (a ReLU mask would be recomputed in the backward from
    the float it is computed from, keeping that float alive instead).
    """
    backward = restores.handoff.backward
    n_res = len(restores.handoff.decisions)
    jaxpr = backward.jaxpr
    lazy = {v: i for i, v in enumerate(jaxpr.invars[:n_res])}
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, backward.consts))
    # `jax.vjp`'s function accepts Python scalars as cotangents of scalar outputs.
    env.update((v, as_array(ct, v.aval.dtype)) for v, ct in zip(jaxpr.invars[n_res:], cts))

    def read(v: Any, tie: Any) -> Any:
        if isinstance(v, jp.Literal):
            return v.val
        if v not in env:
            env[v] = restores.residual(lazy[v], tie)
        return env[v]

    constant = set(jaxpr.constvars)
    handoff = restores.handoff
    stacks = Stacks(jaxpr, stores_as_jax=stores_as_jax_does(handoff.decisions, handoff.recompute))
    for eqn in jaxpr.eqns:
        tie = _tie(eqn, env, constant) if ordered else None
        invals = [read(v, tie) for v in eqn.invars]
        outs = stacks.build(eqn, invals)
        if outs is None:
            outs = jp.bind_equation(eqn, invals)
        env.update(zip(eqn.outvars, outs))
        stacks.computed(eqn.outvars, outs)
        if _reads_only_constants(eqn, constant):
            constant.update(eqn.outvars)
    return [read(v, None) for v in jaxpr.outvars]


def _tie(eqn: Any, env: dict[Any, Any], constant: set[Any]) -> Any:
    """What the residuals `eqn` restores wait for: the first value `eqn` reads that the
    backward has computed, not from constants alone, and that is a non-empty float
    array; None if there is none."""
    known = [env[v] for v in eqn.invars
             if not isinstance(v, jp.Literal) and v in env and v not in constant]
    return next((x for x in known if x.size and jnp.issubdtype(x.dtype, jnp.inexact)), None)


def _reads_only_constants(eqn: Any, constant: set[Any]) -> bool:
    """Whether every value `eqn` reads is a literal or computed from constants alone."""
    return all(isinstance(v, jp.Literal) or v in constant for v in eqn.invars)

