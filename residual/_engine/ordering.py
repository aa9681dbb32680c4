"""Ordering the work of packing and unpacking: the one place that decides how.

Without help, XLA fuses `pack` into the backward (computing the packed form there
from the float residual, which it then keeps alive), runs `unpack` early (a float
copy alive across the whole forward), and runs a `pack` long after its value was
computed (see docs/xla-and-packed-residuals.md). `ordered` is what the forward and
the backward call to stop that: it passes values through a conditional (or, with
several devices, an optimization barrier) that cannot run before a given value,
the tie, is computed, and that XLA never fuses across.

`passed_after` is the conditional: `lax.cond(first == first, fn, copy of fn,
operands)`, `first` one element of the tie. Under `vmap` the predicate is batched
and JAX would turn the `cond` into a `select` that computes both branches: the copy
is made and neither tie holds. Its batching rule folds the predicate into one
scalar for the whole batch and keeps the conditional (but for a view in a program
for a TPU, taken outside it). Both branches return the same values, so the predicate
only orders the work: no result depends on it. Where its readers turn what it
passes into floats (unpacking, a recomputation from unpacked values), its result goes
through an optimization barrier: XLA would move them into both branches, which would
then return those floats whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _jax_private as jp
from .._placement import program_platform, tracing_for_a_target


def ordered(
    values: Sequence[Any],
    tie: Any,
    *,
    forward: bool = False,
    view: Callable[[Any], Any] | None = None,
    probe_self: bool = False,
    barrier: bool = False,
) -> list[Any]:
    """`values`, computed after the array `tie` and not fused with the code around them.

    In the backward (the default) each array among `values` that can be ordered
    (`_movable`) waits for `tie`, a value of the backward computed just before the
    residual is needed; with `probe_self`, when there is no tie, the first of them
    waits for itself, which still stops XLA fusing across. `view` (a slice, a
    reshape) is applied to the single value of `values` inside the conditional, so
    the view's copy exists only from then on. With `barrier`, `values` come out of the
    conditional through an optimization barrier, which nothing reading them crosses.

    In the `forward`, `values` is the value just computed followed by what was packed
    from it: the rest of the forward reads the value through the conditional, so the
    packed arrays are computed first and the float can be freed after its last use.
    """
    values = list(values)
    if forward:
        return _ordered_forward(values)
    movable = [i for i, v in enumerate(values) if _movable(v)]
    if not jp.is_staged() or not movable or (tie is None and not probe_self):
        # In eager mode each operation runs on its own, and the conditionals would be
        # compiled anew on every call.
        return _viewed(values, view)
    chosen = [values[i] for i in movable]
    if several_devices([*chosen, tie]):
        return _viewed(_ordered_by_barrier(values, movable, tie, view is not None), view)
    return _ordered_by_conditional(values, movable, tie, view, barrier)


def _viewed(values: list[Any], view: Callable[[Any], Any] | None) -> list[Any]:
    """`values` as `ordered` returns them: `[view(values[0])]` when there is a view."""
    return [view(values[0])] if view is not None else values


def _ordered_by_barrier(
    values: list[Any], movable: list[int], tie: Any, has_view: bool
) -> list[Any]:
    """`values`, those at `movable` ordered after `tie` by an optimization barrier: the
    ordering used when the program may be partitioned over several devices."""
    if has_view:
        # A view of an input (a layer's slice of stacked weights) taken after a
        # barrier is a new value: XLA gathers it again for the backward where it
        # shares the forward's gathered copy (FSDP: one more all-gather a layer).
        return values
    # XLA's SPMD partitioner replicates what flows through a conditional, which
    # would all-gather sharded activations: with several devices, a barrier
    # (kept by the GPU pipeline) orders the work after `tie` instead.
    return _replaced(values, movable, _barrier_after([values[i] for i in movable], tie))


def _ordered_by_conditional(
    values: list[Any],
    movable: list[int],
    tie: Any,
    view: Callable[[Any], Any] | None,
    barrier: bool,
) -> list[Any]:
    """`values`, those at `movable` passed through a conditional on `tie` (`passed_after`),
    or on the first of them when there is no tie; with a view, only the viewed value."""
    chosen = [values[i] for i in movable]
    # Only when nothing of the backward is at hand does the probe read the value
    # itself: XLA would compute that element from the float residual, keeping it alive.
    probe = tie if tie is not None else chosen[0]
    if view is not None:
        return [passed_after(probe, chosen[0], view)]
    return _replaced(values, movable, passed_after(probe, chosen, barrier=barrier))


def _replaced(values: list[Any], indices: list[int], replacements: Sequence[Any]) -> list[Any]:
    """A copy of `values` with the value at each of `indices` replaced, in order."""
    values = list(values)
    for i, value in zip(indices, replacements):
        values[i] = value
    return values


def in_device_memory(array: Any) -> bool:
    space = getattr(jax.typeof(array), "memory_space", None)
    return space is None or space == jax.memory.Space.Device


def several_devices(values: Sequence[Any]) -> bool:
    """Whether the program may be partitioned over several devices (`devices_spanned`)."""
    return devices_spanned(values) > 1


def devices_spanned(values: Sequence[Any]) -> int:
    """How many devices the program may be partitioned over: the largest mesh a value
    is sharded over, or the run's devices (counting every process of a multi-host run)
    where that is more. A program for a compile-only target spans what its shardings
    say: this host's devices are not the target's."""
    return devices_spanned_by([jax.typeof(v) for v in values if isinstance(v, jax.Array)])


def devices_spanned_by(avals: Sequence[Any]) -> int:
    """`devices_spanned` of values of these abstract types (a jaxpr's)."""
    meshes = (getattr(getattr(aval, "sharding", None), "mesh", None) for aval in avals)
    run = 1 if tracing_for_a_target() else jax.device_count()
    return max([run, *(getattr(mesh, "size", 1) for mesh in meshes)])


def _movable(value: Any) -> bool:
    """Whether the backward orders `value`: a numeric, non-empty array on the device.

    Offloaded arrays stay on the host; constants and keys pass as they are.
    """
    return (isinstance(value, jax.Array) and not jp.is_extended_dtype(value.dtype)
            and bool(value.size) and in_device_memory(value))


def _ordered_forward(values: list[Any]) -> list[Any]:
    value = values[0]
    # Floats and boolean masks (packed as bits) are what the built-in policies pack.
    if (len(values) < 2 or not value.size or several_devices(values) or not jp.is_staged()
            or not (jnp.issubdtype(value.dtype, jnp.inexact) or value.dtype == bool)
            or not all(in_device_memory(v) for v in values)):
        return values
    return list(passed_after(value, values))


def _barrier_after(values: list[Any], tie: Any) -> list[Any]:
    """`values`, which XLA may not compute before `tie`, through an optimization barrier.

    Inside `shard_map` a barrier's outputs vary over every manual mesh axis any of
    its operands varies over: a value that is invariant where `tie` varies would
    change type, and the backward's equations (a `pvary` of it, say) would refuse
    it. Only values that vary over the same axes as `tie` are tied to it.
    """
    if tie is None:
        return values
    axes = jp.varying_axes(tie)
    tied = [i for i, v in enumerate(values) if jp.varying_axes(v) == axes]
    if not tied:
        return values
    out, _ = lax.optimization_barrier(([values[i] for i in tied], tie))
    return _replaced(values, tied, out)


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def passed_after(tie, operands, fn: Callable | None = None, *, barrier: bool = False) -> Any:
    """`fn(operands)` (identity by default), computed after the array `tie`, unfused.

    The predicate reads one element of `tie`. `fn` must be linear (a view: a slice, a
    reshape) and work on one example: under `vmap` it is vmapped when an operand is
    batched. With `barrier` the result comes out through an optimization barrier, so
    that nothing reading it moves into the conditional.
    """
    # Indexed, not raveled: a TPU lays arrays out in tiles, and raveling one copies
    # the whole tie out of them to read one element.
    first = jnp.real(tie[(0,) * tie.ndim]).astype(jnp.float32)

    @jax.custom_batching.custom_vmap
    def conditional(first, operands):
        apply = fn or (lambda x: x)
        # The branches must differ: JAX inlines a `cond` whose branches are equal.
        out = lax.cond(first == first, apply, lambda x: _copy(apply(x)), operands)
        return lax.optimization_barrier(out) if barrier else out

    @conditional.def_vmap
    def batched(axis_size, in_batched, first, operands):
        first_batched, operands_batched = in_batched
        if first_batched:
            # One predicate for the whole batch. Should the sum be NaN (a NaN, or
            # infinities of both signs), the copy branch runs: the same values.
            first = jnp.sum(first)
        if fn is None:
            return passed_after(first, operands, barrier=barrier), operands_batched
        batched = any(jax.tree.leaves(operands_batched))
        view = fn
        if batched:
            axes = jax.tree.map(lambda b: 0 if b else None, operands_batched)
            view = jax.vmap(fn, in_axes=(axes,), axis_size=axis_size)
        # A TPU program under `vmap` copies the whole input a conditional takes into
        # on-chip memory and keeps it through the backward; outside one, the view
        # reads the copy the forward's matmuls read.
        out = view(operands) if program_platform() == "tpu" else passed_after(first, operands, view)
        return out, jax.tree.map(lambda _: batched, out)

    # `custom_vmap` has no reverse-mode rule; the result is linear in `operands`.
    @jax.custom_jvp
    def differentiable(first, operands):
        return conditional(first, operands)

    @differentiable.defjvp
    def _jvp(primals, tangents):
        first, operands = primals
        _, operand_tangents = tangents
        out = differentiable(first, operands)
        if fn is None:
            return out, operand_tangents
        # A view of integers (token ids, say) has float0 tangents, which `fn` can't slice.
        if not all(jnp.issubdtype(x.dtype, jnp.inexact) for x in jax.tree.leaves(operands)):
            return out, jax.tree.map(lambda o: np.zeros(o.shape, jax.dtypes.float0), out)
        return out, fn(operand_tangents)

    return differentiable(first, operands)
