"""`Plan`: the planner's result, a policy value that applies one action per residual
(`PlanDecision`s), with its JSON form and its table."""

from __future__ import annotations

import dataclasses
import functools
import html
import json

from .._format import array_label, precise_size
from .._info import ResidualInfo, dtype_name
from .._policy import Policy
from .actions import ACTIONS, LOSSLESS, policy_of


@dataclasses.dataclass(frozen=True)
class PlanDecision:
    """One residual (or one group of identical scan layers) and the action chosen for it.

    The first fields identify the residual in code, so that a plan made on one trace
    applies to a fresh trace of the same function: whether it is in a scan body, its
    scope, `checkpoint_name`, primitive, derivative, shape, dtype and source frames,
    its index among the residuals of its call, and its occurrence among residuals
    with all the other fields equal (an unrolled loop's layers). The last fields are
    the planner's figures, left out of comparisons: bytes per step before and after,
    predicted seconds per step and relative gradient error.
    """

    in_scan: bool
    scope: str
    name: str | None
    primitive: str | None
    derivative_of: str | None
    shape: tuple[int, ...]
    dtype: str
    frames: tuple[str, ...]
    index: int
    occurrence: int
    action: str
    nbytes: int = dataclasses.field(default=0, compare=False)
    stored: int = dataclasses.field(default=0, compare=False)
    seconds: float = dataclasses.field(default=0.0, compare=False)
    error: float = dataclasses.field(default=0.0, compare=False)
    iterations: int = dataclasses.field(default=1, compare=False)

    @property
    def code_key(self) -> tuple:
        return (self.in_scan, self.scope, self.name, self.primitive, self.derivative_of,
                self.shape, self.dtype, self.frames)


def code_key_of(info: ResidualInfo) -> tuple:
    return (info.in_scan, info.scope, info.name, info.primitive, info.derivative_of,
            tuple(info.shape), dtype_name(info.dtype), tuple(info.frames or
                                                            (info.source or "",)))


