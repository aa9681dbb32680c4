"""What becomes of each residual between the forward and the backward: one decision each.

`decide` chooses, once per residual, a frozen `Decision`: `Keep` it as it is, `Pack`
it with its policy, `Derive` it from other residuals, re-take it as a `View` of an
input, or `Recompute` it. Every decision has the same protocol: `store` (in the
forward, into a `Stores`), `restore` (in the backward, from a `Restores`), `nbytes`
(what it stored) and `how` (the word reports show). `RecomputePlan` holds the slices
of the forward that `Recompute` runs again, and the values it stores for them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from .. import _jax_private as jp
from .._errors import HookError
from .._info import ResidualInfo
from .._policy import FunctionHooks, Policy
from .._scope import innermost_policy
from .ordering import ordered
from .residuals import OWNED_NAME, Analysis, InputKind, Residual, value_describer


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
    """
    residuals = analysis.residuals
    policies = [None if r.owned_by_inner else policy_for(r, base) for r in residuals]
    derived = set() if higher_order else _derivable(residuals, policies)
    constants = {} if higher_order else _constants(residuals, policies)
    # Once anything is packed the program is no longer JAX's own: views of
    # kept-alive inputs (`ws[i]`) are then re-taken in the backward, not stored, and
    # what is stored as it is gets read after the backward's own values.
    acting = not higher_order and not in_scan and any(
        p is not None for p, r in zip(policies, residuals) if not r.owned_by_inner
    )
    decisions = [
        Derive(policy=p, eqn=constants[r.info.index][0], operands=constants[r.info.index][1])
        if r.info.index in constants else
        _decide_one(r, p, derived=r.info.index in derived, acting=acting,
                    higher_order=higher_order)
        for r, p in zip(residuals, policies)
    ]
    recomputed = {i for i, d in enumerate(decisions) if isinstance(d, Recompute)}
    if not recomputed:
        return decisions, None
    describe = value_describer(analysis, input_kinds, scope_prefix=scope_prefix,
                               in_scan=in_scan)

    def keep(var: Any, index: int) -> tuple[Residual, Decision] | None:
        residual = describe(var, index)
        if not residual.hookable or residual.info.kept_alive:
            return None
        policy = policy_for(residual, base)
        if recomputes(policy):
            return None
        if policy is None:
            return residual, Keep()
        return residual, RoundTrip(policy=policy) if higher_order else Pack(policy=policy)

    return decisions, RecomputePlan(analysis, recomputed, keep)


def policy_for(residual: Residual, base: Policy | None) -> Policy | None:
    """The policy that handles `residual` (the innermost hooks region's, else `base`)."""
    if not residual.hookable:
        return None
    policy = innermost_policy(residual.region_policies, base)
    return None if policy is None else policy.resolve(residual.info)


def recomputes(policy: Policy | None) -> bool:
    return policy is not None and policy.recompute


def _decide_one(residual: Residual, policy: Policy | None, *, derived: bool, acting: bool,
                higher_order: bool) -> Decision:
    if residual.owned_by_inner:
        return OwnedByInner()
    if derived:
        eqn, operands = residual.derivation
        return Derive(policy=policy, eqn=eqn, operands=operands)
    if acting and residual.view is not None and (policy is None or recomputes(policy)):
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


class Storage:
    """The arrays the forward stores for the backward (the custom VJP's residuals).

    Values are put once, by position; ordering and tagging may replace one with the
    same value as seen through a conditional or a name.
    """

    def __init__(self, arrays: Sequence[Any] = ()) -> None:
        self.arrays: list[Any] = list(arrays)

    def put(self, value: Any) -> int:
        self.arrays.append(value)
        return len(self.arrays) - 1

    def __getitem__(self, position: int) -> Any:
        return self.arrays[position]

    def __setitem__(self, position: int, value: Any) -> None:
        self.arrays[position] = value

    def tag_owned(self, slot: Slot, kept_alive: bool) -> None:
        """Tags what `slot` holds, so that an enclosing hooked call leaves it alone.

        An operand that stays alive anyway and is stored as it is stays untagged: the
        tag would hide from `lax.scan` that the residual is just its operand, and the
        scan would copy it. The enclosing call then sees it as its own value, which
        it is.
        """
        for position in slot.positions:
            if not (kept_alive and position in slot.unchanged):
                self.arrays[position] = checkpoint_name(self.arrays[position], OWNED_NAME)


