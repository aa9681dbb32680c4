"""Every use of JAX internals in `residual`, in one place.

`residual` needs a few things no public JAX API offers: which kind of differentiation
is tracing a value, how to re-bind one jaxpr equation with its source information, and
dead-code elimination of a jaxpr. `tests/test_jax_private.py` exercises each of them,
so a JAX release that changes them fails loudly there instead of deep in a trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax._src import config as _config
from jax._src import source_info_util as _source_info
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import partial_eval as _pe
from jax.extend import core as _core

Literal = _core.Literal
Var = _core.Var
ClosedJaxpr = _core.ClosedJaxpr
Jaxpr = _core.Jaxpr
JaxprEqn = _core.JaxprEqn


def differentiation_mode(values: Sequence[Any]) -> str | None:
    """How the innermost differentiation of `values` works: "forward", "reverse" or None.

    Reverse mode (`grad`, `vjp`, `jacrev`) traces with JAX's linearize trace, marked
    `is_vjp`; `jax.linearize` uses the same trace unmarked, and its linear function
    runs forward, so it counts as forward mode, as do `jvp` and `jacfwd` (JVP trace).
    Other traces (jit, vmap) are looked through.
    """
    trace = _core.find_top_trace(list(values))
    while trace is not None:
        if isinstance(trace, _ad.LinearizeTrace):
            return "reverse" if trace.is_vjp else "forward"
        if isinstance(trace, _ad.JVPTrace):
            # Without direct linearization, reverse mode also starts with a JVP trace.
            return "forward" if _config.use_direct_linearize.value else "reverse"
        trace = getattr(trace, "parent_trace", None)
    return None


def bind_equation(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Binds one equation again, keeping its name stack and source line."""
    params = eqn.primitive.get_bind_params(eqn.params)
    name_stack = _source_info.current_name_stack() + eqn.source_info.name_stack
    with (
        _source_info.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager,
    ):
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def name_stack_context(eqn: JaxprEqn):
    """A context that makes new equations carry `eqn`'s name stack and source line."""
    name_stack = _source_info.current_name_stack() + eqn.source_info.name_stack
    return _source_info.user_context(eqn.source_info.traceback, name_stack=name_stack)


def scope_names(eqn: JaxprEqn) -> list[str]:
    """The `jax.named_scope` names around an equation, outermost first."""
    return [
        entry.name
        for entry in eqn.source_info.name_stack.stack
        if isinstance(entry, _source_info.Scope)
    ]


def user_source(eqn: JaxprEqn) -> str | None:
    """`"file.py:12 (function)"` of the user code that produced `eqn`, if known."""
    frame = _source_info.user_frame(eqn.source_info.traceback)
    if frame is None:
        return None
    file_name = frame.file_name.rsplit("/", 1)[-1]
    return f"{file_name}:{frame.start_line} ({frame.function_name})"


def dce(jaxpr: Jaxpr, used_outputs: Sequence[bool]) -> tuple[Jaxpr, list[bool]]:
    """Dead-code elimination: the slice of `jaxpr` that computes `used_outputs`."""
    return _pe.dce_jaxpr(jaxpr, list(used_outputs))


def jaxpr_as_fun(closed: ClosedJaxpr):
    return _core.jaxpr_as_fun(closed)


def is_extended_dtype(dtype: Any) -> bool:
    """PRNG key data and other extended dtypes, which hooks never see."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def current_scope_names() -> tuple[str, ...]:
    """The `jax.named_scope` names active where the caller is being traced."""
    return tuple(
        entry.name
        for entry in _source_info.current_name_stack().stack
        if isinstance(entry, _source_info.Scope)
    )


def tangent_dtype(dtype):
    """The dtype of cotangents for values of `dtype` (float0 for integers)."""
    return _core.primal_dtype_to_tangent_dtype(dtype)


def varying_axes(value) -> frozenset:
    """The manual (`shard_map`) mesh axes `value` varies over; empty outside `shard_map`.

    JAX 0.10 keeps them in `jax.typeof(x).mat.varying`; earlier releases had
    `jax.typeof(x).vma`.
    """
    aval = jax.typeof(value)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def is_staged() -> bool:
    """Whether the caller is being traced into a program (`jit`, `make_jaxpr`, a scan body).

    False in eager mode, under eager `grad` or `vmap` too: each operation then runs on
    its own, so nothing can fuse or reorder it.
    """
    trace = _core.find_top_trace([])
    while trace is not None:
        if isinstance(trace, _pe.DynamicJaxprTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False
