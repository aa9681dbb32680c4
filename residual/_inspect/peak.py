"""`peak`: what is live at a compiled program's peak, where it came from, and over time."""

from __future__ import annotations

import dataclasses
import html
import itertools
import os
import re
import textwrap
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .. import _jax_private as jp
from .._format import size
from .._memory import Memory
from .._source import file_label, is_library
from . import buffers
from .report import footer

# What each kind of row is, for the legends.
KINDS = {
    "argument": "an argument of the program: parameters, inputs, optimizer state",
    "output": "an output already computed, such as a finished gradient",
    "constant": "a constant the compiler keeps in memory",
    "stored": "made in the forward and kept for the backward: a residual, or its packed form",
    "forward": "a working value of the forward pass, not kept for the backward",
    "backward": "a working value of the backward pass: cotangents, unpacked residuals",
    "unplaced": "counted in the compiler's peak but not live at this moment: the "
                "allocator's slack, and outputs written later",
}

# The memory spaces a platform's working values live in: device memory, and on TPU the
# on-chip memory the compiler moves values into (listed as a space of its own).
_SPACES = {"tpu": (buffers.DEVICE, buffers.ON_CHIP)}
# A program's working values: its temporaries (not its arguments, outputs, constants).
_WORKING = ("temporary",)
_SPARK = " ▁▂▃▄▅▆▇█"


@dataclasses.dataclass(frozen=True)
class PeakRow:
    """Buffers live at the peak that share a kind, an array type, an operation and a source.

    Attributes:
        kind: what they are (`KINDS`' keys: `"stored"`, `"backward"`, `"argument"`, ...).
        array: their HLO type, `"f32[4096,1024]"`.
        count: how many buffers the row groups.
        bytes: their bytes as the target lays them out, padding included.
        unpadded: their elements' bytes alone.
        op: the JAX operation that made them (`"tanh"`, `"transpose(jvp())/dot_general"`).
        source: the user's `file:line` that made them, else the innermost one known.
        space: the memory space (0: device memory; on TPU 1: on-chip memory).
    """

    kind: str
    array: str
    count: int
    bytes: int
    unpadded: int
    op: str
    source: str | None
    space: int = buffers.DEVICE

    @property
    def padding(self) -> float:
        """Bytes as laid out per byte of elements (1.0: no padding)."""
        return self.bytes / self.unpadded if self.unpadded else 1.0


