"""`plan` and the `Planner` behind it: residuals grouped, their costs measured, the
cheapest plan that fits a budget searched for on the compiled program."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._engine.record import recording
from .._engine.transform import with_hooks
from .._format import precise_size
from .._info import ResidualInfo, dtype_name
from .._measure import whole_gradient_error
from .._memory import Memory
from .._policy import Policy
from .._target import DoesNotFitError, Target, resolve
from .actions import MIN_BYTES, NOMINAL_ERROR, policy_of
from .checks import check_actions, check_budget, check_error, check_loss
from .costs import (
    RoundTrips,
    cost_of,
    measured_rates,
    packed_bytes,
    plan_error,
    predicted_rates,
    predicted_seconds_of,
)
from .timing import SAMPLE_SECONDS, TIMING_SECONDS, best_time, fastest_of, run_steps
from .value import Plan, PlanDecision, code_key_of

# Compiles per budget for each of the two searches (the byte bound's, then one
# group at a time).
_ROUNDS = 4


# Recomputing is costed residual by residual (one lowering each) up to this many
# distinct residuals; beyond, from one program that recomputes them all.
_REMAT_MEASURED = 8


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
    check_loss(loss, example_args)
    max_grad_error = check_error(max_grad_error)
    where = resolve(target)
    chosen = check_actions(actions, where)
    requested = check_budget(budget)
    planner = Planner(loss, example_args, argnums, chosen, max_grad_error, where)
    result = planner.run(requested)
    return dataclasses.replace(result, compiles=planner.compiles,
                               planning_seconds=time.perf_counter() - start)


@dataclasses.dataclass
class Group:
    """Residuals one decision covers: one residual in code, every scan iteration of it."""

    info: ResidualInfo
    key: tuple
    occurrence: int
    nbytes: int  # per step, all iterations
    iterations: int
    # action -> (stored bytes per step, seconds per step, relative error)
    options: dict[str, tuple[int, float, float]] = dataclasses.field(default_factory=dict)


class Planner:
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

    def _groups(self) -> list[Group]:
        from ..policies import Identity

        with recording() as records:
            jax.eval_shape(self.grad_fn(Identity()), *self.args)
        groups: dict[tuple, Group] = {}
        for r in records:
            info = r.info
            if (info.kept_alive or not jnp.issubdtype(info.dtype, jnp.floating)
                    or info.nbytes < MIN_BYTES):
                continue
            key = (code_key_of(info), info.index)
            if key in groups:  # identical scan bodies: one decision
                groups[key].nbytes += info.nbytes * r.iterations
                groups[key].iterations += r.iterations
            else:
                groups[key] = Group(info, key, 0, info.nbytes * r.iterations, r.iterations)
        seen: dict[tuple, int] = {}
        for g in sorted(groups.values(), key=lambda g: g.info.index):
            g.occurrence = seen.get(g.key[0], 0)
            seen[g.key[0]] = g.occurrence + 1
        return list(groups.values())

    def _costs(self) -> None:
        packing = tuple(a for a in self.actions if a not in ("keep", "remat"))
        rates = self._rates = (measured_rates(packing) if self.where.chip is None
                               else predicted_rates(packing, self.where))
        errors = self._round_trip_errors(packing) if self.concrete else {}
        traced = {a: self._stored_by_group(a) for a in packing}
        for g in self.groups:
            g.options["keep"] = (g.nbytes, 0.0, 0.0)
            for action in packing:
                policy = policy_of(action).resolve(g.info)
                if policy is None:
                    continue
                stored = traced[action].get(g.key)
                if stored is None:
                    stored = packed_bytes(policy, g.info) * g.iterations
                error = errors.get((g.key, action), NOMINAL_ERROR.get(action, 0.0))
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
            key = (code_key_of(r.info), r.info.index)
            stored[key] = stored.get(key, 0) + r.stored_bytes * r.iterations
        return stored

    def _round_trip_errors(self, actions: tuple[str, ...]) -> dict[tuple, float]:
        """The relative error of `unpack(pack(x))` under each action, on the example's
        own residual values, all iterations together: summed inside the gradient's
        program (one run; only two numbers per residual and action leave it)."""
        sums: dict[tuple, list[float]] = {}
        jax.block_until_ready(self.grad_fn(RoundTrips(actions, sums))(*self.args))
        return {key: math.sqrt(err / norm) if norm > 0 else 0.0
                for key, (err, norm) in sums.items()}

    def _remat_costs(self) -> None:
        """Seconds and bytes of recomputing each residual: XLA's cost analysis of the
        program with it recomputed, against the program with it kept, at the measured
        rates; and the bytes the trace stores then, which include the values the engine
        stores to recompute from (a recomputed `tanh` may store the matmul before it)."""
        candidates = [g for g in self.groups if policy_of("remat").resolve(g.info) is not None]
        base, base_stored = self._base
        rates = self._rates
        # An unrolled loop's layers share a code key and cost the same: measured once.
        first: dict[tuple, Group] = {}
        for g in candidates:
            first.setdefault(g.key[0], g)
        if len(first) <= _REMAT_MEASURED:
            costs = {}
            for key, g in first.items():
                cost, stored = self._traced(self._choice_plan({g.key: "remat"}))
                costs[key] = (predicted_seconds_of(cost, base, rates, g.nbytes),
                              stored - base_stored)
            for g in candidates:
                seconds, extra = costs[g.key[0]]
                g.options["remat"] = (max(g.nbytes + extra, 0), seconds, 0.0)
            return
        # Many residuals: one program with all of them recomputed, shared by their bytes.
        cost, stored = self._traced(self._choice_plan({g.key: "remat" for g in candidates}))
        total = predicted_seconds_of(cost, base, rates, 0)
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
            cost = cost_of(self.grad_fn(policy), self.args)
        return cost, sum(r.stored_bytes * r.iterations for r in records)

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
        for plan in sorted(plans, key=plan_error):
            predicted = plan_error(plan)
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
        return self.error_scale * plan_error(plan)

    def _recompute_scans(self, choice: dict[tuple, str]) -> Plan:
        """The plan that recomputes every scan body, its time from XLA's cost analysis
        of the whole program: recomputing the values the plan does not list costs more
        than the residuals' own shares."""
        plan = self._choice_plan(choice, recompute_scans=True)
        cost, _ = self._traced(plan)
        seconds = predicted_seconds_of(cost, self._base[0], self._rates, 0)
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
        within `TIME_TIE` of the fastest are as fast: the most accurate of them wins."""
        ranked = sorted(fits, key=lambda p: (p.predicted_seconds, self._memory[p]))
        if self.where.chip is not None:  # nothing runs: every plan's step is predicted
            predicted = [p for p in ranked if self._step_seconds(p) is not None]
            if not predicted:
                return ranked[0]
            return fastest_of(predicted, self._step_seconds, self._error,
                               self._memory.__getitem__)
        if not self.concrete or len(ranked) == 1:
            return ranked[0]
        finalists = ranked[:FINALISTS] + [p for p in ranked[FINALISTS:]
                                           if p in self._uniform or p in self._step_ratio]
        self._time_steps(finalists)
        return fastest_of(finalists, self._step_ratio.__getitem__, self._error,
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
        runs = math.ceil(SAMPLE_SECONDS / plain)
        rounds = max(2, min(9, int(TIMING_SECONDS / (plain * runs * (1 + len(plans))))))
        ratios: list[list[float]] = [[] for _ in plans]
        for _ in range(rounds):
            seconds = [best_time(functools.partial(run_steps, s, self.args, runs), repeats=1)
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
        return best_time(lambda: step(*self.args))
