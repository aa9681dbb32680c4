"""`plan`: a policy per residual that fits a memory budget, checked on the compiled program."""

from __future__ import annotations

import dataclasses
import functools
import html
import itertools
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._engine.record import recording
from ._engine.transform import with_hooks
from ._format import array_label, precise_size
from ._info import ResidualInfo, dtype_name
from ._measure import whole_gradient_error
from ._memory import Memory
from ._policy import Policy
from ._target import DoesNotFitError, Target, resolve

# The actions a plan may choose, by the name plans store (JSON stays readable and stable).
ACTIONS = ("keep", "bf16", "int8", "int4", "remat", "offload")
_LOSSLESS = {"keep", "remat", "offload"}
# Residuals smaller than this (per iteration) are kept: they cost little to store, and
# they are where quantization hurts most (the built-in `Quantize` default).
_MIN_BYTES = 16384
# Round-trip error of each lossy action when no values are at hand (arguments given as
# `jax.ShapeDtypeStruct`): relative RMS error on Gaussian data, groups of 64.
_NOMINAL_ERROR = {"bf16": 1.2e-3, "int8": 5.5e-3, "int4": 9.2e-2}
# Compiles per budget for each of the two searches (the byte bound's, then one
# group at a time).
_ROUNDS = 4
# Recomputing is costed residual by residual (one lowering each) up to this many
# distinct residuals; beyond, from one program that recomputes them all.
_REMAT_MEASURED = 8
# Plans that fit, of least predicted time, whose steps are run and timed before one is
# returned (with every one-action plan that fits): the predicted times rank them less
# surely than the gaps between them.
_FINALISTS = 3
# Seconds of steps spent timing finalists, at most (but at least 2 samples of each),
# and the least time one sample takes (short steps are run several times a sample).
_TIMING_SECONDS = 4.0
_SAMPLE_SECONDS = 0.02
# Finalists within this fraction of the fastest count as fast as it (timing noise): of
# those, the one of least gradient error, then least memory, is returned.
_TIME_TIE = 0.05


@functools.cache
def _policy(action: str) -> Policy | None:
    """The policy value that carries out `action` (`None` stores the residual as it is)."""
    from .policies import Cast, Offload, Quantize, Remat

    return {
        "keep": lambda: None,
        "bf16": lambda: Cast(jnp.bfloat16),
        "int8": lambda: Quantize(bits=8),
        "int4": lambda: Quantize(bits=4),
        "remat": Remat,
        "offload": Offload,
    }[action]()


def offload_available(where: Target | None = None) -> bool:
    """Whether the default device (or the target's) has host memory apart from its own
    (not on CPU)."""
    device = (where or resolve(None)).devices[0]
    kinds = [m.kind for m in device.addressable_memories()]
    return device.platform != "cpu" and "pinned_host" in kinds


@dataclasses.dataclass(frozen=True)
class Decision:
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


def _code_key(info: ResidualInfo) -> tuple:
    return (info.in_scan, info.scope, info.name, info.primitive, info.derivative_of,
            tuple(info.shape), dtype_name(info.dtype), tuple(info.frames or
                                                            (info.source or "",)))


