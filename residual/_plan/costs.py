"""The cost model: the bytes, seconds and round-trip error of each action on a residual."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._engine.record import recording
from .._info import ResidualInfo
from .._policy import Policy
from .._target import Target
from ..policies._complex import widened
from ..policies._defaults import worth_packing
from .actions import MIN_BYTES, NOMINAL_ERROR, policy_of
from .programs import Programs
from .timing import agreed, best_time
from .value import Plan, code_key_of

# Recomputing is costed residual by residual (one lowering each) up to this many
# distinct residuals; beyond, from one program that recomputes them all.
_REMAT_MEASURED = 8


@dataclasses.dataclass(frozen=True, eq=False)
class RoundTrips(Policy):
    """Stores every residual as it is, and adds each action's squared round-trip error
    and the squared norm of the residual to `sums`, keyed as plans' groups are."""

    actions: tuple[str, ...]
    sums: dict
    lossless = True

    def pack(self, x, info):
        if not jnp.issubdtype(info.dtype, jnp.inexact) or info.nbytes < MIN_BYTES:
            return x
        key = (code_key_of(info), info.index)
        want = widened(x)
        for action in self.actions:
            policy = policy_of(action).resolve(info)
            if policy is None or policy.lossless:
                continue
            # Known at trace time on every process, whichever runs the callback.
            self.sums.setdefault((key, action), [0.0, 0.0])
            packed = jax.tree.map(opaque, policy.pack(x, info))
            got = widened(policy.unpack(packed, info))
            jax.debug.callback(functools.partial(add_sums, self.sums, (key, action)),
                               jnp.sum(jnp.abs(got - want) ** 2), jnp.sum(jnp.abs(want) ** 2))
        return x

    def unpack(self, packed, info):
        return packed


def opaque(x):
    """`x`, through integers XLA cannot see into: with excess precision allowed (its
    default), XLA folds a cast to a narrower float and back into nothing, which would
    make the round trip look exact."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    bits = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
    hidden = jax.lax.optimization_barrier(jax.lax.bitcast_convert_type(x, bits))
    return jax.lax.bitcast_convert_type(hidden, x.dtype)


def add_sums(sums: dict, key: tuple, err, norm) -> None:
    total = sums.setdefault(key, [0.0, 0.0])
    total[0] += float(err)
    total[1] += float(norm)


def packed_bytes(policy: Policy, info: ResidualInfo) -> int:
    shape = jax.eval_shape(lambda x: policy.pack(x, info),
                           jax.ShapeDtypeStruct(info.shape, info.dtype))
    return sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(shape))


def plan_error(plan: Plan) -> float:
    """A plan's predicted gradient error: its round-trip errors added in quadrature."""
    return math.sqrt(sum(d.error**2 for d in plan.decisions))


def cost_of(fn: Callable, args) -> dict[str, float]:
    analysis = jax.jit(fn).lower(*args).cost_analysis() or {}
    if isinstance(analysis, list):  # older JAX: one dictionary per program
        analysis = analysis[0] if analysis else {}
    return {k: float(analysis.get(k, 0.0)) for k in ("flops", "bytes accessed")}


def predicted_seconds_of(cost, base, rates, nbytes: int) -> float:
    flops = max(cost["flops"] - base["flops"], 0.0)
    moved = max(cost["bytes accessed"] - base["bytes accessed"], float(nbytes))
    return flops / rates["flops"] + moved * rates["bandwidth"]


@functools.cache
def measured_rates(actions: tuple[str, ...]) -> dict[str, float]:
    """Measured on the running backend: seconds per byte of each action's pack and unpack,
    seconds per byte moved, and FLOPs per second.

    On an accelerator a call on a few MiB is mostly launch and dispatch time (timed on
    2 MiB, an H200's rates predicted a scan MLP's int8 step at 13x its measured time), so
    there the rates are the slopes between two sizes, which that fixed time drops out of."""
    small = _timings(actions, rows=512, side=512)
    if jax.default_backend() == "cpu":
        return agreed({k: seconds / small["work"][k] if k != "flops"
                       else small["work"][k] / seconds
                       for k, seconds in small["seconds"].items()})
    large = _timings(actions, rows=32 * 512, side=2048)
    rates = {}
    for k, seconds in large["seconds"].items():
        extra_work = large["work"][k] - small["work"][k]
        extra_seconds = seconds - small["seconds"][k]
        if extra_seconds <= 0:  # timing noise: the large size's own rate
            extra_work, extra_seconds = large["work"][k], seconds
        rates[k] = (extra_work / extra_seconds if k == "flops"
                    else extra_seconds / extra_work)
    return agreed(rates)


