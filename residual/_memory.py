"""`Memory`: the one memory figure of a compiled program, read the same way on every backend."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from ._placement import platform_family


@dataclasses.dataclass(frozen=True)
class Memory:
    """The memory a compiled program needs on one device, as its compiler planned it.

    `peak` is the most device memory the program holds at once: its arguments, its
    outputs and its temporaries (activations, residuals, workspace) live together at
    their worst moment, per device for a program sharded over several. `beyond` is
    the part of the peak beyond the arguments and outputs: what the computation itself
    adds, which is where policies act. An output that reuses a donated argument's
    buffer (`donate_argnums`) is counted once.

    Backends fill XLA's `memory_analysis()` differently, and `Memory.of` reads each as
    its compiler means it:

    - TPU: `peak_memory_in_bytes`, the buffer assignment's peak (its `temp_size_in_bytes`
      leaves out much of what is live at the peak, and is often 0);
    - GPU and CPU: arguments + outputs + `temp_size_in_bytes`, since both runtimes
      allocate a program's temporaries as one block of that size next to its arguments
      and outputs, so that `beyond` is the temp memory. (XLA:CPU's peak field holds the
      arguments and outputs only; the GPU's also counts buffers placed in host memory,
      such as offloaded residuals, which the device never holds.)

    Attributes:
        peak: bytes per device at the program's peak.
        arguments: bytes of the arguments, per device.
        outputs: bytes of the outputs, per device.
        aliased: bytes of outputs that reuse an argument's buffer (donation).
        platform: the platform compiled for (`"cpu"`, `"tpu"`, `"gpu"`).
    """

    peak: int
    arguments: int
    outputs: int
    aliased: int
    platform: str

    @property
    def beyond(self) -> int:
        """Bytes of the peak beyond the arguments and outputs."""
        return self.peak - self.arguments - self.outputs + self.aliased

    @classmethod
    def of(cls, compiled: jax.stages.Compiled) -> Memory:
        """The memory of a compiled program (`jax.jit(f).lower(*args).compile()`).

        Raises:
            TypeError: `compiled` is not a compiled program.
            RuntimeError: the compiler gives no memory analysis for it.
        """
        if not isinstance(compiled, jax.stages.Compiled):
            raise TypeError(
                f"`Memory.of` expects a compiled program, `jax.jit(f).lower(*args).compile()`, "
                f"but got {type(compiled).__name__}."
            )
        stats = compiled.memory_analysis()
        if stats is None:
            raise RuntimeError(
                "The compiler gave no memory analysis for this program "
                "(`compiled.memory_analysis()` is None): its backend does not report memory."
            )
        platform = platform_of(compiled)
        arguments = int(stats.argument_size_in_bytes)
        outputs = int(stats.output_size_in_bytes)
        aliased = int(stats.alias_size_in_bytes)
        if platform == "tpu":
            peak = int(stats.peak_memory_in_bytes)
        else:
            peak = arguments + outputs - aliased + int(stats.temp_size_in_bytes)
        return cls(peak, arguments, outputs, aliased, platform)


def platform_of(compiled: jax.stages.Compiled) -> str:
    """The platform a compiled program runs on: that of its arguments' or outputs' devices
    (`"gpu"` for CUDA and ROCm alike), else the default backend's."""
    shardings: list[Any] = jax.tree.leaves(
        (compiled.input_shardings, compiled.output_shardings),
        is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
    for sharding in shardings:
        if isinstance(sharding, jax.sharding.Sharding) and sharding.device_set:
            platform = next(iter(sharding.device_set)).platform
            return platform_family(platform)
    return platform_family(jax.default_backend())


def compiled_memory(fn: Callable, *args: Any, target: Any = None) -> Memory:
    """The `Memory` of `jax.jit(fn)` at `args`, compiled for `target` (nothing runs).

    Args:
        fn: the function to compile, such as `jax.grad(loss)`.
        *args: its arguments: arrays or `jax.ShapeDtypeStruct`s.
        target: where to compile: `None` for the running backend, or a name such as
            `"v5e"`, `"v5e:2x2"`, `"h100"` or `"cpu"` (see the Targets page of the docs).

    Returns:
        A `Memory`: `peak` and `beyond` (the part beyond arguments and outputs), per device.

    Examples:
        >>> import jax, jax.numpy as jnp, residual
        >>> m = residual.compiled_memory(jax.grad(lambda x: jnp.sum(jnp.tanh(x) ** 2)),
        ...                              jnp.ones((256, 256)))
        >>> m.peak == m.arguments + m.outputs + m.beyond
        True
    """
    from ._target import resolve

    return resolve(target).memory(fn, args)
