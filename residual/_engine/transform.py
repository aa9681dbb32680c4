"""`with_hooks`: the function transform that puts saved-tensor hooks on a JAX function."""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import _jax_private as jp
from .._policy import Policy, as_policy
from .._scope import (
    current_policy,
    disable_saved_tensors_hooks,
    is_marker,
    saved_tensors_hooks,
)
from .._source import PACKAGE_DIR
from .decisions import as_array
from .hooked_call import hooked_call
from .nnx import call_with_state_updates
from .residuals import KEPT
from .rewrite import has_markers, interpret


def with_hooks(
    f: Callable | None = None,
    pack: Callable[[Any], Any] | None = None,
    unpack: Callable[[Any], Any] | None = None,
    *,
    policy: Policy | None = None,
) -> Callable:
    """Wraps `f` so that every residual its derivative saves goes through `pack`/`unpack`.

    The functional counterpart of PyTorch's `saved_tensors_hooks`. When the wrapped
    function is differentiated in reverse mode (`jax.grad`, `jax.vjp`,
    `jax.value_and_grad`, ...), its forward pass applies `pack` to each residual (an
    activation or other intermediate that the backward pass needs) and stores what
    `pack` returns; the backward pass calls `unpack` to get the residual back. Use it
    to quantize, cast, offload or recompute activations, or just to look at them.

    `f` is traced to a jaxpr and its residuals are found with `jax.vjp`, so hooks run
    at trace time: `pack` once per residual when the forward is traced, `unpack` each
    time the backward is traced (under `jax.jit`, once per compilation, not per step).
    Residuals produced inside `lax.scan` bodies are packed inside the body, once per
    iteration, so the loop stores the packed form.

    Hooks come from, in order of precedence: the innermost
    `residual.saved_tensors_hooks` region inside `f` around the code that produced the
    residual; the hooks given here; the innermost `saved_tensors_hooks` active when the
    wrapped function is traced. With none of them, it behaves exactly like `f`.

    Forward-mode differentiation (`jax.jvp`, `jax.jacfwd`) saves no residuals: the
    wrapped function then computes exactly what `f` does. Higher-order reverse-mode
    derivatives treat each `unpack(pack(x))` round trip as the identity for
    differentiation (its value is still the round trip's), as PyTorch restores the
    autograd history of an unpacked tensor; value-preserving hooks give exact
    derivatives of every order.

    Args:
        f: the function; its arguments and outputs may be any pytrees (equinox
            Modules included). Non-array leaves are treated as static. flax NNX
            modules among the arguments have their state updates (BatchNorm
            statistics, RNG counts) written back, as under `nnx.grad`.
        pack: `pack(x) -> packed`, any pytree of arrays and static Python values. Plain
            hooks see every residual that is a numeric array, `f`'s inputs included.
        unpack: `unpack(packed) -> array`, of the residual's shape and dtype.
        policy: a `residual.Policy` (which also receives each residual's
            `ResidualInfo`) instead of `pack`/`unpack`.

    Returns:
        A function with `f`'s signature. Used as `@with_hooks(policy=p)` or
        `@with_hooks`, it is a decorator.

    Raises:
        TypeError: `f` or the hooks are not callable, or `pack` comes without `unpack`,
            or hooks and `policy` are both given.
        residual.HookError: (at trace time) `unpack` returned something other than an
            array of the residual's shape and dtype.

    Examples:
        >>> import jax, jax.numpy as jnp, residual
        >>> def f(a, b):
        ...     return jnp.sum(a * b)
        >>> seen = []
        >>> g = residual.with_hooks(f, lambda x: seen.append(x.shape) or x, lambda p: p)
        >>> jax.grad(g)(jnp.ones(3), jnp.arange(3.0))
        Array([0., 1., 2.], dtype=float32)
        >>> seen
        [(3,), (3,)]
    """
    if f is None:
        return functools.partial(with_hooks, pack=pack, unpack=unpack, policy=policy)
    if not callable(f):
        raise TypeError(
            f"`with_hooks` wraps a function, but got {type(f).__name__}: {f!r:.80}. "
            "Pass the function to differentiate, e.g. `with_hooks(loss_fn, pack, unpack)`."
        )
    explicit = as_policy(pack, unpack, policy, caller="with_hooks")

    def call(f, args, kwargs):
        return _call(f, explicit, args, kwargs)

    @functools.wraps(f)
    def hooked(*args, **kwargs):
        return call_with_state_updates(call, f, args, kwargs)

    return hooked


