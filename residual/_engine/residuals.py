"""Finding the residuals of a function and where each one came from.

`trace_residuals` traces `jax.vjp` of a function to a jaxpr. JAX's `VJP` object is a
pytree whose leaves are the residuals, so they are the trailing outputs of that jaxpr;
following each back to the equation that produced it (through inner `jit`s, scan
bodies, `cond` branches and `checkpoint`s) gives its metadata.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .. import _jax_private as jp
from .._info import ResidualInfo
from .._scope import is_marker, policy_of_marker
from .._source import is_own_file
from .ordering import devices_spanned_by

# The `checkpoint_name` given to what a hooked call stores: an enclosing `with_hooks`
# leaves these residuals to it, so hooks never pack already-packed data twice.
OWNED_NAME = "residual.owned"


@dataclasses.dataclass(frozen=True)
class InputKind:
    """How an input of a hooked function lives: whether packing it could save memory."""

    kept_alive: bool


KEPT = InputKind(kept_alive=True)
PER_ITERATION = InputKind(kept_alive=False)


@dataclasses.dataclass(frozen=True)
class Residual:
    """One residual: its public metadata plus what the transform needs to hook it."""

    info: ResidualInfo
    region_policies: tuple[Any, ...]  # scope-stack entries of the hooks regions around it,
    # outermost first
    hookable: bool  # a numeric array, neither a literal nor owned by an inner call
    owned_by_inner: bool  # stored by an inner hooked call (a scan body, a nested with_hooks)
    input_index: int | None  # which input it is, when it is one
    # (equation, operands) when it is a cheap elementwise function of other residuals
    # and literals: operands are residual indices, or literal values.
    derivation: tuple[Any, tuple[Any, ...]] | None = None
    # (view equations, input index) when it is a view of a kept-alive input that the
    # backward can take again instead of storing it.
    view: tuple[tuple[Any, ...], int] | None = None
    # (equation, literal operands) when it is computed from literals alone (the zeros
    # `where`'s derivative saves), in the function or inside a call in it.
    constant: tuple[Any, tuple[Any, ...]] | None = None


@dataclasses.dataclass(frozen=True)
class Analysis:
    """`jax.vjp` of a function as one jaxpr: inputs -> outputs + residuals."""

    closed: jp.ClosedJaxpr
    num_outputs: int
    vjp_treedef: Any
    residuals: tuple[Residual, ...]


def trace_residuals(
    fun: Callable[..., Sequence[Any]],
    inputs: Sequence[Any],
    input_kinds: Sequence[InputKind],
    *,
    scope_prefix: Sequence[str] = (),
    in_scan: bool = False,
) -> Analysis:
    """Traces `jax.vjp(fun, *inputs)` and describes every residual it saves."""
    box = {}

    def forward_and_residuals(*xs):
        outs, vjp = jax.vjp(fun, *xs)
        leaves, box["treedef"] = jax.tree.flatten(vjp)
        box["num_outputs"] = len(outs)
        return [*outs, *leaves]

    closed = jax.make_jaxpr(forward_and_residuals)(*inputs)
    n_out = box["num_outputs"]
    jaxpr = closed.jaxpr
    producers = _producers(jaxpr)
    inputs_at = {v: i for i, v in enumerate(jaxpr.invars)}
    residual_vars = jaxpr.outvars[n_out:]
    index_of = {}
    for index, var in enumerate(residual_vars):
        if not isinstance(var, jp.Literal):
            index_of.setdefault(var, index)
    residuals = []
    rules = _DerivativeRules(jaxpr, n_out)
    devices = _devices_spanned(jaxpr)
    for index, var in enumerate(residual_vars):
        origin = _Provenance(scopes=list(scope_prefix), in_scan=in_scan)
        _trace_origin(var, producers, inputs_at, origin)
        residual = _as_residual(index, var, origin, input_kinds, devices,
                                rules.operation_of(origin))
        residuals.append(dataclasses.replace(
            residual,
            derivation=_derivation(var, index, producers, index_of),
            view=_retakeable_view(var, producers, inputs_at, input_kinds),
        ))
    return Analysis(closed, n_out, box["treedef"], tuple(residuals))


def backward_jaxpr(
    analysis: Analysis, residuals: Sequence[Any], outputs: Sequence[Any]
) -> jp.ClosedJaxpr:
    """JAX's backward pass as a jaxpr of the residuals and the output cotangents.

    Traced from the forward's own values, so that every type detail (weak types, the
    varying axes of `shard_map`) is exactly what the backward will receive.
    """
    n = len(residuals)

    def backward(*args):
        vjp = jax.tree.unflatten(analysis.vjp_treedef, list(args[:n]))
        return list(vjp(list(args[n:])))

    cotangents = [
        o if jp.tangent_dtype(o.dtype) == o.dtype
        else jax.ShapeDtypeStruct(o.shape, jp.tangent_dtype(o.dtype))
        for o in outputs
    ]
    return jax.make_jaxpr(backward)(*residuals, *cotangents)


def _derivation(var: Any, index: int, producers: dict, index_of: dict[Any, int]
                ) -> tuple[Any, tuple[Any, ...]] | None:
    # Elementwise equations as cheap to recompute as to read (`jp.CHEAP`): XLA
    # recomputes them from their operands in the backward instead of storing them,
    # and so does `hooked_call`.
    if isinstance(var, jp.Literal) or var not in producers:
        return None
    eqn, _ = producers[var]
    if eqn.primitive not in jp.CHEAP or len(eqn.outvars) != 1:
        return None
    operands = []
    for v in eqn.invars:
        if isinstance(v, jp.Literal):
            operands.append(LiteralOperand(v.val))
        elif index_of.get(v, index) != index:
            operands.append(index_of[v])
        else:
            return None
    if not any(isinstance(o, int) for o in operands):
        return None
    return eqn, tuple(operands)


@dataclasses.dataclass(frozen=True)
class LiteralOperand:
    """A literal operand of an equation that `Derive` binds again in the backward."""

    value: Any


@dataclasses.dataclass
class _Provenance:
    scopes: list[str]
    in_scan: bool
    eqn: Any = None
    # The equations whose bodies hold `eqn`, innermost first: their source lines stand
    # in for `eqn`'s when it has none of its own (JAX's jitted helpers, `jax.nn.silu`).
    enclosing: list = dataclasses.field(default_factory=list)
    primitive: str | None = None
    name: str | None = None
    packed: bool = False
    literal: bool = False
    zeros: bool = False  # a literal broadcast, as `cond` fills in other branches' residuals
    input_index: int | None = None
    view_of_input: int | None = None  # a slice or reshape of this input


def _devices_spanned(jaxpr: jp.Jaxpr) -> int:
    """How many devices the program of `jaxpr` spans: a residual computed from constants
    alone (an `iota`) names no mesh, but is partitioned as its program is."""
    return devices_spanned_by([v.aval for v in (*jaxpr.invars, *jaxpr.outvars)])


def _as_residual(index: int, var: Any, origin: _Provenance, kinds: Sequence[InputKind],
                 devices: int, derivative_of: str | None = None) -> Residual:
    aval = var.aval
    dtype = getattr(aval, "dtype", None)
    shape = tuple(getattr(aval, "shape", ()))
    numeric = dtype is not None and not jp.is_extended_dtype(dtype)
    numeric = numeric and dtype != jax.dtypes.float0
    is_input = origin.input_index is not None
    viewed = origin.input_index if is_input else origin.view_of_input
    info = ResidualInfo(
        index=index,
        shape=shape,
        dtype=np.dtype(dtype) if numeric else dtype,
        primitive=origin.primitive,
        source=_source(origin),
        frames=_frames(origin),
        scope="/".join(s for s in origin.scopes if not is_marker(s)),
        name=origin.name,
        is_input=is_input,
        kept_alive=viewed is not None and kinds[viewed].kept_alive,
        in_host_memory=getattr(aval, "memory_space", None) == jax.memory.Space.Host,
        in_scan=origin.in_scan,
        derivative_of=derivative_of,
        devices=devices,
    )
    region_policies = tuple(policy_of_marker(s) for s in origin.scopes if is_marker(s))
    hookable = numeric and not origin.literal and not origin.packed
    return Residual(info, region_policies, hookable, origin.packed, origin.input_index,
                    constant=_constant(origin.eqn))


def _constant(eqn: Any) -> tuple[Any, tuple[LiteralOperand, ...]] | None:
    """`(eqn, operands)` when `eqn` computes its one output from literals alone."""
    if (eqn is None or len(eqn.outvars) != 1 or jp.sub_jaxprs(eqn)
            or not all(isinstance(v, jp.Literal) for v in eqn.invars)):
        return None
    return eqn, tuple(LiteralOperand(v.val) for v in eqn.invars)


class _DerivativeRules:
    """Names the user's operation whose derivative rule computed a residual.

    For `jnp.tanh(x)` JAX saves `1 - tanh(x)`, a `sub` its rule computes at the
    user's line: reported as the output of `sub` alone, the residual reads like a
    subtraction the user never wrote. An equation that only the backward needs (not
    on the way to the function's outputs) is part of a derivative rule; the operation
    is the one on that way, at the same source line, that it reads from or shares
    an operand with (`tanh` for `1 - tanh(x)`, `sin` for `cos(x)`).
    """

    def __init__(self, jaxpr: jp.Jaxpr, num_outputs: int):
        self.jaxpr = jaxpr
        used = [True] * num_outputs + [False] * (len(jaxpr.outvars) - num_outputs)
        primal, _ = jp.dce(jaxpr, used)
        self.primal_vars = {v for eqn in primal.eqns for v in eqn.outvars}
        self.by_source: dict[str | None, list] | None = None
        self.position: dict[int, int] = {}

    def operation_of(self, origin: _Provenance) -> str | None:
        eqn = origin.eqn
        if eqn is None or origin.enclosing or any(v in self.primal_vars for v in eqn.outvars):
            return None
        source = jp.user_source(eqn)
        if source is None:
            return None
        if self.by_source is None:
            self._index_primal_equations()
        position = self.position.get(id(eqn))
        if position is None:
            return None
        operands = {v for v in eqn.invars if not isinstance(v, jp.Literal)}
        # A rule's equations follow the operation they differentiate: of those on the
        # line (`tanh(x) ** 2` has two), the nearest one before it.
        for e in reversed(self.by_source.get(source, ())):
            if self.position[id(e)] <= position and _shares_a_value(e, operands):
                return _operation_name(e)
        return None

    def _index_primal_equations(self) -> None:
        """Numbers every equation and groups those on the way to the outputs by source
        line; built only once a residual of a derivative rule needs it."""
        self.position = {id(e): i for i, e in enumerate(self.jaxpr.eqns)}
        self.by_source = {}
        for e in self.jaxpr.eqns:
            if any(v in self.primal_vars for v in e.outvars):
                self.by_source.setdefault(jp.user_source(e), []).append(e)


def _shares_a_value(eqn: Any, operands: set[Any]) -> bool:
    """Whether `eqn` computes one of `operands` or reads one of them too."""
    related = [*eqn.outvars, *(v for v in eqn.invars if not isinstance(v, jp.Literal))]
    return not operands.isdisjoint(related)


def _operation_name(eqn: Any) -> str:
    """The name the user knows `eqn` by: a `jit`'s function name, else the primitive's."""
    name = eqn.primitive.name
    return str(eqn.params.get("name", name)) if name in ("jit", "pjit") else name


def _frames(origin: _Provenance) -> tuple[str, ...]:
    if origin.eqn is None:
        return ()
    labels = (
        jp.frame_label(*frame)
        for e in (origin.eqn, *origin.enclosing) for frame in jp.source_frames(e)
        if not is_own_file(frame[0])
    )
    return tuple(dict.fromkeys(labels))


def _source(origin: _Provenance) -> str | None:
    if origin.eqn is None:
        return None
    sources = (jp.user_source(e) for e in (origin.eqn, *origin.enclosing))
    return next((s for s in sources if s is not None), None)


def producing_equations(jaxpr: jp.Jaxpr, out_index: int) -> tuple:
    """The equation that really produced output `out_index` of `jaxpr` (past the
    primitives that only pass a value on), then those enclosing it; empty for an input."""
    origin = _Provenance(scopes=[], in_scan=False)
    _trace_origin(jaxpr.outvars[out_index], _producers(jaxpr),
                  {v: i for i, v in enumerate(jaxpr.invars)}, origin)
    return tuple(e for e in (origin.eqn, *origin.enclosing) if e is not None)


def _producers(jaxpr: jp.Jaxpr) -> dict[Any, tuple[Any, int]]:
    return {v: (eqn, k) for eqn in jaxpr.eqns for k, v in enumerate(eqn.outvars)}


def _trace_origin(var: Any, producers: dict, inputs_at: dict, origin: _Provenance) -> None:
    """Walks back from `var` to the equation that really produced it, filling in `origin`."""
    if isinstance(var, jp.Literal):
        origin.literal = True
    elif var in inputs_at:
        origin.input_index = inputs_at[var]
    elif var not in producers:  # a constant of the traced function
        origin.literal = True
    else:
        eqn, k = producers[var]
        operand = _looked_through(eqn, k, origin)
        if operand is not None:
            _trace_origin(operand, producers, inputs_at, origin)
        elif not origin.packed and not _traced_into_bodies(eqn, k, producers, inputs_at,
                                                            origin):
            _produced_by(eqn, var, producers, inputs_at, origin)


def _looked_through(eqn: Any, k: int, origin: _Provenance) -> Any:
    """The operand that `eqn`'s output `k` merely passes on (a name, a copy), if any.

    What an inner hooked call stored (named `OWNED_NAME`) stops the walk: `packed`.
    """
    if jp.kind(eqn) in jp.NAMES:  # `checkpoint_name`: note the tag, look through it
        tag = jp.checkpoint_name_of(eqn)
        if tag == OWNED_NAME:
            origin.packed = True
            return None
        origin.name = origin.name or tag
        return eqn.invars[0]
    if eqn.primitive in jp.IDENTITIES:
        return eqn.invars[k]
    return None


def _traced_into_bodies(eqn: Any, k: int, producers: dict, inputs_at: dict,
                        origin: _Provenance) -> bool:
    """Follows output `k` of a call-like `eqn` into its bodies; whether that settled it."""
    bodies = _inner_jaxprs(eqn, k)
    inner = _body_origins(bodies, origin.in_scan)
    operand = _common_forwarded_operand(inner)
    if operand is not None:
        # Every body that sets it forwards the same operand: keep walking outside.
        # (`cond` may merge the residuals of different branches into one output,
        # and then it is the operand only in some of them.)
        _trace_origin(operand, producers, inputs_at, origin)
        return True
    if bodies and not inner:
        origin.literal = True
        return True
    first = inner[0][0] if inner else None
    if first is None or (first.eqn is None and not first.packed):
        return False
    # The first body that computes it names it (`cond` branches compute it alike).
    _take_body_origin(origin, eqn, first)
    return True


def _body_origins(bodies: list, in_scan: bool) -> list[tuple[_Provenance, Sequence[Any]]]:
    """`(origin, operands)` of the output in each body that computes it, not a literal
    or (where there are several bodies) the zeros another body's residual leaves."""
    inner = []
    for jaxpr, operands, out_index, body_in_scan in bodies:
        inner_origin = _Provenance(scopes=[], in_scan=in_scan or body_in_scan)
        inner_inputs = {v: i for i, v in enumerate(jaxpr.invars)}
        _trace_origin(jaxpr.outvars[out_index], _producers(jaxpr), inner_inputs, inner_origin)
        # A `cond` branch may fill in zeros for another branch's residual; in a
        # single body (`jit`, `checkpoint`), a broadcast constant is the residual itself.
        if not (inner_origin.literal or (inner_origin.zeros and len(bodies) > 1)):
            inner.append((inner_origin, operands))
    return inner


def _common_forwarded_operand(inner: list[tuple[_Provenance, Sequence[Any]]]) -> Any:
    """The outer operand every body returns unchanged, when they all return the same
    one; else `None`."""
    # Compared by identity: an operand may be a (unhashable) literal.
    forwarded = [_forwarded_operand(o, operands) for o, operands in inner]
    if forwarded and forwarded[0] is not None and all(f is forwarded[0] for f in forwarded):
        return forwarded[0]
    return None


def _take_body_origin(origin: _Provenance, eqn: Any, first: _Provenance) -> None:
    """Fills in `origin` from `first`, the origin inside a body of the call `eqn`."""
    origin.scopes.extend([*jp.scope_names(eqn), *first.scopes])
    for field in ("eqn", "primitive", "packed", "in_scan"):
        setattr(origin, field, getattr(first, field))
    origin.enclosing = [*first.enclosing, eqn]
    origin.name = origin.name or first.name


def _produced_by(eqn: Any, var: Any, producers: dict, inputs_at: dict,
                 origin: _Provenance) -> None:
    origin.scopes.extend(jp.scope_names(eqn))
    origin.eqn = eqn
    origin.primitive = eqn.primitive.name
    if eqn.primitive in jp.VIEWS:
        view = _view_of_input(var, producers, inputs_at)
        origin.view_of_input = None if view is None else view[1]
    origin.zeros = _is_filler(eqn, producers)


def _forwarded_operand(inner_origin: _Provenance, operands: Sequence[Any]) -> Any:
    """The outer operand a body returns unchanged, if it does."""
    if inner_origin.input_index is None:
        return None
    return operands[inner_origin.input_index]


def _is_filler(eqn: Any, producers: dict) -> bool:
    """A placeholder `cond` puts where another branch has a residual."""
    if eqn.primitive in jp.FILLERS:
        return True
    if eqn.primitive is not jp.broadcast_in_dim_p:
        return False
    operand = eqn.invars[0]
    return isinstance(operand, jp.Literal) or (
        operand in producers and producers[operand][0].primitive in jp.FILLERS
    )


def _view_of_input(var: Any, producers: dict, inputs_at: dict
                   ) -> tuple[tuple[tuple[Any, int], ...], int] | None:
    """`(chain, j)` when `var` is a view (a slice, a reshape) of input `j`, else `None`.

    `chain` holds the (equation, output index) pairs that take it, from the input on.
    A view of a value that stays alive (`ws[i]` of stacked weights) costs XLA
    nothing to keep; packing it would add a copy.
    """
    chain = []
    while not isinstance(var, jp.Literal) and var in producers:
        eqn, k = producers[var]
        if eqn.primitive not in jp.VIEWS:
            return None
        chain.append((eqn, k))
        var = eqn.invars[0]
    if not chain or isinstance(var, jp.Literal) or var not in inputs_at:
        return None
    return tuple(reversed(chain)), inputs_at[var]


def _retakeable_view(var: Any, producers: dict, inputs_at: dict,
                     kinds: Sequence[InputKind]) -> tuple[tuple[Any, ...], int] | None:
    """The view `var` is of a kept-alive input, when the backward can take it again.

    A `dynamic_slice` (which has index operands too) cannot: it is stored.
    """
    view = _view_of_input(var, producers, inputs_at)
    if view is None or not kinds[view[1]].kept_alive:
        return None
    return view if all(len(eqn.invars) == 1 for eqn, _ in view[0]) else None


def _inner_jaxprs(eqn: Any, out_index: int) -> list[tuple[jp.Jaxpr, list[Any], int, bool]]:
    """(jaxpr, operands, output index, is a scan body) for each body of a call-like eqn."""
    if eqn.primitive is jp.scan_p:
        # A forwarded loop-invariant operand or xs slice is (a stack of) the scan's
        # operand; a forwarded carry is not.
        scan = jp.scan_parts(eqn)
        n_consts, n_carry = scan.num_consts, scan.num_carry
        operands = [
            None if n_consts <= i < n_consts + n_carry else v
            for i, v in enumerate(eqn.invars)
        ]
        return [(scan.body.jaxpr, operands, out_index, True)]
    if eqn.primitive is jp.cond_p:
        return [(b.jaxpr, eqn.invars[1:], out_index, False) for b in jp.cond_branches(eqn)]
    # Calls, `checkpoint`s, custom derivatives: one body that takes the operands.
    body = jp.single_body(eqn)
    return [] if body is None else [(body, list(eqn.invars), out_index, False)]


def value_describer(
    analysis: Analysis,
    input_kinds: Sequence[InputKind],
    *,
    scope_prefix: Sequence[str] = (),
    in_scan: bool = False,
) -> Callable[[Any, int], Residual]:
    """`describe(var, index)`: a value of the forward described as a residual would be.

    For values that are not residuals but that `Recompute` may store instead, so that
    policies choose for them from the same metadata.
    """
    jaxpr = analysis.closed.jaxpr
    producers = _producers(jaxpr)
    inputs_at = {v: i for i, v in enumerate(jaxpr.invars)}
    devices = _devices_spanned(jaxpr)

    def describe(var, index: int) -> Residual:
        origin = _Provenance(scopes=list(scope_prefix), in_scan=in_scan)
        _trace_origin(var, producers, inputs_at, origin)
        return _as_residual(index, var, origin, input_kinds, devices)

    return describe
