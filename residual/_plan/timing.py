"""Timing steps, and which of several plans that fit is the one returned."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .value import Plan

# Seconds of steps spent timing finalists, at most (but at least 2 samples of each),
# and the least time one sample takes (short steps are run several times a sample).
TIMING_SECONDS = 4.0
SAMPLE_SECONDS = 0.02

# Finalists within this fraction of the fastest count as fast as it (timing noise): of
# those, the one of least gradient error, then least memory, is returned.
TIME_TIE = 0.05


def preferred(a: Plan, b: Plan) -> Plan:
    """Of two plans that both fit, the one `plan` returns: the faster by measured step
    time, where steps within `TIME_TIE` of each other are as fast and the more accurate
    (then the smaller) wins; by predicted time for shapes only."""
    if a.step_seconds is None or b.step_seconds is None:
        return min((a, b), key=lambda p: (p.predicted_seconds, p.memory))
    return fastest_of((a, b), lambda p: p.step_seconds, lambda p: p.grad_error or 0.0,
                       lambda p: p.memory)


def fastest_of(plans: Sequence[Plan], seconds: Callable, error: Callable,
                memory: Callable) -> Plan:
    """The fastest of `plans` by measured `seconds` (or ratios to plain): steps within
    `TIME_TIE` of the fastest count as as fast (timing noise), and of those the least
    `error`, then the least `memory`, wins."""
    fastest = min(map(seconds, plans))
    ties = [p for p in plans if seconds(p) <= (1 + TIME_TIE) * fastest]
    return min(ties, key=lambda p: (error(p), memory(p), seconds(p)))


def agreed(measured: dict[Any, float]) -> dict[Any, float]:
    """`measured` as the first process measured it, on every process of a multi-host run
    (the keys, known at trace time, are the same on all).

    Timings differ between hosts, and a callback's figures may reach one host only;
    the plan chosen from them, or how many steps a timing runs, must not differ: each
    process compiles and runs the same programs, whose collectives wait for all."""
    if jax.process_count() == 1 or not measured:
        return measured
    from jax.experimental import multihost_utils

    values = multihost_utils.broadcast_one_to_all(
        np.asarray(list(measured.values()), np.float64))
    return dict(zip(measured, map(float, values)))


def run_steps(step: Callable, args: tuple, times: int):
    for _ in range(times):
        out = step(*args)
    return out


def best_time(run: Callable, repeats: int = 3) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run())
        best = min(best, time.perf_counter() - start)
    return best
