"""`RecomputePlan`: the slices of the forward that `Recompute` runs again in the backward,
and the values it stores for them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .. import _jax_private as jp
from .residuals import Analysis, Residual

if TYPE_CHECKING:
    from .decisions import Decision


@dataclasses.dataclass(frozen=True, eq=False)
class Saved:
    """A value of the forward that is not a residual, stored for recomputation to start from."""

    var: Any
    residual: Residual  # the value described as a residual would be
    decision: Decision  # `Keep`, `Pack` or `RoundTrip`


@dataclasses.dataclass(eq=False)
class Slice:
    """Equations of the forward recomputed together, and where their inputs come from."""

    eqns: list
    inputs: list  # the variables the slice reads
    sources: list  # for each input: ("input", j), ("residual", i), ("saved", k), ("const", c)
    outputs: list  # (residual index, variable)


def made_by_loops(jaxpr: jp.Jaxpr) -> Callable[[Any], bool]:
    """Whether a value of `jaxpr` (a variable or a literal) is computed by a loop (a
    `scan`, a `while`, or a call, a `cond` or a custom derivative that runs one):
    recomputing it would run the whole loop again, so it is stored where a slice needs
    it. A scan's body recomputes per iteration instead."""
    looped = {v for eqn in jaxpr.eqns if _runs_a_loop(eqn) for v in eqn.outvars}
    return lambda var: not isinstance(var, jp.Literal) and var in looped


def _runs_a_loop(eqn: jp.JaxprEqn) -> bool:
    return eqn.primitive in jp.LOOPS or any(
        _runs_a_loop(inner) for body in jp.sub_jaxprs(eqn) for inner in body.eqns)


class RecomputePlan:
    """The slices of the forward that produce the residuals decided `Recompute`.

    As `jax.checkpoint` recomputes from what its policy saves, a slice starts from the
    nearest values that are stored: the function's inputs, residuals kept or packed
    (unpacked in the backward), and the forward's other values that the policy does
    not mark for recomputation, which are then stored for it (`saved`, chosen by
    `keep`). A `Remat` region thus recomputes from its boundary. Slices that share no
    equation are recomputed separately, each where the backward first needs one of
    its residuals, so a model unrolled in Python recomputes layer by layer instead of
    running the whole forward again at the start of the backward.

    `keep(var, index)` says whether a value on a slice is stored: `(residual,
    decision)` to store it, `None` to recompute it too. `index` numbers the stored
    values after the residuals.
    """

    def __init__(self, analysis: Analysis, recomputed: set[int],
                 keep: Callable[[Any, int], tuple[Residual, Decision] | None]) -> None:
        self.analysis = analysis
        self.saved: list[Saved] = []
        jaxpr = analysis.closed.jaxpr
        residual_vars = jaxpr.outvars[analysis.num_outputs:]
        self._inputs_at = {v: j for j, v in enumerate(jaxpr.invars)}
        self._consts = dict(zip(jaxpr.constvars, analysis.closed.consts))
        self._keep = keep
        self._sources: dict[Any, tuple] = self._stored_residuals(residual_vars, recomputed)
        recomputed_vars = [residual_vars[i] for i in sorted(recomputed)]
        needed = {v for v in recomputed_vars if v not in self._sources
                  and v not in self._inputs_at and v not in self._consts}
        self.slice_of: dict[int, Slice] = self._slice_of_each(recomputed, recomputed_vars, needed)
        self.needed_inputs = sorted({
            s[1] for part in self.slice_of.values() for s in part.sources if s[0] == "input"
        })

    def _stored_residuals(self, residual_vars: list, recomputed: set[int]) -> dict[Any, tuple]:
        """Where the backward reads each stored residual (not recomputed, not an input):
        `("residual", i)`, `i` the first residual of that variable."""
        sources: dict[Any, tuple] = {}
        for i, (var, residual) in enumerate(zip(residual_vars, self.analysis.residuals)):
            # A residual that is an input reads as the input: where a `cond` forwards
            # it from one branch only, the residual itself is zeros in the others.
            if (i not in recomputed and not isinstance(var, jp.Literal)
                    and residual.input_index is None):
                sources.setdefault(var, ("residual", i))
        return sources

    def _slice_of_each(self, recomputed: set[int], recomputed_vars: list,
                       needed: set[Any]) -> dict[int, Slice]:
        """The slice that produces each recomputed residual, by its index: a slice of
        the forward's equations, or for a value the backward reads anyway an empty one
        that passes it on."""
        slices, root, producer = self._slices(needed)
        slice_of: dict[int, Slice] = {}
        for i, var in zip(sorted(recomputed), recomputed_vars):
            if var in needed:
                part = slices[root(producer[var])]
            else:  # stored anyway (an input, another residual's value)
                part = Slice([], [var], [self._source(var)], [])
            part.outputs.append((i, var))
            slice_of[i] = part
        return slice_of

    def run(self, part: Slice, inputs: Sequence[Any]) -> dict[int, Any]:
        """The residuals `part` produces, from the values of its inputs."""
        env = dict(zip(part.inputs, inputs))
        for eqn in part.eqns:
            values = [v.val if isinstance(v, jp.Literal) else env[v] for v in eqn.invars]
            env.update(zip(eqn.outvars, jp.bind_equation(eqn, values)))
        return {i: env[var] for i, var in part.outputs}

    def _source(self, var: Any) -> tuple | None:
        """Where the backward reads `var`; `None` when it is recomputed."""
        if var not in self._sources:
            if var in self._inputs_at:
                self._sources[var] = ("input", self._inputs_at[var])
            elif var in self._consts:
                self._sources[var] = ("const", self._consts[var])
            else:
                kept = self._keep(var, len(self.analysis.residuals) + len(self.saved))
                if kept is None:
                    return None
                self._sources[var] = ("saved", len(self.saved))
                self.saved.append(Saved(var, *kept))
        return self._sources[var]

    def _slices(self, needed: set[Any]) -> tuple[dict[int, Slice], Callable, dict]:
        """Groups the equations that compute `needed` (grown to everything recomputed)
        into slices that share no equation, in forward order."""
        jaxpr = self.analysis.closed.jaxpr
        producer = {v: k for k, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
        parent: dict[int, int] = {}  # union-find over equation numbers

        def root(k: int) -> int:
            while parent.setdefault(k, k) != k:
                parent[k] = parent[parent[k]]
                k = parent[k]
            return k

        region = []
        for k in reversed(range(len(jaxpr.eqns))):  # consumers before producers
            eqn = jaxpr.eqns[k]
            if not any(v in needed for v in eqn.outvars):
                continue
            region.append(k)
            root(k)
            for v in eqn.invars:
                if isinstance(v, jp.Literal) or (v not in needed
                                                 and self._source(v) is not None):
                    continue
                needed.add(v)
                parent[root(producer[v])] = root(k)

        slices: dict[int, Slice] = {}
        for k in reversed(region):
            part = slices.setdefault(root(k), Slice([], [], [], []))
            part.eqns.append(jaxpr.eqns[k])
            for v in jaxpr.eqns[k].invars:
                if not isinstance(v, jp.Literal) and v not in needed and v not in part.inputs:
                    part.inputs.append(v)
                    part.sources.append(self._sources[v])
        return slices, root, producer
