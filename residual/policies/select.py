"""`where` and `select`: choose a policy per residual from its metadata."""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import fnmatch
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._info import ResidualInfo
from .._policy import FORWARD_WRAPPERS, Policy, check_hashable


def select(
    rules: Sequence[tuple[Callable[[ResidualInfo], bool], Policy]],
    default: Policy | None = None,
) -> Policy:
    """A policy that picks, per residual, the first rule whose predicate matches.

    `select` only dispatches: for each residual, the policy of the first rule whose
    predicate is true resolves it (`policy.resolve(info)`, so a built-in policy still
    leaves alone what it always leaves alone, such as integers for `Quantize`), and
    `default` resolves the residuals no rule matches. It is how per-residual choices
    are written: what `jax.checkpoint` policies express (keep `dot_general` outputs,
    recompute the rest) and more (by scope, source line, size, dtype, `checkpoint_name`).

    Args:
        rules: a list of `(predicate, policy)` pairs, tried in order. A predicate is a
            `where(...)` value or any hashable function of a `ResidualInfo` returning a
            bool (it takes part in `jax.jit`'s cache key through the hook scope: prefer
            `where`, which compares by value, to a `lambda`, which compares by identity).
        default: the policy for residuals no rule matches; `None` stores them as they
            are.

    Returns:
        A `residual.Policy` value, hashable and equal to any `select` of equal rules.

    Raises:
        TypeError: `rules` is not a list of `(predicate, policy)` pairs with a callable,
            hashable predicate and a `residual.Policy`, or `default` is not a policy.

    Examples:
        >>> import jax, jax.numpy as jnp, residual
        >>> from residual import policies as rp
        >>> keep_dots = rp.select([(rp.where(primitive="dot_general"), rp.Identity())],
        ...                       default=rp.Remat())
        >>> keep_dots
        select([(where(primitive='dot_general'), Identity())], default=Remat())
        >>> def f(w, x):
        ...     h = x @ w  # saved for the product: kept; sin(h) and cos(h) are recomputed
        ...     return jnp.sum(jnp.sin(h) * h)
        >>> jax.grad(residual.with_hooks(f, policy=keep_dots))(jnp.eye(2), jnp.ones((1, 2)))
        Array([[1.3817732, 1.3817732],
               [1.3817732, 1.3817732]], dtype=float32)
    """
    if _is_pair(rules):
        raise TypeError(
            f"`rules` must be a list of (predicate, policy) pairs, but got a single pair "
            f"{rules!r}. Wrap it in a list: `select([(predicate, policy)])`."
        )
    if not isinstance(rules, Sequence) or isinstance(rules, str):
        raise TypeError(
            f"`rules` must be a list of (predicate, policy) pairs, but got "
            f"{type(rules).__name__}: {rules!r}."
        )
    checked = []
    for i, rule in enumerate(rules):
        if not _is_pair(rule, check_types=False):
            raise TypeError(
                f"rule {i} of `select` must be a (predicate, policy) pair, but got {rule!r}."
            )
        predicate, policy = rule
        if not callable(predicate) or isinstance(predicate, Policy):
            raise TypeError(
                f"rule {i} of `select`: the predicate must be callable (e.g. "
                f"`rp.where(dtype=jnp.float32)`), but got {predicate!r}. Rules are "
                "(predicate, policy) pairs, predicate first."
            )
        try:
            hash(predicate)
        except TypeError:
            raise TypeError(
                f"rule {i} of `select`: the predicate must be hashable (policies take "
                f"part in `jax.jit`'s cache key), but got {type(predicate).__name__}: "
                f"{predicate!r}. Use `rp.where(...)` or a plain function."
            ) from None
        if not isinstance(policy, Policy):
            raise TypeError(
                f"rule {i} of `select`: the policy must be a `residual.Policy`, but got "
                f"{type(policy).__name__}: {policy!r}."
            )
        check_hashable(policy, f"the policy of rule {i} of `select`")
        checked.append((predicate, policy))
    if default is not None and not isinstance(default, Policy):
        raise TypeError(
            f"`default` must be a `residual.Policy` or None, but got {type(default).__name__}: "
            f"{default!r}."
        )
    if default is not None:
        check_hashable(default, "`default`")
    return Select(tuple(checked), default)


