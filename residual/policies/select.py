"""`where` and `select`: choose a policy per residual from its metadata."""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._info import ResidualInfo
from .._policy import Policy


def _as_tuple(value):
    if value is None or isinstance(value, tuple):
        return value
    if isinstance(value, list):
        return tuple(value)
    return (value,)


@dataclasses.dataclass(frozen=True)
class where:
    """A predicate on `ResidualInfo`: true when every given condition holds.

    Args:
        dtype: a dtype or tuple of dtypes the residual must have.
        shape: the exact shape.
        min_bytes: at least this many bytes (per iteration inside scan bodies).
        max_bytes: at most this many bytes.
        primitive: name or tuple of names of the producing primitive (`"dot_general"`,
            `"tanh"`; `None` matches any, use `is_input=True` for inputs).
        name: `checkpoint_name` tag or tuple of tags.
        scope: glob on the scope path, e.g. `"block*/mlp"` (`fnmatch` rules).
        is_input: whether the residual is an input of the hooked function.
        kept_alive: whether the value stays alive anyway.
        in_scan: whether it is produced inside a scan body.

    Raises:
        ValueError: `min_bytes`/`max_bytes` negative or crossed.

    Examples:
        >>> import jax.numpy as jnp
        >>> from residual import policies as rp
        >>> big_float = rp.where(dtype=jnp.float32, min_bytes=1 << 20)
    """

    dtype: Any = None
    shape: tuple[int, ...] | None = None
    min_bytes: int | None = None
    max_bytes: int | None = None
    primitive: Any = None
    name: Any = None
    scope: str | None = None
    is_input: bool | None = None
    kept_alive: bool | None = None
    in_scan: bool | None = None

    def __post_init__(self):
        dtypes = _as_tuple(self.dtype)
        if dtypes is not None:
            dtypes = tuple(np.dtype(d) for d in dtypes)
        object.__setattr__(self, "dtype", dtypes)
        object.__setattr__(self, "primitive", _as_tuple(self.primitive))
        object.__setattr__(self, "name", _as_tuple(self.name))
        if self.shape is not None:
            object.__setattr__(self, "shape", tuple(self.shape))
        for field in ("min_bytes", "max_bytes"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"`{field}` must be a non-negative int, but got {value!r}.")
        if (
            self.min_bytes is not None
            and self.max_bytes is not None
            and self.min_bytes > self.max_bytes
        ):
            raise ValueError(
                f"`min_bytes` ({self.min_bytes}) is larger than `max_bytes` "
                f"({self.max_bytes}): nothing would match."
            )
        if self.scope is not None and not isinstance(self.scope, str):
            raise ValueError(f"`scope` must be a glob string, but got {self.scope!r}.")

    def __call__(self, info: ResidualInfo) -> bool:
        checks = (
            self.dtype is None or np.dtype(info.dtype) in self.dtype,
            self.shape is None or tuple(info.shape) == self.shape,
            self.min_bytes is None or info.nbytes >= self.min_bytes,
            self.max_bytes is None or info.nbytes <= self.max_bytes,
            self.primitive is None or info.primitive in self.primitive,
            self.name is None or info.name in self.name,
            self.scope is None or fnmatch.fnmatchcase(info.scope, self.scope),
            self.is_input is None or info.is_input == self.is_input,
            self.kept_alive is None or info.kept_alive == self.kept_alive,
            self.in_scan is None or info.in_scan == self.in_scan,
        )
        return all(checks)


@dataclasses.dataclass(frozen=True)
class _Select(Policy):
    rules: tuple[tuple[Callable[[ResidualInfo], bool], Policy], ...]
    default: Policy | None

    def __repr__(self) -> str:
        rules = ", ".join(f"{p!r}" for _, p in self.rules)
        return f"select([{rules}], default={self.default!r})"

    def resolve(self, info: ResidualInfo) -> Policy | None:
        for predicate, policy in self.rules:
            if predicate(info):
                return policy.resolve(info)
        return None if self.default is None else self.default.resolve(info)

    def pack(self, x, info):
        raise TypeError("`select` only dispatches; `resolve` picks the policy that packs.")

    def unpack(self, packed, info):
        raise TypeError("`select` only dispatches; `resolve` picks the policy that unpacks.")


def select(
    rules: Sequence[tuple[Callable[[ResidualInfo], bool], Policy]],
    default: Policy | None = None,
) -> Policy:
    """A policy that picks, per residual, the first rule whose predicate matches.

    Args:
        rules: `(predicate, policy)` pairs; a predicate is a `where(...)` value or
            any hashable function of a `ResidualInfo` returning a bool.
        default: the policy for residuals no rule matches; `None` stores them as they
            are.

    Returns:
        A `residual.Policy` value.

    Raises:
        TypeError: a rule is not a `(predicate, policy)` pair of the right types.

    Examples:
        >>> import jax.numpy as jnp
        >>> from residual import policies as rp
        >>> p = rp.select(
        ...     [(rp.where(dtype=jnp.float32, min_bytes=1 << 20), rp.Quantize(bits=8)),
        ...      (rp.where(primitive="dot_general"), rp.Identity())],
        ...     default=rp.Remat())
    """
    checked = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, tuple | list) and len(rule) == 2):
            raise TypeError(
                f"rule {i} of `select` must be a (predicate, policy) pair, but got {rule!r}."
            )
        predicate, policy = rule
        if not callable(predicate):
            raise TypeError(
                f"rule {i} of `select`: the predicate must be callable (e.g. "
                f"`rp.where(dtype=jnp.float32)`), but got {predicate!r}."
            )
        if not isinstance(policy, Policy):
            raise TypeError(
                f"rule {i} of `select`: the policy must be a `residual.Policy`, but got "
                f"{type(policy).__name__}: {policy!r}."
            )
        checked.append((predicate, policy))
    if default is not None and not isinstance(default, Policy):
        raise TypeError(
            f"`default` must be a `residual.Policy` or None, but got {type(default).__name__}."
        )
    return _Select(tuple(checked), default)
