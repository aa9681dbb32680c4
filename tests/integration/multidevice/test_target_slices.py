"""Arguments sharded over this machine's 8 simulated CPU devices, compiled for a TPU slice
and 8 GPUs: the mesh is laid over the target's devices, memory is per device."""

from __future__ import annotations

import importlib.util

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import residual
from residual import _target
from residual import policies as rp

from .test_sharding import _setup, mlp


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


SLICES = [
    pytest.param("v5e:2x4", marks=pytest.mark.skipif(
        not _installed("libtpu"), reason="libtpu is not installed (pip install 'residual[tpu]')")),
    pytest.param("h100:8", marks=pytest.mark.skipif(
        not _installed("jax_plugins.xla_cuda12"),
        reason="JAX's CUDA plugin is not installed (pip install 'residual[cuda]')")),
]


@pytest.mark.parametrize("layout", ["data", "tensor"])
@pytest.mark.parametrize("target", SLICES)
def test_a_cpu_mesh_is_laid_over_the_targets_devices(target, layout):
    _, params, x = _setup(layout, 1024)
    devices = _target.resolve(target).devices
    on_target = Mesh(np.array(devices[:8]).reshape(2, 4), ("data", "model"))

    def there(a):
        return jax.ShapeDtypeStruct(a.shape, a.dtype,
                                    sharding=NamedSharding(on_target, a.sharding.spec))

    mapped = residual.compiled_memory(jax.grad(mlp), params, x, target=target)
    built = residual.compiled_memory(jax.grad(mlp), [there(w) for w in params], there(x),
                                     target=target)
    assert mapped == built
    # Per device: a quarter of each weight (tensor parallel) or all of it (data
    # parallel), an eighth or a half of the batch.
    weights = sum(w.nbytes for w in params) // (4 if layout == "tensor" else 1)
    batch = x.nbytes // (8 if layout == "data" else 2)
    assert mapped.arguments == weights + batch


@pytest.mark.parametrize("target", SLICES)
def test_plan_of_sharded_arguments_on_a_slice(target):
    _, params, x = _setup("tensor", 1024)
    p = residual.plan(mlp, params, x, budget=None, target=target, actions=["keep", "remat"])
    hooked = jax.grad(residual.with_hooks(mlp, policy=p))
    assert p.memory <= p.plain_memory
    assert residual.compiled_memory(hooked, params, x, target=target).peak == p.memory
    assert p.plain_memory == residual.compiled_memory(jax.grad(mlp), params, x,
                                                      target=target).peak


def test_a_mesh_larger_than_the_target_is_refused():
    if not _installed("libtpu"):
        pytest.skip("libtpu is not installed (pip install 'residual[tpu]')")
    _, params, x = _setup("tensor")
    with pytest.raises(ValueError, match=r"mesh of 8 devices.*'v5e:2x2' has 4.*'v5e:2x4'"):
        residual.inspect(mlp, params, x, target="v5e:2x2")


def _devices_seen(*args, target=None) -> set[int]:
    """`ResidualInfo.devices` of every residual of `mlp` on `args`."""
    spans = []

    def seen(info):
        spans.append(info.devices)
        return True

    residual.inspect(mlp, *args, policy=rp.select([(seen, rp.Identity())]), target=target,
                     compiled=False)
    assert spans
    return set(spans)


def test_residual_info_counts_the_devices_of_the_run():
    _, params, x = _setup("data")
    assert _devices_seen(params, x) == {8}
    # Unsharded, the program may still be a process of a run over all 8.
    assert _devices_seen(*jax.device_get((params, x))) == {8}


@pytest.mark.parametrize("target", SLICES)
def test_residual_info_counts_the_devices_of_a_targets_mesh(target):
    # Compiled for a target, this host's 8 devices are not the program's: its mesh is.
    _, params, x = _setup("data")
    half = Mesh(np.array(jax.devices()[:4]), ("data",))

    def on(mesh, spec):
        return lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                              sharding=NamedSharding(mesh, spec))

    split = [on(half, P())(w) for w in params], on(half, P("data"))(x)
    assert _devices_seen(*split, target=target) == {4}
    one = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in params], jax.ShapeDtypeStruct(
        x.shape, x.dtype)
    assert _devices_seen(*one, target=target) == {1}
