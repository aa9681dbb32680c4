"""The device a program being traced runs on: a compile-only target's first device while
`Target.lower` traces for it, else this process's first device. Policies that
decide by device ask here: `Offload` naming a device inside `jit` (a one-device
sharding), so that a program compiled for an H100 or a TPU from a CPU host names no
device of the host; `Quantize` choosing what to recompute on a TPU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import jax

# Part of JAX's trace context: a function jitted once and traced again for a target
# misses JAX's tracing cache rather than reuse decisions made for another device.
_TARGET_DEVICES = jax.make_user_context(None)


def platform_family(platform: str) -> str:
    """A device's platform as the reports name it: `"cpu"`, `"gpu"` (CUDA and ROCm
    alike) or `"tpu"`."""
    return "gpu" if platform in ("cuda", "rocm") else platform


def program_device() -> jax.Device:
    devices = _TARGET_DEVICES.value
    return devices[0] if devices else jax.local_devices()[0]


def program_platform() -> str:
    """`"tpu"`, `"gpu"` or `"cpu"`: what the program being traced is for."""
    return platform_family(program_device().platform)


def program_devices() -> tuple[jax.Device, ...]:
    """Every device the program being traced may run on: the target's, else every
    device of every process."""
    return _TARGET_DEVICES.value or tuple(jax.devices())


def tracing_for_a_target() -> bool:
    """Whether the program being traced is for a compile-only target's devices, not
    this process's (as `target="cpu"`'s are)."""
    devices = _TARGET_DEVICES.value
    return bool(devices) and devices[0] not in jax.devices()


@contextlib.contextmanager
def tracing_for(devices: Sequence[jax.Device]) -> Iterator[None]:
    with _TARGET_DEVICES(tuple(devices)):
        yield
