"""`plan` and the `Planner` behind it: residuals grouped, their costs measured, the
cheapest plan that fits a budget searched for on the compiled program."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._format import precise_size
from .._info import dtype_name
from .._target import Target, resolve
from .checks import (
    Budget,
    check_actions,
    check_budget,
    check_differentiable,
    check_error,
    check_loss,
)
from .costs import (
    CostModel,
    group_residuals,
    plan_error,
)
from .programs import Programs
from .search import cheapest_choice
from .timing import fastest_of
from .value import Plan, PlanDecision

# Compiles per budget for each of the two searches (the byte bound's, then one
# group at a time).
_ROUNDS = 4

# Plans that fit, of least predicted time, whose steps are run and timed before one is
# returned (with every one-action plan that fits): the predicted times rank them less
# surely than the gaps between them.
FINALISTS = 3


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
        TypeError: `loss` is not callable, `budget`, `max_grad_error`, `actions` or
            `argnums` has the wrong type, or an argument `argnums` names holds a leaf
            `jax.grad` cannot differentiate (a model object with integer state or
            functions: pass its float arrays alone, the message says how).
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
    check_loss(loss, example_args)
    check_differentiable(example_args, argnums, "plan")
    max_grad_error = check_error(max_grad_error)
    where = resolve(target)
    chosen = check_actions(actions, where)
    requested = check_budget(budget)
    planner = Planner(loss, example_args, argnums, chosen, max_grad_error, where)
    result = planner.run(requested)
    return dataclasses.replace(result, compiles=planner.compiles,
                               planning_seconds=time.perf_counter() - start)


class Planner:
    """One plan search: its compiled programs, the residual groups and their costs, and
    the search for the plan of least time that fits each budget asked of it."""

    def __init__(self, loss, args, argnums, actions, max_grad_error, where: Target | None = None):
        self.actions, self.max_grad_error = actions, max_grad_error
        self.where = where = where or resolve(None)
        self.programs = Programs(loss, args, argnums, where)
        self.concrete = self.programs.concrete
        self._uniform: list[Plan] | None = None  # the one-action plans, once compiled
        # The ratio of measured to predicted gradient error that the plans of one action
        # everywhere show (round-trip errors of residuals overstate the gradient's: many
        # are damped on their way to it).
        self.error_scale = 1.0
        self.plain = self.memory(None)
        self.groups = group_residuals(self.programs)
        self.costs = CostModel(self.programs, self.groups, actions, self._choice_plan)
        # Keeping everything steps as plain does: timing it would only add noise.
        self.programs.step_ratio[self._choice_plan({})] = 1.0

    @property
    def compiles(self) -> int:
        return self.programs.compiles

    def memory(self, policy: Plan | None) -> int:
        """The compiled peak memory of `jit(grad)` under `policy`, compiled once."""
        return self.programs.memory(policy)

    # Plans ------------------------------------------------------------------------

    def _choice_plan(self, choice: dict[tuple, str], **extra) -> Plan:
        decisions = []
        for g in self.groups:
            action = choice.get(g.key, "keep")
            stored, seconds, error = g.options.get(action, (g.nbytes, 0.0, 0.0))
            info = g.info
            decisions.append(PlanDecision(
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

    def run(self, requested: Budget | None) -> Plan:
        """The plan for one budget (`None`: the least memory reached)."""
        target = None
        if requested is not None:
            target = Budget(*requested).bytes_of(self.plain)
            if target >= self.plain:
                return self._finish(self._choice_plan({}), target, memory=self.plain)
        error_cap = self.max_grad_error
        for _ in range(3):
            result = self._fit(target, error_cap)
            if not self.concrete or result.lossless:
                return self._finish(result, target)
            error = self.programs.grad_error(result)
            if error <= self.max_grad_error:
                return self._finish(result, target, grad_error=error)
            error_cap *= 0.5 * self.max_grad_error / error
        return self._finish(self._fit(target, 0.0), target)

    def _fit(self, target: int | None, error_cap: float) -> Plan:
        """The plan of least predicted time whose compiled memory fits `target`."""
        self.programs.compiled_memory.setdefault(self._choice_plan({}), self.plain)
        self._compile_uniform(error_cap)
        if target is None:
            least_bytes = cheapest_choice(self.groups, np.inf, error_cap / self.error_scale,
                                          "bytes")
            self.memory(self._choice_plan(least_bytes or {}))
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
        fits = [p for p in self._within(error_cap) if self.programs.compiled_memory[p] <= target]
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
            choice = cheapest_choice(self.groups, cap, error_cap / self.error_scale)
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
        self._uniform = plans = self._one_action_plans()
        for plan in sorted(plans, key=plan_error):
            predicted = plan_error(plan)
            if (plan in self.programs.compiled_memory
                    or (scales and predicted * min(scales) > error_cap)):
                continue  # already known, or beyond the bound at the smallest scale seen
            self.memory(plan)
            if self.concrete and predicted > 0:
                self.programs.grad_errors[plan] = self.programs.grad_error(plan)
                scales.append(self.programs.grad_errors[plan] / predicted)
        if scales:
            self.error_scale = max(scales)

    def _one_action_plans(self) -> list[Plan]:
        """Each action taken wherever it is offered, and `Remat` on every scan body."""
        plans = [self._choice_plan({g.key: a for g in self.groups if a in g.options})
                 for a in self.actions if a != "keep"]
        in_scan = {g.key: "remat" for g in self.groups if g.info.in_scan and "remat" in g.options}
        if in_scan:
            plans.append(self.costs.recompute_scans_plan(in_scan))
        return plans

    def _error(self, plan: Plan) -> float:
        """A plan's gradient error: measured if it was, else predicted and calibrated."""
        if plan in self.programs.grad_errors:
            return self.programs.grad_errors[plan]
        return self.error_scale * plan_error(plan)

    def _within(self, error_cap: float) -> list[Plan]:
        """The plans compiled so far whose gradient error is within `error_cap`."""
        return [p for p in self.programs.compiled_memory
                if p is not None and self._error(p) <= error_cap + 1e-12]

    def _relax(self, target: int, error_cap: float) -> None:
        """From the cheapest plan that fits, compiles plans that give one residual group
        a cheaper action (greatest predicted saving first), moving on from each that
        still fits: XLA's liveness leaves room the byte model does not see."""
        def fits(p):
            return self.programs.compiled_memory[p] <= target
        for tries in range(_ROUNDS):
            best = min((p for p in self._within(error_cap) if fits(p)),
                       key=lambda p: p.predicted_seconds, default=None)
            # Within 5% of the budget, little is left to gain: half the compiles.
            if best is None or (self.programs.compiled_memory[best] >= 0.95 * target
                                and 2 * tries >= _ROUNDS):
                return
            choice = {(d.code_key, d.index): d.action for d in best.decisions}
            extra = {"recompute_scans": best.recompute_scans}
            moves = sorted(
                ((g.options[choice[g.key]].seconds - o.seconds, g.key, a) for g in self.groups
                 for a, o in g.options.items() if o.seconds < g.options[choice[g.key]].seconds),
                key=lambda m: -m[0])
            for _saving, key, action in moves:
                candidate = self._choice_plan({**choice, key: action}, **extra)
                if candidate in self.programs.compiled_memory or self._error(candidate) > error_cap:
                    continue
                self.memory(candidate)
                break
            else:
                return

    def _fastest(self, fits: list[Plan]) -> Plan:
        """Of the plans that fit, the fastest: by measured step time among the few of
        least predicted time and the one-action plans that fit (what a policy chosen by
        hand would do), when the arguments have values; else by predicted time. Plans
        within `TIME_TIE` of the fastest are as fast: the most accurate of them wins."""
        ranked = sorted(fits, key=lambda p: (p.predicted_seconds, self.programs.compiled_memory[p]))
        if self.where.chip is not None:  # nothing runs: every plan's step is predicted
            predicted = [p for p in ranked if self.programs.step_seconds(p) is not None]
            if not predicted:
                return ranked[0]
            return fastest_of(predicted, self.programs.step_seconds, self._error,
                               self.programs.compiled_memory.__getitem__)
        if not self.concrete or len(ranked) == 1:
            return ranked[0]
        finalists = ranked[:FINALISTS] + [p for p in ranked[FINALISTS:]
                                           if p in self._uniform or p in self.programs.step_ratio]
        self.programs.time_steps(finalists)
        return fastest_of(finalists, self.programs.step_ratio.__getitem__, self._error,
                           self.programs.compiled_memory.__getitem__)

    def _least(self, error_cap: float) -> Plan:
        """Of every plan compiled so far within `error_cap`, the one of least memory
        (then least predicted time): never above plain, which keeps everything."""
        return min(self._within(error_cap),
                   key=lambda p: (self.programs.compiled_memory[p], p.predicted_seconds))

    def _finish(self, result: Plan, target, memory=None, grad_error=None) -> Plan:
        memory = self.memory(result) if memory is None else memory
        if grad_error is None and self.concrete:
            grad_error = 0.0 if not any(d.action != "keep" for d in result.decisions) else (
                self.programs.grad_error(result))
        plain_seconds = self.programs.plain_seconds
        step_seconds = None
        if self.concrete:
            self.programs.time_steps([result])
            step_seconds = self.programs.step_ratio[result] * plain_seconds
        elif self.where.chip is not None:
            step_seconds = self.programs.step_seconds(result)
        return dataclasses.replace(result, memory=memory, budget=target, grad_error=grad_error,
                                   plain_step_seconds=plain_seconds, step_seconds=step_seconds,
                                   target=self.where.name)

