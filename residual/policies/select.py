"""`select`: a policy per residual, chosen by rules on its metadata (`where`)."""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence

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


def _is_pair(value, check_types: bool = True) -> bool:
    if not (isinstance(value, tuple | list) and len(value) == 2):
        return False
    return not check_types or (callable(value[0]) and isinstance(value[1], Policy))
