"""The programs a plan search compiles: `jit(grad(loss))` under each policy it tries,
compiled once, and what is read from each (compiled memory, predicted step time) or run
on it (the gradient, timed steps)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._engine.transform import with_hooks
from .._measure import whole_gradient_error
from .._memory import Memory
from .._policy import Policy
from .._target import DoesNotFitError, Target
from .timing import SAMPLE_SECONDS, TIMING_SECONDS, agreed, best_time, run_steps
from .value import Plan


class Programs:
    def __init__(self, loss, args, argnums, where: Target):
        self.loss, self.args, self.argnums = loss, args, argnums
        # Where programs are compiled; off the running backend nothing runs, and step
        # times are predicted from the compiled programs.
        self.where = where
        self.concrete = where.runs and all(isinstance(x, jax.Array | np.ndarray | float | int)
                                           for x in jax.tree.leaves(args))
        self.compiles = 0
        # Compiled peak memory per policy, in the order compiled (`None`: plain).
        self.compiled_memory: dict[Plan | None, int] = {}
        self._executables: dict[Plan | None, Any] = {}
        self._predicted: dict[Plan | None, float | None] = {}
        # Measured step time of plans, as a ratio to plain's (timed in alternation).
        self.step_ratio: dict[Plan, float] = {}
        # Measured gradient errors against plain `jax.grad`.
        self.grad_errors: dict[Plan, float] = {}

    def grad_fn(self, policy: Policy | None) -> Callable:
        fn = self.loss if policy is None else with_hooks(self.loss, policy=policy)
        return jax.grad(fn, argnums=self.argnums)

    def memory(self, policy: Plan | None) -> int:
        if policy not in self.compiled_memory:
            self.compiles += 1
            try:
                compiled = self.where.compile(self.grad_fn(policy), self.args)
            except DoesNotFitError as e:  # a TPU compiler refuses what exceeds its HBM
                if e.required is None:
                    raise
                self.compiled_memory[policy], self._executables[policy] = e.required, None
                return e.required
            self.compiled_memory[policy] = Memory.of(compiled).peak
            self._executables[policy] = compiled
        return self.compiled_memory[policy]

    def executable(self, policy: Plan | None):
        """The compiled `jit(grad)` under `policy` (compiled once, for memory and runs)."""
        if policy not in self._executables:
            self.compiled_memory.pop(policy, None)
            self.memory(policy)
        return self._executables[policy]

    @functools.cached_property
    def plain_grad(self):
        return self.executable(None)(*self.args)

    def grad_error(self, result: Plan) -> float:
        if result not in self.grad_errors:
            got = self.executable(result)(*self.args)
            self.grad_errors[result] = whole_gradient_error(got, self.plain_grad)
        return self.grad_errors[result]

    def step_seconds(self, policy: Plan | None) -> float | None:
        """A step under `policy` on the target, predicted from its compiled program
        (`None` when the target's compiler refused it for want of memory)."""
        if policy not in self._predicted:
            compiled = self.executable(policy)
            self._predicted[policy] = (
                None if compiled is None else self.where.predicted_seconds(compiled))
        return self._predicted[policy]

    @functools.cached_property
    def plain_seconds(self) -> float | None:
        """Plain's step: predicted on a target, timed where the arguments have values."""
        if self.where.chip is not None:
            return self.step_seconds(None)
        if not self.concrete:
            return None
        step = self.executable(None)
        jax.block_until_ready(step(*self.args))
        return agreed({"plain": best_time(lambda: step(*self.args))})["plain"]

    def time_steps(self, plans: list[Plan]) -> None:
        """Times the steps of `plans` not timed yet, each right after a plain step, in
        rounds (the median ratio to plain is kept): a ratio taken in alternation is
        steadier than seconds on a busy machine."""
        plans = [p for p in plans if p not in self.step_ratio]
        if not plans:
            return
        steps = [self.executable(None), *(self.executable(p) for p in plans)]
        for p, step in zip(plans, steps[1:]):
            if p not in self.grad_errors:  # not run yet: its first run allocates
                jax.block_until_ready(step(*self.args))
        plain = max(self.plain_seconds, 1e-6)
        runs = math.ceil(SAMPLE_SECONDS / plain)
        rounds = max(2, min(9, int(TIMING_SECONDS / (plain * runs * (1 + len(plans))))))
        ratios: list[list[float]] = [[] for _ in plans]
        for _ in range(rounds):
            seconds = [best_time(functools.partial(run_steps, s, self.args, runs), repeats=1)
                       for s in steps]
            for i, t in enumerate(seconds[1:]):
                ratios[i].append(t / seconds[0])
        medians = agreed({str(i): float(np.median(r)) for i, r in enumerate(ratios)})
        self.step_ratio.update(zip(plans, medians.values()))