@dataclasses.dataclass(frozen=True, eq=False)
class Slot:
    """Where one value's arrays lie in `Storage`, and the static rest of `pack`'s result."""

    positions: tuple[int, ...]
    unchanged: frozenset[int]  # positions holding the value itself, not a packed form
    treedef: Any = None  # of `pack`'s result; `None`: the value stored as it is
    leaves: tuple[Any, ...] = ()  # `pack`'s leaves, `None` where an array is stored
    leaf_indices: tuple[int, ...] = ()  # for each position, its leaf

    @classmethod
    def as_is(cls, position: int) -> Slot:
        return cls((position,), frozenset({position}))


class Stores:
    """What the forward stores, as it runs: `Storage`, and a `Slot` per stored value."""

    def __init__(self, inputs: Sequence[Any], *, in_scan: bool) -> None:
        self.inputs, self.in_scan = inputs, in_scan
        self.storage = Storage()
        # By residual index; values stored for recomputation are numbered after them.
        self.slots: dict[int, Slot] = {}
        self.input_positions: dict[int, int] = {}

    def value(self, info: ResidualInfo, value: Any, *, tag: bool = True) -> None:
        """Stores `value` as it is for the residual `info`."""
        slot = Slot.as_is(self.storage.put(value))
        if tag:
            self.storage.tag_owned(slot, info.kept_alive)
        self.slots[info.index] = slot

    def input(self, j: int, kept_alive: bool) -> int:
        """Input `j`'s position in storage, storing it the first time it is asked for."""
        if j not in self.input_positions:
            slot = Slot.as_is(self.storage.put(self.inputs[j]))
            self.input_positions[j] = slot.positions[0]
            self.storage.tag_owned(slot, kept_alive)
        return self.input_positions[j]


@dataclasses.dataclass(frozen=True, eq=False)
class Handoff:
    """What the backward needs from the forward besides the stored arrays."""

    analysis: Analysis
    decisions: tuple[Decision, ...]
    recompute: RecomputePlan | None
    slots: dict[int, Slot]
    input_positions: dict[int, int]
    backward: jp.ClosedJaxpr  # JAX's backward pass: residuals, cotangents -> input cotangents


class Restores:
    """The backward's reads: each residual restored once, where it is first needed."""

    def __init__(self, handoff: Handoff, arrays: Sequence[Any],
                 cotangents: Sequence[Any]) -> None:
        self.handoff = handoff
        self.storage = Storage(arrays)
        self.cotangents = cotangents
        self.restored: dict[int, Any] = {}

    def residual(self, i: int, tie: Any) -> Any:
        """Residual `i`, restored after `tie` (a value the backward has just computed)."""
        if i not in self.restored:
            residual = self.handoff.analysis.residuals[i]
            self.restored[i] = self.handoff.decisions[i].restore(self, residual, tie)
        return self.restored[i]

    def tie_or_cotangent(self, tie: Any) -> Any:
        """`tie`, or when there is none the first cotangent: work tied to it can neither
        merge with the forward nor be scheduled early."""
        return tie if tie is not None else next(iter(jax.tree.leaves(self.cotangents)), None)

    def source(self, source: tuple[str, Any], tie: Any) -> Any:
        """A value recomputation starts from (see `RecomputePlan`)."""
        kind, key = source
        if kind == "input":
            return self.storage[self.handoff.input_positions[key]]
        if kind == "residual":
            return self.residual(key, tie)
        if kind == "saved":
            entry = self.handoff.recompute.saved[key]
            return entry.decision.restore(self, entry.residual, tie)
        return key  # a constant


