"""Targets: where a program is compiled and measured, the running backend or hardware not here.

`target=None` compiles for the running backend, as `jax.jit` does. A name compiles for
that hardware without it (JAX's compile-only devices, `jax.experimental.topologies`):

- TPUs (needs libtpu: `pip install 'residual[tpu]'`): `"v4"`, `"v5e"`, `"v5p"`, `"v6e"` for
  one chip, or with libtpu's slice shape, `"v5e:2x2"`, `"v6e:4x4"`, `"v5p:2x2x1"`,
  `"v4:2x2x1"` (chips along each axis);
- NVIDIA GPUs (needs JAX's CUDA plugin and ptxas: `pip install 'residual[cuda]'`; on a
  machine without a GPU, start Python with `JAX_PLATFORMS=cpu`): `"a100"`, `"h100"`,
  `"h100-pcie"`, `"h200"`, `"b200"`, or `"h100:8"` for 8 GPUs of one host;
- `"cpu"`: the host's CPU backend, whatever the default backend is.

Arguments are given as arrays or `jax.ShapeDtypeStruct`s; their shardings are mapped onto
the target's devices: a `NamedSharding` over a mesh of N devices becomes the same mesh
shape and axis names over the target's first N devices, anything on one device goes to its
first device. Memory is per device. Nothing runs on a target, so its step time is
predicted: the compiled program's FLOPs and bytes accessed at the chip's peak FLOP/s and
memory bandwidth (a roofline), not measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, make_single_device_sharding

from . import _jax_private as jp
from ._errors import TargetUnavailableError
from ._memory import Memory
from ._placement import platform_family, tracing_for


@dataclasses.dataclass(frozen=True)
class Chip:
    """One device of a target, as the roofline sees it: peak dense bfloat16 FLOP/s and
    memory bandwidth (bytes/s), per device as JAX counts devices, with their source."""

    kind: str
    flops: float
    bandwidth: float
    source: str


# Vendor figures per chip. libtpu's compile-only v4 has one device per TensorCore (two per
# chip, each with half the chip's HBM), so a v4 device has half a chip's figures; v5p's
# two TensorCores are one device (megacore), as on the real chips.
CHIPS = {
    "v4": Chip("TPU v4 (one TensorCore)", 275e12 / 2, 1200e9 / 2,
               "cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, 1.2 TB/s HBM per chip"),
    "v5e": Chip("TPU v5e", 197e12, 819e9,
                "cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 819 GB/s HBM per chip"),
    "v5p": Chip("TPU v5p", 459e12, 2765e9,
                "cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 2,765 GB/s HBM per chip"),
    "v6e": Chip("TPU v6e", 918e12, 1640e9,
                "cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 1,640 GB/s HBM per chip"),
    "a100": Chip("NVIDIA A100 SXM4 80GB", 312e12, 2039e9,
                 "NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense, 2,039 GB/s HBM2e"),
    "h100": Chip("NVIDIA H100 SXM5 80GB", 989e12, 3350e9,
                 "NVIDIA H100 datasheet: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3"),
    "h100-pcie": Chip("NVIDIA H100 PCIe 80GB", 756e12, 2000e9,
                      "NVIDIA H100 datasheet: 756 TFLOP/s bf16 dense, 2.0 TB/s HBM2e"),
    "h200": Chip("NVIDIA H200 SXM 141GB", 989e12, 4800e9,
                 "NVIDIA H200 datasheet: 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e"),
    "b200": Chip("NVIDIA B200", 2250e12, 8000e9,
                 "NVIDIA HGX B200 datasheet: 2.25 PFLOP/s bf16 dense, 8 TB/s HBM3e per GPU"),
}
TPUS = ("v4", "v5e", "v5p", "v6e")
GPUS = ("a100", "h100", "h100-pcie", "h200", "b200")
# One chip, in libtpu's topology names.
_ONE_CHIP = {"v4": "1x1x1", "v5e": "1x1", "v5p": "1x1x1", "v6e": "1x1"}
_SPECS = Path(__file__).parent / "_gpu_specs"
_EXAMPLES = "'v5e', 'v5e:2x2', 'v6e:4x4', 'v5p:2x2x1', 'v4', 'h100', 'h100:8', 'a100', 'cpu'"


@dataclasses.dataclass(frozen=True, eq=False)
class Target:
    """Where programs are compiled: the running backend (`name=None`), or named hardware.

    Attributes:
        name: the target as asked (`"v5e:2x2"`), `None` for the running backend.
        platform: `"tpu"`, `"gpu"` or `"cpu"`.
        devices: the target's devices, in the order meshes are laid on them.
        chip: its peak figures, for predicted step times (`None` for the running backend
            and `"cpu"`, where steps run and are timed).
    """

    name: str | None
    platform: str
    devices: tuple
    chip: Chip | None = None

    @property
    def runs(self) -> bool:
        """Whether programs compiled for it can run here (else times are predicted)."""
        return self.chip is None

    @property
    def label(self) -> str:
        """How reports name it: the target as asked, or the running backend's platform."""
        return self.name or self.platform

    def compile(self, fn: Callable, args: Sequence[Any]) -> jax.stages.Compiled:
        """`jax.jit(fn)` lowered at `args` and compiled for this target (nothing runs).

        Raises:
            ValueError: the arguments' shardings need more devices than the target has, or
                the function names devices of the running backend.
            DoesNotFitError: the program needs more memory than one device has (a TPU
                compiler refuses such a program).
        """
        lowered = self.lower(fn, args)
        with self._compile_errors():
            return lowered.compile()

    def compile_with_dumps(self, fn: Callable, args: Sequence[Any]):
        """`compile`, and XLA's texts of the compiled program (`_jax_private.DUMPS`)."""
        from . import _jax_private as jp

        lowered = self.lower(fn, args)
        with self._compile_errors():
            return jp.compile_with_dumps(lowered)

    def lower(self, fn: Callable, args: Sequence[Any]) -> jax.stages.Lowered:
        """`jax.jit(fn)` lowered at `args`, placed on this target's devices."""
        if self.name is None:
            return jax.jit(fn).lower(*args)
        placed = self.place(args)
        with self._compile_errors(), self.tracing():
            return jax.jit(fn).lower(*placed)

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """Traces within it are for this target: policies that decide by device (where
        `Offload` puts a value, what `Quantize` recomputes) decide for its devices."""
        if self.name is None:
            yield
            return
        with tracing_for(self.devices):
            yield

    @contextlib.contextmanager
    def _compile_errors(self):
        """Compiler errors as what they mean for this target."""
        try:
            yield
        except jax.errors.JaxRuntimeError as e:
            too_big = None if self.name is None else DoesNotFitError.parse(e, self)
            if too_big is None:
                raise
            raise too_big from None
        except ValueError as e:
            if self.name is None or "incompatible devices" not in str(e):
                raise
            raise ValueError(
                f"Compiling for target {self.name!r} failed: the function builds shardings on "
                f"the running backend's devices ({e}). Compile for a target functions whose "
                "shardings come from their arguments, or measure on the running backend "
                "(`target=None`)."
            ) from None

    def memory(self, fn: Callable, args: Sequence[Any]) -> Memory:
        """The `Memory` of `jax.jit(fn)` at `args`, compiled for this target."""
        return Memory.of(self.compile(fn, args))

    def place(self, args: Any) -> Any:
        """`args` as `jax.ShapeDtypeStruct`s whose shardings are on this target's devices:
        a `NamedSharding` on the same mesh shape and axis names over the target's first
        devices; an argument on one device (or none) on the target's first device, or
        replicated over the mesh of the others when some are sharded (as `jax.jit`
        places an uncommitted array next to sharded ones)."""
        leaves, tree = jax.tree.flatten(args)
        meshes = [self._mesh(s.mesh) for s in (getattr(x, "sharding", None) for x in leaves)
                  if isinstance(s, NamedSharding)]
        return jax.tree.unflatten(tree, [self._placed(x, meshes[0] if meshes else None)
                                         for x in leaves])

    def _placed(self, x: Any, mesh: Mesh | None) -> jax.ShapeDtypeStruct:
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            x = jax.numpy.asarray(x)
        sharding = getattr(x, "sharding", None)
        kind = _kept_kind(sharding)
        if isinstance(sharding, NamedSharding):
            placed = NamedSharding(self._mesh(sharding.mesh), sharding.spec, memory_kind=kind)
        elif sharding is None or len(sharding.device_set) == 1:
            placed = (make_single_device_sharding(self.devices[0], memory_kind=kind) if mesh is None
                      else NamedSharding(mesh, PartitionSpec(), memory_kind=kind))
        else:
            raise TypeError(
                f"Compiling for target {self.name!r} maps `NamedSharding`s and single-device "
                f"arrays onto its devices, but an argument has a {type(sharding).__name__}. "
                "Shard it with `jax.sharding.NamedSharding(mesh, PartitionSpec(...))`."
            )
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed,
                                    weak_type=bool(getattr(x, "weak_type", False)))

    def _mesh(self, mesh: Any) -> Mesh:
        """`mesh`'s shape and axis names over this target's first devices."""
        shape = tuple(mesh.shape.values())
        size = math.prod(shape)
        if size > len(self.devices):
            raise ValueError(
                f"The arguments are sharded over a mesh of {size} devices "
                f"({dict(mesh.shape)}), but target {self.name!r} has {len(self.devices)}. "
                f"Pick a target with at least {size} devices: a TPU slice such as "
                f"'{self._bigger_example(size)}', or 'h100:{size}' for GPUs."
            )
        devices = np.array(self.devices[:size], dtype=object).reshape(shape)
        types = getattr(mesh, "axis_types", None)
        return (Mesh(devices, mesh.axis_names) if types is None
                else Mesh(devices, mesh.axis_names, axis_types=types))

    def _bigger_example(self, size: int) -> str:
        family = (self.name or "v5e").split(":")[0]
        if family not in ("v5e", "v6e"):
            family = "v5e"
        side = 2 ** math.ceil(math.log2(max(size, 1)) / 2)
        return f"{family}:{2 ** math.ceil(math.log2(max(size, 1))) // side}x{side}"

    def predicted_seconds(self, compiled: jax.stages.Compiled) -> float:
        """A step of `compiled` on this target, predicted by a roofline: its FLOPs at the
        chip's peak or its bytes accessed at the memory bandwidth, whichever takes longer
        (per device; the compiler's own cost analysis of the optimized program)."""
        if self.chip is None:
            raise ValueError(
                f"Programs compiled for {self.label!r} run here: time them rather than "
                "predict them."
            )
        cost = cost_analysis(compiled)
        return max(cost["flops"] / self.chip.flops,
                   cost["bytes accessed"] / self.chip.bandwidth)


