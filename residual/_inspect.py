"""`inspect`: every residual of a function, what a policy does to it, and compiled memory."""

from __future__ import annotations

import dataclasses
import functools
import html
import textwrap
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _jax_private as jp
from ._engine.record import Record, recording
from ._engine.residuals import producing_equations
from ._engine.transform import with_hooks
from ._format import array_label, size, sizes
from ._info import dtype_name
from ._measure import backward
from ._policy import Policy
from ._source import file_label, is_library
from ._target import resolve


@dataclasses.dataclass(frozen=True)
class Row:
    """One stored residual in a `Report` (see `Report.to_dicts` for the fields)."""

    label: str
    section: str
    index: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    iterations: int
    primitive: str | None
    source: str | None
    scope: str
    name: str | None
    policy: str
    how: str
    stored_bytes: int
    is_input: bool = False

    @property
    def total_bytes(self) -> int:
        """Unpacked bytes, all iterations together."""
        return self.nbytes * self.iterations


# What each `how` means, for the legends.
HOW = {
    "kept": "stored as it is",
    "packed": "stored as what the policy's `pack` returned",
    "derived": "not stored: recomputed in the backward from other stored residuals or "
               "from constants",
    "view": "not stored apart: re-taken from an input that stays alive anyway",
    "recomputed": "not stored: recomputed in the backward from the nearest stored values",
}