@dataclasses.dataclass(frozen=True, repr=False)
class Peak:
    """The compiled program's peak: every buffer live at it, and live bytes over time.

    `print(peak)` gives the timeline as a bar and a table of what is live at the peak,
    grouped by kind, array, operation and source line; `peak` in Jupyter the same in
    HTML; `peak.plot()` the timeline as a figure. The rows, with an `unplaced` row for
    what the compiler counts but is not live at that moment, add up to the compiler's
    peak figure (`memory.peak`): the summary line says by how much they differ.

    Attributes:
        memory: the compiler's figures (`residual.Memory`).
        rows: the groups of buffers live at the peak, largest first.
        timeline: live bytes at each position of the program's order (counted spaces).
        position: the position of the peak in the program's order.
        backward: the position where the backward pass starts (`None`: no backward).
        target: where it was compiled (`"cpu"`, `"v5e"`, ...).
        host_bytes: bytes in host memory (offloaded) at the peak.
        notes: findings: decisions that took no effect, padding, what the rows leave out.
        working: each memory space's own peak of working values (temporaries), each at
            its own moment: on TPU `{"device": ..., "on-chip": ...}` as XLA's live
            ranges give them (its compiler's peak counts the larger), elsewhere
            `{"device": memory.beyond}`, the compiler's own figure.
    """

    memory: Memory
    rows: tuple[PeakRow, ...]
    timeline: np.ndarray
    position: int
    backward: int | None
    target: str
    host_bytes: int = 0
    notes: tuple[str, ...] = ()
    working: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def live_bytes(self) -> int:
        """Bytes live at the peak: the rows without `unplaced`."""
        return sum(r.bytes for r in self.rows if r.kind != "unplaced")

    def by_kind(self) -> dict[str, int]:
        """Bytes at the peak per kind of row."""
        totals: dict[str, int] = {}
        for r in self.rows:
            totals[r.kind] = totals.get(r.kind, 0) + r.bytes
        return totals

    def __repr__(self) -> str:
        return self.text()

    def text(self, width: int | None = 100, rows: int = 20) -> str:
        """The peak as text: a timeline bar, the `rows` largest rows, the summary."""
        width_ = width or 100
        title = textwrap.wrap(self._title(), width) if width is not None else [self._title()]
        lines = [*title, "", *self._bar(min(width_ - 12, 80)), ""]
        header = ("kind", "array", "n", "bytes", "op", "source")
        cells = [header] + [(r.kind, r.array + (f" S({r.space})" if r.space else ""),
                             str(r.count), size(r.bytes) + _padded(r), _short_op(r.op),
                             r.source or "") for r in self.rows[:rows]]
        widths = _column_widths(cells, width)
        for n, c in enumerate(cells):
            parts = [_cut(v, w).rjust(w) if i in (2, 3) else _cut(v, w).ljust(w)
                     for i, (v, w) in enumerate(zip(c, widths))]
            lines.append("  ".join(parts).rstrip())
            if n == 0:
                lines.append("-" * len(lines[-1]))
        if len(self.rows) > rows:
            rest = self.rows[rows:]
            lines.append(f"... {len(rest)} more rows, {size(sum(r.bytes for r in rest))}")
        lines += footer(self._legend(), self._summary(), self.notes, width)
        return "\n".join(lines)

    def _title(self) -> str:
        m = self.memory
        return (f"Peak of the compiled program on {self.target}: {size(m.peak)} "
                f"({size(m.arguments)} arguments, {size(m.outputs)} outputs, "
                f"{size(m.beyond)} beyond them)")

    def _bar(self, width: int) -> list[str]:
        """The timeline in `width` characters, the peak and the backward's start marked."""
        live = self.timeline
        if len(live) == 0:
            return []
        edges = np.linspace(0, len(live), min(width, len(live)) + 1).astype(int)
        columns = np.array([live[a:b].max() for a, b in itertools.pairwise(edges)])
        top = max(int(columns.max()), 1)
        bar = "".join(_SPARK[round(c / top * (len(_SPARK) - 1))] for c in columns)
        marks = [" "] * len(columns)
        column = int(np.searchsorted(edges, self.position, side="right") - 1)
        if self.backward is not None:
            marks[int(np.searchsorted(edges, self.backward, side="right") - 1)] = "|"
        marks[min(column, len(marks) - 1)] = "^"
        lines = [f"live   {bar}  {size(top)}", f"       {''.join(marks).rstrip()}"]
        key = "^ the peak"
        if self.backward is not None:
            key += ", | the backward's start (forward before it)"
        return [*lines, f"       {key}; {len(live)} steps of the program's order"]

    def _legend(self) -> list[str]:
        kinds = [k for k in KINDS if any(r.kind == k for r in self.rows)]
        lines = [f"{k}: {KINDS[k]}" for k in kinds]
        if any(r.padding > 1.05 for r in self.rows):
            lines.append("(padded Nx): the target lays the arrays out in tiles, N times the "
                         "bytes of their elements")
        if any(r.space for r in self.rows):
            lines.append("S(1): in the chip's on-chip memory")
        return lines

    def _summary(self) -> list[str]:
        by_kind = self.by_kind()
        total = sum(by_kind.values())
        parts = ", ".join(f"{k} {size(v)}" for k, v in
                          sorted(by_kind.items(), key=lambda kv: -kv[1]))
        lines = [f"at the peak: {parts}"]
        differs = total / self.memory.peak - 1 if self.memory.peak else 0.0
        agreement = ("as the compiler's peak" if abs(differs) < 0.01 else
                     f"{abs(differs):.0%} {'more' if differs > 0 else 'less'} than the "
                     "compiler's peak")
        lines.append(f"rows add up to {size(total)}, {agreement} ({size(self.memory.peak)})")
        if self.host_bytes:
            lines.append(f"in host memory at the peak (not counted): {size(self.host_bytes)}")
        return lines

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in ("kind", "array", "n", "bytes", "op", "source"))
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in (
                r.kind, r.array, str(r.count), size(r.bytes) + _padded(r), _short_op(r.op),
                r.source or "")) + "</tr>" for r in self.rows)
        bar = html.escape("\n".join(self._bar(80)))
        foot = "<br>".join(html.escape(s) for s in
                           [*self._legend(), *self._summary(), *self.notes])
        return (f"<div><b>{html.escape(self._title())}</b><pre>{bar}</pre>"
                f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
                f"<p><small>{foot}</small></p></div>")

    def to_dicts(self) -> list[dict[str, Any]]:
        """The rows as plain data, one dictionary per row (`PeakRow`'s fields)."""
        return [{**dataclasses.asdict(r), "padding": r.padding} for r in self.rows]

    def plot(self, ax=None):
        """Live bytes over the program's order, as a matplotlib figure.

        Raises:
            ImportError: matplotlib is not installed (`pip install residual[plot]`).
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "`Peak.plot` needs matplotlib: `pip install 'residual[plot]'`.") from e
        if ax is None:
            _, ax = plt.subplots(figsize=(7, 3))
        steps = np.arange(len(self.timeline))
        ax.fill_between(steps, self.timeline / 2**20, step="post", alpha=0.6, label="live")
        ax.axhline(self.memory.peak / 2**20, color="k", lw=0.8, ls="--",
                   label="compiler's peak")
        ax.axvline(self.position, color="C3", lw=1, label="peak")
        if self.backward is not None:
            ax.axvline(self.backward, color="C2", lw=1, ls=":", label="backward starts")
        ax.set_xlabel("program order")
        ax.set_ylabel("MiB")
        ax.set_title(f"Live memory on {self.target}")
        ax.legend(fontsize="small")
        ax.figure.tight_layout()
        return ax.figure


def peak(fn: Callable | jax.stages.Lowered, *args: Any, target: Any = None,
         **kwargs: Any) -> Peak:
    """What is live at the peak of `jax.jit(fn)` compiled at `args` (nothing runs).

    Compiles the program with XLA's buffer assignment and live ranges written out, and
    reads them: every buffer live at the moment of the peak, with its bytes as the
    target lays it out, what it is (an argument, a value stored for the backward, a
    working value of the forward or of the backward, an output), the JAX operation and
    the user's source line that made it; and live bytes at every step of the program.

    Args:
        fn: the function to compile, such as `jax.grad(loss)` or
            `jax.grad(residual.with_hooks(loss, policy=...))`; or a lowered program,
            `jax.jit(f).lower(*args)` (then give no `args`), compiled as it is.
        *args: the arguments: arrays or `jax.ShapeDtypeStruct`s.
        target: where to compile: `None` for the running backend, or a name such as
            `"v5e"` or `"h100"` (see the Targets page of the docs).
        **kwargs: keyword arguments of `fn`.

    Returns:
        A `Peak`: `print(peak)` for the timeline and the table, `peak.rows`,
        `peak.timeline` and `peak.memory` for data, `peak.plot()` for a figure.

    Raises:
        TypeError: `fn` is a compiled program (its buffer assignment is gone: pass
            `jax.jit(f).lower(*args)` instead), or a lowered program with `args`.

    Examples:
        >>> import jax, jax.numpy as jnp, residual
        >>> p = residual.peak(jax.grad(lambda x: jnp.sum(jnp.tanh(x) ** 2)),
        ...                   jnp.ones((256, 256)))
        >>> sum(r.bytes for r in p.rows) == p.memory.peak
        True
    """
    from .._target import resolve

    if isinstance(fn, jax.stages.Compiled):
        raise TypeError(
            "`residual.peak` needs the program before compilation, to compile it with "
            "XLA's buffer assignment written out: pass `jax.jit(f).lower(*args)` (or `f` "
            "and its arguments) instead of `jax.jit(f).lower(*args).compile()`."
        )
    if isinstance(fn, jax.stages.Lowered):
        if args or kwargs or target is not None:
            raise TypeError(
                "`residual.peak` got a lowered program and arguments too: a lowered "
                "program has its arguments and target already. Pass `jax.jit(f).lower(x)` "
                "alone, or `f` with its arguments and `target=`."
            )
        compiled, texts = jp.compile_with_dumps(fn)
        label = None
    elif callable(fn):
        where = resolve(target)
        body = (lambda *a: fn(*a, **kwargs)) if kwargs else fn
        compiled, texts = where.compile_with_dumps(body, args)
        label = where.label
    else:
        raise TypeError(
            f"`residual.peak` expects a function or `jax.jit(f).lower(*args)`, but got "
            f"{type(fn).__name__}."
        )
    return read(compiled, texts, label)[0]


def read(compiled: jax.stages.Compiled, texts: dict[str, str],
         target: str | None) -> tuple[Peak, buffers.Program]:
    """The `Peak` of a program compiled with XLA's texts (`compile_with_dumps`), and the
    parsed program it was read from."""
    memory = Memory.of(compiled)
    program = buffers.parse(texts["module"], texts["assignment"], texts["live_ranges"])
    return from_program(program, memory, target or memory.platform), program


def from_program(program: buffers.Program, memory: Memory, target: str) -> Peak:
    """The `Peak` of a parsed program whose compiler's figures are `memory`."""
    notes = []
    if memory.platform == "tpu":
        timeline, position, live, working, note = _tpu_peak(program)
        notes.append(note)
    else:
        timeline = program.live_bytes(buffers.DEVICE)
        position = int(np.argmax(timeline))
        live = program.live_at(position, buffers.DEVICE)
        working = {"device": memory.beyond}
    backward = _backward_start(program)
    rows = _grouped(live, backward)
    rest = memory.peak - sum(r.bytes for r in rows)
    if rest > 0:
        rows.append(PeakRow("unplaced", "", 0, rest, rest, "", None))
    elif rest < -0.01 * memory.peak:
        notes.append(
            f"The buffers live at this moment come to {size(-rest)} more than the "
            "compiler's peak figure, which counts the values it moves into on-chip memory "
            "its own way (its dumps do not show how): read these rows as what is live, "
            "not as a breakdown of its figure."
        )
    padded = [r for r in rows if r.padding >= 2 and r.bytes >= 0.01 * memory.peak]
    if padded:
        waste = sum(r.bytes - r.unpadded for r in padded)
        notes.append(
            f"{len(padded)} rows are padded 2x or more by the target's tiling "
            f"({size(waste)} of padding at the peak): arrays whose last two dimensions "
            "are small (per-group statistics, narrow heads) occupy whole tiles there."
        )
    host = sum(b.bytes for b in program.live_at(position, buffers.HOST))
    return Peak(memory, tuple(rows), timeline, position, backward, target, host, tuple(notes),
                working)


