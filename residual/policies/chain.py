"""`Chain`: apply policies one after another, e.g. quantize then offload."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from .._info import ResidualInfo
from .._policy import Policy, check_hashable
from .identity import Identity
from .offload import Offload
from .profile import Profile
from .select import Select


@dataclasses.dataclass(frozen=True, init=False)
class Chain(Policy):
    """Packs with each policy in turn; unpacks in reverse order.

    `Chain(Quantize(bits=8), Offload())` quantizes a residual, then offloads the
    packed codes and scales to host memory. Each later policy sees every array of
    the previous one's packed form as a residual of its own: the same `ResidualInfo`
    (index, primitive, scope, ...) with that array's `shape` and `dtype`, so its
    `resolve` may leave it as it is (`Offload` moves the `uint8` codes and the
    scales; `Cast` would leave the codes alone). A stage whose `resolve` returns
    `None` for the residual itself (`Quantize` on an integer residual, say) is
    skipped, and the rest of the chain handles the residual as it is.

    Args:
        *policies: two or more `residual.Policy` values. `Remat` cannot be one of
            them: it stores nothing, so there is nothing to pass on.

    Raises:
        TypeError: an argument is not a (hashable) `Policy`, is `Remat`, or fewer than
            two are given; or a policy that computes (`Quantize`, `Cast`, your own)
            comes after `Offload`, whose arrays are in host memory by then.

    Examples:
        >>> from residual import policies as rp
        >>> rp.Chain(rp.Quantize(bits=8), rp.Offload())
        Chain(Quantize(bits=8, ...), Offload(memory_kind='pinned_host', ...))
    """

    policies: tuple[Policy, ...]

    def __init__(self, *policies: Policy):
        if len(policies) < 2:
            raise TypeError(f"`Chain` takes two or more policies, but got {len(policies)}.")
        for i, policy in enumerate(policies):
            if not isinstance(policy, Policy):
                raise TypeError(
                    f"`Chain` argument {i} must be a `residual.Policy`, but got "
                    f"{type(policy).__name__}: {policy!r}."
                )
            if policy.recompute:
                raise TypeError(
                    f"`Chain` argument {i} is {policy!r}, which stores nothing and "
                    "recomputes the residual: there is no packed form to pass along the "
                    "chain. Use it on its own, or choose it per residual with `select`."
                )
            check_hashable(policy, f"`Chain` argument {i}")
        for i, policy in enumerate(policies[1:], start=1):
            offloading = next((p for p in policies[:i] if _may_offload(p)), None)
            if offloading is not None and not _only_moves(policy):
                raise TypeError(
                    f"`Chain` argument {i}, {_short_repr(policy)}, comes after "
                    f"{_short_repr(offloading)}: it would compute on arrays in host memory, "
                    f"which XLA cannot do. Offload last: `Chain({_short_repr(policy)}, "
                    f"{_short_repr(offloading)})` packs on the device and offloads what "
                    "it packed."
                )
        object.__setattr__(self, "policies", tuple(policies))

    def __repr__(self) -> str:
        return f"Chain({', '.join(map(_short_repr, self.policies))})"

    @property
    def lossless(self) -> bool:  # type: ignore[override]
        return all(p.lossless for p in self.policies)

    def resolve(self, info: ResidualInfo) -> Policy | None:
        first = self.policies[0].resolve(info)
        if first is not None:
            # A `select` stage may choose `Remat`: then nothing is stored to pass on.
            # Where it recomputes only if that stores less, what it stores instead
            # goes through the whole chain.
            if first.instead is not None:
                return dataclasses.replace(first, instead=self)
            if first.beside_floats:
                # A mask as bits: exact, and so is what the rest does with it.
                return Chain(first, *self.policies[1:])
            return first if first.recompute else self
        rest = self.policies[1:]
        return rest[0].resolve(info) if len(rest) == 1 else Chain(*rest).resolve(info)

    def pack(self, x, info: ResidualInfo) -> Any:
        rest = self.policies[1:]
        packed = self._first_stage(info).pack(x, info)
        for level, policy in enumerate(rest):
            packed = jax.tree.map(lambda a, p=policy, k=level: _apply(p, k, a, info), packed)
        return packed

    def unpack(self, packed, info: ResidualInfo):
        rest = self.policies[1:]
        for level in reversed(range(len(rest))):
            packed = jax.tree.map(
                _undo, packed, is_leaf=lambda n, k=level: isinstance(n, _Stage) and n.level == k
            )
        return self._first_stage(info).unpack(packed, info)

    def _first_stage(self, info: ResidualInfo) -> Policy:
        """What the first policy stores `info`'s residual with, when it is stored."""
        first = self.policies[0].resolve(info)
        return first if first.instead is None else first.instead


@dataclasses.dataclass(frozen=True)
class _Stage:
    """One array packed by a later policy of the chain, with what it needs to undo it."""

    packed: Any
    info: ResidualInfo
    policy: Policy | None
    level: int


jax.tree_util.register_dataclass(
    _Stage, data_fields=["packed"], meta_fields=["info", "policy", "level"]
)


def _apply(policy: Policy, level: int, array, info: ResidualInfo):
    if not hasattr(array, "shape"):
        return array
    array_info = dataclasses.replace(info, shape=tuple(array.shape), dtype=array.dtype)
    chosen = policy.resolve(array_info)
    if chosen is not None and chosen.recompute and chosen.instead is not None:
        # A packed array cannot be recomputed: where the stage recomputes only if that
        # stores less (`Cast` and `Quantize` on a TPU, for an elementwise residual's
        # arrays), it packs the array as it would otherwise.
        chosen = chosen.instead
    if chosen is not None and chosen.recompute:
        raise TypeError(
            f"stage {level + 2} of a `Chain` chose {chosen!r} for a packed array of "
            f"{info.describe()}; a packed array cannot be recomputed. Choose `Remat` in "
            "the first stage instead."
        )
    packed = array if chosen is None else chosen.pack(array, array_info)
    return _Stage(packed, array_info, chosen, level)


def _undo(stage):
    if not isinstance(stage, _Stage):
        return stage
    return stage.packed if stage.policy is None else stage.policy.unpack(stage.packed, stage.info)


def _may_offload(policy: Policy) -> bool:
    """Whether `policy` may leave a residual's arrays in host memory."""
    if isinstance(policy, Offload):
        return True
    return any(_may_offload(p) for p in _choices(policy))


def _only_moves(policy: Policy) -> bool:
    """Whether `policy` never computes on the arrays it is given: it moves or records them.

    Unknown policies are assumed to compute (`pack` is arbitrary code).
    """
    if isinstance(policy, Offload | Profile | Identity):
        return True
    choices = _choices(policy)
    return bool(choices) and all(_only_moves(p) for p in choices)


def _choices(policy: Policy) -> tuple[Policy, ...]:
    """The policies a composite policy (`Chain`, `select`) hands residuals to."""
    if isinstance(policy, Chain):
        return policy.policies
    if isinstance(policy, Select):
        default = () if policy.default is None else (policy.default,)
        return (*(p for _, p in policy.rules), *default)
    return ()


def _short_repr(policy: Policy) -> str:
    text = repr(policy)
    return text if len(text) < 40 else text.split(",")[0] + ", ...)"
