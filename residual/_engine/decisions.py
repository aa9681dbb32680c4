"""What becomes of each residual between the forward and the backward: one decision each.

`decide.decide` chooses, once per residual, a frozen `Decision`: `Keep` it as it is, `Pack`
it with its policy, `Derive` it from other residuals, re-take it as a `View` of an
input, or `Recompute` it. Every decision has the same protocol: `store` (in the
forward, into a `Stores`), `restore` (in the backward, from a `Restores`), `nbytes`
(what it stored) and `how` (the word reports show).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _jax_private as jp
from .._errors import HookError
from .._info import ResidualInfo
from .._policy import Policy
from .ordering import ordered, several_devices
from .residuals import Residual
from .storage import Restores, Slot, Storage, Stores


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
        packed = call_hook("pack", self.policy.pack, _differentiated_never(value, self.policy),
                           info)
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
                                             probe_self=True, barrier=True)):
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

    @property
    def as_is(self) -> bool:  # type: ignore[override]
        # Unless recomputed, the input it views is stored as it is.
        return self.policy is None

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
        unpacked = [isinstance(restores.source_decision(source), Pack)
                    for source in part.sources]
        # Sources unpacked here and now were ordered after `tie` with their codes.
        unpacked_now = [u and tie is not None and not restores.was_restored(source)
                        for u, source in zip(unpacked, part.sources)]
        inputs = [restores.source(source, tie) for source in part.sources]
        # Tied to the backward where it is needed, the recomputation can neither
        # merge with the forward nor be scheduled early.
        # Stored values, and inputs that live only for this call (a loop's carry).
        stored = [kind in ("residual", "saved")
                  or (kind == "input" and key not in restores.handoff.kept_inputs)
                  for kind, key in part.sources]
        tie = restores.tie_or_cotangent(tie)
        if several_devices([*inputs, tie]) and any(stored):
            # An input that stays alive (a layer's weights) comes out of a barrier a new
            # value, which XLA gathers again where the backward shares the forward's
            # gathered copy: FSDP then gathers each weight once more per layer. The
            # stored sources tie the recomputation.
            inputs = _ordered_where(inputs, stored, tie)
        else:
            # Recomputed from unpacked values, the chain is what XLA would otherwise
            # move into the conditional, which would then return each of its floats.
            # A float unpacked just now is already ordered: passed through again, a
            # TPU would copy it whole to lay it out for the conditional.
            inputs = _ordered_where(inputs, [not now for now in unpacked_now], tie,
                                    barrier=any(unpacked))
        restores.restored.update(plan.run(part, inputs))
        return restores.restored[residual.info.index]


def _ordered_where(values: list[Any], chosen: list[bool], tie: Any, **kwargs: Any) -> list[Any]:
    """`values`, those where `chosen` is true passed through `ordered` after `tie`."""
    tied = iter(ordered([v for v, c in zip(values, chosen) if c], tie, **kwargs))
    return [next(tied) if c else v for v, c in zip(values, chosen)]


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


def _differentiated_never(value: Any, policy: Policy) -> Any:
    """`value`, refused with a clear error if anything differentiates `pack` through it.

    A first derivative never does (the custom VJP's forward is run, not differentiated);
    a higher one does when it reaches the hooked call from outside a `jax.jit`,
    `jax.checkpoint`, `lax.cond` or `lax.scan` around it, which traces the call afresh
    so that it cannot tell (`RoundTrip` serves the derivatives it can see). Through the
    packed form the derivative would be silently wrong: rounding's is zero, and an
    offloaded value's cotangent is not on the device.
    """
    if not (isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jnp.inexact)):
        return value
    # The rule holds the text, not the policy: JAX may keep the rule with a cached
    # trace, and a policy's hooks must be freed with their scope.
    message = (
        f"A residual packed by {policy!r} is being differentiated again: a higher "
        "derivative (`jax.hessian`, `grad` of `grad`, `jvp` of `grad`) reaches the "
        "hooked function through a `jax.jit`, `jax.checkpoint`, `lax.cond` or "
        "`lax.scan` around it, where its hooks cannot see the outer derivative, and "
        "through packed residuals that derivative would be silently wrong. Take the "
        "higher derivative of the hooked function itself and wrap that instead "
        "(`jax.jit(jax.hessian(residual.with_hooks(f, ...)))`), or use a policy that "
        "stores values as they are (`Identity`, `Remat`) for this computation."
    )

    @jax.custom_jvp
    def passed(x):
        return x

    @passed.defjvp
    def _refused(primals, tangents):
        raise ValueError(message)

    return passed(value)


@jax.custom_jvp
def _straight_through(x, y):
    return y


@_straight_through.defjvp
def _straight_through_jvp(primals, tangents):
    out = _straight_through(*primals)
    return out, _in_memory_of(out, tangents[0])


def _in_memory_of(like: Any, tangent: Any) -> Any:
    """`tangent` moved to the memory `like` is in: a residual a `jax.checkpoint` policy
    offloaded is on the host, and the hooks' `unpack` may bring it back to the device."""
    space = getattr(jax.typeof(like), "memory_space", None)
    if space is None or space == getattr(jax.typeof(tangent), "memory_space", None):
        return tangent
    return jax.device_put(tangent, space)