def _tpu_peak(program: buffers.Program
              ) -> tuple[np.ndarray, int, list[buffers.Buffer], dict[str, int], str]:
    """A TPU program's peak: the timeline (the arguments and outputs, and the working
    values of the space whose peak is larger), the peak's position, the buffers live
    there, each space's own peak of working values, and a note saying so.

    The TPU compiler's peak is its arguments and outputs plus the larger of two peaks:
    the working values in device memory (HBM), and those in on-chip memory. Measured
    on 56 programs (v5e and v6e, jax 0.12.0.1, libtpu 0.0.50.1: MLPs, a CNN and a
    transformer, plain and under Quantize, Cast and Remat), the rows add up to the
    compiler's figure within 1% on 39, 3% to 10% over on 8 and 5% to 30% under on 9
    (docs/peak.md); the sum of both spaces at one moment, on none.
    """
    # The compiler counts the arguments and outputs whole, one buffer per place in
    # memory (the largest: a loop's values may follow one another in an output's).
    whole = [max(group, key=lambda b: b.bytes) for group in
             program.slots(None, ("argument", "output")).values()]
    timelines = {s: program.live_bytes(s, _WORKING) for s in (buffers.DEVICE, buffers.ON_CHIP)}
    space = max(timelines, key=lambda s: int(timelines[s].max()))
    position = int(np.argmax(timelines[space]))
    live = whole + [b for b in program.live_at(position, space)
                    if b.role not in ("argument", "output")]
    working = {"device": int(timelines[buffers.DEVICE].max()),
               "on-chip": int(timelines[buffers.ON_CHIP].max())}
    larger = "on-chip memory's" if space == buffers.ON_CHIP else "device memory's"
    note = (f"On TPU the compiler's peak is the arguments and outputs plus the larger of "
            f"two peaks: working values in device memory ({size(working['device'])}) and "
            f"in on-chip memory ({size(working['on-chip'])}). The rows are the arguments, "
            f"the outputs, and the {larger} values at its peak.")
    timeline = sum(b.bytes for b in whole) + timelines[space]
    return timeline, position, live, working, note