class DoesNotFitError(RuntimeError):
    """The program needs more memory than one device of the target has: its compiler
    refuses it (TPU). `required` is the compiler's figure in bytes (`None` if it gave none)."""

    def __init__(self, message: str, required: int | None):
        super().__init__(message)
        self.required = required

    @classmethod
    def parse(cls, error: Exception, target: Target) -> DoesNotFitError | None:
        """The error as a `DoesNotFitError` when it is the compiler's out-of-memory one."""
        text = str(error)
        if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
            return None
        needed = re.search(r"required for [^(]*\(([0-9.]+)([KMGT])\)", text)
        required = None if needed is None else _bytes(*needed.groups())
        first = text.strip().splitlines()[0]
        return cls(
            f"The program does not fit on one device of target {target.name!r}: {first} "
            "Shard it over more devices (a larger slice), or plan it under a budget "
            "(`residual.plan(..., target=...)`).",
            required,
        )


DoesNotFitError.__module__ = "residual"


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit])


def _kept_kind(sharding: Any) -> str | None:
    """A sharding's memory kind to keep on the target: an explicit one (host memory), not
    the running device's default (which names another platform's memory)."""
    kind = getattr(sharding, "memory_kind", None)
    if kind is None or sharding is None:
        return None
    try:
        default = next(iter(sharding.device_set)).default_memory().kind
    except (AttributeError, StopIteration, jax.errors.JaxRuntimeError):
        return None
    return None if kind == default else kind


