"""`Profile`: record what is saved, change nothing."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .._info import ResidualInfo
from .._policy import Policy


class ProfileLog:
    """What a `Profile` policy saw: one `ResidualInfo` per residual, in trace order."""

    def __init__(self):
        self.infos: list[ResidualInfo] = []

    @property
    def total_bytes(self) -> int:
        """Bytes of all residuals seen, per iteration for those inside scan bodies."""
        return sum(info.nbytes for info in self.infos)

    def clear(self) -> None:
        self.infos.clear()

    def __len__(self) -> int:
        return len(self.infos)

    def __repr__(self) -> str:
        return f"ProfileLog({len(self.infos)} residuals, {self.total_bytes} bytes)"


@dataclasses.dataclass(frozen=True)
class Profile(Policy):
    """Records every residual's `ResidualInfo` when the forward is traced; values unchanged.

    Gradients and the compiled program are those of plain `jax.grad`. Read
    `policy.log.infos` after tracing (under `jit`, records appear once per trace, not
    per step). For a full table with packed sizes and compiled memory, see
    `residual.inspect`.

    Args:
        log: where to record; a new `ProfileLog` by default. The policy compares and
            hashes by the identity of its log.

    Raises:
        TypeError: `log` is not a `ProfileLog`.

    Examples:
        >>> import jax, jax.numpy as jnp, residual
        >>> from residual import policies as rp
        >>> p = rp.Profile()
        >>> _ = jax.grad(residual.with_hooks(lambda x: jnp.sum(jnp.exp(x)), policy=p))(jnp.ones(3))
        >>> [(i.primitive, i.shape) for i in p.log.infos]
        [('exp', (3,))]
    """

    log: ProfileLog = dataclasses.field(default_factory=ProfileLog, repr=False)
    lossless = True

    def __post_init__(self):
        if not isinstance(self.log, ProfileLog):
            raise TypeError(
                f"`log` must be a `residual.policies.ProfileLog`, but got "
                f"{type(self.log).__name__}: {self.log!r:.80}. Leave it out for a new one, "
                "or pass the log of another `Profile` to share it."
            )

    def pack(self, x: jnp.ndarray, info: ResidualInfo) -> jnp.ndarray:
        self.log.infos.append(info)
        return x

    def unpack(self, packed: jnp.ndarray, info: ResidualInfo) -> jnp.ndarray:
        return packed
