"""`decide`: the one place a residual's fate is chosen, from its policy and the others'."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._policy import FunctionHooks, Policy
from .._scope import innermost_policy
from .decisions import (
    Decision,
    Derive,
    Keep,
    KeepInput,
    OwnedByInner,
    Pack,
    Recompute,
    RoundTrip,
    View,
)
from .recompute import RecomputePlan, made_by_loops
from .residuals import Analysis, InputKind, Residual, value_describer
from .smallest_store import stored_instead


def decide(
    analysis: Analysis,
    input_kinds: Sequence[InputKind],
    base: Policy | None,
    *,
    higher_order: bool,
    scope_prefix: Sequence[str] = (),
    in_scan: bool = False,
) -> tuple[list[Decision], RecomputePlan | None]:
    """The decision for each residual of `analysis`, and what `Recompute` recomputes.

    `base` applies outside any hooks region. A `higher_order` derivative (the values
    are themselves being differentiated) stores every residual, round-tripped
    through its policy (see `RoundTrip`): nothing is derived, re-taken or packed.
    Masks that `Cast` and `Quantize` would store as bits beside no packed float are
    kept as they are (see `MaskBits`).
    """
    # A loop's output is never recomputed (that would run the loop again): it is
    # stored, as its policy's `instead` would store it, else as it is.
    by_a_loop = made_by_loops(analysis.closed.jaxpr)
    residual_vars = analysis.closed.jaxpr.outvars[analysis.num_outputs:]
    policies = [None if r.owned_by_inner else policy_for(r, base) for r in analysis.residuals]
    policies = [_storing(p) if by_a_loop(v) else p for p, v in zip(policies, residual_vars)]
    decisions, plan = _decide_with(
        policies, analysis, input_kinds, base, by_a_loop=by_a_loop,
        higher_order=higher_order, scope_prefix=scope_prefix, in_scan=in_scan)
    packed = [d.policy for d in decisions if isinstance(d, (Pack, RoundTrip))]
    if packed and all(p.beside_floats for p in packed):
        # Only masks would be packed (see `MaskBits`): kept as JAX keeps them.
        without = [None if p is not None and p.beside_floats else p for p in policies]
        decisions, plan = _decide_with(
            without, analysis, input_kinds, base, by_a_loop=by_a_loop,
            higher_order=higher_order, scope_prefix=scope_prefix, in_scan=in_scan)
    return decisions, plan


def _decide_with(policies: list[Policy | None], analysis: Analysis,
                 input_kinds: Sequence[InputKind], base: Policy | None, *,
                 by_a_loop: Callable[[Any], bool], higher_order: bool,
                 scope_prefix: Sequence[str], in_scan: bool,
                 ) -> tuple[list[Decision], RecomputePlan | None]:
    """`decide`, with each residual's policy chosen."""
    residuals = analysis.residuals
    derived = set() if higher_order else _derivable(residuals, policies)
    constants = {} if higher_order else _constants(residuals, policies)
    # Once anything is packed the program is no longer JAX's own: views of
    # kept-alive inputs (`ws[i]`) are then re-taken in the backward, not stored, and
    # what is stored as it is gets read after the backward's own values.
    hooked = not higher_order and any(
        p is not None for p, r in zip(policies, residuals) if not r.owned_by_inner
    )
    acting = hooked and not in_scan
    # A scan body re-takes views too: stored, the loop would stack a copy (of a layer's
    # weights, `w.T`), a residual of the call around the scan that its policy would pack.
    decisions = [
        Derive(policy=p, eqn=constants[r.info.index][0], operands=constants[r.info.index][1])
        if r.info.index in constants else
        _decide_one(r, p, derived=r.info.index in derived, acting=acting,
                    retakes_views=hooked, higher_order=higher_order)
        for r, p in zip(residuals, policies)
    ]
    if not any(isinstance(d, Recompute) for d in decisions):
        return decisions, None
    values = _ForwardValues(
        value_describer(analysis, input_kinds, scope_prefix=scope_prefix, in_scan=in_scan),
        base, by_a_loop, higher_order, len(residuals))
    while True:
        recomputed = {i for i, d in enumerate(decisions) if isinstance(d, Recompute)}
        plan = RecomputePlan(analysis, recomputed, values.keep)
        stored, cut = stored_instead(plan, decisions, residuals, values.storable)
        values.cut |= cut
        if not stored and not cut:
            break
        for i in stored:
            policy = decisions[i].policy.instead
            decisions[i] = RoundTrip(policy=policy) if higher_order else Pack(policy=policy)
    if higher_order:
        return decisions, plan if recomputed else None
    # What storing some of them made derivable (a `tanh`'s derivative from its stored
    # output) is derived as `instead` would have it, not recomputed.
    derived = _derivable_from_stored(residuals, decisions)
    for i in derived:
        eqn, operands = residuals[i].derivation
        decisions[i] = Derive(policy=decisions[i].policy.instead, eqn=eqn, operands=operands)
    if derived:
        recomputed -= derived
        plan = RecomputePlan(analysis, recomputed, values.keep)
    plan = plan if recomputed else None
    if hooked and stores_as_jax_does(decisions, plan):
        decisions = [d if isinstance(d, Recompute) else
                     _decide_one(r, p, derived=False, acting=False, retakes_views=False,
                                 higher_order=False)
                     for r, p, d in zip(residuals, policies, decisions)]
    return decisions, plan


