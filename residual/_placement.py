"""The device a program being traced runs on: a compile-only target's first device while
`Target.lower` traces for it, else this process's first device. Policies that
name a device inside `jit` (a one-device sharding) ask here, so that a program compiled
for an H100 or a TPU from a CPU host names no device of the host."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax

_TARGET_DEVICES: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "residual_target_devices", default=None)


def platform_family(platform: str) -> str:
    """A device's platform as the reports name it: `"cpu"`, `"gpu"` (CUDA and ROCm
    alike) or `"tpu"`."""
    return "gpu" if platform in ("cuda", "rocm") else platform


def program_device() -> jax.Device:
    devices = _TARGET_DEVICES.get()
    return devices[0] if devices else jax.local_devices()[0]


@contextlib.contextmanager
def tracing_for(devices: Sequence[jax.Device]) -> Iterator[None]:
    token = _TARGET_DEVICES.set(tuple(devices))
    try:
        yield
    finally:
        _TARGET_DEVICES.reset(token)