def _grouped(live: list[buffers.Buffer], backward: int | None) -> list[PeakRow]:
    """The buffers live at the peak as rows, one per kind, array type, operation, source
    line and memory space, largest first."""
    groups: dict[tuple, list[buffers.Buffer]] = {}
    for b in live:
        kind = _kind(b, backward)
        # Arguments and outputs are named, not made: one row per array type.
        op = _op(b.op_name) if kind not in ("argument", "output") else ""
        if not op and kind not in ("argument", "output"):
            op = f"({_opcode(b.name)})"  # made by the compiler: an async copy, a constant
        array = "tuple" if b.shape.startswith("(") else b.shape.split("{")[0]
        key = (kind, array, op, _source(b.stack), b.space)
        groups.setdefault(key, []).append(b)
    rows = [PeakRow(kind, array, len(bs), sum(b.bytes for b in bs),
                    sum(b.unpadded for b in bs), op or _names(bs), source, space)
            for (kind, array, op, source, space), bs in groups.items()]
    rows.sort(key=lambda r: -r.bytes)
    return rows


def _backward_start(program: buffers.Program) -> int | None:
    """Where the backward pass starts: after the last operation of the forward (JAX names
    them `jvp(...)`), when there are operations of the backward (`transpose(...)`).

    Not the first backward operation: the scheduler hoists some (zeros for cotangents)
    to the program's start.
    """
    first_backward = last_forward = None
    for i, name in enumerate(program.order):
        op = program.op_names.get(name, "")
        if "transpose(" in op:
            first_backward = i if first_backward is None else first_backward
        elif "jvp(" in op:
            last_forward = i
    if first_backward is None:
        return None
    return first_backward if last_forward is None else last_forward + 1