class Decision:
    """What becomes of one residual; subclasses are frozen dataclasses.

    `store` runs in the forward and returns the value the rest of the forward reads;
    `restore` runs in the backward. `how` is the word reports show, `as_is` says the
    residual is stored unchanged, `reported` whether reports list it, and `early`
    whether the forward stores it as soon as it computes it (outside scan bodies).
    """

    how: ClassVar[str]
    as_is: ClassVar[bool] = False
    reported: ClassVar[bool] = True
    early: ClassVar[bool] = False
    policy: Policy | None  # the policy that chose it; `None` when none did

    def store(self, stores: Stores, residual: Residual, value: Any) -> Any:
        return value  # nothing stored

    def restore(self, restores: Restores, residual: Residual, tie: Any) -> Any:
        raise NotImplementedError

    def nbytes(self, storage: Storage, slot: Slot | None, info: ResidualInfo) -> int:
        return 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Keep(Decision):
    """Stored as it is.

    `tied` when others are packed: read straight from the forward's value, XLA
    merges the backward's work on it with the forward's (the full-size broadcast of
    a batch norm's per-channel scale is computed once and kept alive from the
    forward to the backward, one float per layer); read after the backward's own
    values, it is not.
    """

    how: ClassVar[str] = "kept"
    as_is: ClassVar[bool] = True
    policy: Policy | None = None
    tied: bool = False

    def store(self, stores: Stores, residual: Residual, value: Any) -> Any:
        stores.value(residual.info, value)
        return value

    def restore(self, restores: Restores, residual: Residual, tie: Any) -> Any:
        slot = restores.handoff.slots[residual.info.index]
        value = restores.storage[slot.positions[0]]
        if self.tied:
            return ordered([value], restores.tie_or_cotangent(tie))[0]
        return value

    def nbytes(self, storage: Storage, slot: Slot | None, info: ResidualInfo) -> int:
        return info.nbytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeepInput(Keep):
    """An input of the hooked function, stored as it is (and once, for recomputation too).

    The input itself is stored, not the residual: a `cond` that forwards it in one
    branch fills the residual with zeros in the others, which recomputation
    (reading it as the input) must not see.
    """

    input_index: int

    def store(self, stores: Stores, residual: Residual, value: Any) -> Any:
        stores.input_positions.setdefault(self.input_index, len(stores.storage.arrays))
        stores.value(residual.info, stores.inputs[self.input_index])
        return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class OwnedByInner(Keep):
    """Stored by an inner hooked call (a scan body, a nested `with_hooks`): passed on as
    it is, untagged, and reported by that call."""

    reported: ClassVar[bool] = False

    def store(self, stores: Stores, residual: Residual, value: Any) -> Any:
        stores.value(residual.info, value, tag=False)
        return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoundTrip(Keep):
    """For higher-order derivatives: stores `unpack(pack(x))`, differentiable as `x`.

    When the hooked function is differentiated more than once, the backward itself
    is differentiated, and with it the residuals. Rounding has a zero derivative, so
    differentiating through a lossy `pack` would make higher derivatives silently
    wrong (100% wrong for an int8 cast). As PyTorch restores the autograd history of
    an unpacked tensor, the round trip here is transparent to differentiation.
    """

    policy: Policy

    def store(self, stores: Stores, residual: Residual, value: Any) -> Any:
        # `stop_gradient` of a traced Python scalar is the scalar itself: hooks see arrays.
        info = residual.info
        packed = call_hook("pack", self.policy.pack, as_array(lax.stop_gradient(value)), info)
        unpacked = checked(call_hook("unpack", self.policy.unpack, packed, info), info)
        stores.value(info, _straight_through(value, unpacked))
        return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pack(Decision):
    """Stored as the arrays of `policy.pack`'s result; its static parts stay in Python."""

    how: ClassVar[str] = "packed"
    early: ClassVar[bool] = True
    policy: Policy

    def store(self, stores: Stores, residual: Residual, value: Any) -> Any:
        info = residual.info
        if not stores.in_scan and self.policy.reads_twice:
            # Materialized once, through a conditional, before `pack` reads it: else
            # XLA computes a cheap producer (a batch norm's `x - mean`) twice, into
            # pack's own `cond` and into the one below, two floats alive at once. (A
            # `Cast` fuses its producer and gains nothing: it measured a little worse.)
            value = ordered([value, value], value, forward=True)[0]
        packed = call_hook("pack", self.policy.pack, value, info)
        leaves, treedef = jax.tree.flatten(packed)
        positions, leaf_indices, unchanged = [], [], set()
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, (jax.Array, np.ndarray)):
                position = stores.storage.put(leaf if leaf is value else jnp.asarray(leaf))
                if leaf is value:
                    unchanged.add(position)
                positions.append(position)
                leaf_indices.append(k)
                leaves[k] = None
        slot = Slot(tuple(positions), frozenset(unchanged), treedef, tuple(leaves),
                    tuple(leaf_indices))
        if not stores.in_scan:
            # The rest of the forward reads `value` after the packed arrays exist.
            changed = [p for p in slot.positions if p not in slot.unchanged]
            value, *arrays = ordered([value, *(stores.storage[p] for p in changed)], value,
                                     forward=True)
            for p, array in zip(changed, arrays):
                stores.storage[p] = array
        stores.storage.tag_owned(slot, info.kept_alive)
        stores.slots[info.index] = slot
        return value

    def restore(self, restores: Restores, residual: Residual, tie: Any) -> Any:
        info = residual.info
        slot = restores.handoff.slots[info.index]
        arrays = [restores.storage[p] for p in slot.positions]
        changed = [k for k, p in enumerate(slot.positions) if p not in slot.unchanged]
        for k, array in zip(changed, ordered([arrays[k] for k in changed], tie,
                                             probe_self=True)):
            arrays[k] = array
        leaves = list(slot.leaves)
        for k, array in zip(slot.leaf_indices, arrays):
            leaves[k] = array
        packed = jax.tree.unflatten(slot.treedef, leaves)
        return checked(call_hook("unpack", self.policy.unpack, packed, info), info)

    def nbytes(self, storage: Storage, slot: Slot | None, info: ResidualInfo) -> int:
        return sum(storage[p].size * storage[p].dtype.itemsize for p in slot.positions)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Derive(Decision):
    """Not stored: a cheap elementwise function of other residuals, recomputed from them.

    JAX's residuals often include both `y` and `1 - y` (tanh's derivative). XLA
    stores only `y` without hooks, fusing `1 - y` into the backward; packing both
    would store twice as much as needed. So the backward derives it from the
    restored `y` instead.
    """

    how: ClassVar[str] = "derived"
    policy: Policy | None
    eqn: Any
    operands: tuple[Any, ...]  # residual indices, or literal operands

    def restore(self, restores: Restores, residual: Residual, tie: Any) -> Any:
        values = [restores.residual(o, tie) if isinstance(o, int) else o.value
                  for o in self.operands]
        return jp.bind_equation(self.eqn, values)[0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class View(Decision):
    """Not stored: a view (`ws[i]`) of an input that stays alive, re-taken in the backward.

    XLA materializes `ws[i]` as a copy; stored, that copy lives from the forward to
    the backward (as it does without hooks). Re-taken inside a conditional tied to
    the backward, it lives only around its use, and XLA cannot merge it with the
    forward's copy. A policy that chose recomputation (`policy`) re-takes it too.
    """

    how: ClassVar[str] = "view"
    policy: Policy | None
    chain: tuple[tuple[Any, int], ...]  # (equation, output index) from the input on
    input_index: int

    def store(self, stores: Stores, residual: Residual, value: Any) -> Any:
        stores.slots[residual.info.index] = Slot.as_is(stores.input(self.input_index, True))
        return value

    def restore(self, restores: Restores, residual: Residual, tie: Any) -> Any:
        def take(x):
            for eqn, k in self.chain:  # output k: `unstack` has one per slice
                x = jp.bind_equation(eqn, [x])[k]
            return x

        slot = restores.handoff.slots[residual.info.index]
        return ordered([restores.storage[slot.positions[0]]], tie, view=take)[0]

    def nbytes(self, storage: Storage, slot: Slot | None, info: ResidualInfo) -> int:
        # Unless recomputed, reported as stored as it is: the input it views is.
        return 0 if self.policy is not None else info.nbytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recompute(Decision):
    """Not stored: recomputed in the backward from the nearest stored values."""

    how: ClassVar[str] = "recomputed"
    policy: Policy

    def restore(self, restores: Restores, residual: Residual, tie: Any) -> Any:
        plan = restores.handoff.recompute
        part = plan.slice_of[residual.info.index]
        inputs = [restores.source(source, tie) for source in part.sources]
        # Tied to the backward where it is needed, the recomputation can neither
        # merge with the forward nor be scheduled early.
        restores.restored.update(
            plan.run(part, ordered(inputs, restores.tie_or_cotangent(tie))))
        return restores.restored[residual.info.index]


@dataclasses.dataclass(frozen=True, eq=False)
class Saved:
    """A value of the forward that is not a residual, stored for recomputation to start from."""

    var: Any
    residual: Residual  # the value described as a residual would be
    decision: Decision  # `Keep`, `Pack` or `RoundTrip`


@dataclasses.dataclass(eq=False)
class Slice:
    """Equations of the forward recomputed together, and where their inputs come from."""

    eqns: list
    inputs: list  # the variables the slice reads
    sources: list  # for each input: ("input", j), ("residual", i), ("saved", k), ("const", c)
    outputs: list  # (residual index, variable)


class RecomputePlan:
    """The slices of the forward that produce the residuals decided `Recompute`.

    As `jax.checkpoint` recomputes from what its policy saves, a slice starts from the
    nearest values that are stored: the function's inputs, residuals kept or packed
    (unpacked in the backward), and the forward's other values that the policy does
    not mark for recomputation, which are then stored for it (`saved`, chosen by
    `keep`). A `Remat` region thus recomputes from its boundary. Slices that share no
    equation are recomputed separately, each where the backward first needs one of
    its residuals, so a model unrolled in Python recomputes layer by layer instead of
    running the whole forward again at the start of the backward.

    `keep(var, index)` says whether a value on a slice is stored: `(residual,
    decision)` to store it, `None` to recompute it too. `index` numbers the stored
    values after the residuals.
    """

    def __init__(self, analysis: Analysis, recomputed: set[int],
                 keep: Callable[[Any, int], tuple[Residual, Decision] | None]) -> None:
        self.analysis = analysis
        self.saved: list[Saved] = []
        jaxpr = analysis.closed.jaxpr
        residual_vars = jaxpr.outvars[analysis.num_outputs:]
        self._inputs_at = {v: j for j, v in enumerate(jaxpr.invars)}
        self._consts = dict(zip(jaxpr.constvars, analysis.closed.consts))
        self._keep = keep
        self._sources: dict[Any, tuple] = self._stored_residuals(residual_vars, recomputed)
        recomputed_vars = [residual_vars[i] for i in sorted(recomputed)]
        needed = {v for v in recomputed_vars if v not in self._sources
                  and v not in self._inputs_at and v not in self._consts}
        self.slice_of: dict[int, Slice] = self._slice_of_each(recomputed, recomputed_vars, needed)
        self.needed_inputs = sorted({
            s[1] for part in self.slice_of.values() for s in part.sources if s[0] == "input"
        })

    def _stored_residuals(self, residual_vars: list, recomputed: set[int]) -> dict[Any, tuple]:
        """Where the backward reads each stored residual (not recomputed, not an input):
        `("residual", i)`, `i` the first residual of that variable."""
        sources: dict[Any, tuple] = {}
        for i, (var, residual) in enumerate(zip(residual_vars, self.analysis.residuals)):
            # A residual that is an input reads as the input: where a `cond` forwards
            # it from one branch only, the residual itself is zeros in the others.
            if (i not in recomputed and not isinstance(var, jp.Literal)
                    and residual.input_index is None):
                sources.setdefault(var, ("residual", i))
        return sources

    def _slice_of_each(self, recomputed: set[int], recomputed_vars: list,
                       needed: set[Any]) -> dict[int, Slice]:
        """The slice that produces each recomputed residual, by its index: a slice of
        the forward's equations, or for a value the backward reads anyway an empty one
        that passes it on."""
        slices, root, producer = self._slices(needed)
        slice_of: dict[int, Slice] = {}
        for i, var in zip(sorted(recomputed), recomputed_vars):
            if var in needed:
                part = slices[root(producer[var])]
            else:  # stored anyway (an input, another residual's value)
                part = Slice([], [var], [self._source(var)], [])
            part.outputs.append((i, var))
            slice_of[i] = part
        return slice_of

    def run(self, part: Slice, inputs: Sequence[Any]) -> dict[int, Any]:
        """The residuals `part` produces, from the values of its inputs."""
        env = dict(zip(part.inputs, inputs))
        for eqn in part.eqns:
            values = [v.val if isinstance(v, jp.Literal) else env[v] for v in eqn.invars]
            env.update(zip(eqn.outvars, jp.bind_equation(eqn, values)))
        return {i: env[var] for i, var in part.outputs}

    def _source(self, var: Any) -> tuple | None:
        """Where the backward reads `var`; `None` when it is recomputed."""
        if var not in self._sources:
            if var in self._inputs_at:
                self._sources[var] = ("input", self._inputs_at[var])
            elif var in self._consts:
                self._sources[var] = ("const", self._consts[var])
            else:
                kept = self._keep(var, len(self.analysis.residuals) + len(self.saved))
                if kept is None:
                    return None
                self._sources[var] = ("saved", len(self.saved))
                self.saved.append(Saved(var, *kept))
        return self._sources[var]

    def _slices(self, needed: set[Any]) -> tuple[dict[int, Slice], Callable, dict]:
        """Groups the equations that compute `needed` (grown to everything recomputed)
        into slices that share no equation, in forward order."""
        jaxpr = self.analysis.closed.jaxpr
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
                if isinstance(v, jp.Literal) or (v not in needed
                                                 and self._source(v) is not None):
                    continue
                needed.add(v)
                parent[root(producer[v])] = root(k)

        slices: dict[int, Slice] = {}
        for k in reversed(region):
            part = slices.setdefault(root(k), Slice([], [], [], []))
            part.eqns.append(jaxpr.eqns[k])
            for v in jaxpr.eqns[k].invars:
                if not isinstance(v, jp.Literal) and v not in needed and v not in part.inputs:
                    part.inputs.append(v)
                    part.sources.append(self._sources[v])
        return slices, root, producer


def call_hook(which: str, hook: Callable, value: Any, info: ResidualInfo) -> Any:
    try:
        return hook(value, info)
    except HookError:
        raise
    except Exception as e:
        e.add_note(f"(raised by `{which}` for {info.describe()})")
        raise


def checked(value: Any, info: ResidualInfo) -> jax.Array:
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


def as_array(x: Any, dtype: Any = None) -> Any:
    """`x` as a JAX array (of `dtype` if given), when it is a Python or NumPy scalar."""
    if isinstance(x, jax.Array) or (isinstance(x, np.ndarray) and x.dtype == jax.dtypes.float0):
        return x
    return jnp.asarray(x, dtype=dtype)


@jax.custom_jvp
def _straight_through(x, y):
    return y


@_straight_through.defjvp
def _straight_through_jvp(primals, tangents):
    return _straight_through(*primals), tangents[0]