@dataclasses.dataclass(frozen=True)
class Plan(Policy):
    """A policy that applies one chosen action per residual: what `residual.plan` returns.

    A plan is a frozen, hashable `residual.Policy`: pass it anywhere a policy goes
    (`with_hooks(f, policy=plan)`, a `saved_tensors_hooks` scope, a `select` rule).
    Residuals are matched by what identifies them in code (see `Decision`), so the
    same plan applies to every retrace of the function, and one decision covers
    every iteration of a scan body. Residuals the plan does not know are stored as
    they are. Equality and hashing look at the decisions only.

    `str(plan)` is a table of the decisions with the planner's figures; `plan` in
    Jupyter renders it as HTML; `plan.to_json()` and `Plan.from_json(text)` save and
    load it; `repr(plan)` evaluates back to an equal plan given `Plan` and `Decision`.

    Attributes:
        decisions: one `Decision` per residual group.
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

    decisions: tuple[Decision, ...] = ()
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
                isinstance(d, Decision) for d in self.decisions):
            raise TypeError(
                f"`decisions` must be a tuple of `Decision`s, but got "
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
        return all(d.action in _LOSSLESS for d in self.decisions)

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
    def _lookup(self) -> dict[tuple, tuple[Decision, ...]]:
        table: dict[tuple, list[Decision]] = {}
        for d in self.decisions:
            table.setdefault(d.code_key, []).append(d)
        return {k: tuple(v) for k, v in table.items()}

    def action_for(self, info: ResidualInfo) -> str:
        """The action this plan takes for the residual `info` (`"keep"` when unknown).

        A residual whose code key (everything but its index) matches decisions of
        the plan takes the action of the one with its index; if its index moved (the
        function changed elsewhere), the action they all share, if they share one.
        """
        candidates = self._lookup.get(_code_key(info), ())
        for d in candidates:
            if d.index == info.index:
                return d.action
        actions = {d.action for d in candidates}
        if len(actions) == 1:
            return actions.pop()
        return "remat" if self.recompute_scans and info.in_scan else "keep"

    def resolve(self, info: ResidualInfo) -> Policy | None:
        policy = _policy(self.action_for(info))
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
            Decision(**{**d, "shape": tuple(d["shape"]), "frames": tuple(d["frames"])})
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


def plan(
    loss: Callable,
    *example_args: Any,
    budget: float | int | str | None = 0.5,
    max_grad_error: float = 1e-2,
    actions: Sequence[str] | None = None,
    argnums: int | Sequence[int] = 0,
    target: str | None = None,
) -> Plan:
    """Chooses an action per residual so that `jit(grad(loss))` fits a memory budget.

    For each residual `loss` saves at the example arguments, `plan` weighs keeping
    it, casting it to bfloat16, quantizing it to 8 or 4 bits, recomputing it
    (`Remat`, from the nearest values the plan stores) and, where the device has
    host memory of its own, offloading it. Plans are tried on the compiler
    (`jit(grad)` lowered and compiled, nothing run) and the cheapest that fits is
    returned: first the plans that take one action everywhere; then the plans of
    least predicted time under a bound on predicted stored bytes
    (`scipy.optimize.milp`), the bound moved until the compiled memory lands within
    5% under the budget; then, from the cheapest plan that fits, one residual at a
    time given a cheaper action. Finally the plan's gradient is compared with plain
    `jax.grad` on the example arguments; above `max_grad_error`, the error bound is
    tightened and the plan made again.

    The cost model, per residual and action:

    - bytes: what the engine stores, read from its decisions in a trace (a residual
      derived from other stored values stores nothing; recomputing one may store
      the value it is recomputed from), times the scans' trip counts;
    - gradient error: the relative error of `unpack(pack(x))` on the example's own
      residuals (one run of its gradient), added in quadrature over the residuals
      chosen and scaled by the ratio of measured to predicted gradient error that
      the one-action plans show (nominal figures for shapes only);
    - time: packing and unpacking at a throughput measured once on the running
      backend; recomputation from XLA's cost analysis (FLOPs and bytes accessed) of
      the program with that residual recomputed, at a measured FLOP rate and
      bandwidth.

    Memory is the peak of the compiled `jax.jit(jax.grad(loss, argnums))`
    (`residual.Memory.peak`, per device when the arguments are sharded), as
    `residual.inspect` reports it. The result is never above plain `jax.grad`: if no
    plan lowers the compiled memory, every residual is kept.

    With `target` (`"v5e"`, `"v5e:2x2"`, `"h100"`, ...) the plan is made for hardware
    that need not be here: every program is compiled for it (its memory per device),
    and nothing runs. Step times are then predicted, not measured: each compiled
    program's FLOPs and bytes accessed (its compiler's cost analysis) at the chip's
    peak FLOP/s and memory bandwidth, whichever takes longer; the fastest plan that
    fits is chosen by that prediction, and packing costs come from the same roofline.
    Gradient errors are the nominal ones of shapes only, as nothing runs; `offload`
    is left out unless asked for (its host transfers are not in the roofline).

    Args:
        loss: a function returning a scalar, as you would pass it to `jax.grad`.
        *example_args: its arguments: arrays (their values give the gradient error),
            or `jax.ShapeDtypeStruct`s (nominal errors, no gradient check).
        budget: the peak memory to fit (per device): a fraction of plain `jax.grad`'s (`0.5`),
            bytes (an int), a string such as `"6 GiB"` or `"512 MiB"`, or `None` for
            the least memory within `max_grad_error`.
        max_grad_error: the largest relative error of the gradient (global norm)
            against plain `jax.grad` on the example arguments; `0` allows lossless
            actions only.
        actions: the action names to choose from, a subset of `"keep"`, `"bf16"`,
            `"int8"`, `"int4"`, `"remat"`, `"offload"`; `None` for all of them the
            backend supports (`"offload"` needs host memory apart from the device's,
            not the CPU's).
        argnums: the arguments differentiated, as for `jax.grad`.
        target: `None` to plan for the running backend (and time steps on it), or a TPU
            or GPU to compile for without one (see the Targets page); the arguments'
            shardings are mapped onto its devices.

    Returns:
        A `Plan`: a `residual.Policy` to pass to `with_hooks`, with its compiled
        `memory`, `plain_memory`, `grad_error` and `predicted_step_overhead`.

    Raises:
        TypeError: `loss` is not callable, or `budget`, `max_grad_error`, `actions`
            has the wrong type.
        ValueError: a value out of range, or no plan reaches `budget`; the message
            gives the least memory that the allowed actions reached.

    Examples:
        >>> import jax, jax.numpy as jnp, residual
        >>> def loss(w, x):
        ...     for _ in range(4):
        ...         x = jnp.tanh(x @ w)
        ...     return jnp.sum(x ** 2)
        >>> w, x = jnp.eye(128) * 0.5, jnp.ones((128, 128))
        >>> p = residual.plan(loss, w, x, budget=None)
        >>> p.memory <= p.plain_memory
        True
        >>> g = jax.grad(residual.with_hooks(loss, policy=p))(w, x)

    References:
        Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016. Jain et
        al., "Checkmate: Breaking the Memory Wall with Optimal Tensor
        Rematerialization", MLSys 2020. Liu et al., "GACT: Activation Compressed
        Training for Generic Network Architectures", ICML 2022.
    """
    start = time.perf_counter()
    _check_loss(loss, example_args)
    max_grad_error = _check_error(max_grad_error)
    where = resolve(target)
    chosen = _check_actions(actions, where)
    requested = _check_budget(budget)
    planner = _Planner(loss, example_args, argnums, chosen, max_grad_error, where)
    result = planner.run(requested)
    return dataclasses.replace(result, compiles=planner.compiles,
                               planning_seconds=time.perf_counter() - start)


def plan_sweep(
    loss: Callable,
    *example_args: Any,
    budgets: Sequence[float | int | str | None] = (0.25, 0.5, 0.75, None),
    max_grad_error: float = 1e-2,
    actions: Sequence[str] | None = None,
    argnums: int | Sequence[int] = 0,
    target: str | None = None,
) -> PlanSweep:
    """Plans `loss` for each of `budgets`, sharing the measurements: a memory-time trade-off.

    Arguments as for `residual.plan`. The residuals, their costs and every compiled
    program are measured once for all budgets. The plans are made monotone: a smaller
    budget never gets a plan of larger compiled memory (it takes the larger budget's
    plan, which fits it too), and a larger budget never a slower one (it takes the
    smaller budget's plan). Slower is by measured step time, where steps within 5% of
    each other count as equally fast (timing noise) and the more accurate, then the
    smaller, plan is preferred; a larger budget's plan is never more than 5% slower
    than any smaller budget's. With shapes only, slower is by predicted time; on a
    `target`, by the step time predicted from each compiled program. A budget no plan
    reaches is listed with the reason instead of a plan.

    Returns:
        A `PlanSweep`: `sweep.plans` (a `Plan` or `None` per budget), `print(sweep)`
        for a table, `sweep.plot()` for memory against step time (measured, else
        predicted) and error.

    Raises:
        TypeError, ValueError: as `residual.plan`, for its arguments and each budget.

    Examples:
        >>> import jax.numpy as jnp, residual
        >>> loss = lambda w, x: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w) ** 2)
        >>> sweep = residual.plan_sweep(loss, jnp.eye(128), jnp.ones((128, 128)),
        ...                             budgets=[None, 1.0])
        >>> len(sweep.plans)
        2
    """
    start = time.perf_counter()
    _check_loss(loss, example_args)
    max_grad_error = _check_error(max_grad_error)
    where = resolve(target)
    chosen = _check_actions(actions, where)
    if isinstance(budgets, str) or not isinstance(budgets, Sequence) or not budgets:
        raise TypeError(
            f"`budgets` must be a non-empty list of budgets (fractions, bytes, sizes such as "
            f"'6 GiB', or None), but got {budgets!r}."
        )
    requested = [_check_budget(b) for b in budgets]
    planner = _Planner(loss, example_args, argnums, chosen, max_grad_error, where)
    targets = [None if r is None else int(r[1] * planner.plain) if r[0] == "fraction"
               else int(r[1]) for r in requested]
    plans: list[Plan | None] = [None] * len(budgets)
    reasons: list[str | None] = [None] * len(budgets)
    # Smallest first: what the tight budgets compile, the loose ones may reuse.
    order = sorted(range(len(budgets)), key=lambda i: -1 if targets[i] is None else targets[i])
    for i in order:
        try:
            plans[i] = planner.run(requested[i])
        except ValueError as e:
            reasons[i] = str(e)
    _make_monotone(plans, [i for i in order if plans[i] is not None], targets)
    return PlanSweep(tuple(budgets), tuple(plans), tuple(reasons), planner.plain,
                     planner.compiles, time.perf_counter() - start, where.name)


def _make_monotone(plans: list, ascending: list[int], targets: list) -> None:
    """Gives the plans at `ascending` (indices of budgets, smallest first) monotone
    memory and step time, in place, each taking a plan that fits its budget.

    A smaller budget never uses more memory: it takes the larger budget's plan, which
    fits it too. A larger budget takes the smaller budget's plan when `plan` would
    prefer that one (`_preferred`), or when its own steps more than `_TIME_TIE` slower
    than the fastest plan of any smaller budget: a step up may be slower by at most that
    much, so the allowance does not add up along the sweep.
    """
    for i, j in reversed(list(itertools.pairwise(ascending))):
        if plans[i].memory > plans[j].memory:
            plans[i] = dataclasses.replace(plans[j], budget=targets[i])
    fastest = math.inf  # step seconds of the fastest plan so far (timed plans only)
    for i, j in itertools.pairwise(ascending):
        if plans[i].step_seconds is not None:
            fastest = min(fastest, plans[i].step_seconds)
        slow = plans[j].step_seconds is not None and (
            plans[j].step_seconds > (1 + _TIME_TIE) * fastest)
        if slow or _preferred(plans[i], plans[j]) is plans[i]:
            plans[j] = dataclasses.replace(plans[i], budget=targets[j])


@dataclasses.dataclass(frozen=True)
class PlanSweep:
    """The plans `residual.plan_sweep` made, one per budget.

    Attributes:
        budgets: the budgets asked for, as given.
        plans: a `Plan` per budget, `None` where no plan reaches it.
        reasons: why, where a budget has no plan (`None` elsewhere).
        plain_memory: the peak memory of plain `jit(grad)`, in bytes per device.
        compiles: programs compiled for the whole sweep.
        planning_seconds: wall time of the whole sweep.
        target: the hardware planned for, `None` for the running backend.
    """

    budgets: tuple
    plans: tuple[Plan | None, ...]
    reasons: tuple[str | None, ...]
    plain_memory: int
    compiles: int = 0
    planning_seconds: float = 0.0
    target: str | None = None

    def __str__(self) -> str:
        lines = [f"{'budget':>10s}  {'memory':>8s}  {'overhead':>8s}  {'grad error':>10s}",
                 "-" * 44]
        for budget, p in zip(self.budgets, self.plans):
            asked = "least" if budget is None else str(budget)
            if p is None:
                lines.append(f"{asked:>10s}  {'not reachable':>30s}")
                continue
            overhead = _overhead(p)
            lines.append(
                f"{asked:>10s}  {p.memory / self.plain_memory:7.2f}x  "
                f"{'' if overhead is None else f'{100 * overhead:7.1f}%':>8s}  "
                f"{'' if p.grad_error is None else f'{p.grad_error:.2e}':>10s}"
            )
        lines.append(f"memory: compiled jit(grad) peak memory on "
                     f"{self.target or 'the running backend'}, of plain "
                     f"{precise_size(self.plain_memory)}; overhead: {self._overhead_kind}, of a "
                     "plain step")
        return "\n".join(lines)

    @property
    def _overhead_kind(self) -> str:
        """'measured' when every plan's step was timed (values given), else 'predicted'
        (shapes only, or a target: nothing runs)."""
        plans = [p for p in self.plans if p is not None]
        timed = self.target is None and plans and all(
            p.step_seconds is not None for p in plans)
        return "measured" if timed else "predicted"

    def plot(self):
        """A matplotlib figure: compiled memory against step overhead (measured, or
        predicted for shapes only), coloured by gradient error.

        Raises:
            ImportError: matplotlib is not installed (`pip install 'residual[plot]'`).
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "`PlanSweep.plot` needs matplotlib: `pip install 'residual[plot]'`."
            ) from e
        points = [(b, p) for b, p in zip(self.budgets, self.plans) if p is not None]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        memory = [p.memory / self.plain_memory for _, p in points]
        cost = [100 * (_overhead(p) or 0.0) for _, p in points]
        error = [p.grad_error or 0.0 for _, p in points]
        dots = ax.scatter(memory, cost, c=error, cmap="viridis")
        ax.scatter([1.0], [0.0], marker="x", color="black")
        ax.annotate("plain jax.grad", (1.0, 0.0), fontsize=8, xytext=(-4, 6),
                    textcoords="offset points", ha="right")
        # Budgets that got the same plan share one label.
        labels: dict[tuple[float, float], list[str]] = {}
        for (budget, _), m, c in zip(points, memory, cost):
            labels.setdefault((m, c), []).append("least" if budget is None else str(budget))
        for (m, c), names in labels.items():
            ax.annotate(", ".join(names), (m, c), fontsize=8, xytext=(4, 4),
                        textcoords="offset points")
        fig.colorbar(dots, ax=ax, label="gradient error (relative)")
        ax.set_xlabel("compiled memory / plain jax.grad")
        ax.set_ylabel(f"{self._overhead_kind} step overhead (%)")
        ax.set_title("Plans: memory, time and error")
        fig.tight_layout()
        return fig


