"""`inspect`: every residual of a function, what a policy does to it, and compiled memory."""

from __future__ import annotations

import dataclasses
import functools
import html
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._info import dtype_name
from ._policy import Policy
from ._record import Record, recording
from ._transform import with_hooks


@dataclasses.dataclass(frozen=True)
class Row:
    """One residual in a `Report`: its metadata and what the policy stores for it."""

    index: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int  # per iteration
    iterations: int  # times stored (scan trip counts); 1 outside scans
    primitive: str | None
    source: str | None
    scope: str
    name: str | None
    policy: str  # the policy that handles it, "-" when stored as it is
    stored_bytes: int  # what is stored, all iterations together

    @property
    def total_bytes(self) -> int:
        """Unpacked bytes, all iterations together."""
        return self.nbytes * self.iterations


@dataclasses.dataclass(frozen=True)
class Report:
    """The residuals of one function at one set of arguments, before and after a policy.

    Attributes:
        rows: one `Row` per residual (residuals inside scan bodies once, with their
            trip count in `iterations`).
        totals: `residual_bytes` (unpacked), `stored_bytes` (under the policy),
            `ratio`, and with `compiled=True` XLA's temp memory of the backward
            without (`plain_temp_bytes`) and with (`hooked_temp_bytes`) the policy
            and `temp_ratio`.
        policy: repr of the policy inspected.
    """

    rows: tuple[Row, ...]
    totals: dict[str, Any]
    policy: str

    def __str__(self) -> str:
        header = ("#", "shape", "dtype", "bytes", "x", "primitive", "source", "scope",
                  "name", "policy", "stored")
        lines = [header]
        for r in self.rows:
            lines.append((
                str(r.index), _shape(r.shape), r.dtype, _bytes(r.nbytes),
                str(r.iterations) if r.iterations > 1 else "", r.primitive or "(input)",
                r.source or "", r.scope, r.name or "", r.policy, _bytes(r.stored_bytes),
            ))
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        text = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
        text.insert(1, "-" * len(text[0]))
        legend = "bytes: one iteration; x: scan iterations; stored: all iterations together"
        return "\n".join([f"Residuals under {self.policy}:", *text, legend, "",
                          *self._summary()])

    def _summary(self) -> list[str]:
        t = self.totals
        lines = [
            f"residuals: {len(self.rows)}, {_bytes(t['residual_bytes'])} unpacked, "
            f"{_bytes(t['stored_bytes'])} stored ({t['ratio']:.2f}x)"
        ]
        if "plain_temp_bytes" in t:
            lines.append(
                f"compiled backward temp memory: plain jax.grad {_bytes(t['plain_temp_bytes'])}"
                f", with the policy {_bytes(t['hooked_temp_bytes'])} ({t['temp_ratio']:.2f}x)"
            )
        return lines

    def _repr_html_(self) -> str:
        head = ["#", "shape", "dtype", "bytes", "iterations", "primitive", "source", "scope",
                "name", "policy", "stored"]
        cells = [
            [r.index, _shape(r.shape), r.dtype, _bytes(r.nbytes), r.iterations,
             r.primitive or "(input)", r.source or "", r.scope, r.name or "", r.policy,
             _bytes(r.stored_bytes)]
            for r in self.rows
        ]
        rows = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
            for row in cells
        )
        summary = "<br>".join(html.escape(s) for s in self._summary())
        return (
            f"<div><b>Residuals under {html.escape(self.policy)}</b>"
            f"<table><thead><tr>{''.join(f'<th>{h}</th>' for h in head)}</tr></thead>"
            f"<tbody>{rows}</tbody></table><p>{summary}</p></div>"
        )

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
            key = (getattr(r, by) or ("(input)" if by == "primitive" else "(top)"))
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
    f: Callable, *args: Any, policy: Policy | None = None, compiled: bool = True, **kwargs: Any
) -> Report:
    """Lists every residual `f` saves at these arguments, and what `policy` does to it.

    Traces `jax.vjp` of `residual.with_hooks(f, policy=policy)` (nothing runs) and
    reports, per residual: index, shape, dtype, bytes, producing primitive, source
    line, scope, `checkpoint_name`, the policy that applies and the bytes it stores.
    Residuals inside scan bodies appear once, with the trip count; totals count every
    iteration. With `compiled=True` it also compiles the backward pass with and
    without the policy and reports XLA's temp memory for both.

    Args:
        f: the function, as you would pass it to `jax.grad` or `jax.vjp`.
        *args: its arguments (arrays, or `jax.ShapeDtypeStruct`s when
            `compiled=False`... and also when `compiled=True`: nothing is executed).
        policy: a `residual.Policy`; `None` shows what plain `jax.grad` stores.
        compiled: also compile and report temp memory.
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

    fn = functools.partial(f, **kwargs) if kwargs else f
    probe = policy if policy is not None else Identity()
    with recording() as records:
        jax.eval_shape(lambda *a: _backward(with_hooks(fn, policy=probe))(*a), *args)
    rows = tuple(_row(r, policy is not None) for r in records)
    residual_bytes = sum(r.total_bytes for r in rows)
    stored = sum(r.stored_bytes for r in rows)
    totals: dict[str, Any] = {
        "residual_bytes": residual_bytes,
        "stored_bytes": stored,
        "ratio": stored / residual_bytes if residual_bytes else 1.0,
    }
    if compiled:
        plain = _temp_bytes(_backward(fn), args)
        hooked = _temp_bytes(_backward(with_hooks(fn, policy=probe)), args)
        totals.update(
            plain_temp_bytes=plain,
            hooked_temp_bytes=hooked,
            temp_ratio=hooked / plain if plain else 1.0,
        )
    return Report(rows, totals, _label(policy) if policy is not None else "plain jax.grad")


def _backward(fn: Callable) -> Callable:
    """The forward and backward pass of `fn`, with a cotangent of ones."""

    def run(*args):
        out, vjp = jax.vjp(fn, *args)
        return vjp(jax.tree.map(jnp.ones_like, out))

    return run


def _temp_bytes(fn: Callable, args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _row(record: Record, with_policy: bool) -> Row:
    info = record.info
    stored = record.stored_bytes if with_policy else info.nbytes
    policy = _label(record.policy) if with_policy and record.policy is not None else "-"
    return Row(
        index=info.index, shape=tuple(info.shape), dtype=dtype_name(info.dtype),
        nbytes=info.nbytes, iterations=record.iterations, primitive=info.primitive,
        source=info.source, scope=info.scope, name=info.name, policy=_short(policy),
        stored_bytes=stored * record.iterations,
    )


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


def _shape(shape) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover
