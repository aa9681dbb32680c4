"""`plan_sweep`: plans for several budgets from one set of measurements, made monotone."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._format import precise_size
from .._target import resolve
from .checks import check_actions, check_budget, check_differentiable, check_error, check_loss
from .planner import Planner
from .timing import TIME_TIE, preferred
from .value import Plan


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
    check_loss(loss, example_args)
    check_differentiable(example_args, argnums, "plan_sweep")
    max_grad_error = check_error(max_grad_error)
    where = resolve(target)
    chosen = check_actions(actions, where)
    if isinstance(budgets, str) or not isinstance(budgets, Sequence) or not budgets:
        raise TypeError(
            f"`budgets` must be a non-empty list of budgets (fractions, bytes, sizes such as "
            f"'6 GiB', or None), but got {budgets!r}."
        )
    requested = [check_budget(b) for b in budgets]
    planner = Planner(loss, example_args, argnums, chosen, max_grad_error, where)
    targets = [None if r is None else r.bytes_of(planner.plain) for r in requested]
    plans: list[Plan | None] = [None] * len(budgets)
    reasons: list[str | None] = [None] * len(budgets)
    # Smallest first: what the tight budgets compile, the loose ones may reuse.
    order = sorted(range(len(budgets)), key=lambda i: -1 if targets[i] is None else targets[i])
    for i in order:
        try:
            plans[i] = planner.run(requested[i])
        except ValueError as e:
            reasons[i] = str(e)
    make_monotone(plans, [i for i in order if plans[i] is not None], targets)
    return PlanSweep(tuple(budgets), tuple(plans), tuple(reasons), planner.plain,
                     planner.compiles, time.perf_counter() - start, where.name)


def make_monotone(plans: list, ascending: list[int], targets: list) -> None:
    """Gives the plans at `ascending` (indices of budgets, smallest first) monotone
    memory and step time, in place, each taking a plan that fits its budget.

    A smaller budget never uses more memory: it takes the larger budget's plan, which
    fits it too. A larger budget takes the smaller budget's plan when `plan` would
    prefer that one (`preferred`), or when its own steps more than `TIME_TIE` slower
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
            plans[j].step_seconds > (1 + TIME_TIE) * fastest)
        if slow or preferred(plans[i], plans[j]) is plans[i]:
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