def _overhead(plan: Plan) -> float | None:
    """A plan's extra time per step as a fraction of plain's: measured when it was, else
    predicted (`None` for shapes only: no plain step was timed)."""
    if plan.step_overhead is not None:
        return plan.step_overhead
    return plan.predicted_step_overhead


def _preferred(a: Plan, b: Plan) -> Plan:
    """Of two plans that both fit, the one `plan` returns: the faster by measured step
    time, where steps within `_TIME_TIE` of each other are as fast and the more accurate
    (then the smaller) wins; by predicted time for shapes only."""
    if a.step_seconds is None or b.step_seconds is None:
        return min((a, b), key=lambda p: (p.predicted_seconds, p.memory))
    return _fastest_of((a, b), lambda p: p.step_seconds, lambda p: p.grad_error or 0.0,
                       lambda p: p.memory)


def _fastest_of(plans: Sequence[Plan], seconds: Callable, error: Callable,
                memory: Callable) -> Plan:
    """The fastest of `plans` by measured `seconds` (or ratios to plain): steps within
    `_TIME_TIE` of the fastest count as as fast (timing noise), and of those the least
    `error`, then the least `memory`, wins."""
    fastest = min(map(seconds, plans))
    ties = [p for p in plans if seconds(p) <= (1 + _TIME_TIE) * fastest]
    return min(ties, key=lambda p: (error(p), memory(p), seconds(p)))


