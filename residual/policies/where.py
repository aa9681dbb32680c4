"""`where`: a predicate on a residual's metadata, for `select`'s rules."""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._info import ResidualInfo
from .._policy import Policy


def where(
    *,
    dtype: Any = None,
    shape: Sequence[int] | None = None,
    min_bytes: int | None = None,
    max_bytes: int | None = None,
    primitive: str | Sequence[str] | None = None,
    name: str | Sequence[str] | None = None,
    scope: str | None = None,
    source: str | None = None,
    is_input: bool | None = None,
    kept_alive: bool | None = None,
    in_scan: bool | None = None,
    in_host_memory: bool | None = None,
    **unknown: Any,
) -> Callable[[ResidualInfo], bool]:
    """A predicate on `ResidualInfo`: true when every condition given holds.

    Conditions left as `None` are not checked, so `where()` matches every residual.
    The result is a frozen, hashable value that compares by its conditions, so a
    `select` built from it is a policy value `jax.jit` can cache on.

    Args:
        dtype: a dtype, or a tuple of them, the residual must have. Abstract dtypes such
            as `jnp.floating` or `jnp.integer` match their whole family.
        shape: the exact shape (per iteration inside a scan body).
        min_bytes: at least this many bytes (per iteration inside a scan body).
        max_bytes: at most this many bytes.
        primitive: name or tuple of names of the primitive that produced it
            (`"dot_general"`, `"tanh"`); inputs have no primitive, so use
            `is_input=True` for them.
        name: a `jax.ad_checkpoint.checkpoint_name` tag, or a tuple of them.
        scope: a glob on the scope path (`fnmatch` rules, case-sensitive), e.g.
            `"block*/mlp"`; `""` is the top level.
        source: a glob on a source line, `"file.py:12 (qualified.name)"`, matched
            against every frame that produced the residual (`ResidualInfo.frames`):
            `"model.py:*"` for a file, `"*(Block.__call__)"` for everything a method
            computes, layers it calls included, `"normalization.py:*"` for what a
            library's file computes. A residual with no known source never matches.
        is_input: whether it is an input of the hooked function (or a scan body's carry,
            slice or loop-invariant operand).
        kept_alive: whether the value stays alive anyway (see `ResidualInfo.kept_alive`).
        in_scan: whether it is produced inside a `lax.scan` body.
        in_host_memory: whether it is already in host memory (see
            `ResidualInfo.in_host_memory`).

    Returns:
        A hashable predicate: call it on a `ResidualInfo` to get a bool.

    Raises:
        TypeError: an unknown condition, or a condition of the wrong type.
        ValueError: `min_bytes`/`max_bytes` negative or crossed, or a negative dimension.

    Examples:
        >>> import jax.numpy as jnp
        >>> from residual import ResidualInfo, policies as rp
        >>> big_float = rp.where(dtype=jnp.floating, min_bytes=1 << 20)
        >>> big_float
        where(dtype=floating, min_bytes=1048576)
        >>> big_float(ResidualInfo(index=0, shape=(1024, 1024), dtype=jnp.dtype("float32")))
        True
        >>> rp.where(scope="block*/mlp")(ResidualInfo(0, (4,), jnp.dtype("int32"), scope="x"))
        False
    """
    if unknown:
        fields = [f.name for f in dataclasses.fields(_Where)]
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, fields, n=1)
            hints.append(f"`{key}`" + (f" (did you mean `{close[0]}`?)" if close else ""))
        # `where(name="a", then=rp.Remat())` reads naturally but is not the API.
        pairing = (
            " A `where` only tests residuals: pair it with its policy in "
            "`rp.select([(rp.where(...), policy)], default=...)`."
            if any(isinstance(v, Policy) for v in unknown.values()) else ""
        )
        raise TypeError(
            f"`where` got unknown condition(s) {', '.join(hints)}; the conditions are "
            f"{', '.join(fields)}.{pairing}"
        )
    return _Where(
        dtype=_dtypes(dtype),
        shape=_shape(shape),
        min_bytes=_byte_count("min_bytes", min_bytes),
        max_bytes=_byte_count("max_bytes", max_bytes),
        primitive=_strings("primitive", primitive),
        name=_strings("name", name),
        scope=_glob("scope", scope, "'block*/mlp'"),
        source=_glob("source", source, "'model.py:*'"),
        is_input=_flag("is_input", is_input),
        kept_alive=_flag("kept_alive", kept_alive),
        in_scan=_flag("in_scan", in_scan),
        in_host_memory=_flag("in_host_memory", in_host_memory),
    )