@dataclasses.dataclass(frozen=True, repr=False)
class Report:
    """The residuals of one function at one set of arguments, before and after a policy.

    `print(report)` gives a table that fits 100 columns, `report.text(width=None)` the
    wide form with every column whole, `report` in Jupyter an HTML table with a
    legend. Each row is one stored residual, numbered as error messages and
    `gradcheck` number it: `12` for the function's own residuals, `body[3]` for those
    of a `lax.scan` body (`body1[3]`, `body2[3]` with several), listed once with their
    trip count in `x`. `size` and `stored` are per training step, all scan iterations
    together, so the two read in the same unit.

    Attributes:
        rows: the rows, in the table's order; `report.to_dicts()` gives them as
            dictionaries (what each field means is there).
        totals: `residual_bytes` (unpacked), `stored_bytes` (under the policy),
            `ratio`, and with `compiled=True` the memory of the compiled forward and
            backward (`jit` of `vjp`, as `jit(grad)` runs them; see `residual.Memory`),
            per device, on `target` (the running backend's platform, or the target's
            name): the peak without (`plain_peak_bytes`) and with (`hooked_peak_bytes`)
            the policy and `peak_ratio`; the part of it beyond arguments and outputs
            (`plain_beyond_bytes`, `hooked_beyond_bytes`, `beyond_ratio`).
        policy: the policy inspected, as the table's title names it.
        notes: sentences on what the figures mean here (when the policy packed
            nothing and why; when packing does not lower the compiled memory; how many
            decisions took no effect in the compiled program, with `peak=True`).
        peak: with `peak=True`, the `residual.Peak` of the compiled program under the
            policy: what is live at its peak, over time, and each decision that took no
            effect; else `None`.
    """

    rows: tuple[Row, ...]
    totals: dict[str, Any]
    policy: str
    sections: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()
    peak: Any = None

    def __repr__(self) -> str:
        return self.text()

    def text(self, width: int | None = 100) -> str:
        """The report as text, at most `width` columns wide (`None`: every column whole)."""
        columns = self._columns(wide=width is None)
        if width is not None:
            columns = _fitting(columns, self.rows, width)
        header = tuple(name for name, _, _ in columns)
        body: list[tuple[str, ...] | str] = []
        section = ""
        for row in self.rows:
            if row.section != section:
                section = row.section
                body.append(f"{section}: {self.sections.get(section, '')}")
            body.append(tuple(cell(row) for _, cell, _ in columns))
        widths = _column_widths(header, [line for line in body if isinstance(line, tuple)],
                                width)
        right = {"x", "size", "stored"}

        def render(line: tuple[str, ...]) -> str:
            parts = []
            for name, cell, w in zip(header, line, widths):
                cell = _cut(cell, w, keep_end=name == "scope")
                parts.append(cell.rjust(w) if name in right else cell.ljust(w))
            return "  ".join(parts).rstrip()

        lines = [f"Residuals stored for the backward, under {self.policy}:", render(header)]
        lines.append("-" * len(lines[-1]))
        lines += [render(line) if isinstance(line, tuple) else line for line in body]
        lines += footer(_legend(self.rows), self._summary(), self.notes, width)
        return "\n".join(lines)

    def _columns(self, wide: bool):
        """(header, cell of a row, may be cut to fit) for each column worth showing."""
        rows = self.rows
        policies = {r.policy for r in rows if r.policy != "-"}
        columns = [
            ("#", lambda r: r.label, False),
            ("array", lambda r: array_label(r.dtype, r.shape), False),
            ("x", lambda r: str(r.iterations) if r.iterations > 1 else "", False),
            ("size", lambda r: sizes(r.total_bytes, r.stored_bytes)[0], False),
            ("how", lambda r: r.how, False),
            ("stored", lambda r: sizes(r.total_bytes, r.stored_bytes)[1], False),
            ("policy", lambda r: r.policy, True),
            ("op", _op, False),
            ("scope", lambda r: r.scope, True),
            ("name", lambda r: r.name or "", True),
            ("source", lambda r: r.source or "", True),
        ]
        shown = []
        for column in columns:
            title, cell, _ = column
            if not wide and title == "policy" and len(policies) <= 1:
                continue  # one policy: the title names it
            if title in ("#", "size", "stored", "how") or any(cell(r) for r in rows):
                shown.append(column)
        return shown

    def _summary(self) -> list[str]:
        t = self.totals
        before, after = sizes(t["residual_bytes"], t["stored_bytes"])
        lines = [
            f"{len(self.rows)} residuals: {before} per step unpacked, {after} stored "
            f"({t['ratio']:.2f}x)"
        ]
        if "plain_peak_bytes" in t:
            plain, hooked = sizes(t["plain_peak_bytes"], t["hooked_peak_bytes"])
            lines.append(
                f"compiled jit(grad) peak memory on {t['target']}: {plain} plain, {hooked} "
                f"under the policy ({t['peak_ratio']:.2f}x)"
            )
            plain, hooked = sizes(t["plain_beyond_bytes"], t["hooked_beyond_bytes"])
            lines.append(
                f"  beyond arguments and outputs: {plain} plain, {hooked} under the policy "
                f"({t['beyond_ratio']:.2f}x)"
            )
        if self.peak is not None:
            lines.append(f"  {self.peak._summary()[0]} (`report.peak` for the whole of it)")
        return lines

    def _repr_html_(self) -> str:
        columns = self._columns(wide=True)
        head = "".join(f"<th>{html.escape(name)}</th>" for name, _, _ in columns)
        body, section = [], ""
        for row in self.rows:
            if row.section != section:
                section = row.section
                text = html.escape(f"{section}: {self.sections.get(section, '')}")
                body.append(f'<tr><td colspan="{len(columns)}"><b>{text}</b></td></tr>')
            body.append("<tr>" + "".join(
                f'<td style="text-align:right">{html.escape(cell(row))}</td>'
                if name in ("x", "size", "stored") else f"<td>{html.escape(cell(row))}</td>"
                for name, cell, _ in columns) + "</tr>")
        legend = "<br>".join(html.escape(line) for line in _legend(self.rows))
        summary = "<br>".join(html.escape(s) for s in [*self._summary(), *self.notes])
        return (
            f"<div><b>Residuals stored for the backward, under {html.escape(self.policy)}</b>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
            f"<p><small>{legend}</small></p><p>{summary}</p></div>"
        )

    def to_dicts(self) -> list[dict[str, Any]]:
        """The rows as plain data: one dictionary per stored residual, in table order.

        Keys: `label` (`"12"`, `"body[3]"`: unique, as in the table), `section` (`""`
        for the function's own residuals, `"body"`, `"body2"`, ... for scan bodies),
        `index` (the residual's number within its section, as error messages give
        it), `shape` and `dtype` (one iteration's), `nbytes` (one iteration's
        bytes), `iterations` (times stored: the scans' trip counts), `total_bytes`
        (`nbytes * iterations`), `primitive` (`None` for an input or a constant), `source`
        (`"model.py:12 (loss)"`, `"In[3]:4 (loss)"` in a notebook), `scope`
        (`jax.named_scope`s), `name` (`checkpoint_name`), `policy` (`"-"` when
        none applies), `how` (`"kept"`, `"packed"`, `"derived"`, `"view"`,
        `"recomputed"`), `stored_bytes` (all iterations) and `is_input` (whether it
        is an input of the function).

        Examples:
            >>> import jax.numpy as jnp, residual
            >>> report = residual.inspect(lambda x: jnp.sum(jnp.sin(x)), jnp.ones(8),
            ...                           compiled=False)
            >>> [(d["label"], d["primitive"], d["how"], d["total_bytes"])
            ...  for d in report.to_dicts()]
            [('0', 'cos', 'kept', 32)]
        """
        return [{**dataclasses.asdict(r), "total_bytes": r.total_bytes} for r in self.rows]

    def to_dataframe(self):
        """`to_dicts()` as a pandas `DataFrame`.

        Raises:
            ImportError: pandas is not installed (`pip install pandas`).
        """
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError(
                "`Report.to_dataframe` needs pandas: `pip install pandas`, or use "
                "`report.to_dicts()`, the same rows as a list of dictionaries."
            ) from e
        return pd.DataFrame(self.to_dicts())

    def plot(self, by: str = "scope"):
        """A matplotlib figure: bytes per `by` ("scope" or "primitive"), before vs after.

        Raises:
            ImportError: matplotlib is not installed (`pip install residual[plot]`).
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "`Report.plot` needs matplotlib: `pip install 'residual[plot]'`."
            ) from e
        if by not in ("scope", "primitive"):
            raise ValueError(f"`by` must be 'scope' or 'primitive', but got {by!r}.")
        groups: dict[str, list[int]] = {}
        for r in self.rows:
            key = _op(r) if by == "primitive" else r.scope or "(top)"
            before, after = groups.setdefault(key, [0, 0])
            groups[key] = [before + r.total_bytes, after + r.stored_bytes]
        labels = list(groups)
        x = np.arange(len(labels))
        fig, ax = plt.subplots(figsize=(max(4, 0.8 * len(labels) + 2), 3.5))
        ax.bar(x - 0.2, [groups[k][0] / 2**20 for k in labels], 0.4, label="unpacked")
        ax.bar(x + 0.2, [groups[k][1] / 2**20 for k in labels], 0.4, label=self.policy[:40])
        ax.set_xticks(x, labels, rotation=30, ha="right")
        ax.set_ylabel("MiB")
        ax.set_title(f"Residual bytes per {by}")
        ax.legend()
        fig.tight_layout()
        return fig


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

    Examples:
        >>> import jax.numpy as jnp, residual
        >>> from residual import policies as rp
        >>> report = residual.inspect(lambda x: jnp.sum(jnp.tanh(x) ** 2), jnp.ones((64, 64)),
        ...                           policy=rp.Quantize(bits=8))
        >>> report.totals["residual_bytes"] > report.totals["stored_bytes"]
        True
    """
    from .policies.identity import Identity

    if peak and not compiled:
        raise ValueError(
            "`inspect(..., peak=True)` reads the compiled program's peak, but "
            "`compiled=False` asks not to compile it: drop `compiled=False`."
        )
    fn = functools.partial(f, **kwargs) if kwargs else f
    probe = policy if policy is not None else Identity()
    with recording() as records:
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