@dataclasses.dataclass(frozen=True)
class Select(Policy):
    """What `select` returns: dispatches each residual to one of its policies."""

    rules: tuple[tuple[Callable[[ResidualInfo], bool], Policy], ...]
    default: Policy | None

    def __repr__(self) -> str:
        rules = ", ".join(f"({pred!r}, {policy!r})" for pred, policy in self.rules)
        default = "" if self.default is None else f", default={self.default!r}"
        return f"select([{rules}]{default})"

    @property
    def lossless(self) -> bool:  # type: ignore[override]
        """Lossless when every policy it may choose is."""
        chosen = [policy for _, policy in self.rules]
        chosen += [] if self.default is None else [self.default]
        return all(policy.lossless for policy in chosen)

    def resolve(self, info: ResidualInfo) -> Policy | None:
        audit = _AUDIT.get()
        if audit is not None:
            audit.saw(self, info)
        for predicate, policy in self.rules:
            if predicate(info):
                return policy.resolve(info)
        return None if self.default is None else self.default.resolve(info)

    def pack(self, x, info):
        raise TypeError("`select` only dispatches; `resolve` picks the policy that packs.")

    def unpack(self, packed, info):
        raise TypeError("`select` only dispatches; `resolve` picks the policy that unpacks.")


def warns_on_unmatched_rules(fwd: Callable) -> Callable:
    """`fwd` (a hooked function's forward), warning of `select` rules that match nothing.

    Each rule's predicate is tried on every residual its `select` is asked about,
    including those of scan bodies and inner calls traced inside the outermost
    forward; when that forward has been traced, a rule that matched none of them
    is warned about once (Python's warning filters drop the repeats), with the
    scopes, sources and primitives the residuals do have. A rule that matches
    nothing is almost always a selector written for other code: a scope the model
    does not emit (flax NNX and keras emit no `jax.named_scope`), a typo, a renamed
    file.
    """

    @functools.wraps(fwd)
    def audited(*args):
        if _AUDIT.get() is not None:
            return fwd(*args)
        audit = _Audit()
        token = _AUDIT.set(audit)
        try:
            out = fwd(*args)
        finally:
            _AUDIT.reset(token)
        audit.warn()
        return out

    return audited


FORWARD_WRAPPERS.append(warns_on_unmatched_rules)

class _Audit:
    """Which rules of each `select` matched, and the residuals they were tried on."""

    def __init__(self):
        self.matched: dict[Select, list[bool]] = {}
        self.seen: dict[Select, set[ResidualInfo]] = {}

    def saw(self, chooser: Select, info: ResidualInfo) -> None:
        matched = self.matched.setdefault(chooser, [False] * len(chooser.rules))
        self.seen.setdefault(chooser, set()).add(info)
        for i, (predicate, _) in enumerate(chooser.rules):
            matched[i] = matched[i] or bool(predicate(info))

    def warn(self) -> None:
        for chooser, matched in self.matched.items():
            for (predicate, policy), hit in zip(chooser.rules, matched):
                if not hit:
                    warnings.warn(_unmatched(predicate, policy, self.seen[chooser]),
                                  UserWarning, stacklevel=2)


def _unmatched(predicate, policy: Policy, infos: set[ResidualInfo]) -> str:
    def listed(values) -> str:
        values = sorted({v for v in values if v})
        if not values:
            return "none"
        shown = ", ".join(repr(v) for v in values[:6])
        return shown + (f" and {len(values) - 6} more" if len(values) > 6 else "")

    hint = ""
    if getattr(predicate, "scope", None) is not None and not any(i.scope for i in infos):
        hint = (
            " No residual has a scope: the model emits no `jax.named_scope` (flax NNX and "
            "keras do not). Select by `source=` (a file, function or method, e.g. "
            "'*(Block.__call__)') or `primitive=` instead."
        )
    return (
        f"`select` rule ({predicate!r}, {policy!r}) matched none of the {len(infos)} "
        f"residuals it was tried on, so its policy is never used. Their scopes: "
        f"{listed(i.scope for i in infos)}; sources: {listed(i.source for i in infos)}; "
        f"primitives: {listed(i.primitive for i in infos)}.{hint}"
    )


_AUDIT: contextvars.ContextVar[_Audit | None] = contextvars.ContextVar(
    "residual_select_audit", default=None
)


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


def _is_pair(value, check_types: bool = True) -> bool:
    if not (isinstance(value, tuple | list) and len(value) == 2):
        return False
    return not check_types or (callable(value[0]) and isinstance(value[1], Policy))


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
