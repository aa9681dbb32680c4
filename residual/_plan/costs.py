"""The cost model: the bytes, seconds and round-trip error of each action on a residual."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .._info import ResidualInfo
from .._policy import Policy
from .._target import Target
from .actions import MIN_BYTES, policy_of
from .timing import best_time
from .value import Plan, code_key_of


@dataclasses.dataclass(frozen=True, eq=False)
class RoundTrips(Policy):
    """Stores every residual as it is, and adds each action's squared round-trip error
    and the squared norm of the residual to `sums`, keyed as plans' groups are."""

    actions: tuple[str, ...]
    sums: dict
    lossless = True

    def pack(self, x, info):
        if not jnp.issubdtype(info.dtype, jnp.floating) or info.nbytes < MIN_BYTES:
            return x
        key = (code_key_of(info), info.index)
        want = x.astype(jnp.float32)
        for action in self.actions:
            policy = policy_of(action).resolve(info)
            if policy is None or policy.lossless:
                continue
            packed = jax.tree.map(opaque, policy.pack(x, info))
            got = policy.unpack(packed, info).astype(jnp.float32)
            jax.debug.callback(functools.partial(add_sums, self.sums, (key, action)),
                               jnp.sum((got - want) ** 2), jnp.sum(want**2))
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
    seconds per byte moved, and FLOPs per second."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((512, 1024)), jnp.float32)
    info = ResidualInfo(index=0, shape=x.shape, dtype=np.dtype(np.float32), primitive="tanh")
    rates: dict[str, float] = {}
    copy = jax.jit(lambda x: x * 2 + 1)
    jax.block_until_ready(copy(x))
    rates["bandwidth"] = best_time(lambda: copy(x)) / (2 * x.nbytes)
    a = x[:512, :512]
    matmul = jax.jit(lambda a: a @ a)
    jax.block_until_ready(matmul(a))
    rates["flops"] = 2 * 512**3 / best_time(lambda: matmul(a))
    for action in actions:
        policy = policy_of(action)
        trip = jax.jit(lambda x, p=policy: p.unpack(p.pack(x, info), info))
        jax.block_until_ready(trip(x))
        rates[action] = best_time(lambda trip=trip: trip(x)) / x.nbytes
    return rates


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
