"""`Report`: the table `residual.inspect` returns, as text, HTML, dicts, a data frame, a plot."""

from __future__ import annotations

import dataclasses
import html
import textwrap
from typing import Any

import numpy as np

from .._format import array_label, sizes


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


def _op(row: Row) -> str:
    """The primitive that made a row's residual, or what it is when no primitive did."""
    return row.primitive or ("(input)" if row.is_input else "(constant)")


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
