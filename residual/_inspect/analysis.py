"""`inspect`: every residual of a function, what a policy does to it, and compiled memory."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax_private as jp
from .._engine.record import Record, recording
from .._engine.residuals import producing_equations
from .._engine.transform import with_hooks
from .._format import size
from .._info import dtype_name
from .._measure import backward, check_array_arguments
from .._policy import Policy
from .._source import file_label, is_library
from .._target import resolve
from .peak import read as read_peak
from .peak import unkept_decisions
from .report import Report, Row


def inspect(
    f: Callable,
    *args: Any,
    policy: Policy | None = None,
    compiled: bool = True,
    target: str | None = None,
    peak: bool = False,
    **kwargs: Any,
) -> Report:
    """Lists every residual `f` saves at these arguments, and what `policy` does to it.

    Traces `jax.vjp` of `residual.with_hooks(f, policy=policy)` (nothing runs) and
    reports, per residual: index, shape, dtype, bytes, producing primitive, source
    line, scope, `checkpoint_name`, the policy that applies and the bytes it stores.
    Residuals inside scan bodies appear once, with the trip count; totals count every
    iteration. With `compiled=True` it also compiles the backward pass with and
    without the policy and reports the compiled memory of both (`residual.Memory`: the
    peak, and its part beyond arguments and outputs, per device), for the running
    backend or for `target`, hardware that need not be here.

    Args:
        f: the function, as you would pass it to `jax.grad` or `jax.vjp`.
        *args: its arguments: arrays or `jax.ShapeDtypeStruct`s (nothing is executed).
        policy: a `residual.Policy`; `None` shows what plain `jax.grad` stores.
        compiled: also compile and report memory.
        target: where to compile: `None` for the running backend, or a TPU or GPU
            compiled for without one (`"v5e"`, `"v5e:2x2"`, `"h100"`, ...; see the
            Targets page), with the arguments' shardings mapped onto its devices.
        peak: also read what is live at the compiled program's peak under the policy
            (`report.peak`, a `residual.Peak`), and check each decision against it: a
            residual packed, offloaded or recomputed whose float the compiled program
            still keeps for the backward is flagged. Needs `compiled=True`.
        **kwargs: keyword arguments of `f`.

    Returns:
        A `Report`: `print(report)` for a text table, `report` in Jupyter for HTML,
        `report.plot()` for a figure, `report.rows` and `report.totals` for data.

    Raises:
        TypeError: an argument holds something other than arrays (a model's functions:
            pass its arrays alone).
        ValueError: `peak=True` with `compiled=False`.

    Examples:
        >>> import jax.numpy as jnp, residual
        >>> from residual import policies as rp
        >>> report = residual.inspect(lambda x: jnp.sum(jnp.tanh(x) ** 2), jnp.ones((64, 64)),
        ...                           policy=rp.Quantize(bits=8))
        >>> report.totals["residual_bytes"] > report.totals["stored_bytes"]
        True
    """
    from ..policies.identity import Identity

    if peak and not compiled:
        raise ValueError(
            "`inspect(..., peak=True)` reads the compiled program's peak, but "
            "`compiled=False` asks not to compile it: drop `compiled=False`."
        )
    check_array_arguments(args, "inspect")
    fn = functools.partial(f, **kwargs) if kwargs else f
    probe = policy if policy is not None else Identity()
    # The rows' decisions are made for the target, as in the program compiled for it.
    with recording() as records, resolve(target).tracing():
        jax.eval_shape(lambda *a: backward(with_hooks(fn, policy=probe))(*a), *args)
    rows, sections = _rows(records, policy is not None)
    residual_bytes = sum(r.total_bytes for r in rows)
    stored = sum(r.stored_bytes for r in rows)
    totals: dict[str, Any] = {
        "residual_bytes": residual_bytes,
        "stored_bytes": stored,
        "ratio": stored / residual_bytes if residual_bytes else 1.0,
    }
    at_peak, flagged = None, []
    if compiled:
        compiled_totals, at_peak, flagged = _compiled(fn, args, probe, rows, target, peak)
        totals.update(compiled_totals)
    notes = _notes(records, rows, policy, totals, flagged)
    label = _label(policy) if policy is not None else "plain jax.grad"
    return Report(rows, totals, label, sections, tuple(notes), at_peak)


def nothing_packed(records: list[Record], policy: Policy) -> str | None:
    """Why `policy` packed none of these residuals, or `None` when it packed some."""
    if any(r.how != "kept" for r in records):
        return None
    name = _label(policy)
    if not records:
        return f"{name} packed nothing: the function saves no residuals at these arguments."
    min_bytes = getattr(policy, "min_bytes", None)
    reasons: dict[str, int] = {}
    small = []
    for r in records:
        info = r.info
        if not jnp.issubdtype(info.dtype, jnp.inexact):
            reason = ("not floating point (indices: never approximated; masks: as bits "
                      "only beside packed floats)")
        elif info.kept_alive:
            reason = "alive anyway (inputs, weights: a packed copy would add memory)"
        elif info.in_host_memory:
            reason = ("in host memory already (offloaded by a `jax.checkpoint` policy in "
                      "the function)")
        elif r.region is not None and r.region != policy:
            reason = ("decided by a `saved_tensors_hooks` region in the function, not by "
                      "this policy")
        elif isinstance(min_bytes, int) and info.nbytes < min_bytes:
            reason = f"smaller than its `min_bytes={min_bytes}`"
            small.append(info.nbytes)
        else:
            reason = "left unpacked by the policy itself"
        reasons[reason] = reasons.get(reason, 0) + 1
    parts = [f"{n} {'is' if n == 1 else 'are'} {reason}" for reason, n in reasons.items()]
    text = f"{name} packed nothing: of {len(records)} residuals, {', '.join(parts)}."
    if small:
        text += (
            f" The largest is {size(max(small))}: residuals this small cost little, and "
            "packing pays only on large activations (wide layers, big batches, deep models). "
            "To pack them anyway, pass `min_bytes=0`."
        )
    return text


def _notes(records: list[Record], rows, policy: Policy | None, totals: dict[str, Any],
           flagged: list[str]) -> list[str]:
    """What the report says below its table: a policy that packed nothing or saved
    nothing compiled, and how many decisions took no effect."""
    notes = []
    if policy is not None:
        nothing = nothing_packed(records, policy)
        if nothing:
            notes.append(nothing)
        elif "beyond_ratio" in totals and totals["beyond_ratio"] > 0.95:
            notes.append(
                f"The compiled program is not smaller ({totals['beyond_ratio']:.2f}x of "
                "plain's memory beyond arguments and outputs): its residuals are a small "
                "part of its memory, or the compiler kept the floats alive next to the "
                "packed form. Packing pays on deep or wide models with large activations; "
                "on shallow or small ones, keep plain `jax.grad`."
            )
    if flagged:
        acted = sum(r.how in ("packed", "recomputed") for r in rows)
        notes.append(
            f"{len(flagged)} of {acted} decisions took no effect in the compiled program: "
            "the float is still kept for the backward, or is an argument alive anyway "
            "(`report.peak` lists them)."
        )
    return notes


def _compiled(fn: Callable, args: tuple, probe: Policy, rows, target: str | None,
              peak: bool) -> tuple[dict[str, Any], Any, list[str]]:
    """The report's compiled totals (plain and hooked memory on the target); and when
    `peak`, the hooked program's `Peak` and the decisions that took no effect in it."""
    where = resolve(target)
    plain = where.memory(backward(fn), args)
    hooked_fn = backward(with_hooks(fn, policy=probe))
    at_peak, flagged = None, []
    if peak:
        at_peak, program = read_peak(*where.compile_with_dumps(hooked_fn, args), where.label)
        hooked = at_peak.memory
        flagged = unkept_decisions(at_peak, program, rows)
        at_peak = dataclasses.replace(at_peak, notes=(*flagged, *at_peak.notes))
    else:
        hooked = where.memory(hooked_fn, args)
    totals = dict(
        target=where.label,
        plain_peak_bytes=plain.peak,
        hooked_peak_bytes=hooked.peak,
        peak_ratio=hooked.peak / plain.peak if plain.peak else 1.0,
        plain_beyond_bytes=plain.beyond,
        hooked_beyond_bytes=hooked.beyond,
        beyond_ratio=hooked.beyond / plain.beyond if plain.beyond else 1.0,
    )
    return totals, at_peak, flagged