def _kind(b: buffers.Buffer, backward: int | None) -> str:
    if b.role != "temporary":
        return b.role
    # A backward value the scheduler made early (zeros for a cotangent) is no residual.
    if backward is None or b.start >= backward or "transpose(" in b.op_name:
        return "backward" if backward is not None else "forward"
    return "stored" if b.end >= backward else "forward"


def _op(op_name: str) -> str:
    """`jit(f)/transpose(jvp())/dot_general` -> `transpose(jvp())/dot_general`, a
    forward op as its primitive alone."""
    parts = op_name.split("/")
    if len(parts) <= 1:
        return op_name
    inner = parts[1:]
    if inner and inner[0].startswith("jvp(") and len(inner) > 1:
        inner = inner[1:]
    return "/".join(inner)


def _source(stack: tuple[str, ...]) -> str | None:
    """The innermost frame of the user's own code, as `file.py:12`; else the innermost."""
    for frame in stack:
        file_name, _, line = frame.rpartition(":")
        if not is_library(file_name):
            return f"{file_label(file_name)}:{line}"
    if stack:
        file_name, _, line = stack[0].rpartition(":")
        return f"{os.path.basename(file_name)}:{line}"
    return None


def _opcode(name: str) -> str:
    """`copy-start.12{0}` -> `copy-start`: the HLO opcode an instruction's name starts with."""
    return re.sub(r"(\.\d+)?(\{[\d,]*\})?$", "", name)


def _names(buffers: list[buffers.Buffer]) -> str:
    """`ws[0]`, or `ws[0] and 5 more`: the names of arguments or outputs."""
    names = sorted(b.op_name or b.name for b in buffers)
    return names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"


def _short_op(op: str) -> str:
    return op if len(op) <= 40 else "..." + op[-37:]


def _column_widths(cells: list[tuple[str, ...]], width: int | None) -> list[int]:
    """Each column as wide as its widest cell; beyond `width`, the op and source columns
    give up what they must (to 12 characters each)."""
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    if width is not None:
        excess = sum(widths) + 2 * (len(widths) - 1) - width
        for i in (4, 5):
            cut = min(max(excess, 0), widths[i] - 12)
            widths[i] -= max(cut, 0)
            excess -= max(cut, 0)
    return widths


def _padded(r: PeakRow) -> str:
    factor = f"{r.padding:.1f}".removesuffix(".0")
    return f" (padded {factor}x)" if r.padding >= 1.5 else ""


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 3, 0)] + "..."


