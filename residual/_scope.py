"""The hook scope stack: `saved_tensors_hooks` and `disable_saved_tensors_hooks`.

The stack is an immutable tuple in a `contextvars.ContextVar`, so threads and async
tasks never see each other's hooks. It is consulted at trace time, in two ways:

- `with_hooks` reads the innermost entry when it traces its function: hooks around a
  `jax.grad(with_hooks(f))(x)` call apply to all of `f`'s residuals.
- Entering a scope also enters a `jax.named_scope` whose name is a marker for the
  entry. JAX records name scopes on every equation, through inner `jit`s, scan bodies
  and `cond` branches, so a residual produced inside a region of traced code can be
  matched to the hooks of the innermost region around it.

The stack is mirrored into a `jax.make_user_context` value, which takes part in
`jax.jit`'s cache key: a jitted function traced under one scope and called under
another is traced again instead of silently reusing the old hooks.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import re
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax

from ._policy import Policy, as_policy


@dataclasses.dataclass(frozen=True)
class _Disabled:
    message: str


_Entry = Policy | _Disabled

_STACK: contextvars.ContextVar[tuple[_Entry, ...]] = contextvars.ContextVar(
    "residual_saved_tensors_hooks", default=()
)
_JIT_KEY = jax.make_user_context(default_value=())

# Marker names in JAX's name stack stand for stack entries. A marker is a `str` that
# holds its entry, so every traced equation that names a region keeps that region's
# hooks alive, and nothing else does: once no scope, jaxpr or `jit` cache key refers
# to them, hooks and what their closures hold are freed. Equal entries get the same
# name, so equal hooks give identical jaxprs.
_MARKER_PREFIX = "residual-hooks-"
_MARKER_RE = re.compile(re.escape(_MARKER_PREFIX) + r"(\d+)$")
_marker_ids: weakref.WeakKeyDictionary[_Entry, int] = weakref.WeakKeyDictionary()
_marker_entries: weakref.WeakValueDictionary[int, _Entry] = weakref.WeakValueDictionary()
_marker_count = itertools.count()
_strong_ids: dict[_Entry, int] = {}  # entries that cannot be weakly referenced
_marker_lock = threading.Lock()


class _Marker(str):
    """A name-scope name that carries the stack entry it stands for."""

    entry: _Entry


class saved_tensors_hooks:
    """Context manager: residuals traced inside it are packed and unpacked by these hooks.

    The JAX counterpart of `torch.autograd.graph.saved_tensors_hooks`. Hooks are bound
    when the forward is traced: a residual uses the hooks of the innermost scope
    around the code that produced it, and a vjp function made inside a scope keeps
    using them after it exits. Scopes take effect through `residual.with_hooks`: use
    them around a call of a hooked function, or inside the function it wraps (inside
    `jit`, scan bodies and `cond` branches too).

    Args:
        pack: `pack(x) -> packed`, any pytree of arrays and static Python values.
        unpack: `unpack(packed) -> array` of `x`'s shape and dtype.
        policy: a `residual.Policy` instead of `pack`/`unpack`.

    Raises:
        TypeError: hooks missing, not callable, or given together with `policy`.
        RuntimeError: entered inside `disable_saved_tensors_hooks` (with its message).

    Examples:
        >>> import jax, jax.numpy as jnp, residual
        >>> f = residual.with_hooks(lambda x: jnp.sum(jnp.sin(x)))
        >>> with residual.saved_tensors_hooks(lambda x: x * 4, lambda p: p / 4):
        ...     g = jax.grad(f)(jnp.arange(3.0))
    """

    def __init__(
        self,
        pack: Callable[[Any], Any] | None = None,
        unpack: Callable[[Any], Any] | None = None,
        *,
        policy: Policy | None = None,
    ):
        entry = as_policy(pack, unpack, policy, caller="saved_tensors_hooks")
        if entry is None:
            raise TypeError(
                "`saved_tensors_hooks` needs hooks: pass `pack` and `unpack`, or "
                "`policy=`. To turn hooks off in a region use "
                "`residual.disable_saved_tensors_hooks(message)`."
            )
        self._entry = entry
        self._exits: list[tuple[contextlib.ExitStack, tuple[_Entry, ...]]] = []

    def __enter__(self) -> saved_tensors_hooks:
        disabled = _innermost_disabled(_STACK.get())
        if disabled is not None:
            raise RuntimeError(disabled.message)
        self._exits.append(_push(self._entry))
        return self

    def __exit__(self, *exc_info) -> None:
        _exit(self._exits)


class disable_saved_tensors_hooks:
    """Context manager that forbids saved-tensor hooks inside it.

    As `torch.autograd.graph.disable_saved_tensors_hooks`: entering hook scopes inside
    it, or entering it while hooks are active, raises `RuntimeError(message)`. Nested,
    the inner message wins. Use it to protect code whose residuals must never be
    altered.

    Args:
        error_message: the message of the `RuntimeError` raised on violation.

    Raises:
        RuntimeError: when hooks are active on entry.

    Examples:
        >>> import residual
        >>> with residual.disable_saved_tensors_hooks("no hooks here"):
        ...     pass
    """

    def __init__(self, error_message: str):
        if not isinstance(error_message, str):
            raise TypeError(
                f"`error_message` must be a str, got {type(error_message).__name__}."
            )
        self._entry = _Disabled(error_message)
        self._exits: list[tuple[contextlib.ExitStack, tuple[_Entry, ...]]] = []

    def __enter__(self) -> disable_saved_tensors_hooks:
        stack = _STACK.get()
        if stack and isinstance(stack[-1], Policy):
            raise RuntimeError(self._entry.message)
        self._exits.append(_push(self._entry))
        return self

    def __exit__(self, *exc_info) -> None:
        _exit(self._exits)


def current_policy() -> Policy | None:
    """The innermost active hooks, or `None` when there are none or they are disabled."""
    stack = _STACK.get()
    return stack[-1] if stack and isinstance(stack[-1], Policy) else None


def policy_of_marker(scope_name: str) -> _Entry | None:
    """The stack entry a name-scope marker stands for, or `None` for an ordinary scope."""
    if isinstance(scope_name, _Marker):
        return scope_name.entry
    match = _MARKER_RE.match(scope_name)
    if match is None:
        return None
    # A marker JAX turned into a plain string: its entry is found while it lives.
    entry = _marker_entries.get(int(match.group(1)))
    if entry is None:
        raise RuntimeError(
            f"The name scope {scope_name!r} marks a `saved_tensors_hooks` region whose "
            "hooks no longer exist: the code was traced under hooks that have since been "
            "freed, and the trace kept only the region's name. Trace it again under the "
            "hooks (call it inside the `saved_tensors_hooks` block)."
        )
    return entry


def is_marker(scope_name: str) -> bool:
    return _MARKER_RE.match(scope_name) is not None


def resolve_entry(entry: _Entry | None) -> Policy | None:
    return entry if isinstance(entry, Policy) else None


def innermost_policy(region_entries: Sequence[_Entry | None], base: Policy | None) -> Policy | None:
    """The one rule of which policy a residual gets: that of the innermost hooks region
    around the code that produced it (none in a `disable_saved_tensors_hooks` region),
    else `base` (the hooks given to `with_hooks`, else those active at its trace)."""
    return resolve_entry(region_entries[-1]) if region_entries else base


def _push(entry: _Entry) -> tuple[contextlib.ExitStack, tuple[_Entry, ...]]:
    try:
        hash(entry)
    except TypeError as e:
        raise TypeError(
            f"Hooks must be hashable (they take part in `jax.jit`'s cache key), but "
            f"{entry!r} is not: {e}. Make policy fields tuples, not lists or arrays."
        ) from None
    old = _STACK.get()
    new = (*old, entry)
    exits = contextlib.ExitStack()
    token = _STACK.set(new)
    exits.callback(_STACK.reset, token)
    exits.enter_context(_JIT_KEY(tuple(_weak_key(e) for e in new)))
    exits.enter_context(jax.named_scope(_marker(entry)))
    return exits, new


def _exit(open_scopes: list[tuple[contextlib.ExitStack, tuple[_Entry, ...]]]) -> None:
    # Checked before anything is undone: a refused exit leaves the hook stack, JAX's
    # name stack and the jit cache key as they were, so the scopes can still be
    # exited in the right order.
    if not open_scopes:
        raise RuntimeError("This hook scope was exited more often than it was entered.")
    exits, expected = open_scopes[-1]
    if _STACK.get() is not expected:
        raise RuntimeError(
            "Hook scopes were exited out of order: the scope being exited is not the "
            "innermost one. Use `with` blocks so that inner scopes exit first."
        )
    open_scopes.pop()
    exits.close()


def _marker(entry: _Entry) -> _Marker:
    marker = _Marker(f"{_MARKER_PREFIX}{_marker_index(entry)}")
    marker.entry = entry
    return marker


def _weak_key(value: Any) -> Any:
    """A key that equals `_weak_key(other)` exactly when `value == other`, holding no hooks.

    JAX keeps the jit key in the caches of every operation run under it, so a key
    holding the entries would keep the hooks' closures alive. A dataclass entry is
    keyed by its class and fields, as its `==` compares them; objects (functions,
    logs) by weak references, which compare their referents while they live and
    never match once they are gone: equal hooks made again (`Remat()` in every
    step, `save_on_cpu()`) hit the cache, and freed ones can never be mistaken for
    new ones.
    """
    if isinstance(value, tuple):
        return tuple(_weak_key(v) for v in value)
    if isinstance(value, types.MethodType):
        # `model.pack` is a new object at each access: equal to another while both
        # bind the same function to the same object, which a reference to it alone
        # would not keep alive.
        try:
            return _SameObject(value.__self__), _weak_key(value.__func__)
        except TypeError:  # an object that cannot be weakly referenced: kept
            return value
    cls = type(value)
    params = getattr(cls, "__dataclass_params__", None)
    if params is not None and params.eq and not isinstance(value, type):
        fields = tuple(
            _weak_key(getattr(value, f.name)) for f in dataclasses.fields(value) if f.compare
        )
        return weakref.ref(cls), fields
    try:
        return weakref.ref(value)
    except TypeError:  # numbers, strings, dtypes: values that hold nothing
        return value


class _SameObject:
    """A weak key equal to another while both refer to the same live object."""

    def __init__(self, obj: Any):
        self._ref = weakref.ref(obj)
        self._hash = id(obj)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _SameObject):
            return NotImplemented
        obj = self._ref()
        return obj is not None and obj is other._ref()


def _marker_index(entry: _Entry) -> int:
    """The number of `entry`'s marker: the same for equal entries while one of them lives."""
    with _marker_lock:
        try:
            index = _marker_ids.get(entry)
        except TypeError:  # not weakly referenceable (a policy class with `__slots__`)
            index = _strong_ids.setdefault(entry, next(_marker_count))
        if index is None:
            index = _marker_ids[entry] = next(_marker_count)
            _marker_entries[index] = entry
    return index


def _innermost_disabled(stack: tuple[_Entry, ...]) -> _Disabled | None:
    for entry in reversed(stack):
        if isinstance(entry, _Disabled):
            return entry
    return None
