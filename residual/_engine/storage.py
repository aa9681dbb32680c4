"""What the forward stores for the backward (the custom VJP's residuals), and how each
decision reaches it: `Storage`, `Slot`, `Stores` in the forward, `Restores` in the backward,
and the `Handoff` between the two rules."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
from jax.ad_checkpoint import checkpoint_name

from .. import _jax_private as jp
from .._info import ResidualInfo
from .residuals import OWNED_NAME, Analysis

if TYPE_CHECKING:
    from .decisions import Decision
    from .recompute import RecomputePlan


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
    kept_inputs: frozenset[int] = frozenset()  # the inputs that stay alive (`InputKind`)


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

    def was_restored(self, source: tuple[str, Any]) -> bool:
        """Whether a recomputation's source was restored already, by an earlier use."""
        kind, key = source
        return kind == "residual" and key in self.restored

    def source_decision(self, source: tuple[str, Any]) -> Decision | None:
        """The decision that stored a recomputation's source; None for inputs and
        constants."""
        kind, key = source
        if kind == "residual":
            return self.handoff.decisions[key]
        if kind == "saved":
            return self.handoff.recompute.saved[key].decision
        return None