def _column_widths(header: tuple[str, ...], lines: list[tuple[str, ...]],
                   width: int | None) -> list[int]:
    """Each column as wide as its widest cell; beyond `width`, the policy, name, scope
    and source columns give up what they must, in that order (to 10, the source to 0)."""
    cells = [header, *lines]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    for title in ("policy", "name", "scope", "source"):
        excess = sum(widths) + 2 * (len(widths) - 1) - (width or sum(widths))
        if title in header and excess > 0:
            i = header.index(title)
            widths[i] -= min(excess, widths[i] - (10 if title != "source" else 0))
    return widths


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
        if not jnp.issubdtype(info.dtype, jnp.floating):
            reason = "not floating point (indices, masks: never approximated)"
        elif info.kept_alive:
            reason = "alive anyway (inputs, weights: a packed copy would add memory)"
        elif isinstance(min_bytes, int) and info.nbytes < min_bytes:
            reason = f"smaller than its `min_bytes={min_bytes}`"
            small.append(info.nbytes)
        else:
            reason = "left as it is by the policy itself"
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
        from . import _peak

        at_peak, program = _peak.read(*where.compile_with_dumps(hooked_fn, args), where.label)
        hooked = at_peak.memory
        flagged = _peak.unkept_decisions(at_peak, program, rows)
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