def _rows(records: list[Record], with_policy: bool) -> tuple[tuple[Row, ...], dict[str, str]]:
    """The rows in table order, and a line on each section (a scan body, an inner call)."""
    calls: dict[int, list[Record]] = {}
    for r in records:
        calls.setdefault(id(r.call), []).append(r)
    ordered = _outermost_first(list(calls.values()))
    bodies = [c for c in ordered[1:] if c[0].info.in_scan]
    others = [c for c in ordered[1:] if not c[0].info.in_scan]
    names = {id(ordered[0][0].call): ""} if ordered else {}
    for kind, group in (("body", bodies), ("call", others)):
        for k, call in enumerate(group, 1):
            names[id(call[0].call)] = kind if len(group) == 1 else f"{kind}{k}"
    rows, sections = [], {}
    for call in ordered:
        section = names[id(call[0].call)]
        if section:
            sections[section] = _describe_section(call)
        for r in sorted(call, key=lambda r: r.info.index):
            rows.append(_row(r, section, with_policy))
    return tuple(rows), sections


def _outermost_first(calls: list[list[Record]]) -> list[list[Record]]:
    """Calls in the order a reader meets them: the function, then its scan bodies, nested.

    Calls record their residuals as their tracing ends, so an inner call (a scan body)
    comes before the call around it, and sibling calls in program order. A scan
    body's records are stored more times than those of the call around it.
    """
    stack: list[tuple[list[Record], list]] = []
    for call in calls:
        children = []
        while stack and stack[-1][0][0].iterations > call[0].iterations:
            children.append(stack.pop())
        stack.append((call, children[::-1]))
    ordered: list[list[Record]] = []

    def visit(node):
        ordered.append(node[0])
        for child in node[1]:
            visit(child)

    for node in reversed(stack):
        visit(node)
    return ordered


