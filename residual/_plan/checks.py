"""The planner's argument checks: each turns bad input into a clear error, early."""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._target import Target, resolve
from .actions import ACTIONS, offload_available


def check_loss(loss: Any, example_args: tuple) -> None:
    if not callable(loss):
        raise TypeError(
            f"`loss` must be a function returning a scalar, but got {type(loss).__name__}: "
            f"{loss!r:.80}. Pass the function first, then its example arguments."
        )
    if not example_args:
        raise TypeError(
            "`plan` needs example arguments of `loss` (arrays or `jax.ShapeDtypeStruct`s): "
            "`residual.plan(loss, params, batch, budget=0.5)`."
        )


def check_differentiable(example_args: tuple, argnums: Any, tool: str) -> None:
    """`argnums` name example arguments whose every leaf `jax.grad` takes: a float or
    complex array (or its `jax.ShapeDtypeStruct`). A model object holding anything
    else (flax NNX's random-number state, equinox's activation functions) is refused
    here, where the fix can be named, rather than deep in `jax.grad`."""
    try:
        numbers = ([operator.index(argnums)] if not isinstance(argnums, Iterable)
                   else [operator.index(i) for i in argnums])
    except TypeError:
        raise TypeError(
            f"`argnums` must be an int or a sequence of ints, as for `jax.grad`, but got "
            f"{argnums!r}."
        ) from None
    for i in numbers:
        if not -len(example_args) <= i < len(example_args):
            raise ValueError(
                f"`argnums` names argument {i}, but `loss` got {len(example_args)} example "
                "arguments."
            )
        for path, leaf in jax.tree_util.tree_flatten_with_path(example_args[i])[0]:
            dtype = getattr(leaf, "dtype", None)
            if isinstance(leaf, float | complex) or (
                    dtype is not None and hasattr(leaf, "shape")
                    and jnp.issubdtype(dtype, jnp.inexact)):
                continue
            what = (f"an array of dtype {dtype}" if dtype is not None
                    else f"a {type(leaf).__name__}")
            where = f"whose leaf {jax.tree_util.keystr(path)} is" if path else "which is"
            raise TypeError(
                f"`{tool}` differentiates `loss` with respect to argument {i} "
                f"(`argnums`), {where} {what}, which `jax.grad` cannot differentiate. "
                "Pass the trained floats alone as that argument and the rest as another: "
                "with flax NNX `graphdef, params, rest = nnx.split(model, nnx.Param, ...)` "
                "and a loss of `nnx.merge(graphdef, params, rest)`; with equinox "
                "`params, static = eqx.partition(model, eqx.is_inexact_array)` and a loss "
                "of `eqx.combine(params, static)`."
            )


def check_error(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise TypeError(
            f"`max_grad_error` must be a number, the largest relative gradient error "
            f"allowed (e.g. 1e-2), but got {type(value).__name__}: {value!r}."
        )
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"`max_grad_error` must be a finite number >= 0 (0: lossless actions only), "
            f"but got {value!r}."
        )
    return float(value)


def check_actions(actions: Any, where: Target | None = None) -> tuple[str, ...]:
    where = where or resolve(None)
    available = offload_available(where)
    if actions is None:  # on a target, offload only when asked: see `plan`
        return tuple(a for a in ACTIONS if a != "offload" or (available and where.runs))
    if isinstance(actions, str) or not isinstance(actions, Sequence):
        raise TypeError(
            f"`actions` must be a list of action names from {ACTIONS}, but got "
            f"{type(actions).__name__}: {actions!r}. For one action write "
            f"`actions=[{actions!r}]`."
        )
    for a in actions:
        if a not in ACTIONS:
            raise ValueError(
                f"`actions` must name actions from {ACTIONS}, but got {a!r}."
            )
    if "offload" in actions and not available:
        raise ValueError(
            f"`actions` includes 'offload', but {where.label} devices have no "
            "host memory apart from their own: offloading saves nothing there. Leave "
            "'offload' out (it is unavailable on this backend)."
        )
    return tuple(dict.fromkeys(("keep", *actions)))


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class Budget(NamedTuple):
    """A memory budget: `("fraction", f)` of plain `jax.grad`'s memory, or `("bytes", n)`."""

    kind: str
    value: float

    def bytes_of(self, plain: int) -> int:
        """The budget in bytes, for a program whose plain `jax.grad` takes `plain`."""
        return int(self.value * plain) if self.kind == "fraction" else int(self.value)


def check_budget(budget: Any) -> Budget | None:
    """The budget asked for, checked: `None` (least memory) or a `Budget`."""
    if budget is None:
        return None
    if isinstance(budget, bool):
        raise TypeError(f"`budget` must be a fraction, bytes or a string, but got {budget!r}.")
    if isinstance(budget, int | np.integer):
        if budget <= 0:
            raise ValueError(f"`budget` in bytes must be positive, but got {budget!r}.")
        return Budget("bytes", float(budget))
    if isinstance(budget, float | np.floating):
        if not 0 < budget <= 1:
            raise ValueError(
                f"`budget` as a float is a fraction of plain `jax.grad`'s memory, in (0, 1], "
                f"but got {budget!r}. For bytes pass an int or a string such as '6 GiB'."
            )
        return Budget("fraction", float(budget))
    if isinstance(budget, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B)\s*", budget, flags=re.I)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"`budget` as a string must be a size such as '6 GiB' or '512 MiB', but got "
                f"{budget!r}."
            )
        n = float(match.group(1)) * _UNITS[match.group(2).lower()]
        if n <= 0:
            raise ValueError(f"`budget` must be positive, but got {budget!r}.")
        return Budget("bytes", n)
    raise TypeError(
        f"`budget` must be a fraction of plain memory (0.5), bytes (an int), a string "
        f"('6 GiB') or None, but got {type(budget).__name__}: {budget!r}."
    )