def _check_loss(loss: Any, example_args: tuple) -> None:
    if not callable(loss):
        raise TypeError(
            f"`loss` must be a function returning a scalar, but got {type(loss).__name__}: "
            f"{loss!r:.80}. Pass the function first, then its example arguments."
        )
    if not example_args:
        raise TypeError(
            "`plan` needs example arguments of `loss` (arrays or `jax.ShapeDtypeStruct`s): "
            "`residual.plan(loss, params, batch, budget=0.5)`."
        )


def _check_error(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise TypeError(
            f"`max_grad_error` must be a number, the largest relative gradient error "
            f"allowed (e.g. 1e-2), but got {type(value).__name__}: {value!r}."
        )
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"`max_grad_error` must be a finite number >= 0 (0: lossless actions only), "
            f"but got {value!r}."
        )
    return float(value)


def _check_actions(actions: Any, where: Target | None = None) -> tuple[str, ...]:
    where = where or resolve(None)
    available = offload_available(where)
    if actions is None:  # on a target, offload only when asked: see `plan`
        return tuple(a for a in ACTIONS if a != "offload" or (available and where.runs))
    if isinstance(actions, str) or not isinstance(actions, Sequence):
        raise TypeError(
            f"`actions` must be a list of action names from {ACTIONS}, but got "
            f"{type(actions).__name__}: {actions!r}. For one action write "
            f"`actions=[{actions!r}]`."
        )
    for a in actions:
        if a not in ACTIONS:
            raise ValueError(
                f"`actions` must name actions from {ACTIONS}, but got {a!r}."
            )
    if "offload" in actions and not available:
        raise ValueError(
            f"`actions` includes 'offload', but {where.label} devices have no "
            "host memory apart from their own: offloading saves nothing there. Leave "
            "'offload' out (it is unavailable on this backend)."
        )
    return tuple(dict.fromkeys(("keep", *actions)))


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _check_budget(budget: Any) -> tuple[str, float] | None:
    """`None`, `("fraction", f)` or `("bytes", n)`."""
    if budget is None:
        return None
    if isinstance(budget, bool):
        raise TypeError(f"`budget` must be a fraction, bytes or a string, but got {budget!r}.")
    if isinstance(budget, int | np.integer):
        if budget <= 0:
            raise ValueError(f"`budget` in bytes must be positive, but got {budget!r}.")
        return ("bytes", float(budget))
    if isinstance(budget, float | np.floating):
        if not 0 < budget <= 1:
            raise ValueError(
                f"`budget` as a float is a fraction of plain `jax.grad`'s memory, in (0, 1], "
                f"but got {budget!r}. For bytes pass an int or a string such as '6 GiB'."
            )
        return ("fraction", float(budget))
    if isinstance(budget, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B)\s*", budget, flags=re.I)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"`budget` as a string must be a size such as '6 GiB' or '512 MiB', but got "
                f"{budget!r}."
            )
        n = float(match.group(1)) * _UNITS[match.group(2).lower()]
        if n <= 0:
            raise ValueError(f"`budget` must be positive, but got {budget!r}.")
        return ("bytes", n)
    raise TypeError(
        f"`budget` must be a fraction of plain memory (0.5), bytes (an int), a string "
        f"('6 GiB') or None, but got {type(budget).__name__}: {budget!r}."
    )


@dataclasses.dataclass
class _Group:
    """Residuals one decision covers: one residual in code, every scan iteration of it."""

    info: ResidualInfo
    key: tuple
    occurrence: int
    nbytes: int  # per step, all iterations
    iterations: int
    # action -> (stored bytes per step, seconds per step, relative error)
    options: dict[str, tuple[int, float, float]] = dataclasses.field(default_factory=dict)