def resolve(target: str | Target | None) -> Target:
    """The `Target` for `target=` as users give it (see the module docstring).

    Raises:
        TypeError: `target` is not a string or `None`.
        ValueError: an unknown name or slice shape.
        TargetUnavailableError: what compiling for it needs is not installed.
    """
    if isinstance(target, Target):
        return target
    if target is None:
        return _running()
    if not isinstance(target, str):
        raise TypeError(
            f"`target` must be None (the running backend) or a name such as {_EXAMPLES}, "
            f"but got {type(target).__name__}: {target!r}."
        )
    return _named(target.strip().lower())


@functools.cache
def _running() -> Target:
    devices = tuple(jax.devices())
    platform = devices[0].platform
    return Target(None, platform_family(platform), devices)


@functools.cache
def _named(name: str) -> Target:
    family, _, shape = name.partition(":")
    if family == "cpu":
        if shape:
            raise ValueError(f"`target='cpu'` takes no shape, but got {name!r}.")
        return Target("cpu", "cpu", tuple(jax.devices("cpu")))
    if family in TPUS:
        return Target(name, "tpu", _tpu_devices(family, shape or _ONE_CHIP[family], name),
                      CHIPS[family])
    if family in GPUS:
        return Target(name, "gpu", _gpu_devices(family, shape, name), CHIPS[family])
    raise ValueError(
        f"Unknown `target` {name!r}: expected None (the running backend), 'cpu', a TPU "
        f"({', '.join(TPUS)}, with a slice shape such as 'v5e:2x2') or an NVIDIA GPU "
        f"({', '.join(GPUS)}, with a count such as 'h100:8')."
    )


