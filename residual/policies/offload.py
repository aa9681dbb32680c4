"""`Offload`: keep residuals in host memory between the forward and the backward."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import make_single_device_sharding

from .. import _jax_private as jp
from .._engine.ordering import devices_spanned, several_devices
from .._info import ResidualInfo
from .._placement import platform_family, program_device
from .._policy import Policy
from .._scope import saved_tensors_hooks
from . import _fusion

_HOST_KINDS = ("pinned_host", "unpinned_host")


@dataclasses.dataclass(frozen=True)
class Offload(Policy):
    """Moves residuals to host memory in the forward and back to the device in the backward.

    Uses JAX memory kinds inside `jit` (as JAX's own
    `save_and_offload_only_these_names` does): XLA schedules the copies, overlapping
    them with compute where it can. Values are unchanged. On the CPU backend host and
    device memory are the same, so this changes nothing there: memory savings from
    offloading are only measured on a GPU. Residuals kept alive anyway (weights), and
    those a `jax.checkpoint` offloading policy already put in host memory, stay where
    they are.

    In a program for a TPU (`elementwise="auto"`, the default), the residuals of
    elementwise chains (`tanh`, GELU's terms, a loss's `2 * x`) are recomputed in the
    backward from the values they are computed from, as the TPU compiler's fusion
    does, wherever that stores fewer bytes: offloaded one by one, each is a device
    array the compiler itself would not keep, written out in the forward and read
    back in the backward (a 4-layer GELU MLP on v5e:2x2, batch 4,096 x width 1,024,
    f32, data parallel: 1.49x plain's peak offloaded one by one, 0.92x recomputed).
    `elementwise="pack"` offloads every residual, `"recompute"` recomputes them on
    every backend.

    Args:
        memory_kind: `"pinned_host"` (default; fast DMA) or `"unpinned_host"` (pageable
            memory). Under `jit` `"unpinned_host"` stores in pinned host memory on a GPU,
            whose compiler offloads to pinned memory only (a value placed in unpinned
            memory stays on the device), and with several devices, where JAX moves a
            sharded value only to pinned host memory while keeping its sharding.
        elementwise: `"auto"` (recompute on a TPU, else offload), `"pack"` or
            `"recompute"`.

    Raises:
        TypeError: `memory_kind` or `elementwise` is not a string.
        ValueError: `memory_kind` is not a host kind the default device has, or
            `elementwise` not one of `"auto"`, `"pack"`, `"recompute"`.

    Examples:
        >>> import jax, jax.numpy as jnp, residual
        >>> from residual import policies as rp
        >>> f = residual.with_hooks(lambda x: jnp.sum(jnp.sin(x)), policy=rp.Offload())
        >>> jax.grad(f)(jnp.zeros(2))
        Array([1., 1.], dtype=float32)
    """

    memory_kind: str = "pinned_host"
    elementwise: str = "auto"
    lossless = True

    def __post_init__(self):
        if not isinstance(self.memory_kind, str):
            raise TypeError(
                f"`memory_kind` must be a string, \"pinned_host\" or \"unpinned_host\", but "
                f"got {type(self.memory_kind).__name__}: {self.memory_kind!r}."
            )
        device = jax.local_devices()[0]
        available = _memory_kinds()
        if self.memory_kind not in _HOST_KINDS or self.memory_kind not in available:
            hosts = [k for k in available if k in _HOST_KINDS]
            raise ValueError(
                f"`memory_kind` must be a host memory of the device; "
                f"{device.device_kind} has {available}, so one of {hosts}, "
                f"but got {self.memory_kind!r}."
            )
        _fusion.check_elementwise(self.elementwise, auto="recomputes them on a TPU and "
                                  "offloads them elsewhere")

    def resolve(self, info: ResidualInfo) -> Policy | None:
        if info.kept_alive or info.in_host_memory:
            return None
        return _fusion.resolved(self, info, _fusion.recomputes(self.elementwise,
                                                               auto=_fusion.for_a_tpu()))

    def pack(self, x: jnp.ndarray, info: ResidualInfo) -> jnp.ndarray:
        if _stacked_by_rows_in_host_memory(x, info):
            x = x.astype(_WIDER[jnp.dtype(x.dtype).kind])
        return jax.device_put(x, self._host(x))

    def unpack(self, packed: jnp.ndarray, info: ResidualInfo) -> jnp.ndarray:
        # `Space.Device` keeps the sharding, traced or not. (jax 0.12.1's CPU client
        # refuses an eager copy to `sharding.with_memory_kind("device")` of an array
        # in pinned host memory: "Unsupported layout ... S(5)".)
        value = jax.device_put(packed, jax.memory.Space.Device)
        return value if value.dtype == info.dtype else value.astype(info.dtype)

    def _host(self, x):
        """Where `x` goes: the same devices and layout, in host memory."""
        if self.memory_kind == "pinned_host":
            return jax.memory.Space.Host
        if _concrete(x):  # outside `jit`: the array knows its own sharding
            return x.sharding.with_memory_kind(self.memory_kind)
        device = program_device()
        if platform_family(device.platform) == "gpu":
            # The GPU compiler offloads to pinned host memory only: a value placed in
            # unpinned host memory inside `jit` stays on the device.
            return jax.memory.Space.Host
        if not several_devices([x]):
            return make_single_device_sharding(device, memory_kind=self.memory_kind)
        # Traced with several devices, JAX has no transfer to unpinned memory that
        # keeps each shard where it is (`jax.memory.Space` names pinned host memory
        # only), and a one-device sharding would pull every shard onto one device.
        # Pinned host memory is the host memory that keeps the sharding.
        return jax.memory.Space.Host


# The 32-bit type an 8- or 16-bit value travels as, by dtype kind; each holds it exactly.
_WIDER = {"f": jnp.float32, "V": jnp.float32, "i": jnp.int32, "u": jnp.uint32, "b": jnp.uint32}


def _stacked_by_rows_in_host_memory(x, info: ResidualInfo) -> bool:
    """Whether a TPU scan would stack `x` in host memory with the loop's axis among the
    two minor axes the TPU tiles, packing several 8- or 16-bit values per row there:
    an 8- or 16-bit array offloaded from a scan body, with fewer than two axes longer
    than the number of devices (a longer axis stays longer than one on each device,
    whatever the sharding)."""
    if not info.in_scan or not hasattr(x, "dtype") or jp.is_extended_dtype(x.dtype):
        return False
    dtype = jnp.dtype(x.dtype)
    if dtype.itemsize >= 4 or dtype.kind not in _WIDER or not _fusion.for_a_tpu():
        return False
    devices = devices_spanned([x])
    return sum(d > devices for d in x.shape) < 2


def _concrete(x) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def save_on_cpu(pin_memory: bool = False) -> saved_tensors_hooks:
    """Context manager: residuals traced inside it are kept in host memory.

    The counterpart of `torch.autograd.graph.save_on_cpu`: a `saved_tensors_hooks`
    scope with the `Offload` policy, `"pinned_host"` memory when `pin_memory` is
    true, `"unpinned_host"` otherwise (pinned too in a program traced under `jit`
    for a GPU or for several devices: see `Offload`). A device with no pageable host
    memory (JAX's CUDA backend offers `"device"` and `"pinned_host"` only) stores in
    pinned memory either way: `pin_memory` asks for faster copies, not for another
    place.

    Args:
        pin_memory: use page-locked host memory (faster copies).

    Returns:
        A `saved_tensors_hooks` context manager.

    Examples:
        >>> import jax, jax.numpy as jnp, residual
        >>> f = residual.with_hooks(lambda x: jnp.sum(jnp.sin(x)))
        >>> with residual.save_on_cpu(pin_memory=True):
        ...     g = jax.grad(f)(jnp.zeros(2))
    """
    return saved_tensors_hooks(policy=Offload(host_memory_kind(pin_memory, _memory_kinds())))


def _memory_kinds() -> list[str]:
    """The memory kinds of this process's first device (`"device"`, `"pinned_host"`, ...)."""
    return [m.kind for m in jax.local_devices()[0].addressable_memories()]


def host_memory_kind(pin_memory: bool, kinds) -> str:
    """The host memory `save_on_cpu(pin_memory)` stores in, of a device's memory `kinds`."""
    return "unpinned_host" if not pin_memory and "unpinned_host" in kinds else "pinned_host"


