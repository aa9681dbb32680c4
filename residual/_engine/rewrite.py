"""Re-evaluating a jaxpr so that every `lax.scan` body gets hooks of its own.

Hooks applied around a whole function see the residuals of a scan only after the
loop, stacked in their original dtype: packing them there would *add* memory. So
`interpret` evaluates the function's jaxpr equation by equation and rebuilds each
scan with a body that is itself a `hooked_call`: its residuals are packed inside the
body, once per iteration, and the loop stacks the packed form. Inner `jit`s are
inlined, and `cond` branches and `checkpoint` regions rebuilt, to reach the scans
inside them; every other equation is bound again as it was, with its source line
and name scopes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax

from .. import _jax_private as jp
from .._policy import Policy
from .._scope import innermost_policy, is_marker, policy_of_marker
from .hooked_call import differentiated_again, hooked_call
from .residuals import KEPT, PER_ITERATION


def interpret(
    jaxpr: jp.Jaxpr, consts: Sequence[Any], args: Sequence[Any], base: Policy | None,
    scopes: tuple[str, ...] = (), iterations: int | None = None,
) -> list[Any]:
    """Evaluates `jaxpr`, rebuilding scans with hooked bodies.

    `base` is the policy for residuals outside any hooks region, `scopes` the name
    scopes around `jaxpr` (used to resolve the regions a scan sits in), and
    `iterations` the product of the lengths of the scans around it.
    """
    env: dict[Any, Any] = {}

    def read(v):
        return v.val if isinstance(v, jp.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        rule = _rule(jp.kind(eqn))
        if rule is not None and contains_scan(eqn):
            eqn_scopes = (*scopes, *jp.scope_names(eqn))
            with jp.name_stack_context(eqn):
                outs = rule(eqn, invals, base, eqn_scopes, iterations)
        else:
            outs = jp.bind_equation(eqn, invals)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def contains_scan(eqn_or_jaxpr: Any) -> bool:
    """Whether a scan is reachable through the sub-jaxprs of an equation or jaxpr."""
    eqns = getattr(eqn_or_jaxpr, "eqns", None)
    if eqns is not None:
        return any(contains_scan(e) for e in eqns)
    eqn = eqn_or_jaxpr
    if eqn.primitive is jp.scan_p:
        return True
    return any(contains_scan(sub) for sub in jp.sub_jaxprs(eqn))


def has_markers(jaxpr: jp.Jaxpr) -> bool:
    """Whether any equation sits inside a `saved_tensors_hooks` region."""
    for eqn in jaxpr.eqns:
        if any(is_marker(s) for s in jp.scope_names(eqn)):
            return True
        if any(has_markers(sub) for sub in jp.sub_jaxprs(eqn)):
            return True
    return False


def _region_policy(scopes: Sequence[str], base: Policy | None) -> Policy | None:
    return innermost_policy([policy_of_marker(s) for s in scopes if is_marker(s)], base)


def _scan(eqn: jp.JaxprEqn, invals: list[Any], base: Policy | None,
          scopes: tuple[str, ...], iterations: int | None) -> list[Any]:
    if differentiated_again():
        # A higher derivative stores every residual as it is (`decisions.RoundTrip`);
        # a body with hooks of its own would differentiate through what they packed.
        return jp.bind_equation(eqn, invals)
    scan = jp.scan_parts(eqn)
    body = scan.body
    n_consts, n_carry = scan.num_consts, scan.num_carry
    consts = invals[:n_consts]
    init = invals[n_consts : n_consts + n_carry]
    xs = invals[n_consts + n_carry :]
    kinds = [KEPT] * n_consts + [PER_ITERATION] * n_carry + [KEPT] * len(xs)
    body_base = _region_policy(scopes, base)
    plain_scopes = tuple(s for s in scopes if not is_marker(s))
    # The regions around the scan stay around scans in its body, whose base they chose.
    regions = tuple(s for s in scopes if is_marker(s))

    body_iterations = (iterations or 1) * scan.length

    def body_fun(*flat):
        return interpret(body.jaxpr, body.consts, flat, body_base, regions, body_iterations)

    def step(carry, x):
        outs = hooked_call(
            body_fun, [*consts, *carry, *x], kinds, body_base,
            scope_prefix=plain_scopes, iterations=body_iterations, in_region=bool(regions),
        )
        return outs[:n_carry], outs[n_carry:]

    carry, ys = lax.scan(
        step, list(init), list(xs), length=scan.length, reverse=scan.reverse,
        unroll=scan.unroll,
    )
    return [*carry, *ys]


def _inline_call(eqn: jp.JaxprEqn, invals: list[Any], base: Policy | None,
                 scopes: tuple[str, ...], iterations: int | None) -> list[Any]:
    body = jp.call_body(eqn)
    return interpret(body.jaxpr, body.consts, invals, base, scopes, iterations)


def _cond(eqn: jp.JaxprEqn, invals: list[Any], base: Policy | None,
          scopes: tuple[str, ...], iterations: int | None) -> list[Any]:
    index, *operands = invals
    branches = [
        functools.partial(_run_branch, branch, base, scopes, iterations)
        for branch in jp.cond_branches(eqn)
    ]
    return lax.switch(index, branches, *operands)


def _run_branch(branch: jp.ClosedJaxpr, base: Policy | None, scopes: tuple[str, ...],
                iterations: int | None, *operands: Any) -> list[Any]:
    return interpret(branch.jaxpr, branch.consts, operands, base, scopes, iterations)


def _checkpoint(eqn: jp.JaxprEqn, invals: list[Any], base: Policy | None,
                scopes: tuple[str, ...], iterations: int | None) -> list[Any]:
    remat = jp.remat_parts(eqn)
    region = functools.partial(
        interpret, remat.body.jaxpr, remat.body.consts, base=base, scopes=scopes,
        iterations=iterations,
    )
    wrapped = jax.checkpoint(
        lambda *a: region(a), prevent_cse=remat.prevent_cse, policy=remat.policy
    )
    return wrapped(*invals)


def _rule(kind: Any) -> Callable[..., list[Any]] | None:
    """How `interpret` rebuilds an equation of this `jp.kind` that contains a scan."""
    if kind is jp.scan_p:
        return _scan
    if kind is jp.cond_p:
        return _cond
    if kind in jp.REMATS:
        return _checkpoint
    if kind in jp.CALLS:
        return _inline_call
    return None