@dataclasses.dataclass(frozen=True)
class Plan(Policy):
    """A policy that applies one chosen action per residual: what `residual.plan` returns.

    A plan is a frozen, hashable `residual.Policy`: pass it anywhere a policy goes
    (`with_hooks(f, policy=plan)`, a `saved_tensors_hooks` scope, a `select` rule).
    Residuals are matched by what identifies them in code (see `PlanDecision`), so the
    same plan applies to every retrace of the function, and one decision covers
    every iteration of a scan body. Residuals the plan does not know are stored as
    they are. Equality and hashing look at the decisions only.

    `str(plan)` is a table of the decisions with the planner's figures; `plan` in
    Jupyter renders it as HTML; `plan.to_json()` and `Plan.from_json(text)` save and
    load it; `repr(plan)` evaluates back to an equal plan given `Plan` and `PlanDecision`.

    Attributes:
        decisions: one `PlanDecision` per residual group.
        recompute_scans: whether the values of a scan body that the plan does not list
            are recomputed (as `Remat` on the body would: recomputing its residuals
            from the body's inputs) instead of stored: those too small to plan, and
            the values the engine would otherwise store to recompute from.
        memory: the compiled `jit(grad)`'s peak memory under the plan, in bytes per
            device (`residual.Memory.peak`), on the plan's target.
        plain_memory: the same for plain `jax.grad`.
        budget: the budget asked for, in bytes (`None`: the least memory).
        grad_error: relative error of the plan's gradient against plain `jax.grad` on
            the example arguments (`None` when they were shapes only).
        predicted_seconds: predicted extra seconds per step (packing, unpacking,
            recomputing).
        plain_step_seconds: seconds of one plain `jit(grad)` step: measured on the
            running backend; on a `target`, predicted from the compiled program (its
            FLOPs and bytes accessed at the chip's peak FLOP/s and bandwidth).
        step_seconds: seconds of one `jit(grad)` step under the plan: timed
            alternately with plain's on the example arguments (`None` for shapes only);
            on a `target`, predicted as `plain_step_seconds` is.
        max_grad_error: the bound the plan was made under.
        compiles: programs compiled while planning.
        planning_seconds: wall time spent planning.
        target: the hardware planned for (`"v5e"`, `"h100:8"`), compiled for without
            it; `None` for the running backend.
    """

    decisions: tuple[PlanDecision, ...] = ()
    recompute_scans: bool = False
    memory: int | None = dataclasses.field(default=None, compare=False)
    plain_memory: int | None = dataclasses.field(default=None, compare=False)
    budget: int | None = dataclasses.field(default=None, compare=False)
    grad_error: float | None = dataclasses.field(default=None, compare=False)
    predicted_seconds: float = dataclasses.field(default=0.0, compare=False)
    plain_step_seconds: float | None = dataclasses.field(default=None, compare=False)
    step_seconds: float | None = dataclasses.field(default=None, compare=False)
    max_grad_error: float | None = dataclasses.field(default=None, compare=False)
    compiles: int = dataclasses.field(default=0, compare=False)
    planning_seconds: float = dataclasses.field(default=0.0, compare=False)
    target: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if not isinstance(self.decisions, tuple) or not all(
                isinstance(d, PlanDecision) for d in self.decisions):
            raise TypeError(
                f"`decisions` must be a tuple of `PlanDecision`s, but got "
                f"{type(self.decisions).__name__}. Build plans with `residual.plan(...)` "
                "or load one with `residual.Plan.from_json(text)`."
            )
        for d in self.decisions:
            if d.action not in ACTIONS:
                raise ValueError(
                    f"Unknown action {d.action!r} in a plan's decision; actions are {ACTIONS}."
                )

    @property
    def lossless(self) -> bool:  # type: ignore[override]
        """Lossless when every action chosen is (keep, remat, offload)."""
        return all(d.action in LOSSLESS for d in self.decisions)

    @property
    def predicted_step_overhead(self) -> float | None:
        """Predicted extra time per step, as a fraction of a plain step (0.1: 10% slower)."""
        if not self.plain_step_seconds:
            return None
        return self.predicted_seconds / self.plain_step_seconds

    @property
    def step_overhead(self) -> float | None:
        """Extra time per step, as a fraction of a plain step (negative: faster): measured,
        or on a `target` predicted from the compiled programs."""
        if not self.plain_step_seconds or self.step_seconds is None:
            return None
        return self.step_seconds / self.plain_step_seconds - 1

    @functools.cached_property
    def _lookup(self) -> dict[tuple, tuple[PlanDecision, ...]]:
        table: dict[tuple, list[PlanDecision]] = {}
        for d in self.decisions:
            table.setdefault(d.code_key, []).append(d)
        return {k: tuple(v) for k, v in table.items()}

    def action_for(self, info: ResidualInfo) -> str:
        """The action this plan takes for the residual `info` (`"keep"` when unknown).

        A residual whose code key (everything but its index) matches decisions of
        the plan takes the action of the one with its index; if its index moved (the
        function changed elsewhere), the action they all share, if they share one.
        """
        candidates = self._lookup.get(code_key_of(info), ())
        for d in candidates:
            if d.index == info.index:
                return d.action
        actions = {d.action for d in candidates}
        if len(actions) == 1:
            return actions.pop()
        return "remat" if self.recompute_scans and info.in_scan else "keep"

    def resolve(self, info: ResidualInfo) -> Policy | None:
        policy = policy_of(self.action_for(info))
        return None if policy is None else policy.resolve(info)

    def pack(self, x, info):
        raise TypeError("A `Plan` only dispatches; `resolve` picks the policy that packs.")

    def unpack(self, packed, info):
        raise TypeError("A `Plan` only dispatches; `resolve` picks the policy that unpacks.")

    def __repr__(self) -> str:
        decisions = "".join(f"\n    {d!r}," for d in self.decisions)
        extra = "".join(
            f", {f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)[1:]
        )
        return f"Plan(decisions=({decisions}\n){extra})"

    def to_json(self) -> str:
        """The plan as JSON text; `Plan.from_json` loads it back."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)[1:]}
        data["decisions"] = [dataclasses.asdict(d) for d in self.decisions]
        return json.dumps({"format": "residual.Plan", "version": 1, **data}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Loads a plan saved by `Plan.to_json`.

        Raises:
            ValueError: `text` is not a saved plan.
        """
        try:
            data = json.loads(text)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(
                f"`Plan.from_json` expects the text `Plan.to_json()` wrote, but got "
                f"{text!r:.80}: {e}."
            ) from None
        if not isinstance(data, dict) or data.get("format") != "residual.Plan":
            raise ValueError(
                f"`Plan.from_json` expects the text `Plan.to_json()` wrote (a JSON object "
                f"with \"format\": \"residual.Plan\"), but got {text!r:.80}."
            )
        decisions = tuple(
            PlanDecision(**{**d, "shape": tuple(d["shape"]), "frames": tuple(d["frames"])})
            for d in data["decisions"]
        )
        fields = {f.name for f in dataclasses.fields(cls)} - {"decisions"}
        return cls(decisions, **{k: v for k, v in data.items() if k in fields})

    def __str__(self) -> str:
        return self.text()

    def text(self) -> str:
        """The plan as a table: each residual, its action, bytes, predicted cost and error."""
        header = ("#", "array", "x", "action", "size", "stored", "ms", "error", "op", "source")
        rows = [header]
        for i, d in enumerate(self.decisions):
            rows.append((
                str(i), array_label(d.dtype, d.shape),
                str(d.iterations) if d.iterations > 1 else "",
                d.action, precise_size(d.nbytes), precise_size(d.stored), f"{1e3 * d.seconds:.3f}",
                f"{d.error:.1e}" if d.error else "0", d.primitive or "(input)",
                (d.frames[0] if d.frames else "")[:40],
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        right = {"x", "size", "stored", "ms", "error"}
        lines = ["  ".join(c.rjust(w) if h in right else c.ljust(w)
                           for h, c, w in zip(header, r, widths)).rstrip() for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join(["Plan: an action per residual", *lines, "", *self._summary()])

    def _summary(self) -> list[str]:
        before = sum(d.nbytes for d in self.decisions)
        after = sum(d.stored for d in self.decisions)
        lines = [f"{len(self.decisions)} residual groups: {precise_size(before)} stored plainly, "
                 f"{precise_size(after)} under the plan (predicted)"]
        overhead = self.predicted_step_overhead
        if self.recompute_scans:
            lines.append("values of scan bodies not listed: recomputed, as `Remat` on the body")
        lines.append(f"predicted cost: {1e3 * self.predicted_seconds:.3f} ms per step"
                     + (f" ({100 * overhead:.1f}% of a plain step)" if overhead is not None
                        else ""))
        kind = ("measured step" if self.target is None else
                f"predicted step on {self.target} (roofline of the compiled program, not run)")
        if self.step_overhead is not None:
            lines.append(f"{kind}: {1e3 * self.step_seconds:.3g} ms, "
                         f"{100 * self.step_overhead:+.1f}% against plain "
                         f"{1e3 * self.plain_step_seconds:.3g} ms")
        elif self.step_seconds is not None:  # plain jax.grad does not fit on the target
            lines.append(f"{kind}: {1e3 * self.step_seconds:.3g} ms")
        if self.plain_memory is not None and self.memory is not None:
            asked = "least memory" if self.budget is None else f"budget {precise_size(self.budget)}"
            lines.append(
                f"compiled jit(grad) peak memory on {self.target or 'the running backend'}"
                f" (per device): {precise_size(self.memory)} "
                f"({self.memory / max(self.plain_memory, 1):.2f}x of plain "
                f"{precise_size(self.plain_memory)}); {asked}"
            )
        if self.grad_error is not None:
            lines.append(f"gradient error vs plain jax.grad: {self.grad_error:.2e} "
                         f"(bound {self.max_grad_error})")
        return lines

    def _repr_html_(self) -> str:
        lines = self.text().split("\n")
        return f"<pre>{html.escape(chr(10).join(lines))}</pre>"