def unkept_decisions(peak: Peak, program: buffers.Program, rows) -> list[str]:
    """Residuals a policy packed, offloaded or recomputed whose float the compiled program
    still keeps for the backward: a decision without effect, one sentence each.

    Floats kept across the backward's start are counted per array type; those beyond
    the residuals of that type stored as they are belong to residuals the policy acted
    on. (Source lines do not tell them apart: a scan's stacked residuals carry the
    scan's line, a residual the line of its body.) A recomputation starts from stored
    values that need not be rows (a scan's output the function goes on from): a
    recomputed residual is flagged only where a float kept is its primitive's.
    """
    if peak.backward is None:
        return []
    kept_floats = _floats_kept_across_backward(peak, program)
    flagged = [f"residual {r.label} ({_hlo_array(r.dtype, tuple(r.shape))}, an input): packed, "
               "but the program's argument stays alive anyway" for r in rows
               if r.how == "packed" and r.is_input and not r.section]
    for array, group in _rows_by_array(rows).items():
        flagged += _unkept_of_type(array, group, kept_floats.get(array, []))
    return flagged


def _unkept_of_type(array: str, group: list, kept_floats: list[str]) -> list[str]:
    """The rows of one array type a policy acted on beyond what the program's floats
    kept across the backward leave room for (those stored as they are come first).
    `kept_floats` are the operations that made those floats: rows of the same primitive
    are named first."""
    made_by = {op.rsplit("/", 1)[-1] for op in kept_floats}
    acted = sorted((r for r in group if (r.how == "recomputed" and r.primitive in made_by)
                    or (r.how == "packed" and (r.section or not r.is_input))),
                   key=lambda r: r.primitive not in made_by)
    # A scan body's inputs are stored stacked; the function's own are arguments.
    kept = sum(r.how == "kept" and bool(r.section or not r.is_input) for r in group)
    flagged = []
    for r in acted[:max(len(kept_floats) - kept, 0)]:
        if r.how == "recomputed":
            what = "recomputed, but the compiler keeps the value for the backward anyway"
        elif r.policy.startswith("Offload"):
            what = "offloaded, but a device copy is kept for the backward"
        else:
            what = "packed, but the float is still kept for the backward"
        flagged.append(f"residual {r.label} ({array}, {r.source or r.primitive}): {what}")
    return flagged


def _floats_kept_across_backward(peak: Peak,
                                 program: buffers.Program) -> dict[str, list[str]]:
    """The program's temporaries of each array type that live across the start of the
    backward (a transpose's own buffers aside), each slot once, by the operation that
    made them."""
    spaces = _SPACES.get(peak.memory.platform, (buffers.DEVICE,))
    kept_floats: dict[str, list[str]] = {}
    slots = set()
    for b in program.buffers:
        # A tuple's buffer holds pointers to arrays counted on their own.
        if (b.space in spaces and b.role == "temporary" and "transpose(" not in b.op_name
                and not b.shape.startswith("(")
                and b.start < peak.backward <= b.end and (b.allocation, b.offset) not in slots):
            slots.add((b.allocation, b.offset))
            kept_floats.setdefault(b.shape.split("{")[0], []).append(b.op_name)
    return kept_floats


def _rows_by_array(rows) -> dict[str, list]:
    """Report rows by the HLO array type their stored value has (a scan's stacked)."""
    by_array: dict[str, list] = {}
    for r in rows:
        shape = (r.iterations, *r.shape) if r.iterations > 1 else tuple(r.shape)
        by_array.setdefault(_hlo_array(r.dtype, shape), []).append(r)
    return by_array


_HLO_TYPES = {"bool": "pred", "bfloat16": "bf16"}


def _hlo_array(dtype: str, shape: tuple[int, ...]) -> str:
    """`float32`, `(4, 8)` -> `f32[4,8]`, as HLO writes an array type."""
    name = _HLO_TYPES.get(dtype) or re.sub(
        r"^(float|int|uint|complex)(\d+)",
        lambda m: {"float": "f", "int": "s", "uint": "u", "complex": "c"}[m.group(1)]
        + m.group(2), dtype)
    return f"{name}[{','.join(map(str, shape))}]"