def _timings(actions: tuple[str, ...], rows: int, side: int) -> dict[str, dict[str, float]]:
    """Best-of-3 seconds of a copy, a `side`-square matmul and each action's round trip on
    a `(rows, 1024)` float32 array, and the work each does (bytes, or FLOPs)."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((rows, 1024)), jnp.float32)
    info = ResidualInfo(index=0, shape=x.shape, dtype=np.dtype(np.float32), primitive="tanh")
    seconds, work = {}, {}
    copy = jax.jit(lambda x: x * 2 + 1)
    jax.block_until_ready(copy(x))
    seconds["bandwidth"], work["bandwidth"] = best_time(lambda: copy(x)), 2 * x.nbytes
    a = jnp.asarray(np.random.default_rng(1).standard_normal((side, side)), jnp.float32)
    matmul = jax.jit(lambda a: a @ a)
    jax.block_until_ready(matmul(a))
    seconds["flops"], work["flops"] = best_time(lambda: matmul(a)), 2 * side**3
    for action in actions:
        policy = policy_of(action)
        trip = jax.jit(lambda x, p=policy: p.unpack(p.pack(x, info), info))
        jax.block_until_ready(trip(x))
        seconds[action], work[action] = best_time(lambda trip=trip: trip(x)), x.nbytes
    return {"seconds": seconds, "work": work}


@functools.cache
def predicted_rates(actions: tuple[str, ...], where: Target) -> dict[str, float]:
    """`measured_rates` on a target, predicted: its chip's peak FLOP/s and seconds per byte of
    memory bandwidth, and each action's pack and unpack compiled for it (a roofline)."""
    x = jax.ShapeDtypeStruct((512, 1024), jnp.float32)
    info = ResidualInfo(index=0, shape=x.shape, dtype=np.dtype(np.float32), primitive="tanh")
    rates = {"flops": where.chip.flops, "bandwidth": 1 / where.chip.bandwidth}
    for action in actions:
        policy = policy_of(action)
        trip = where.compile(lambda x, p=policy: p.unpack(p.pack(x, info), info), [x])
        rates[action] = where.predicted_seconds(trip) / (4 * math.prod(x.shape))
    return rates


class Option(NamedTuple):
    """What taking one action on a group costs, per step."""

    stored: float  # bytes stored
    seconds: float  # seconds added
    error: float  # relative round-trip error


@dataclasses.dataclass
class Group:
    """Residuals one decision covers: one residual in code, every scan iteration of it."""

    info: ResidualInfo
    key: tuple
    occurrence: int
    nbytes: int  # per step, all iterations
    iterations: int
    options: dict[str, Option] = dataclasses.field(default_factory=dict)  # by action


def group_residuals(programs: Programs) -> list[Group]:
    """The residuals worth a decision, grouped: one group per residual in code, holding
    every scan iteration of it (identical scan bodies share one decision)."""
    from ..policies import Identity

    with recording() as records, programs.where.tracing():
        jax.eval_shape(programs.grad_fn(Identity()), *programs.args)
    groups: dict[tuple, Group] = {}
    for r in records:
        info = r.info
        if not worth_packing(info) or info.nbytes < MIN_BYTES:
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