def _tpu_devices(family: str, shape: str, name: str) -> tuple:
    if not re.fullmatch(r"[0-9]+(x[0-9]+)+", shape):
        raise ValueError(
            f"`target` {name!r}: a TPU slice shape gives chips along each axis, '2x2' for "
            f"v5e and v6e, '2x2x1' for v4 and v5p, but got {shape!r}."
        )
    if not _installed("libtpu"):
        raise TargetUnavailableError(
            f"Compiling for target {name!r} needs libtpu, which is not installed. Install "
            "it for the JAX you have with `pip install 'residual[tpu]'` (JAX's own "
            "`jax[tpu]` extra, which pins the matching libtpu)."
        )
    from jax.experimental import topologies

    # A host holds 2x2x1 chips; libtpu takes smaller slices when told their host is
    # smaller (older libtpu releases refuse them otherwise).
    chips = [*map(int, shape.split("x")), 1, 1][:3]
    try:
        topology = topologies.get_topology_desc(
            platform="tpu", topology_name=f"{family}:{shape}",
            chips_per_host_bounds=[min(n, host) for n, host in zip(chips, (2, 2, 1))])
    except (jax.errors.JaxRuntimeError, RuntimeError) as e:
        text = str(e)
        if "lockfile" in text:
            raise TargetUnavailableError(
                f"Compiling for target {name!r}: libtpu refuses to load while another "
                "process holds it (its lock file, /tmp/libtpu_lockfile; any JAX process "
                "with libtpu installed takes it). Nothing runs on a compile-only TPU, so "
                "set `ALLOW_MULTIPLE_LIBTPU_LOAD=1` in the environment before JAX starts "
                "(or end the other process)."
            ) from None
        raise ValueError(
            f"libtpu cannot make a {family} slice of shape {shape!r} (target {name!r}): "
            f"{text.strip().splitlines()[0]}. Shapes follow Cloud TPU's slice shapes: "
            "'1x1', '2x2', '2x4', '4x4', ... for v5e and v6e; '2x2x1', '2x2x2', ... for "
            "v4 and v5p."
        ) from None
    return tuple(topology.devices)


def _gpu_devices(family: str, count: str, name: str) -> tuple:
    if count and not re.fullmatch(r"[1-9][0-9]*", count):
        raise ValueError(
            f"`target` {name!r}: after ':' comes the number of GPUs of one host, as in "
            f"'{family}:8', but got {count!r}."
        )
    if not _installed("jax_plugins.xla_cuda12"):
        raise TargetUnavailableError(
            f"Compiling for target {name!r} needs JAX's CUDA plugin and ptxas, which are "
            "not installed. Install them for the JAX you have with "
            "`pip install 'residual[cuda]'`."
        )
    from jax.experimental import topologies

    config = (_SPECS / f"{family}.txtpb").read_text()
    try:
        topology = topologies.get_topology_desc(
            "", platform="cuda", target_config=config, topology=f"1x1x{count or 1}")
    except NotImplementedError:
        raise TargetUnavailableError(
            f"Compiling for target {name!r}: JAX's CUDA plugin is installed but did not "
            "register, as it does not when it finds no CUDA runtime (cuDNN) on a machine "
            "without a GPU. Start Python with `JAX_PLATFORMS=cpu` (or "
            "`JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`) set before JAX starts, and it registers "
            "for compiling only."
        ) from None
    return tuple(topology.devices)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def cost_analysis(compiled: jax.stages.Compiled) -> dict[str, float]:
    """FLOPs and bytes accessed of a compiled program, per device: its compiler's analysis
    of the optimized program; where the compiler gives none (compile-only GPUs), XLA's
    generic cost analysis of the same optimized program."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):  # older JAX: one dictionary per program
        analysis = analysis[0] if analysis else None
    if not analysis:
        analysis = jp.optimized_cost_analysis(compiled)
    return {k: float(analysis.get(k, 0.0)) for k in ("flops", "bytes accessed")}
