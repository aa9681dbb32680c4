"""`Policy`: the base of policy values, and the adaptor that turns plain hooks into one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._info import ResidualInfo

# Wrappers of every hooked call's forward rule, for a policy that must see all the
# residuals of one trace (`select` warns of rules that matched none). The engine applies
# each, so it never imports a policy.
FORWARD_WRAPPERS: list[Callable[[Callable], Callable]] = []

class Policy:
    """Base for policy values: `pack(x, info)` in the forward, `unpack(packed, info)` after.

    A policy decides, per residual, how it is stored between the forward and the
    backward pass. Subclasses are frozen dataclasses (immutable and hashable, since a
    policy takes part in `jax.jit`'s cache key through the hook scope stack), check
    their arguments in `__post_init__`, and implement:

    - `pack(x, info)`: called once per residual when the forward is traced; returns
      any pytree of arrays and static Python values.
    - `unpack(packed, info)`: called when the backward is traced; returns an array of
      `info.shape` and `info.dtype`.
    - `resolve(info)` (optional): the policy that handles this residual, or `None` to
      store it as it is. Composite policies (`select`, `Chain`) use it to dispatch.

    Attributes:
        lossless: whether `unpack(pack(x))` always equals `x` bit for bit.
        recompute: whether the policy stores nothing and has the backward recompute
            the residual (`Remat`): `pack` and `unpack` are then never called.
        reads_twice: whether `pack` reads its input more than once, across control
            flow of its own (`Quantize`'s `cond`): the input is then computed once
            before `pack`, or XLA may recompute a cheap producer into each read and
            keep two copies alive.
        instead: for a recomputing policy, the policy that stores the residual
            where recomputing it would store at least as many bytes (the values it
            is recomputed from), or `None` to recompute it whatever that stores.
        recomputes_through: for a recomputing policy, the primitives (by name) it
            may run again in the backward, or `None` for any.
        beside_floats: whether the policy packs only beside floats that others pack
            (`Cast` and `Quantize` store masks as bits so): where a hooked function
            would pack nothing else, what it chose is stored as it is instead.

    Examples:
        >>> import dataclasses, jax.numpy as jnp, residual
        >>> @dataclasses.dataclass(frozen=True)
        ... class Half(residual.Policy):
        ...     def pack(self, x, info):
        ...         return x.astype(jnp.float16)
        ...     def unpack(self, packed, info):
        ...         return packed.astype(info.dtype)
        >>> g = residual.with_hooks(lambda x: jnp.sum(jnp.sin(x)), policy=Half())
    """

    lossless: bool = False
    recompute: bool = False
    reads_twice: bool = False
    instead: Policy | None = None
    recomputes_through: frozenset[str] | None = None
    beside_floats: bool = False

    def pack(self, x: jnp.ndarray, info: ResidualInfo) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement `pack(x, info)`.")

    def unpack(self, packed: Any, info: ResidualInfo) -> jnp.ndarray:
        raise NotImplementedError(
            f"{type(self).__name__} must implement `unpack(packed, info)`."
        )

    def resolve(self, info: ResidualInfo) -> Policy | None:
        """The policy that packs this residual, or `None` to store it unchanged."""
        return self


@dataclasses.dataclass(frozen=True)
class FunctionHooks(Policy):
    """Plain PyTorch-style hooks, `pack(x)` and `unpack(packed)`, seen as a policy.

    As in PyTorch, they see every residual that is a numeric array, inputs included.
    """

    pack_fn: Callable[[Any], Any]
    unpack_fn: Callable[[Any], Any]

    def pack(self, x, info):
        return self.pack_fn(x)

    def unpack(self, packed, info):
        return self.unpack_fn(packed)


def as_policy(pack: Any, unpack: Any, policy: Any, *, caller: str) -> Policy | None:
    """Checks a `pack`/`unpack`/`policy` triple and returns the one policy it means."""
    if policy is not None:
        if pack is not None or unpack is not None:
            raise TypeError(
                f"`{caller}` takes either `pack` and `unpack` or `policy`, not both; "
                f"got pack={pack!r}, unpack={unpack!r} and policy={policy!r}. "
                "Wrap the functions in a `residual.Policy` subclass or pass only them."
            )
        if not isinstance(policy, Policy):
            raise TypeError(
                f"`policy` must be a `residual.Policy` (e.g. `residual.policies."
                f"Quantize(bits=8)`), but got {type(policy).__name__}: {policy!r}."
            )
        check_hashable(policy, "`policy`")
        return policy
    if pack is None and unpack is None:
        return None
    if pack is None or unpack is None:
        given, missing = ("pack", "unpack") if unpack is None else ("unpack", "pack")
        raise TypeError(
            f"`{caller}` got `{given}` without `{missing}`: the two hooks come as a "
            f"pair. Pass `{missing}` too (the identity `lambda x: x` if it has "
            "nothing to do)."
        )
    for label, fn in (("pack", pack), ("unpack", unpack)):
        if not callable(fn):
            raise TypeError(
                f"`{label}` must be callable, but got {type(fn).__name__}: {fn!r}. "
                f"Pass a function such as `lambda x: x`."
            )
    return check_hashable(FunctionHooks(pack, unpack), "`pack` and `unpack`")


def check_hashable(policy: Policy, label: str) -> Policy:
    """`policy`, refused early when it has no hash: it takes part in `jax.jit`'s cache key.

    Checked when `with_hooks`, a scope, `Chain` or `select` is built, not at the first
    call: a non-frozen dataclass (which `dataclasses` makes unhashable) or a list field
    would otherwise fail only once a trace begins.
    """
    try:
        hash(policy)
    except TypeError as e:
        params = getattr(type(policy), "__dataclass_params__", None)
        if params is not None and not params.frozen and type(policy).__hash__ is None:
            raise TypeError(
                f"{label} must be hashable (hooks take part in `jax.jit`'s cache key), but "
                f"{type(policy).__name__} is a dataclass that is not frozen, so it has no "
                f"hash. Declare it with `@dataclasses.dataclass(frozen=True)`."
            ) from None
        raise TypeError(
            f"Hooks must be hashable (they take part in `jax.jit`'s cache key), but "
            f"{label} {policy!r:.200} is not: {e}. Make policy fields tuples, not lists "
            "or arrays."
        ) from None
    return policy


def check_int(owner: str, label: str, value: Any, *, minimum: int | None = None) -> int:
    """`value` as an `int`, for a policy field: `bool`s and floats are refused."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(
            f"`{label}` must be an int, but got {type(value).__name__}: {value!r}. Pass "
            f"`{owner}` a whole number, such as `{label}={_example(label)}`."
        )
    if minimum is not None and value < minimum:
        kind = {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"at least {minimum}")
        raise ValueError(f"`{label}` must be {kind}, but got {value!r}.")
    return int(value)


def check_bool(owner: str, label: str, value: Any) -> bool:
    """`value` as a `bool`, for a policy field: `"yes"`, `1` and `None` are refused."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(
            f"`{label}` must be True or False, but got {type(value).__name__}: {value!r}. "
            f"Pass `{owner}` a bool, such as `{label}=True`."
        )
    return bool(value)


def check_choice(label: str, value: Any, choices: tuple[str, ...], why: str = "") -> str:
    """`value`, for a policy field that is one of the strings `choices`; `why` follows
    the error's list of them (`": 'auto' ..."`)."""
    if not isinstance(value, str):
        raise TypeError(
            f"`{label}` must be a string, one of {choices}, but got "
            f"{type(value).__name__}: {value!r}."
        )
    if value not in choices:
        raise ValueError(f"`{label}` must be one of {choices}, but got {value!r}{why}.")
    return value


def _example(label: str) -> str:
    return {"bits": "8", "group_size": "64", "seed": "0", "min_bytes": "16384"}.get(label, "1")