class CostModel:
    """Fills in each group's options: per action it may take, the bytes stored per step,
    the seconds added per step and the relative round-trip error."""

    def __init__(self, programs: Programs, groups: list[Group], actions: tuple[str, ...],
                 choice_plan: Callable[..., Plan]):
        self.programs, self.groups, self.actions = programs, groups, actions
        self.choice_plan = choice_plan
        self.measure()

    def measure(self) -> None:
        packing = tuple(a for a in self.actions if a not in ("keep", "remat"))
        rates = self.rates = (measured_rates(packing) if self.programs.where.chip is None
                               else predicted_rates(packing, self.programs.where))
        errors = self._round_trip_errors(packing) if self.programs.concrete else {}
        traced = {a: self._stored_by_group(a) for a in packing}
        for g in self.groups:
            g.options["keep"] = Option(g.nbytes, 0.0, 0.0)
            for action in packing:
                policy = policy_of(action).resolve(g.info)
                if policy is None:
                    continue
                stored = traced[action].get(g.key)
                if stored is None:
                    stored = packed_bytes(policy, g.info) * g.iterations
                error = errors.get((g.key, action), NOMINAL_ERROR.get(action, 0.0))
                g.options[action] = Option(stored, rates[action] * g.nbytes, error)
        if "remat" in self.actions:
            self._remat_costs()

    def _stored_by_group(self, action: str) -> dict[tuple, int]:
        """Bytes each residual stores when `action` is taken everywhere, as the engine
        decides it (one trace): a residual that other stored values give cheaply is
        derived from them and stores nothing, whatever the action."""
        plan = self.choice_plan({g.key: action for g in self.groups})
        with recording() as records, self.programs.where.tracing():
            jax.eval_shape(self.programs.grad_fn(plan), *self.programs.args)
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
        gradient = jax.jit(self.programs.grad_fn(RoundTrips(actions, sums)))
        jax.block_until_ready(gradient(*self.programs.args))
        both = agreed({(key, part): v for key, pair in sums.items()
                       for part, v in zip(("err", "norm"), pair)})
        return {key: math.sqrt(both[key, "err"] / both[key, "norm"])
                if both[key, "norm"] > 0 else 0.0 for key in sums}

    def _remat_costs(self) -> None:
        """Seconds and bytes of recomputing each residual: XLA's cost analysis of the
        program with it recomputed, against the program with it kept, at the measured
        rates; and the bytes the trace stores then, which include the values the engine
        stores to recompute from (a recomputed `tanh` may store the matmul before it)."""
        candidates = [g for g in self.groups if policy_of("remat").resolve(g.info) is not None]
        base, base_stored = self.base
        rates = self.rates
        # An unrolled loop's layers share a code key and cost the same: measured once.
        first: dict[tuple, Group] = {}
        for g in candidates:
            first.setdefault(g.key[0], g)
        if len(first) <= _REMAT_MEASURED:
            costs = {}
            for key, g in first.items():
                cost, stored = self.traced(self.choice_plan({g.key: "remat"}))
                costs[key] = (predicted_seconds_of(cost, base, rates, g.nbytes),
                              stored - base_stored)
            for g in candidates:
                seconds, extra = costs[g.key[0]]
                g.options["remat"] = Option(max(g.nbytes + extra, 0), seconds, 0.0)
            return
        # Many residuals: one program with all of them recomputed, shared by their bytes.
        cost, stored = self.traced(self.choice_plan({g.key: "remat" for g in candidates}))
        total = predicted_seconds_of(cost, base, rates, 0)
        size = sum(g.nbytes for g in candidates)
        for g in candidates:
            share = g.nbytes / size
            g.options["remat"] = Option(max(g.nbytes + (stored - base_stored) * share, 0),
                                        total * share, 0.0)

    def recompute_scans_plan(self, choice: dict[tuple, str]) -> Plan:
        """The plan that recomputes every scan body, its time from XLA's cost analysis
        of the whole program: recomputing the values the plan does not list costs more
        than the residuals' own shares."""
        plan = self.choice_plan(choice, recompute_scans=True)
        cost, _ = self.traced(plan)
        seconds = predicted_seconds_of(cost, self.base[0], self.rates, 0)
        return dataclasses.replace(plan, predicted_seconds=max(plan.predicted_seconds, seconds))

    @functools.cached_property
    def base(self) -> tuple[dict[str, float], int]:
        """`traced` of the plan that keeps everything: what recomputing is measured
        against (traced only when recomputing is an action)."""
        return self.traced(self.choice_plan({}))

    def traced(self, policy: Policy) -> tuple[dict[str, float], int]:
        """XLA's cost analysis of `jit(grad)` under `policy` (lowered, not compiled), and
        the bytes its trace stores for the backward."""
        with recording() as records, self.programs.where.tracing():
            cost = cost_of(self.programs.grad_fn(policy), self.programs.args)
        return cost, sum(r.stored_bytes * r.iterations for r in records)