class _Planner:
    def __init__(self, loss, args, argnums, actions, max_grad_error, where: Target | None = None):
        self.loss, self.args, self.argnums = loss, args, argnums
        self.actions, self.max_grad_error = actions, max_grad_error
        # Where programs are compiled; off the running backend nothing runs, and step
        # times are predicted from the compiled programs.
        self.where = where = where or resolve(None)
        self.concrete = where.runs and all(isinstance(x, jax.Array | np.ndarray | float | int)
                                           for x in jax.tree.leaves(args))
        self._predicted: dict[Plan | None, float] = {}
        self.compiles = 0
        self._memory: dict[Plan | None, int] = {}
        self._executables: dict[Plan | None, Any] = {}
        self._uniform: list[Plan] | None = None  # the one-action plans, once compiled
        # Measured step time of plans, as a ratio to plain's (timed in alternation).
        self._step_ratio: dict[Plan, float] = {}
        # Measured gradient errors, and the ratio of measured to predicted error that
        # the plans of one action everywhere show (round-trip errors of residuals
        # overstate the gradient's: many are damped on their way to it).
        self._measured: dict[Plan, float] = {}
        self.error_scale = 1.0
        self.plain = self.memory(None)
        self.groups = self._groups()
        self._costs()
        # Keeping everything steps as plain does: timing it would only add noise.
        self._step_ratio[self._choice_plan({})] = 1.0

    # Compiled programs -------------------------------------------------------

    def grad_fn(self, policy: Policy | None) -> Callable:
        fn = self.loss if policy is None else with_hooks(self.loss, policy=policy)
        return jax.grad(fn, argnums=self.argnums)

    def memory(self, policy: Plan | None) -> int:
        if policy not in self._memory:
            self.compiles += 1
            try:
                compiled = self.where.compile(self.grad_fn(policy), self.args)
            except DoesNotFitError as e:  # a TPU compiler refuses what exceeds its HBM
                if e.required is None:
                    raise
                self._memory[policy], self._executables[policy] = e.required, None
                return e.required
            self._memory[policy] = Memory.of(compiled).peak
            self._executables[policy] = compiled
        return self._memory[policy]

    def executable(self, policy: Plan | None):
        """The compiled `jit(grad)` under `policy` (compiled once, for memory and runs)."""
        if policy not in self._executables:
            self._memory.pop(policy, None)
            self.memory(policy)
        return self._executables[policy]

    # The residuals -------------------------------------------------------------

    def _groups(self) -> list[_Group]:
        from .policies import Identity

        with recording() as records:
            jax.eval_shape(self.grad_fn(Identity()), *self.args)
        groups: dict[tuple, _Group] = {}
        for r in records:
            info = r.info
            if (info.kept_alive or not jnp.issubdtype(info.dtype, jnp.floating)
                    or info.nbytes < _MIN_BYTES):
                continue
            key = (_code_key(info), info.index)
            if key in groups:  # identical scan bodies: one decision
                groups[key].nbytes += info.nbytes * r.iterations
                groups[key].iterations += r.iterations
            else:
                groups[key] = _Group(info, key, 0, info.nbytes * r.iterations, r.iterations)
        seen: dict[tuple, int] = {}
        for g in sorted(groups.values(), key=lambda g: g.info.index):
            g.occurrence = seen.get(g.key[0], 0)
            seen[g.key[0]] = g.occurrence + 1
        return list(groups.values())

    def _costs(self) -> None:
        packing = tuple(a for a in self.actions if a not in ("keep", "remat"))
        rates = self._rates = (_rates(packing) if self.where.chip is None
                               else _predicted_rates(packing, self.where))
        errors = self._round_trip_errors(packing) if self.concrete else {}
        traced = {a: self._stored_by_group(a) for a in packing}
        for g in self.groups:
            g.options["keep"] = (g.nbytes, 0.0, 0.0)
            for action in packing:
                policy = _policy(action).resolve(g.info)
                if policy is None:
                    continue
                stored = traced[action].get(g.key)
                if stored is None:
                    stored = _packed_bytes(policy, g.info) * g.iterations
                error = errors.get((g.key, action), _NOMINAL_ERROR.get(action, 0.0))
                g.options[action] = (stored, rates[action] * g.nbytes, error)
        if "remat" in self.actions:
            self._remat_costs()

    def _stored_by_group(self, action: str) -> dict[tuple, int]:
        """Bytes each residual stores when `action` is taken everywhere, as the engine
        decides it (one trace): a residual that other stored values give cheaply is
        derived from them and stores nothing, whatever the action."""
        plan = self._choice_plan({g.key: action for g in self.groups})
        with recording() as records:
            jax.eval_shape(self.grad_fn(plan), *self.args)
        stored: dict[tuple, int] = {}
        for r in records:
            key = (_code_key(r.info), r.info.index)
            stored[key] = stored.get(key, 0) + r.stored_bytes * r.iterations
        return stored

    def _round_trip_errors(self, actions: tuple[str, ...]) -> dict[tuple, float]:
        """The relative error of `unpack(pack(x))` under each action, on the example's
        own residual values, all iterations together: summed inside the gradient's
        program (one run; only two numbers per residual and action leave it)."""
        sums: dict[tuple, list[float]] = {}
        jax.block_until_ready(self.grad_fn(_RoundTrips(actions, sums))(*self.args))
        return {key: math.sqrt(err / norm) if norm > 0 else 0.0
                for key, (err, norm) in sums.items()}

    def _remat_costs(self) -> None:
        """Seconds and bytes of recomputing each residual: XLA's cost analysis of the
        program with it recomputed, against the program with it kept, at the measured
        rates; and the bytes the trace stores then, which include the values the engine
        stores to recompute from (a recomputed `tanh` may store the matmul before it)."""
        candidates = [g for g in self.groups if _policy("remat").resolve(g.info) is not None]
        base, base_stored = self._base
        rates = self._rates
        # An unrolled loop's layers share a code key and cost the same: measured once.
        first: dict[tuple, _Group] = {}
        for g in candidates:
            first.setdefault(g.key[0], g)
        if len(first) <= _REMAT_MEASURED:
            costs = {}
            for key, g in first.items():
                cost, stored = self._traced(self._choice_plan({g.key: "remat"}))
                costs[key] = (_seconds(cost, base, rates, g.nbytes), stored - base_stored)
            for g in candidates:
                seconds, extra = costs[g.key[0]]
                g.options["remat"] = (max(g.nbytes + extra, 0), seconds, 0.0)
            return
        # Many residuals: one program with all of them recomputed, shared by their bytes.
        cost, stored = self._traced(self._choice_plan({g.key: "remat" for g in candidates}))
        total = _seconds(cost, base, rates, 0)
        size = sum(g.nbytes for g in candidates)
        for g in candidates:
            share = g.nbytes / size
            g.options["remat"] = (max(g.nbytes + (stored - base_stored) * share, 0),
                                  total * share, 0.0)

    @functools.cached_property
    def _base(self) -> tuple[dict[str, float], int]:
        """`_traced` of the plan that keeps everything: what recomputing is measured
        against (traced only when recomputing is an action)."""
        return self._traced(self._choice_plan({}))

    def _traced(self, policy: Policy) -> tuple[dict[str, float], int]:
        """XLA's cost analysis of `jit(grad)` under `policy` (lowered, not compiled), and
        the bytes its trace stores for the backward."""
        with recording() as records:
            cost = _cost(self.grad_fn(policy), self.args)
        return cost, sum(r.stored_bytes * r.iterations for r in records)

    # Plans ------------------------------------------------------------------------

    def _choice_plan(self, choice: dict[tuple, str], **extra) -> Plan:
        decisions = []
        for g in self.groups:
            action = choice.get(g.key, "keep")
            stored, seconds, error = g.options.get(action, (g.nbytes, 0.0, 0.0))
            info = g.info
            decisions.append(Decision(
                in_scan=info.in_scan, scope=info.scope, name=info.name,
                primitive=info.primitive, derivative_of=info.derivative_of,
                shape=tuple(info.shape), dtype=dtype_name(info.dtype), frames=g.key[0][-1],
                index=info.index, occurrence=g.occurrence, action=action, nbytes=g.nbytes,
                stored=stored, seconds=seconds, error=error, iterations=g.iterations,
            ))
        decisions.sort(key=lambda d: (not d.in_scan, d.index))
        seconds = sum(d.seconds for d in decisions)
        return Plan(tuple(decisions), predicted_seconds=seconds,
                    plain_memory=self.plain, max_grad_error=self.max_grad_error, **extra)

    def _solve(self, byte_cap: float, error_cap: float, minimize: str = "seconds"
               ) -> dict[tuple, str] | None:
        """The choice of least predicted time (or bytes) within the byte and error caps."""
        from scipy.optimize import Bounds, LinearConstraint, milp

        columns = [(i, a, *o) for i, g in enumerate(self.groups) for a, o in g.options.items()]
        if not columns:
            return {}
        n = len(columns)
        stored = np.array([c[2] for c in columns], float)
        seconds = np.array([c[3] for c in columns], float)
        squared = np.array([c[4] ** 2 for c in columns], float)
        # Ties go to keeping: a change that buys nothing is not made.
        changed = np.array([c[1] != "keep" for c in columns], float)
        if minimize == "seconds":
            objective = seconds + 1e-9 * changed
        else:
            objective = stored / max(stored.max(), 1) + 1e-6 * seconds / max(seconds.max(),
                                                                                1e-12)
        one = np.zeros((len(self.groups), n))
        for j, c in enumerate(columns):
            one[c[0], j] = 1
        constraints = [LinearConstraint(one, 1, 1),
                       LinearConstraint(stored[None], -np.inf, byte_cap),
                       LinearConstraint(squared[None], -np.inf,
                                        (error_cap / self.error_scale)**2 + 1e-18)]
        result = milp(objective, constraints=constraints, integrality=np.ones(n),
                      bounds=Bounds(0, 1))
        if result.x is None:
            return None
        return {self.groups[c[0]].key: c[1] for c, x in zip(columns, result.x) if x > 0.5}

    def run(self, requested) -> Plan:
        target = None
        if requested is not None:
            kind, value = requested
            target = int(value * self.plain) if kind == "fraction" else int(value)
            if target >= self.plain:
                return self._finish(self._choice_plan({}), target, memory=self.plain)
        error_cap = self.max_grad_error
        for _ in range(3):
            result = self._fit(target, error_cap)
            if not self.concrete or result.lossless:
                return self._finish(result, target)
            error = self._grad_error(result)
            if error <= self.max_grad_error:
                return self._finish(result, target, grad_error=error)
            error_cap *= 0.5 * self.max_grad_error / error
        return self._finish(self._fit(target, 0.0), target)

    def _fit(self, target: int | None, error_cap: float) -> Plan:
        """The plan of least predicted time whose compiled memory fits `target`."""
        self._memory.setdefault(self._choice_plan({}), self.plain)
        self._compile_uniform(error_cap)
        if target is None:
            self.memory(self._choice_plan(self._solve(np.inf, error_cap, "bytes") or {}))
            # The fewest predicted bytes need not compile to the least memory (XLA's
            # liveness decides): a few rounds aiming below the best measured so far.
            for _ in range(2):
                try:
                    self._fit(int(0.9 * self.memory(self._least(error_cap))), error_cap)
                except ValueError:
                    break
            return self._least(error_cap)
        self._search(target, error_cap)
        self._relax(target, error_cap)
        fits = [p for p in self._within(error_cap) if self._memory[p] <= target]
        if fits:
            return self._fastest(fits)
        best = self._least(error_cap)
        raise ValueError(
            f"No plan fits `budget` of {precise_size(target)} ({target / self.plain:.2f}x of plain "
            f"`jax.grad`'s {precise_size(self.plain)}): the least compiled memory reached with "
            f"actions {list(self.actions)} within max_grad_error={self.max_grad_error:g} is "
            f"{precise_size(self.memory(best))} ({self.memory(best) / self.plain:.2f}x). Raise "
            "`budget` to at least that, allow a larger `max_grad_error`, or more `actions`."
        )

    def _search(self, target: int, error_cap: float) -> None:
        """Compiles the plans of least predicted time under a byte bound, moving the bound
        until a plan's compiled memory lands within 5% under `target`.

        The bound starts at plain's residual bytes minus the memory to save; a plan
        above the target tightens it by the overshoot, one well under loosens it by the
        slack, and once plans on both sides are known it is bisected. A bound that
        gives a plan compiled before costs no compile.
        """
        cap = sum(g.nbytes for g in self.groups) - (self.plain - target)
        fits_at, over_at = -np.inf, np.inf
        compiles = self.compiles
        for _ in range(3 * _ROUNDS):
            choice = self._solve(cap, error_cap)
            if choice is None:  # nothing within the error bound stores this little
                if fits_at == -np.inf:
                    return
                over_at = cap
            else:
                memory = self.memory(self._choice_plan(choice))
                if memory <= target:
                    fits_at = max(fits_at, cap)
                    if memory >= 0.95 * target:
                        return
                else:
                    over_at = min(over_at, cap)
            if self.compiles - compiles >= _ROUNDS:
                return
            if over_at == np.inf:
                cap += target - memory
            elif fits_at == -np.inf:
                cap -= max(memory - target, 0.02 * self.plain)
            elif over_at - fits_at > 0.005 * self.plain:
                cap = 0.5 * (fits_at + over_at)
            else:
                return

    def _compile_uniform(self, error_cap: float) -> None:
        """Compiles the plans that take one action wherever it is offered (what a single
        policy chosen by hand does), once per planner: candidates the byte model may
        rank wrong, since XLA's liveness, not the sum of stored bytes, sets the peak.
        Their measured gradient errors calibrate the predicted ones."""
        if self._uniform is not None:
            return
        scales: list[float] = []
        plans = [self._choice_plan({g.key: a for g in self.groups if a in g.options})
                 for a in self.actions if a != "keep"]
        in_scan = {g.key: "remat" for g in self.groups if g.info.in_scan and "remat" in g.options}
        if in_scan:  # what `Remat` on every scan body does
            plans.append(self._recompute_scans(in_scan))
        self._uniform = plans
        for plan in sorted(plans, key=_plan_error):
            predicted = _plan_error(plan)
            if plan in self._memory or (scales and predicted * min(scales) > error_cap):
                continue  # already known, or beyond the bound at the smallest scale seen
            self.memory(plan)
            if self.concrete and predicted > 0:
                self._measured[plan] = self._grad_error(plan)
                scales.append(self._measured[plan] / predicted)
        if scales:
            self.error_scale = max(scales)

    def _error(self, plan: Plan) -> float:
        """A plan's gradient error: measured if it was, else predicted and calibrated."""
        if plan in self._measured:
            return self._measured[plan]
        return self.error_scale * _plan_error(plan)

    def _recompute_scans(self, choice: dict[tuple, str]) -> Plan:
        """The plan that recomputes every scan body, its time from XLA's cost analysis
        of the whole program: recomputing the values the plan does not list costs more
        than the residuals' own shares."""
        plan = self._choice_plan(choice, recompute_scans=True)
        cost, _ = self._traced(plan)
        seconds = _seconds(cost, self._base[0], self._rates, 0)
        return dataclasses.replace(plan, predicted_seconds=max(plan.predicted_seconds, seconds))

    def _within(self, error_cap: float) -> list[Plan]:
        """The plans compiled so far whose gradient error is within `error_cap`."""
        return [p for p in self._memory if p is not None and self._error(p) <= error_cap + 1e-12]

    def _relax(self, target: int, error_cap: float) -> None:
        """From the cheapest plan that fits, compiles plans that give one residual group
        a cheaper action (greatest predicted saving first), moving on from each that
        still fits: XLA's liveness leaves room the byte model does not see."""
        def fits(p):
            return self._memory[p] <= target
        for tries in range(_ROUNDS):
            best = min((p for p in self._within(error_cap) if fits(p)),
                       key=lambda p: p.predicted_seconds, default=None)
            # Within 5% of the budget, little is left to gain: half the compiles.
            if best is None or (self._memory[best] >= 0.95 * target and 2 * tries >= _ROUNDS):
                return
            choice = {(d.code_key, d.index): d.action for d in best.decisions}
            extra = {"recompute_scans": best.recompute_scans}
            moves = sorted(
                ((g.options[choice[g.key]][1] - o[1], g.key, a) for g in self.groups
                 for a, o in g.options.items() if o[1] < g.options[choice[g.key]][1]),
                key=lambda m: -m[0])
            for _saving, key, action in moves:
                candidate = self._choice_plan({**choice, key: action}, **extra)
                if candidate in self._memory or self._error(candidate) > error_cap:
                    continue
                self.memory(candidate)
                break
            else:
                return

    def _fastest(self, fits: list[Plan]) -> Plan:
        """Of the plans that fit, the fastest: by measured step time among the few of
        least predicted time and the one-action plans that fit (what a policy chosen by
        hand would do), when the arguments have values; else by predicted time. Plans
        within `_TIME_TIE` of the fastest are as fast: the most accurate of them wins."""
        ranked = sorted(fits, key=lambda p: (p.predicted_seconds, self._memory[p]))
        if self.where.chip is not None:  # nothing runs: every plan's step is predicted
            predicted = [p for p in ranked if self._step_seconds(p) is not None]
            if not predicted:
                return ranked[0]
            return _fastest_of(predicted, self._step_seconds, self._error,
                               self._memory.__getitem__)
        if not self.concrete or len(ranked) == 1:
            return ranked[0]
        finalists = ranked[:_FINALISTS] + [p for p in ranked[_FINALISTS:]
                                           if p in self._uniform or p in self._step_ratio]
        self._time_steps(finalists)
        return _fastest_of(finalists, self._step_ratio.__getitem__, self._error,
                           self._memory.__getitem__)

    def _time_steps(self, plans: list[Plan]) -> None:
        """Times the steps of `plans` not timed yet, each right after a plain step, in
        rounds (the median ratio to plain is kept): a ratio taken in alternation is
        steadier than seconds on a busy machine."""
        plans = [p for p in plans if p not in self._step_ratio]
        if not plans:
            return
        steps = [self.executable(None), *(self.executable(p) for p in plans)]
        for p, step in zip(plans, steps[1:]):
            if p not in self._measured:  # not run yet: its first run allocates
                jax.block_until_ready(step(*self.args))
        plain = max(self._plain_seconds(), 1e-6)
        runs = math.ceil(_SAMPLE_SECONDS / plain)
        rounds = max(2, min(9, int(_TIMING_SECONDS / (plain * runs * (1 + len(plans))))))
        ratios: list[list[float]] = [[] for _ in plans]
        for _ in range(rounds):
            seconds = [_best_time(functools.partial(_run, s, self.args, runs), repeats=1)
                       for s in steps]
            for i, t in enumerate(seconds[1:]):
                ratios[i].append(t / seconds[0])
        for p, r in zip(plans, ratios):
            self._step_ratio[p] = float(np.median(r))

    def _least(self, error_cap: float) -> Plan:
        """Of every plan compiled so far within `error_cap`, the one of least memory
        (then least predicted time): never above plain, which keeps everything."""
        return min(self._within(error_cap), key=lambda p: (self._memory[p], p.predicted_seconds))

    def _finish(self, result: Plan, target, memory=None, grad_error=None) -> Plan:
        memory = self.memory(result) if memory is None else memory
        if grad_error is None and self.concrete:
            grad_error = 0.0 if not any(d.action != "keep" for d in result.decisions) else (
                self._grad_error(result))
        plain_seconds = self._plain_seconds()
        step_seconds = None
        if self.concrete:
            self._time_steps([result])
            step_seconds = self._step_ratio[result] * plain_seconds
        elif self.where.chip is not None:
            step_seconds = self._step_seconds(result)
        return dataclasses.replace(result, memory=memory, budget=target, grad_error=grad_error,
                                   plain_step_seconds=plain_seconds, step_seconds=step_seconds,
                                   target=self.where.name)

    @functools.cached_property
    def _plain_grad(self):
        return self.executable(None)(*self.args)

    def _grad_error(self, result: Plan) -> float:
        if result not in self._measured:
            got = self.executable(result)(*self.args)
            self._measured[result] = whole_gradient_error(got, self._plain_grad)
        return self._measured[result]

    def _step_seconds(self, policy: Plan | None) -> float | None:
        """A step under `policy` on the target, predicted from its compiled program
        (`None` when the target's compiler refused it for want of memory)."""
        if policy not in self._predicted:
            compiled = self.executable(policy)
            self._predicted[policy] = (
                None if compiled is None else self.where.predicted_seconds(compiled))
        return self._predicted[policy]

    @functools.lru_cache(maxsize=1)  # noqa: B019 - one planner, one measurement
    def _plain_seconds(self) -> float | None:
        if self.where.chip is not None:
            return self._step_seconds(None)
        if not self.concrete:
            return None
        step = self.executable(None)
        jax.block_until_ready(step(*self.args))
        return _best_time(lambda: step(*self.args))


