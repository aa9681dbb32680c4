"""Which recomputed residuals to store instead, where recomputing them would store more."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.sparse import coo_array
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

from .. import _jax_private as jp
from .decisions import Decision
from .recompute import RecomputePlan, Slice
from .residuals import Residual

# Capacities are int32 for scipy: bytes are counted in units that keep a slice's
# total below `_FINITE`, and an edge no cut may cross gets `_UNCUT`.
_FINITE = 2**26
_UNCUT = 2**28


def stored_instead(plan: RecomputePlan, decisions: Sequence[Decision],
                   residuals: Sequence[Residual]) -> set[int]:
    """Recomputed residuals to store with their policy's `instead` rather than recompute.

    A slice of the forward starts from values nothing else stores (a `tanh` output
    recomputed from its matmul's output), which recomputing it then stores, and may
    run equations the policy does not recompute through (`recomputes_through`: a
    matmul, a whole scan), whose results it can then only have stored. Per slice
    whose residuals all have an `instead`, the fewest bytes that let the
    backward compute every residual of the slice are a minimum cut between the
    values it starts from and its residuals: the residuals on that cut are stored
    (for a `tanh` MLP, the `tanh` output, from which its derivative is recomputed),
    the rest recomputed. On a tie the residuals are stored: less to recompute.
    """
    stored: set[int] = set()
    for part in {id(part): part for part in plan.slice_of.values()}.values():
        if part.eqns and all(
                decisions[i].policy.instead is not None for i, _ in part.outputs):
            stored |= _on_smallest_cut(plan, part, decisions, residuals)
    return stored


def _on_smallest_cut(plan: RecomputePlan, part: Slice, decisions: Sequence[Decision],
                     residuals: Sequence[Residual]) -> set[int]:
    saved = {var: plan.saved[k].residual.info.nbytes
             for var, (kind, k) in zip(part.inputs, part.sources) if kind == "saved"}
    outputs: dict = {}
    for i, var in part.outputs:
        outputs.setdefault(var, []).append(i)
    # A cut may cross a saved value or a residual, each at its bytes in units, doubled,
    # plus one for a saved value, so that a tie stores the residual. The one is added
    # after rounding to units, which would round it away, and the unit is a power of
    # two, which divides arrays' usual sizes: rounded up, a tie between a cut of several
    # values and one of a single value could otherwise go either way.
    nbytes = {**saved, **{var: residuals[i[0]].info.nbytes for var, i in outputs.items()}}
    unit = 1 << (-(-2 * sum(nbytes.values()) // _FINITE) - 1).bit_length()
    weight = {var: 2 * -(-b // unit) + (var in saved) for var, b in nbytes.items()}
    # Each value is two vertices, in (2n) and out (2n + 1), joined by its weight.
    number: dict = {}
    for var in [*saved, *(v for eqn in part.eqns for v in eqn.outvars)]:
        number.setdefault(var, len(number))
    source, sink = 2 * len(number), 2 * len(number) + 1
    edges = {(source, 2 * number[var]): _UNCUT for var in saved}
    for var, n in number.items():
        edges[2 * n, 2 * n + 1] = weight.get(var, _UNCUT)
    for var in outputs:
        edges[2 * number[var] + 1, sink] = _UNCUT
    through = _through(part, decisions)
    for eqn in part.eqns:
        if through is not None and not _recomputable(eqn, through):
            # Not recomputed: what it computes is available only where stored.
            edges.update({(source, 2 * number[w]): _UNCUT for w in eqn.outvars})
        for u in eqn.invars:
            if not isinstance(u, jp.Literal) and u in number:
                for w in eqn.outvars:
                    edges[2 * number[u] + 1, 2 * number[w]] = _UNCUT
    rows, cols = np.array(list(edges)).T
    capacity = coo_array((np.array(list(edges.values()), np.int32), (rows, cols)),
                         shape=(sink + 1, sink + 1)).tocsr()
    flow = maximum_flow(capacity, source, sink).flow
    left = (capacity - flow).tocsr()
    left.data = np.maximum(left.data, 0)
    left.eliminate_zeros()
    reached = set(breadth_first_order(left, source, return_predecessors=False).tolist())
    return {i for var, indices in outputs.items()
            if 2 * number[var] in reached and 2 * number[var] + 1 not in reached
            for i in indices}


def _through(part: Slice, decisions: Sequence[Decision]) -> frozenset[str] | None:
    """The primitives every residual of `part` may be recomputed through (None: any)."""
    allowed = [decisions[i].policy.recomputes_through for i, _ in part.outputs]
    named = [a for a in allowed if a is not None]
    return frozenset.intersection(*named) if named else None


def _recomputable(eqn, through: frozenset[str]) -> bool:
    """Whether `eqn` computes only what `through` names (a `jit` call: its body)."""
    if eqn.primitive in jp.CALLS:
        return all(_recomputable(inner, through)
                   for body in jp.sub_jaxprs(eqn) for inner in body.eqns)
    return eqn.primitive.name in through