class _ForwardValues:
    """How the forward's values that are not residuals are stored for recomputation.

    `keep` is `RecomputePlan`'s: a value its policy recomputes is recomputed too,
    unless the smallest cut chose to store it (`cut`); `storable` gives that cut the
    values it may choose.
    """

    def __init__(self, describe: Callable[[Any, int], Residual], base: Policy | None,
                 by_a_loop: Callable[[Any], bool], higher_order: bool, count: int) -> None:
        self.describe, self.base, self.by_a_loop = describe, base, by_a_loop
        self.higher_order = higher_order
        self.count = count  # the residuals': values are numbered after them
        self.cut: set[Any] = set()
        self._storable: dict[Any, int | None] = {}

    def keep(self, var: Any, index: int) -> tuple[Residual, Decision] | None:
        residual = self.describe(var, index)
        if not self.by_a_loop(var) and not _policies_act_on(residual):
            return None
        policy = policy_for(residual, self.base)
        if self.by_a_loop(var) or var in self.cut:
            policy = _storing(policy)
        elif recomputes(policy):
            return None
        if policy is None:
            return residual, Keep()
        return residual, RoundTrip(policy=policy) if self.higher_order else Pack(policy=policy)

    def storable(self, var: Any) -> int | None:
        """The bytes of a value that a slice recomputes, where its policy could store it
        instead (`RematWhereSmaller`); else None."""
        if var not in self._storable:
            residual = self.describe(var, self.count)
            policy = (policy_for(residual, self.base)
                      if _policies_act_on(residual) and not self.by_a_loop(var) else None)
            self._storable[var] = (residual.info.nbytes if recomputes(policy) and getattr(
                policy, "instead", None) is not None else None)
        return self._storable[var]


def _policies_act_on(value: Residual) -> bool:
    """Whether a policy may store a value of the forward other than as it is: a numeric
    array of this call's own (`hookable`) that does not stay alive anyway."""
    return value.hookable and not value.info.kept_alive


def stores_as_jax_does(decisions: Sequence[Decision], plan: RecomputePlan | None) -> bool:
    """Whether the decisions store as JAX does: nothing packed, every stored value stored
    as it is, and whatever is recomputed recomputed from such values (a `tanh`'s
    cotangent factor from its output, a loss's `2 * x` from a kept `x`), as a
    compiler's fusion does.

    Then the program needs none of the ordering that packing does (`Keep.tied`,
    `View`): ordered, XLA could no longer fuse those computations into the backward,
    and a bf16 model under `Cast(bf16)` (which packs nothing) would peak above plain
    on a TPU. (On CPU a small bf16 MLP measured below plain ordered, 0.70x; JAX's
    order gives plain's 1.00x.)
    """
    as_jax_does = all(
        (isinstance(d, (Keep, Recompute)) and not isinstance(d, RoundTrip))
        or (isinstance(d, View) and d.policy is None)
        for d in decisions
    )
    if not as_jax_does:
        return False
    return plan is None or all(
        source[0] in ("residual", "const")
        or (source[0] == "saved" and type(plan.saved[source[1]].decision) is Keep)
        for part in plan.slice_of.values() for source in part.sources
    )