@dataclasses.dataclass(frozen=True, eq=False)
class _RoundTrips(Policy):
    """Stores every residual as it is, and adds each action's squared round-trip error
    and the squared norm of the residual to `sums`, keyed as plans' groups are."""

    actions: tuple[str, ...]
    sums: dict
    lossless = True

    def pack(self, x, info):
        if not jnp.issubdtype(info.dtype, jnp.floating) or info.nbytes < _MIN_BYTES:
            return x
        key = (_code_key(info), info.index)
        want = x.astype(jnp.float32)
        for action in self.actions:
            policy = _policy(action).resolve(info)
            if policy is None or policy.lossless:
                continue
            packed = jax.tree.map(_opaque, policy.pack(x, info))
            got = policy.unpack(packed, info).astype(jnp.float32)
            jax.debug.callback(functools.partial(_add_sums, self.sums, (key, action)),
                               jnp.sum((got - want) ** 2), jnp.sum(want**2))
        return x

    def unpack(self, packed, info):
        return packed


def _opaque(x):
    """`x`, through integers XLA cannot see into: with excess precision allowed (its
    default), XLA folds a cast to a narrower float and back into nothing, which would
    make the round trip look exact."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    bits = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
    hidden = jax.lax.optimization_barrier(jax.lax.bitcast_convert_type(x, bits))
    return jax.lax.bitcast_convert_type(hidden, x.dtype)


def _add_sums(sums: dict, key: tuple, err, norm) -> None:
    total = sums.setdefault(key, [0.0, 0.0])
    total[0] += float(err)
    total[1] += float(norm)


def _packed_bytes(policy: Policy, info: ResidualInfo) -> int:
    shape = jax.eval_shape(lambda x: policy.pack(x, info),
                           jax.ShapeDtypeStruct(info.shape, info.dtype))
    return sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(shape))


def _plan_error(plan: Plan) -> float:
    """A plan's predicted gradient error: its round-trip errors added in quadrature."""
    return math.sqrt(sum(d.error**2 for d in plan.decisions))


