"""Recording what the transform decided for each residual, for reports.

`hooked_call` reports every residual it owns to the recorders active while it traces
(a `contextvars.ContextVar`, like the scope stack); `residual.inspect` turns the
records into a table. Recording has no effect on the traced program.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

from .._info import ResidualInfo
from .._policy import Policy


@dataclasses.dataclass(frozen=True)
class Record:
    """One residual and what became of it.

    Attributes:
        info: the residual's metadata.
        policy: the policy that handled it, `None` when stored as it is.
        stored_bytes: bytes stored per iteration (what `pack` returned; 0 when
            recomputed; `info.nbytes` when stored as it is).
        iterations: how many times it is stored: the product of the lengths of the
            scans around it (1 outside scans).
        plan: how the hooked call keeps it (a `decisions.Decision`); `how` names it.
        call: the traced call that stored it, shared by every record of that call (a
            scan body, a nested `with_hooks`): residual indices count within a call.
        region: the policy of the `saved_tensors_hooks` region around the code that
            made it, which chose its fate rather than the policy given to
            `with_hooks`; `None` outside regions.
    """

    info: ResidualInfo
    policy: Policy | None
    stored_bytes: int
    iterations: int
    plan: Any = None
    call: Any = None
    region: Policy | None = None

    @property
    def how(self) -> str:
        """`"kept"`, `"packed"`, `"derived"`, `"view"` or `"recomputed"`."""
        return "kept" if self.plan is None else self.plan.how


_RECORDERS: contextvars.ContextVar[tuple[list[Record], ...]] = contextvars.ContextVar(
    "residual_recorders", default=()
)


@contextlib.contextmanager
def recording() -> Iterator[list[Record]]:
    """Collects the `Record`s of everything traced inside the block."""
    records: list[Record] = []
    token = _RECORDERS.set((*_RECORDERS.get(), records))
    try:
        yield records
    finally:
        _RECORDERS.reset(token)


def record(entry: Record) -> None:
    for records in _RECORDERS.get():
        records.append(entry)