def _derivable_from_stored(residuals: Sequence[Residual], decisions: Sequence[Decision]
                           ) -> set[int]:
    """Recomputed residuals whose policy stores them `instead` where that is smaller,
    and that `instead` would derive from others now stored (see `_derivable`)."""
    stored = {i for i, d in enumerate(decisions) if isinstance(d, (Pack, Keep, KeepInput))}
    return {
        i for i, (r, d) in enumerate(zip(residuals, decisions))
        if isinstance(d, Recompute) and d.policy.instead is not None
        and r.derivation is not None and not d.policy.instead.lossless
        and all(not isinstance(o, int) or o in stored for o in r.derivation[1])
    }


def policy_for(residual: Residual, base: Policy | None) -> Policy | None:
    """The policy that handles `residual` (the innermost hooks region's, else `base`)."""
    if not residual.hookable:
        return None
    policy = innermost_policy(residual.region_policies, base)
    return None if policy is None else policy.resolve(residual.info)


def recomputes(policy: Policy | None) -> bool:
    return policy is not None and policy.recompute


def _storing(policy: Policy | None) -> Policy | None:
    """The policy that stores what `policy` would recompute: its `instead`, else none."""
    while recomputes(policy):
        policy = policy.instead
    return policy


def _decide_one(residual: Residual, policy: Policy | None, *, derived: bool, acting: bool,
                retakes_views: bool, higher_order: bool) -> Decision:
    if residual.owned_by_inner:
        return OwnedByInner()
    if derived:
        eqn, operands = residual.derivation
        return Derive(policy=policy, eqn=eqn, operands=operands)
    if retakes_views and residual.view is not None and (policy is None or recomputes(policy)):
        # Recomputing a view is re-taking it, inside the backward's conditional
        # (recomputed from the whole input, it would be a copy of the input).
        chain, j = residual.view
        return View(policy=policy, chain=chain, input_index=j)
    if policy is None:
        if residual.input_index is not None:
            return KeepInput(input_index=residual.input_index)
        return Keep(tied=acting and not residual.info.kept_alive)
    if recomputes(policy):
        return Recompute(policy=policy)
    if higher_order:
        return RoundTrip(policy=policy)
    return Pack(policy=policy)


def _derivable(residuals: Sequence[Residual], policies: Sequence[Policy | None]) -> set[int]:
    """Residuals to derive from others in the backward instead of storing them.

    Only for residuals a lossy policy would pack (plain hooks and lossless policies
    see every residual, as in PyTorch), and only from residuals that are stored.
    """
    candidates = {
        r.info.index for r, p in zip(residuals, policies)
        if r.derivation is not None and p is not None and not p.lossless
        and not isinstance(p, FunctionHooks) and not p.recompute
    }
    return {
        i for i in candidates
        if all(not isinstance(o, int) or (o not in candidates and not residuals[o].owned_by_inner
                                           and not recomputes(policies[o]))
               for o in residuals[i].derivation[1])
    }


def _constants(residuals: Sequence[Residual], policies: Sequence[Policy | None]
               ) -> dict[int, tuple[Any, tuple[Any, ...]]]:
    """Residuals computed from literals alone (the zeros `relu`'s or `where`'s derivative
    saves), by index: the equation and its operands, to compute them again in the backward.

    Packed, such a residual is a full-size float the forward materializes (XLA keeps
    the broadcast of a constant alive from the start of the program) only to store a
    packed copy of a constant; without hooks, XLA fuses it into its use. Only for
    residuals a lossy policy would pack, as for `_derivable`.
    """
    return {
        r.info.index: r.constant for r, p in zip(residuals, policies)
        if r.constant is not None and p is not None and not p.lossless
        and not isinstance(p, FunctionHooks) and not p.recompute
    }