def _describe_section(call: list[Record]) -> str:
    first = call[0]
    paths = [r.info.scope.split("/") for r in call if r.info.scope]
    common = "/".join(p[0] for p in zip(*paths) if len(set(p)) == 1) if paths else ""
    where = f" in scope '{common}'" if common else ""
    if first.info.in_scan:
        times = "once" if first.iterations == 1 else f"at each of {first.iterations} iterations"
        return f"a lax.scan body{where}, its residuals stored {times} (x)"
    return f"an inner hooked call{where}"


def _row(record: Record, section: str, with_policy: bool) -> Row:
    info = record.info
    stored = record.stored_bytes if with_policy else info.nbytes
    policy = _label(record.policy) if with_policy and record.policy is not None else "-"
    label = f"{section}[{info.index}]" if section else str(info.index)
    return Row(
        label=label, section=section, index=info.index, shape=tuple(info.shape),
        dtype=dtype_name(info.dtype), nbytes=info.nbytes, iterations=record.iterations,
        primitive=info.primitive, source=_user_source(record), scope=info.scope,
        name=info.name, policy=_short(policy), how=record.how if with_policy else "kept",
        stored_bytes=stored * record.iterations, is_input=info.is_input,
    )


def _user_source(record: Record) -> str | None:
    """The innermost frame of the user's own code (not a library's) that made the residual."""
    call, info = record.call, record.info
    jaxpr = None if call is None else call.closed.jaxpr
    # A value stored for recomputation is no residual of JAX's: numbered past them.
    if (jaxpr is None or info.primitive is None
            or call.num_outputs + info.index >= len(jaxpr.outvars)):
        return info.source
    for eqn in producing_equations(jaxpr, call.num_outputs + info.index):
        for file_name, line, function in jp.source_frames(eqn):
            if not is_library(file_name):
                function = function.replace("<locals>.", "")
                return f"{file_label(file_name)}:{line} ({function})"
    return info.source


def _label(policy: Policy) -> str:
    """`Quantize(bits=4)`: the class name and the fields that differ from their defaults."""
    # Dataclasses wrap the `__repr__` they generate; a class's own one is used as is.
    generated = hasattr(type(policy).__repr__, "__wrapped__")
    if not dataclasses.is_dataclass(policy) or not generated:
        return _short(repr(policy))
    parts = []
    resolved = _resolved_defaults(policy)
    for i, field in enumerate(dataclasses.fields(policy)):
        if not field.repr:
            continue
        value = getattr(policy, field.name)
        default = resolved.get(field.name, field.default)
        if i == 0 or default is dataclasses.MISSING or _differs(value, default):
            shown = value.name if isinstance(value, np.dtype) else repr(value)
            parts.append(shown if field.name == "dtype" else f"{field.name}={shown}")
    return _short(f"{type(policy).__name__}({', '.join(parts)})")


def _resolved_defaults(policy: Policy) -> dict[str, Any]:
    """What the fields declared `None` resolve to from the policy's other fields
    (`Quantize`'s group size and scales, by bit width): the defaults `_label` hides."""
    fields = [f for f in dataclasses.fields(policy) if f.init]
    auto = [f.name for f in fields if f.default is None]
    if not auto:
        return {}
    given = {f.name: getattr(policy, f.name) for f in fields if f.name not in auto}
    try:
        reference = type(policy)(**given)
    except (TypeError, ValueError):
        return {}
    return {name: getattr(reference, name) for name in auto}


def _differs(value, default) -> bool:
    try:
        return bool(value != default) and not (
            isinstance(default, type) and np.dtype(default) == np.dtype(value)
        )
    except TypeError:
        return True


def _short(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."