@dataclasses.dataclass(frozen=True)
class _Where:
    """What `where` returns: its conditions, normalized (tuples of dtypes and names)."""

    dtype: tuple[Any, ...] | None = None
    shape: tuple[int, ...] | None = None
    min_bytes: int | None = None
    max_bytes: int | None = None
    primitive: tuple[str, ...] | None = None
    name: tuple[str, ...] | None = None
    scope: str | None = None
    source: str | None = None
    is_input: bool | None = None
    kept_alive: bool | None = None
    in_scan: bool | None = None
    in_host_memory: bool | None = None

    def __post_init__(self):
        if (
            self.min_bytes is not None
            and self.max_bytes is not None
            and self.min_bytes > self.max_bytes
        ):
            raise ValueError(
                f"`min_bytes` ({self.min_bytes}) is larger than `max_bytes` "
                f"({self.max_bytes}): nothing would match."
            )

    def __call__(self, info: ResidualInfo) -> bool:
        checks = (
            self.dtype is None or any(jnp.issubdtype(info.dtype, d) for d in self.dtype),
            self.shape is None or tuple(info.shape) == self.shape,
            self.min_bytes is None or info.nbytes >= self.min_bytes,
            self.max_bytes is None or info.nbytes <= self.max_bytes,
            self.primitive is None or info.primitive in self.primitive,
            self.name is None or info.name in self.name,
            self.scope is None or fnmatch.fnmatchcase(info.scope, self.scope),
            self.source is None or any(
                fnmatch.fnmatchcase(line, self.source)
                for line in (info.source, *info.frames) if line is not None
            ),
            self.is_input is None or info.is_input == self.is_input,
            self.kept_alive is None or info.kept_alive == self.kept_alive,
            self.in_scan is None or info.in_scan == self.in_scan,
            self.in_host_memory is None or info.in_host_memory == self.in_host_memory,
        )
        return all(checks)

    def __repr__(self) -> str:
        parts = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            if field.name == "dtype":
                names = [_dtype_name(d) for d in value]
                shown = names[0] if len(names) == 1 else f"({', '.join(names)})"
            elif isinstance(value, tuple) and field.name != "shape" and len(value) == 1:
                shown = repr(value[0])
            else:
                shown = repr(value)
            parts.append(f"{field.name}={shown}")
        return f"where({', '.join(parts)})"


def _dtypes(dtype) -> tuple[Any, ...] | None:
    if dtype is None:
        return None
    result = []
    for d in dtype if isinstance(dtype, tuple | list) else (dtype,):
        if isinstance(d, type) and issubclass(d, np.generic) and d in _ABSTRACT:
            result.append(d)
            continue
        try:
            result.append(np.dtype(d))
        except TypeError:
            raise TypeError(
                f"`dtype` must be a dtype (`jnp.float32`, `\"bfloat16\"`), an abstract one "
                f"(`jnp.floating`), or a tuple of them, but got {d!r}."
            ) from None
    return tuple(result)


# Abstract dtypes `where(dtype=...)` accepts as families (`np.dtype` would refuse them).
_ABSTRACT = (
    np.generic, np.number, np.inexact, np.floating, np.complexfloating, np.integer,
    np.signedinteger, np.unsignedinteger, np.bool_,
)


def _dtype_name(d) -> str:
    return d.__name__ if isinstance(d, type) else np.dtype(d).name


def _shape(shape) -> tuple[int, ...] | None:
    if shape is None:
        return None
    dims = tuple(shape) if isinstance(shape, tuple | list) else None
    if dims is None or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise TypeError(f"`shape` must be a tuple of ints, e.g. (4096, 1024), but got {shape!r}.")
    if any(d < 0 for d in dims):
        raise ValueError(f"`shape` must have non-negative dimensions, but got {shape!r}.")
    return dims


def _byte_count(label: str, value) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int | np.integer) or isinstance(value, bool):
        raise TypeError(f"`{label}` must be an int number of bytes, but got {value!r}.")
    if value < 0:
        raise ValueError(f"`{label}` must be a non-negative int, but got {value!r}.")
    return int(value)


def _strings(label: str, value) -> tuple[str, ...] | None:
    if value is None:
        return None
    values = tuple(value) if isinstance(value, tuple | list) else (value,)
    if not values or not all(isinstance(v, str) for v in values):
        raise TypeError(
            f"`{label}` must be a string or a non-empty tuple of strings, but got {value!r}."
        )
    return values


def _glob(label: str, pattern, example: str) -> str | None:
    if pattern is not None and not isinstance(pattern, str):
        raise TypeError(
            f"`{label}` must be a glob string such as {example}, but got {pattern!r}."
        )
    return pattern


def _flag(label: str, value) -> bool | None:
    if value is not None and not isinstance(value, bool | np.bool_):
        raise TypeError(f"`{label}` must be True, False or None, but got {value!r}.")
    return None if value is None else bool(value)