def _cost(fn: Callable, args) -> dict[str, float]:
    analysis = jax.jit(fn).lower(*args).cost_analysis() or {}
    if isinstance(analysis, list):  # older JAX: one dictionary per program
        analysis = analysis[0] if analysis else {}
    return {k: float(analysis.get(k, 0.0)) for k in ("flops", "bytes accessed")}


def _seconds(cost, base, rates, nbytes: int) -> float:
    flops = max(cost["flops"] - base["flops"], 0.0)
    moved = max(cost["bytes accessed"] - base["bytes accessed"], float(nbytes))
    return flops / rates["flops"] + moved * rates["bandwidth"]


@functools.cache
def _rates(actions: tuple[str, ...]) -> dict[str, float]:
    """Measured on the running backend: seconds per byte of each action's pack and unpack,
    seconds per byte moved, and FLOPs per second."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((512, 1024)), jnp.float32)
    info = ResidualInfo(index=0, shape=x.shape, dtype=np.dtype(np.float32), primitive="tanh")
    rates: dict[str, float] = {}
    copy = jax.jit(lambda x: x * 2 + 1)
    jax.block_until_ready(copy(x))
    rates["bandwidth"] = _best_time(lambda: copy(x)) / (2 * x.nbytes)
    a = x[:512, :512]
    matmul = jax.jit(lambda a: a @ a)
    jax.block_until_ready(matmul(a))
    rates["flops"] = 2 * 512**3 / _best_time(lambda: matmul(a))
    for action in actions:
        policy = _policy(action)
        trip = jax.jit(lambda x, p=policy: p.unpack(p.pack(x, info), info))
        jax.block_until_ready(trip(x))
        rates[action] = _best_time(lambda trip=trip: trip(x)) / x.nbytes
    return rates


@functools.cache
def _predicted_rates(actions: tuple[str, ...], where: Target) -> dict[str, float]:
    """`_rates` on a target, predicted: its chip's peak FLOP/s and seconds per byte of
    memory bandwidth, and each action's pack and unpack compiled for it (a roofline)."""
    x = jax.ShapeDtypeStruct((512, 1024), jnp.float32)
    info = ResidualInfo(index=0, shape=x.shape, dtype=np.dtype(np.float32), primitive="tanh")
    rates = {"flops": where.chip.flops, "bandwidth": 1 / where.chip.bandwidth}
    for action in actions:
        policy = _policy(action)
        trip = where.compile(lambda x, p=policy: p.unpack(p.pack(x, info), info), [x])
        rates[action] = where.predicted_seconds(trip) / (4 * math.prod(x.shape))
    return rates


def _run(step: Callable, args: tuple, times: int):
    for _ in range(times):
        out = step(*args)
    return out


def _best_time(run: Callable, repeats: int = 3) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run())
        best = min(best, time.perf_counter() - start)
    return best
