"""flax NNX objects as arguments of a hooked function: `f`'s in-place updates reach them.

`with_hooks` traces `f` on copies of its arguments, as `jax.jit` does, so the in-place
updates an NNX module makes (BatchNorm statistics, dropout RNG counts) would stay in
the copies and be lost. `nnx.grad` and `nnx.jit` carry them out; so does this: the
objects' state goes in as a pytree, the Variables `f` changed come out as outputs, and
`nnx.update` writes them into the caller's objects. Only those: a Variable `f` leaves
alone (the `State` of the functional pattern `nnx.merge(graphdef, state, copy=True)`)
is never written, so none is written into a trace it does not belong to. flax is never
imported here: a program whose arguments hold NNX objects has imported it already.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where the `index`-th NNX object went among the arguments (a static leaf)."""

    index: int


def call_with_state_updates(call: Callable, f: Callable, args: tuple, kwargs: dict) -> Any:
    """`call(f, args, kwargs)`, with NNX objects among the arguments passed as state.

    `call` is the hooked call of a pure function; NNX modules and Variables among
    `args`/`kwargs` (bare, or inside a `State`) go in as their state, and the
    Variables `f` assigned to come back and are written into the caller's objects.
    """
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return call(f, args, kwargs)
    # `Pytree` is the base of modules since flax 0.11; `Object` before.
    stateful = tuple(getattr(nnx, name) for name in ("Pytree", "Object", "Variable")
                     if hasattr(nnx, name))
    is_stateful = lambda x: isinstance(x, stateful)  # noqa: E731
    nodes: list = []

    def take(x):
        if not is_stateful(x):
            return x
        nodes.append(x)
        return _Slot(len(nodes) - 1)

    slotted = jax.tree.map(take, (args, kwargs), is_leaf=is_stateful)
    if not nodes:
        return call(f, args, kwargs)
    # One split for all of them keeps a module passed twice, or shared, shared.
    graphdef, state = nnx.split(nodes)

    @functools.wraps(f)
    def pure(state, slotted):
        copies = nnx.merge(graphdef, state, copy=True)
        a, k = jax.tree.map(
            lambda x: copies[x.index] if isinstance(x, _Slot) else x, slotted,
            is_leaf=lambda x: isinstance(x, _Slot),
        )
        out = f(*a, **k)
        # A Variable `f` did not assign to still holds the very value it was given.
        before = {path: variable.get_value() for path, variable in nnx.to_flat_state(state)}
        changed = lambda path, variable: before.get(path) is not variable.get_value()  # noqa: E731
        return out, nnx.state(copies, changed)

    out, updates = call(pure, (state, slotted), {})
    if jax.tree.leaves(updates):
        nnx.update(nodes, updates)
    return out