def _call(f: Callable, explicit: Policy | None, args: tuple, kwargs: dict) -> Any:
    dynamic, static = eqx.partition((args, kwargs), eqx.is_array)
    leaves, treedef = jax.tree.flatten(dynamic)
    mode = jp.differentiation_mode(leaves)
    if mode == "forward" or (mode is None and not jp.is_staged()):
        # Forward mode saves no residuals, and neither does an eager call that nothing
        # differentiates (a program being built, under `jit`, may be differentiated later).
        return f(*args, **kwargs)

    # Concrete integer scalars (loop bounds, sizes) stay concrete while `f` is traced,
    # as under plain eager `jax.grad`: `fori_loop(0, n, ...)` is then a scan, which
    # reverse mode can differentiate, not a `while_loop`, which it cannot.
    traced = [not _concrete_count(x) for x in leaves]
    out_parts: dict[str, Any] = {}
    flat_f = _flat_function(f, leaves, treedef, static, traced, out_parts)
    traced_leaves = [x for t, x in zip(traced, leaves) if t]
    scope = saved_tensors_hooks(policy=explicit) if explicit else contextlib.nullcontext()
    try:
        with scope:
            closed = jax.make_jaxpr(flat_f)(*traced_leaves)
    except _UNTRACEABLE as e:
        if explicit is not None or current_policy() is not None:
            raise _untraceable_error(f, e) from None
        # No hooks around: `f` as it is, as plain `jax.grad` runs it. Scopes inside
        # it would have no effect, so they are refused rather than ignored.
        with disable_saved_tensors_hooks(_untraceable_message(f, e, inner_scope=True)):
            return f(*args, **kwargs)
    base = explicit if explicit is not None else current_policy()
    outs = _hooked_outputs(closed, traced_leaves, base)
    out = jax.tree.unflatten(out_parts["treedef"], outs)
    return eqx.combine(out, out_parts["static"])


def _flat_function(
    f: Callable, leaves: list, treedef: Any, static: Any, traced: list[bool], out_parts: dict
) -> Callable:
    """`f` as a function of its traced array leaves only, returning its output's array
    leaves; it records the output's structure and static part in `out_parts`, for
    `_call` to rebuild the output."""

    def flat_f(*xs):
        given = iter(xs)
        xs = [next(given) if t else x for t, x in zip(traced, leaves)]
        a, k = eqx.combine(jax.tree.unflatten(treedef, xs), static)
        out_dynamic, out_parts["static"] = eqx.partition(f(*a, **k), eqx.is_array)
        out_leaves, out_parts["treedef"] = jax.tree.flatten(out_dynamic)
        return out_leaves

    return flat_f


def _hooked_outputs(closed: Any, traced_leaves: list, base: Policy | None) -> list:
    """The outputs of the traced program `closed` at `traced_leaves`, its residuals
    stored as `base` and the scopes inside it decide; the program as it is when there
    is nothing to hook."""
    # Constants `f` closes over become inputs, so they get gradients too.
    inputs = [*closed.consts, *traced_leaves]
    n_consts = len(closed.consts)

    if base is None and not has_markers(closed.jaxpr):
        return [as_array(v) for v in jp.jaxpr_as_fun(closed)(*traced_leaves)]

    def fun(*xs):
        return interpret(closed.jaxpr, xs[:n_consts], xs[n_consts:], base)

    # Scopes around the call name the residuals; hooks around it are `base`.
    prefix = tuple(s for s in jp.current_scope_names() if not is_marker(s))
    return hooked_call(fun, inputs, [KEPT] * len(inputs), base, scope_prefix=prefix)


# What tracing raises where `f` needs a concrete value: Python control flow on it
# (`if x > 0`), `int(x)`, `np.asarray(x)`, a shape computed from it.
_UNTRACEABLE = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
)


def _concrete_count(x) -> bool:
    """Whether `x` is a concrete (not traced) integer or boolean scalar."""
    return (not isinstance(x, jax.core.Tracer) and x.shape == ()
            and (jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_))


def _untraceable_error(f: Callable, error: Exception) -> TypeError:
    return TypeError(_untraceable_message(f, error, inner_scope=False))


def _untraceable_message(f: Callable, error: Exception, *, inner_scope: bool) -> str:
    name = getattr(f, "__qualname__", None) or type(f).__name__
    where = _user_frame(error)
    at = f" at {where}" if where else ""
    reason = str(error).split("\n", 1)[0].rstrip(".")
    if inner_scope:
        first = (
            f"A `saved_tensors_hooks` scope was entered inside `{name}`, which `with_hooks` "
            f"could not trace: it needs the value of a traced array{at} ({reason}), so "
            "it runs untraced and hooks inside it could not apply."
        )
    else:
        first = (
            f"`with_hooks` traces `{name}` to hook its residuals, but `{name}` needs the "
            f"value of a traced array{at} ({reason}). Hooks apply to traced programs only."
        )
    return (
        f"{first} Write value-dependent control flow with `jax.lax.cond`, `jnp.where` or "
        "`jax.lax.fori_loop`/`scan`, or make the value static: pass it as a Python "
        "number, or mark it static with `jax.jit(..., static_argnums=...)`."
    )


def _user_frame(error: Exception) -> str | None:
    """`file.py:12 (`source line`)` of the innermost frame outside JAX and `residual`."""
    skip = (os.path.dirname(jax.__file__), PACKAGE_DIR, "<frozen ")
    frames = [fr for fr in traceback.extract_tb(error.__traceback__)
              if not fr.filename.startswith(skip)]
    if not frames:
        return None
    frame = frames[-1]
    line = f" (`{frame.line.strip()}`)" if frame.line else ""
    return f"{os.path.basename(frame.filename)}:{frame.lineno}{line}"