def _op(row: Row) -> str:
    """The primitive that made a row's residual, or what it is when no primitive did."""
    return row.primitive or ("(input)" if row.is_input else "(constant)")


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


def footer(legend: list[str], summary: list[str], notes, width: int | None) -> list[str]:
    """A report's legend, summary and notes below its table, wrapped to `width`."""
    wrap = (lambda line: textwrap.wrap(line, width)) if width is not None else (lambda line: [line])
    lines = ["", *(piece for line in legend for piece in wrap(line)), "", *summary]
    for note in notes:
        lines += ["", *wrap(note)]
    return lines


def _legend(rows: tuple[Row, ...]) -> list[str]:
    lines = ["size: a residual's bytes per step, all scan iterations together; stored: the bytes "
             "kept for the backward in its place."]
    if any(r.iterations > 1 for r in rows):
        lines.append("x: times a scan body stores it (array: one iteration's shape); the "
                     "function's own numbers skip what its scan bodies store, listed apart.")
    hows = [h for h in HOW if any(r.how == h for r in rows)]
    lines += [f"{h}: {HOW[h]}" for h in hows]
    return lines


def _fitting(columns: list, rows: tuple[Row, ...], width: int) -> list:
    """The columns that fit in `width`: the source first (`file:line` at least), then the
    scope, the name and the policy while each fits whole or at 10 characters."""
    fixed = [c for c in columns if not c[2]]
    room = width - sum(_needed_width(c, rows) + 2 for c in fixed)
    chosen = {"source"} if any(c[0] == "source" for c in columns) else set()
    room -= sum(_needed_width(c, rows, short=True) + 2 for c in columns if c[0] in chosen)
    chosen |= _optional_columns(columns, rows, room)
    return [c for c in columns if not c[2] or c[0] in chosen]


def _optional_columns(columns: list, rows: tuple[Row, ...], room: int) -> set[str]:
    """The titles of the scope, name and policy columns that fit in `room` characters,
    taken in that order while each fits whole or at 10 characters."""
    chosen = set()
    for title in ("scope", "name", "policy"):
        column = next((c for c in columns if c[0] == title), None)
        if column is not None and room >= min(_needed_width(column, rows), 10) + 2:
            chosen.add(title)
            room -= min(_needed_width(column, rows), max(room - 2, 10)) + 2
    return chosen


def _needed_width(column: tuple, rows: tuple[Row, ...], short: bool = False) -> int:
    """The characters `column` needs for its title and its cell in each of `rows`;
    `short`, for a source column cut to its `file:line`."""
    cells = [column[0], *(column[1](r) for r in rows)]
    if short:
        cells = [c.split(" (")[0] for c in cells]
    return max(len(c) for c in cells)


def _cut(text: str, width: int, keep_end: bool = False) -> str:
    """`text` in `width` characters: a source line loses its function first, then its end."""
    if len(text) <= width:
        return text
    if " (" in text and len(text.split(" (")[0]) <= width:
        return text.split(" (")[0]
    if keep_end:
        return "..." + text[len(text) - width + 3:]
    return text[: max(width - 3, 0)] + "..."


def _label(policy: Policy) -> str:
    """`Quantize(bits=4)`: the class name and the fields that differ from their defaults."""
    # Dataclasses wrap the `__repr__` they generate; a class's own one is used as is.
    generated = hasattr(type(policy).__repr__, "__wrapped__")
    if not dataclasses.is_dataclass(policy) or not generated:
        return _short(repr(policy))
    parts = []
    for i, field in enumerate(dataclasses.fields(policy)):
        if not field.repr:
            continue
        value = getattr(policy, field.name)
        default = field.default
        if i == 0 or default is dataclasses.MISSING or _differs(value, default):
            shown = value.name if isinstance(value, np.dtype) else repr(value)
            parts.append(shown if field.name == "dtype" else f"{field.name}={shown}")
    return _short(f"{type(policy).__name__}({', '.join(parts)})")


def _differs(value, default) -> bool:
    try:
        return bool(value != default) and not (
            isinstance(default, type) and np.dtype(default) == np.dtype(value)
        )
    except TypeError:
        return True


def _short(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."
