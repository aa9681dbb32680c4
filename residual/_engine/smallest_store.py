"""Which recomputed residuals to store instead, where recomputing them would store more."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

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
                   residuals: Sequence[Residual], storable: Callable[[Any], int | None]
                   ) -> tuple[set[int], set[Any]]:
    """Recomputed residuals to store with their policy's `instead` rather than recompute,
    and other values of the slices to store so.

    A slice of the forward starts from values nothing else stores (a `tanh` output
    recomputed from its matmul's output), which recomputing it then stores, and may
    run equations the policy does not recompute through (`recomputes_through`: a
    matmul, a whole scan), whose results it can then only have stored. Over the
    slices whose residuals all have an `instead`, the fewest bytes that let the
    backward compute their residuals are one minimum cut between the values they
    start from and their residuals (one for all: a value that several slices start
    from is stored once): the residuals on that cut are stored (for a `tanh` MLP,
    the `tanh` output, from which its derivative is recomputed), the rest
    recomputed. The cut may also cross a value between them (`storable` gives its
    bytes where its policy could store it). A transformer unrolled in Python
    recomputes each block's norms from its residual stream `x`, a sum that no
    residual holds: stored as its terms (as many bytes), every block's `x` would be
    summed again from the first block's, at the start of the backward, all alive
    together (v5e, a flax NNX transformer of 4 blocks of 256 at batch 32: seven
    blocks' `x`); stored as the sums, each block starts from its own, where the
    backward reaches it. On a tie what is nearest the residuals is stored: less to
    recompute.
    """
    parts = [part for part in {id(part): part for part in plan.slice_of.values()}.values()
             if part.eqns and all(decisions[i].policy.instead is not None
                                  for i, _ in part.outputs)]
    return _on_smallest_cut(plan, parts, residuals, decisions, storable)


def _on_smallest_cut(plan: RecomputePlan, parts: list[Slice], residuals: Sequence[Residual],
                     decisions: Sequence[Decision], storable: Callable[[Any], int | None]
                     ) -> tuple[set[int], set[Any]]:
    """The residuals and the values between on one minimum cut of all `parts`: a value
    that several slices start from is stored once for all."""
    if not parts:
        return set(), set()
    saved = {var: plan.saved[k].residual.info.nbytes for part in parts
             for var, (kind, k) in zip(part.inputs, part.sources) if kind == "saved"}
    outputs: dict = {}
    for i, var in (output for part in parts for output in part.outputs):
        outputs.setdefault(var, []).append(i)
    eqns = [eqn for part in parts for eqn in part.eqns]
    between = {var: b for eqn in eqns for var in eqn.outvars
               if var not in outputs and (b := storable(var)) is not None}
    # A cut may cross a saved value, a residual or a value between them, each at its
    # bytes in units times four, plus one for a value between and two for a saved
    # value, so that a tie stores what is nearest the residuals. These are added after
    # rounding to units, which would round them away, and the unit is a power of two,
    # which divides arrays' usual sizes: rounded up, a tie between a cut of several
    # values and one of a single value could otherwise go either way.
    nbytes = {**saved, **between,
              **{var: residuals[i[0]].info.nbytes for var, i in outputs.items()}}
    unit = 1 << (-(-4 * sum(nbytes.values()) // _FINITE) - 1).bit_length()
    weight = {var: 4 * -(-b // unit) + 2 * (var in saved) + (var in between)
              for var, b in nbytes.items()}
    # Each value is two vertices, in (2n) and out (2n + 1), joined by its weight.
    number: dict = {}
    for var in [*saved, *(v for eqn in eqns for v in eqn.outvars)]:
        number.setdefault(var, len(number))
    source, sink = 2 * len(number), 2 * len(number) + 1
    edges = {(source, 2 * number[var]): _UNCUT for var in saved}
    for var, n in number.items():
        edges[2 * n, 2 * n + 1] = weight.get(var, _UNCUT)
    for var in outputs:
        edges[2 * number[var] + 1, sink] = _UNCUT
    for part in parts:
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

    def on_cut(var: Any) -> bool:
        return 2 * number[var] in reached and 2 * number[var] + 1 not in reached

    return ({i for var, indices in outputs.items() if on_cut(var) for i in indices},
            {var for var in between if on_cut(var)})


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
