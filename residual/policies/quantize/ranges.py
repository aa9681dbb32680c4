"""Each group's range of values, NaN and Inf set apart, before any code is chosen."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def cond(pred, true_fun, false_fun, *operands):
    """`lax.cond` when tracing; eagerly, the branch itself (a `cond` of fresh branches
    would be compiled anew on every call)."""
    if isinstance(pred, jax.core.Tracer):
        return lax.cond(pred, true_fun, false_fun, *operands)
    return (true_fun if pred else false_fun)(*operands)


def as_they_are(groups, lo, hi):
    """All values finite: the groups' ranges as they are, no group broken."""
    del groups
    return lo, hi, jnp.zeros_like(hi, dtype=bool)


def finite_range(groups, lo, hi, layout):
    """Some values are NaN or Inf: the groups' ranges over their finite values and
    zero, and which groups hold a non-finite value.

    One reduction whose reducer skips non-finite values itself, reading `groups` as
    they are. XLA's CPU backend runs plain min and max reductions in kernels that
    take no fused producer, so `where(isfinite(groups), groups, 0)` before them
    would be a float temporary the size of the residual; and a NaN can escape them.
    """
    del lo, hi  # they saw the non-finite values

    def finite_or_zero(v):
        return jnp.where(jnp.isfinite(v), v, 0.0)

    def reducer(a, b):
        (a_lo, a_hi, a_bad), (b_lo, b_hi, b_bad) = a, b
        # `bad` stays non-finite once any value was; in the operands' dtype (Python
        # scalars would make it float64 under `jax_enable_x64`).
        bad = jnp.where(jnp.isfinite(a_bad) & jnp.isfinite(b_bad), jnp.zeros_like(a_bad),
                        jnp.full_like(a_bad, jnp.nan))
        return (jnp.minimum(finite_or_zero(a_lo), finite_or_zero(b_lo)),
                jnp.maximum(finite_or_zero(a_hi), finite_or_zero(b_hi)), bad)

    zero = jnp.zeros((), groups.dtype)
    lo, hi, bad = layout.reduce((groups,) * 3, (zero,) * 3, reducer)
    # XLA takes `zero` for the reducer's identity, which it is not: it may leave it
    # out, and a group of one element comes back as that element, reducer unapplied.
    # So the results are filtered once more.
    lo = jnp.minimum(finite_or_zero(lo), 0.0)
    hi = jnp.maximum(finite_or_zero(hi), 0.0)
    return lo, hi, ~jnp.isfinite(bad)


def finite_ranges(groups, layout):
    """Each group's range over its finite values (`lo`, `hi`, as `Layout.reduce` gives them),
    and which groups hold a NaN or Inf (`broken`); `lo = hi = 0` for a group with no
    finite value.

    One reduction whose reducer reads `groups` as they are and skips non-finite values
    itself: XLA's CPU backend runs plain min and max reductions in kernels that take
    no fused producer, so `where(isfinite(groups), groups, inf)` before them would be
    a float temporary the size of the residual; and a NaN can escape them.
    """

    def finite_or(v, other):
        return jnp.where(jnp.isfinite(v), v, other)

    def reducer(a, b):
        (a_lo, a_hi, a_bad), (b_lo, b_hi, b_bad) = a, b
        # `bad` stays non-finite once any value was; in the operands' dtype (Python
        # scalars would make it float64 under `jax_enable_x64`).
        bad = jnp.where(jnp.isfinite(a_bad) & jnp.isfinite(b_bad), jnp.zeros_like(a_bad),
                        jnp.full_like(a_bad, jnp.nan))
        return (jnp.minimum(finite_or(a_lo, jnp.inf), finite_or(b_lo, jnp.inf)),
                jnp.maximum(finite_or(a_hi, -jnp.inf), finite_or(b_hi, -jnp.inf)), bad)

    inits = tuple(jnp.array(v, groups.dtype) for v in (jnp.inf, -jnp.inf, 0.0))
    lo, hi, bad = layout.reduce((groups,) * 3, inits, reducer)
    # XLA may leave the identities out: a group of one element comes back as that
    # element, reducer unapplied. A group without a finite value has lo > hi.
    kept = jnp.isfinite(lo) & jnp.isfinite(hi)
    lo, hi = jnp.where(kept, lo, 0.0), jnp.where(kept, hi, 0.0)
    return lo, hi, ~jnp.isfinite(bad) | ~kept
