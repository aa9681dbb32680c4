"""`gradcheck`: gradients under hooks against plain `jax.grad`, and each residual's round trip."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np

from ._engine.record import recording
from ._engine.transform import with_hooks
from ._info import ResidualInfo
from ._inspect.analysis import nothing_packed
from ._measure import backward, check_array_arguments, worst_argument_error
from ._memory import Memory
from ._policy import FunctionHooks, Policy, as_policy
from ._target import resolve
from .policies._complex import widened


@dataclasses.dataclass(frozen=True)
class ResidualCheck:
    """The round trip `unpack(pack(x))` of one residual, worst over scan iterations."""

    info: ResidualInfo
    max_abs_error: float
    max_rel_error: float  # max |error| / max |x|


@dataclasses.dataclass(frozen=True)
class GradcheckResult:
    """What `gradcheck` found. `ok` is the verdict.

    Attributes:
        ok: gradients within tolerance (and finite differences agree, when checked).
        grad_rel_error: max over arguments of ||g_hooks - g|| / ||g||.
        rtol: the tolerance used.
        finite_differences: `True`/`False` when checked against finite differences,
            `None` when skipped (it needs float64 inputs).
        residuals: one `ResidualCheck` per packed residual, worst first.
        note: why the policy packed nothing, when it did not (`""` otherwise).
        plain_memory: with `memory=True` (or a `target`), the `residual.Memory` of the
            compiled forward and backward without the hooks, on `target`; else `None`.
        hooked_memory: the same with the hooks.
        target: where the memory was compiled for (the running backend's platform, or
            the target's name); `None` without memory.
    """

    ok: bool
    grad_rel_error: float
    rtol: float
    finite_differences: bool | None
    residuals: tuple[ResidualCheck, ...]
    note: str = ""
    plain_memory: Memory | None = None
    hooked_memory: Memory | None = None
    target: str | None = None

    def __repr__(self) -> str:
        verdict = "OK" if self.ok else "FAILED"
        fd = {None: "skipped (needs float64)", True: "agree", False: "DISAGREE"}
        lines = [
            f"gradcheck {verdict}: relative gradient error {self.grad_rel_error:.2e} "
            f"(tolerance {self.rtol:.0e}); finite differences: {fd[self.finite_differences]}",
            self.note or f"{len(self.residuals)} residuals packed; worst round trips:",
        ]
        for check in self.residuals[:5]:
            lines.append(
                f"  max abs {check.max_abs_error:.2e}, rel {check.max_rel_error:.2e}: "
                f"{check.info.describe()}"
            )
        plain, hooked = self.plain_memory, self.hooked_memory
        if plain is not None and hooked is not None:
            lines.append(
                f"compiled peak memory on {self.target}: {hooked.peak / 2**20:.2f} MiB under "
                f"the hooks, {hooked.peak / max(plain.peak, 1):.2f}x plain's "
                f"{plain.peak / 2**20:.2f} MiB (beyond arguments and outputs: "
                f"{hooked.beyond / max(plain.beyond, 1):.2f}x)"
            )
        return "\n".join(lines)


def gradcheck(
    f: Callable,
    *args: Any,
    policy: Policy | None = None,
    pack: Callable | None = None,
    unpack: Callable | None = None,
    rtol: float | None = None,
    raise_on_failure: bool = False,
    memory: bool = False,
    target: str | None = None,
) -> GradcheckResult:
    """Checks gradients under hooks against plain `jax.grad`, and every residual's round trip.

    PyTorch's docs tell users to test saved-tensor hooks with `gradcheck`; this is
    the same in one call. It computes the gradient of `f` (or its VJP with a
    cotangent of ones, for non-scalar outputs) with respect to every positional
    argument, with and without the hooks, and compares them, each argument's gradient
    as a whole (pass apart what should be judged apart); with float64 inputs it
    also checks the hooked gradient against finite differences
    (`jax.test_util.check_grads`). It runs `unpack(pack(x))` on each residual
    during the hooked forward pass and reports the worst errors. With `memory=True`
    it also compiles the forward and backward with and without the hooks and reports
    both programs' memory (`residual.Memory`), on the running backend or `target`.

    Args:
        f: the function.
        *args: its arguments.
        policy: a `residual.Policy`, or else `pack` and `unpack` hooks.
        pack: `pack(x)` hook.
        unpack: `unpack(packed)` hook.
        rtol: tolerance on the relative gradient error; by default 1e-5 for lossless
            policies and plain hooks, 5e-2 for lossy policies.
        raise_on_failure: raise `AssertionError` with the report when not `ok`.
        memory: also report the compiled memory with and without the hooks.
        target: where to compile for the memory: `None` for the running backend, or a
            TPU or GPU compiled for without one (`"v5e"`, `"h100"`, ...; see the
            Targets page); a target implies `memory=True`. The gradients are always
            computed on the running backend.

    Returns:
        A `GradcheckResult`.

    Raises:
        AssertionError: with `raise_on_failure=True`, when the check fails.
        TypeError: an argument holds something other than arrays (a model's functions:
            pass its arrays alone), or neither `policy` nor `pack` and `unpack`.

    Examples:
        >>> import jax.numpy as jnp, residual
        >>> from residual import policies as rp
        >>> x = jnp.linspace(-1, 1, 64 * 64).reshape(64, 64)
        >>> result = residual.gradcheck(lambda x: jnp.sum(jnp.tanh(x) ** 2), x,
        ...                             policy=rp.Quantize(bits=8))
        >>> result.ok
        True
        >>> result.residuals[0].max_rel_error < 0.01
        True
    """
    check_array_arguments(args, "gradcheck")
    inner = as_policy(pack, unpack, policy, caller="gradcheck")
    if inner is None:
        raise TypeError("`gradcheck` needs `policy=` or `pack` and `unpack` to check.")
    if rtol is None:
        rtol = 1e-5 if inner.lossless or isinstance(inner, FunctionHooks) else 5e-2
    sink = _Sink()
    hooked = with_hooks(f, policy=_RoundTrip(inner, sink))
    expected = backward(f)(*args)
    with recording() as records:
        got = backward(hooked)(*args)
    jax.effects_barrier()
    grad_error = worst_argument_error(got, expected)
    finite_differences = _finite_differences(hooked, args)
    ok = grad_error <= rtol and finite_differences is not False
    figures: tuple[Memory | None, Memory | None, str | None] = (None, None, None)
    if memory or target is not None:
        where = resolve(target)
        figures = (where.memory(backward(f), args),
                   where.memory(backward(with_hooks(f, policy=inner)), args), where.label)
    result = GradcheckResult(ok, grad_error, rtol, finite_differences, sink.checks(),
                             nothing_packed(records, inner) or "", *figures)
    if raise_on_failure and not ok:
        raise AssertionError(repr(result))
    return result


def _finite_differences(hooked: Callable, args: tuple) -> bool | None:
    """Whether `hooked`'s reverse-mode gradient agrees with finite differences
    (`jax.test_util.check_grads`), or `None` unless every float argument is float64."""
    leaves, treedef = jax.tree.flatten(args)
    # Finite differences move the floating-point arguments only: integers and typed
    # PRNG keys (dropout) stay as given, so a model taking a key is checked too.
    varied = [i for i, a in enumerate(leaves) if _is_float(a)]
    if not varied or not all(leaves[i].dtype == jnp.float64 for i in varied):
        return None

    def of_floats(*floats):
        full = list(leaves)
        for i, value in zip(varied, floats):
            full[i] = value
        return hooked(*jax.tree.unflatten(treedef, full))

    try:
        jax.test_util.check_grads(of_floats, [leaves[i] for i in varied], order=1,
                                  modes=("rev",))
    except AssertionError:
        return False
    return True


def _is_float(leaf) -> bool:
    """An array of floats (Python numbers, which have no dtype, stay fixed)."""
    return hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact)


class _Sink:
    """Collects round-trip errors sent from inside traced code (once per iteration)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._worst: dict[tuple, tuple[ResidualInfo, float, float]] = {}

    def add(self, info: ResidualInfo, abs_error, rel_error) -> None:
        key = (info.index, info.shape, info.primitive, info.source, info.scope)
        with self._lock:
            _, a, r = self._worst.get(key, (info, 0.0, 0.0))
            self._worst[key] = (info, max(a, float(abs_error)), max(r, float(rel_error)))

    def checks(self) -> tuple[ResidualCheck, ...]:
        checks = [ResidualCheck(i, a, r) for i, a, r in self._worst.values()]
        return tuple(sorted(checks, key=lambda c: -c.max_rel_error))


@dataclasses.dataclass(frozen=True, eq=False)
class _RoundTrip(Policy):
    """Wraps a policy: packs as it does, and reports `unpack(pack(x))`'s error."""

    inner: Policy
    sink: _Sink

    def resolve(self, info: ResidualInfo) -> Policy | None:
        chosen = self.inner.resolve(info)
        if chosen is None or getattr(chosen, "recompute", False):
            return chosen
        return _RoundTrip(chosen, self.sink)

    def pack(self, x, info: ResidualInfo):
        packed = self.inner.pack(x, info)
        y = self.inner.unpack(packed, info)
        if getattr(y, "shape", None) == x.shape and jnp.issubdtype(x.dtype, jnp.inexact):
            diff = jnp.abs(widened(y) - widened(x))
            finite = jnp.isfinite(x)
            error = jnp.max(jnp.where(finite, diff, 0.0), initial=0.0)
            scale = jnp.max(jnp.where(finite, jnp.abs(widened(x)), 0.0), initial=0.0)
            jax.debug.callback(
                lambda a, r, i=info: self.sink.add(i, np.asarray(a), np.asarray(r)),
                error, error / jnp.maximum(scale, 1e-30),
            )
        return packed

    def unpack(self, packed, info: ResidualInfo):
        return self.inner.unpack(packed, info)
