"""Memory figures and compile-only targets: which field each backend fills, TPU and GPU
programs compiled on this machine, shardings mapped onto a slice, and the errors.

The TPU tests need libtpu (`residual[tpu]`), the GPU ones JAX's CUDA plugin and ptxas
(`residual[cuda]`); each skips, saying so, where its part is not installed.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import residual
from residual import _jax_private as jp
from residual import _target
from residual import policies as rp
from residual._engine.ordering import passed_after
from residual._measure import backward

from ..helpers import (
    RUNNING_PLATFORM,
    Negate,
    mlp_params,
    normalized_relu_convs,
    offloading_y,
    scan_mlp,
    tree_equal,
    unrolled_mlp,
)
from ..policies_under_test import IDS as POLICY_IDS
from ..policies_under_test import POLICIES


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


needs_tpu = pytest.mark.skipif(
    not _installed("libtpu"), reason="libtpu is not installed (pip install 'residual[tpu]')")
needs_gpu = pytest.mark.skipif(
    not _installed("jax_plugins.xla_cuda12"),
    reason="JAX's CUDA plugin is not installed (pip install 'residual[cuda]')")


def _step(w, x):
    """A program with temporaries, arguments and outputs of known sizes (1 MiB each
    argument, 1 MiB out): a training step of a 3-layer tanh MLP."""
    def loss(w, x):
        for _ in range(3):
            x = jnp.tanh(x @ w)
        return jnp.sum(x**2)

    return w - 0.1 * jax.grad(loss)(w, x)


_ARGS = (jax.ShapeDtypeStruct((512, 512), jnp.float32),
         jax.ShapeDtypeStruct((512, 512), jnp.float32))


def _stats(target, donate=()):
    placed = _target.resolve(target).place(_ARGS)
    compiled = jax.jit(_step, donate_argnums=donate).lower(*placed).compile()
    return compiled.memory_analysis(), residual.Memory.of(compiled)


# Which field each backend fills ------------------------------------------------------------
# A JAX release that fills another field fails here, not silently in every figure.


@pytest.mark.parametrize("donate", [(), (0,)])
def test_cpu_peak_field_holds_arguments_and_outputs_only(donate):
    stats, memory = _stats("cpu", donate)
    args_outs = stats.argument_size_in_bytes + stats.output_size_in_bytes
    assert stats.argument_size_in_bytes == 2 * 2**20 and stats.output_size_in_bytes == 2**20
    assert stats.alias_size_in_bytes == (2**20 if donate else 0)
    assert stats.peak_memory_in_bytes == args_outs - stats.alias_size_in_bytes
    assert stats.temp_size_in_bytes >= 2**20  # the activations: three 1 MiB layers
    assert memory.peak == stats.peak_memory_in_bytes + stats.temp_size_in_bytes
    assert memory.beyond == stats.temp_size_in_bytes
    assert memory.platform == "cpu"


@needs_tpu
@pytest.mark.parametrize("donate", [(), (0,)])
def test_tpu_peak_field_is_the_peak_and_temp_field_is_not(donate):
    stats, memory = _stats("v5e", donate)
    args_outs = (stats.argument_size_in_bytes + stats.output_size_in_bytes
                 - stats.alias_size_in_bytes)
    # The buffer assignment's peak holds the activations; the temp field leaves them out.
    assert stats.peak_memory_in_bytes >= args_outs + 2**20 > args_outs + stats.temp_size_in_bytes
    assert memory.peak == stats.peak_memory_in_bytes and memory.platform == "tpu"
    assert memory.beyond == stats.peak_memory_in_bytes - args_outs


@needs_gpu
@pytest.mark.parametrize("donate", [(), (0,)])
def test_gpu_peak_field_is_arguments_outputs_and_temp(donate):
    stats, memory = _stats("h100", donate)
    assert stats.peak_memory_in_bytes == (
        stats.argument_size_in_bytes + stats.output_size_in_bytes
        - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
    assert stats.temp_size_in_bytes >= 2**20
    assert memory.peak == stats.peak_memory_in_bytes and memory.platform == "gpu"
    assert memory.beyond == stats.temp_size_in_bytes


@needs_gpu
def test_gpu_peak_leaves_out_what_is_offloaded_to_the_host():
    # The GPU's peak field counts buffers placed in host memory too. On an H100 the
    # device's measured peak under `Offload()` is arguments + outputs + temp exactly
    # (scan MLP 8x16384x4096: 2368 MiB, where the peak field says 5376), and that is
    # what `Memory` reads.
    ws, x = (jax.ShapeDtypeStruct((4, 1024, 1024), jnp.float32),
             jax.ShapeDtypeStruct((2048, 1024), jnp.float32))
    fn = jax.grad(residual.with_hooks(scan_mlp, policy=rp.Offload()))
    compiled = _target.resolve("h100").compile(fn, (ws, x))
    stats, memory = compiled.memory_analysis(), residual.Memory.of(compiled)
    assert stats.host_temp_size_in_bytes >= 3 * 2048 * 1024 * 4  # the offloaded layers
    assert memory.peak == (stats.argument_size_in_bytes + stats.output_size_in_bytes
                           - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
    assert memory.peak < stats.peak_memory_in_bytes
    plain = residual.compiled_memory(jax.grad(scan_mlp), ws, x, target="h100")
    assert memory.beyond < 0.6 * plain.beyond


def test_donation_counts_a_reused_buffer_once():
    # XLA:CPU moves the donated buffer's megabyte from arguments-and-outputs to temp: the
    # peak stays, as the buffer is counted once.
    plain, donated = _stats("cpu")[1], _stats("cpu", (0,))[1]
    assert donated.aliased == 2**20
    assert donated.peak == plain.peak
    assert donated.beyond == plain.beyond + 2**20


def test_memory_of_rejects_what_is_not_compiled():
    with pytest.raises(TypeError, match=r"expects a compiled program.*Lowered"):
        residual.Memory.of(jax.jit(jnp.sin).lower(1.0))


# Targets: names and errors -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "error", "message"),
    [
        ("tpu9", ValueError, r"Unknown `target` 'tpu9'.*v5e.*h100"),
        ("v5e:2x", ValueError, r"a TPU slice shape gives chips along each axis.*'2x'"),
        ("h100:x", ValueError, r"the number of GPUs of one host, as in 'h100:8'"),
        ("cpu:2", ValueError, r"takes no shape"),
        (5, TypeError, r"`target` must be None .* or a name.*int"),
    ],
)
def test_bad_targets_end_in_a_clear_message(target, error, message):
    with pytest.raises(error, match=message):
        residual.inspect(scan_mlp, *mlp_params(), target=target)


def test_a_target_that_is_not_installed_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(_target, "_installed", lambda module: False)
    _target._named.cache_clear()
    try:
        with pytest.raises(residual.TargetUnavailableError,
                           match=r"'v6e:2x2' needs libtpu.*pip install 'residual\[tpu\]'"):
            residual.plan(scan_mlp, *mlp_params(), target="v6e:2x2")
        with pytest.raises(residual.TargetUnavailableError,
                           match=r"'a100' needs JAX's CUDA plugin.*'residual\[cuda\]'"):
            residual.compiled_memory(jnp.sin, jnp.ones(3), target="a100")
    finally:
        _target._named.cache_clear()


@pytest.mark.parametrize(
    ("raised", "message"),
    [
        (RuntimeError('ABORTED: Internal error when accessing libtpu multi-process lockfile.'),
         r"another process holds it.*ALLOW_MULTIPLE_LIBTPU_LOAD=1"),
        (NotImplementedError("topology not implemented for cuda"),
         r"CUDA plugin is installed but did not register.*JAX_PLATFORMS=cpu"),
    ],
)
def test_a_target_jax_cannot_load_says_why(monkeypatch, raised, message):
    from jax.experimental import topologies

    def refuse(*args, **kwargs):
        raise raised

    monkeypatch.setattr(_target, "_installed", lambda module: True)
    monkeypatch.setattr(topologies, "get_topology_desc", refuse)
    _target._named.cache_clear()
    try:
        with pytest.raises(residual.TargetUnavailableError, match=message):
            _target.resolve("h100" if "cuda" in str(raised) else "v5e")
    finally:
        _target._named.cache_clear()


@pytest.mark.skipif(RUNNING_PLATFORM != "cpu", reason="the running backend is not the CPU")
def test_cpu_target_gives_the_running_backends_figures():
    ws, x = mlp_params(layers=4, width=64, batch=128)
    here = residual.inspect(scan_mlp, ws, x, policy=rp.Quantize(bits=8, min_bytes=0))
    cpu = residual.inspect(scan_mlp, ws, x, policy=rp.Quantize(bits=8, min_bytes=0),
                           target="cpu")
    assert {k: v for k, v in here.totals.items() if k != "target"} == {
        k: v for k, v in cpu.totals.items() if k != "target"}
    assert here.totals["target"] == "cpu" and cpu.totals["target"] == "cpu"


def test_gradcheck_reports_memory_on_request():
    ws, x = mlp_params(layers=4, width=64, batch=128)
    policy = rp.Remat()
    result = residual.gradcheck(scan_mlp, ws, x, policy=policy, memory=True)
    plain = residual.compiled_memory(backward(scan_mlp), ws, x)
    hooked = residual.compiled_memory(
        backward(residual.with_hooks(scan_mlp, policy=policy)), ws, x)
    assert (result.plain_memory, result.hooked_memory) == (plain, hooked)
    assert result.target == RUNNING_PLATFORM and hooked.beyond < plain.beyond
    assert (f"compiled peak memory on {RUNNING_PLATFORM}: {hooked.peak / 2**20:.2f} MiB"
            in repr(result))
    assert residual.gradcheck(scan_mlp, ws, x, policy=policy).plain_memory is None


# Compiled for a TPU or a GPU, on this machine ----------------------------------------------

TARGETS = [pytest.param("v5e", marks=needs_tpu), pytest.param("v6e", marks=needs_tpu),
           pytest.param("h100", marks=needs_gpu)]
PLATFORM = {"v5e": "tpu", "v6e": "tpu", "h100": "gpu"}


@pytest.mark.parametrize("target", TARGETS)
def test_inspect_reports_the_targets_own_figures(target):
    ws, x = mlp_params(layers=4, width=256, batch=512)
    report = residual.inspect(scan_mlp, ws, x, policy=rp.Remat(), target=target)
    t = report.totals
    plain = residual.compiled_memory(backward(scan_mlp), ws, x, target=target)
    here = residual.compiled_memory(backward(scan_mlp), ws, x)
    assert plain.platform == PLATFORM[target] and plain.peak != here.peak
    assert t["target"] == target
    assert (t["plain_peak_bytes"], t["plain_beyond_bytes"]) == (plain.peak, plain.beyond)
    # Recomputing the scan body stores one activation per layer, not three.
    assert t["hooked_beyond_bytes"] < t["plain_beyond_bytes"]
    assert f"peak memory on {target}: " in str(report)


# Actions whose programs compile fast (quantized programs take 5-20 s each on TPU).
ACTIONS = ["keep", "bf16", "remat"]


@pytest.mark.parametrize(("target", "model", "layers"), [
    pytest.param("v5e", unrolled_mlp, 2, marks=needs_tpu),
    pytest.param("v5e", scan_mlp, 4, marks=needs_tpu),
    pytest.param("h100", unrolled_mlp, 4, marks=needs_gpu),
])
def test_plan_on_a_target_is_never_above_plain_and_runs_nothing(target, model, layers):
    ws, x = mlp_params(layers=layers, width=256, batch=512)
    where = _target.resolve(target)
    p = residual.plan(model, ws, x, budget=None, target=target, actions=ACTIONS)
    assert p.target == target and p.grad_error is None  # nothing ran
    plain = residual.compiled_memory(jax.grad(model), ws, x, target=target).peak
    assert p.memory <= p.plain_memory == plain
    hooked = jax.grad(residual.with_hooks(model, policy=p))
    assert residual.compiled_memory(hooked, ws, x, target=target).peak == p.memory
    # Step times are the roofline of the compiled programs, and say so.
    assert p.step_seconds == pytest.approx(where.predicted_seconds(where.compile(hooked, (ws, x))))
    assert p.plain_step_seconds == pytest.approx(
        where.predicted_seconds(where.compile(jax.grad(model), (ws, x))))
    assert f"predicted step on {target} (roofline of the compiled program, not run)" in str(p)


@needs_tpu
def test_plan_stays_at_plain_where_a_policy_loses_on_tpu():
    # Two layers on v5e: bfloat16 residuals take 1.07x plain's peak (jax 0.12.0.1); the
    # plan keeps them.
    ws, x = mlp_params(layers=2, width=256, batch=512)
    cast = jax.grad(residual.with_hooks(unrolled_mlp, policy=rp.Cast(jnp.bfloat16)))
    plain = residual.compiled_memory(jax.grad(unrolled_mlp), ws, x, target="v5e").peak
    assert residual.compiled_memory(cast, ws, x, target="v5e").peak > plain
    p = residual.plan(unrolled_mlp, ws, x, budget=None, target="v5e", actions=ACTIONS)
    assert p.memory <= plain and all(d.action != "bf16" for d in p.decisions)


@needs_tpu
def test_quantize_int8_on_a_tpu_scan_mlp_stays_at_its_measured_peak():
    # Measured on v5e: 0.475x plain's peak on jax 0.10.2, 0.688x on 0.11.2 and 0.12.0.1;
    # marking NaN groups on the float copy of the codes instead of the integer codes
    # fuses differently there and measures 0.720x. The default stores what packing
    # stores here (recomputing the tanh outputs would store their matmul outputs
    # instead; doing so measured 0.80x).
    ws, x = mlp_params(layers=4, width=512, batch=2048)
    policy = rp.Quantize(bits=8)
    hooked = jax.grad(residual.with_hooks(scan_mlp, policy=policy))
    plain = residual.compiled_memory(jax.grad(scan_mlp), ws, x, target="v5e")
    assert residual.compiled_memory(hooked, ws, x, target="v5e").peak <= 0.70 * plain.peak


@needs_tpu
def test_quantize_int8_of_a_bfloat16_scan_stays_under_plain_on_a_tpu():
    # Widened to float32 before the NaN check's conditional, each layer's bf16 matmul
    # output had a float32 copy beside it: 1.14x plain's peak on v5e, 0.73x since the
    # conditional reads the bf16 value and widens it inside (stored activations, 256
    # MiB, outweigh what the chip holds on-chip at this size). Without a barrier after
    # the ordering conditional, XLA moved unpacking's widening of the last layer's
    # codes into it, which returned them as a float32 array: 0.82x.
    ws, x = mlp_params(layers=4, width=1024, batch=16384, dtype=jnp.bfloat16)
    hooked = jax.grad(residual.with_hooks(scan_mlp, policy=rp.Quantize(bits=8)))
    plain = residual.compiled_memory(jax.grad(scan_mlp), ws, x, target="v5e")
    assert residual.compiled_memory(hooked, ws, x, target="v5e").peak <= 0.80 * plain.peak


def _passed_after_a_tiled_tie(a, b, x):
    tie = jnp.tanh(a) @ b
    return passed_after(tie, x) * 2, jnp.sum(tie * tie, axis=-1)


@needs_tpu
def test_the_ordering_conditional_reads_one_element_of_its_tie_on_a_tpu():
    # Raveled to read its first element, the tiled tie was copied whole: 2.1x the
    # tie's bytes of working memory on v5e.
    tie = jax.ShapeDtypeStruct((32, 4, 256, 256), jnp.float32)
    a = jax.ShapeDtypeStruct((32, 4, 256, 64), jnp.float32)
    b = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    memory = residual.compiled_memory(_passed_after_a_tiled_tie, a, b, x, target="v5e")
    assert memory.beyond < 1.5 * tie.size * 4


@needs_tpu
@pytest.mark.parametrize("policy", [rp.Cast(jnp.bfloat16, elementwise="pack"),
                                    rp.Quantize(bits=8, min_bytes=0)], ids=repr)
def test_a_residual_already_in_host_memory_is_not_brought_back_on_a_tpu(policy):
    # Cast once brought the offloaded value back to the device to cast it and stored
    # the bf16 copy there: 1.33x plain's peak on v5e.
    x = jnp.ones((256, 64))
    hooked = jax.grad(residual.with_hooks(offloading_y, policy=policy))
    plain = residual.compiled_memory(jax.grad(offloading_y), x, target="v5e")
    assert residual.compiled_memory(hooked, x, target="v5e").peak <= plain.peak


def _gelu_mlp(ws, x):
    for i in range(ws.shape[0]):
        x = jax.nn.gelu(x @ ws[i])
    return jnp.sum(x**2)


@needs_tpu
@pytest.mark.slow
def test_quantize_recomputing_elementwise_keeps_a_tpu_gelu_mlp_at_plains_peak():
    # Measured on v5e, jax 0.12.0.1: packing every residual takes 1.44x plain's peak (the
    # TPU compiler fuses GELU's elementwise chain and stores little of it; packed, each
    # of its terms is a float the forward materializes); packing the matmul outputs and
    # recomputing the chain from them, 0.93x.
    ws, x = mlp_params(layers=8, width=256, batch=1024)
    plain = residual.compiled_memory(jax.grad(_gelu_mlp), ws, x, target="v5e").peak
    peaks = {e: residual.compiled_memory(jax.grad(residual.with_hooks(
        _gelu_mlp, policy=rp.Quantize(bits=8, elementwise=e))), ws, x, target="v5e").peak / plain
        for e in ("pack", "recompute", "auto")}
    assert peaks["recompute"] <= 0.95 and peaks["pack"] > 1.05, peaks
    assert peaks["auto"] == peaks["recompute"], peaks


@needs_tpu
@pytest.mark.parametrize(("dtype", "width", "batch"), [
    pytest.param(jnp.float32, 1024, 4096, marks=pytest.mark.slow),
    (jnp.bfloat16, 256, 1024)], ids=["f32", "bf16"])
def test_cast_recomputing_elementwise_keeps_a_tpu_gelu_mlp_at_plains_peak(dtype, width, batch):
    # Cast one by one, GELU's terms are each a stored array the TPU compiler itself
    # fuses away. Recomputed (the default on a TPU), an f32 model stores its matmul
    # outputs cast; a bf16 one stores exactly what JAX stores, and compiles to plain's
    # program, the loss's f32 `2 * x` recomputed from `x` as the compiler would.
    # Measured on v5e, jax 0.12.0.1: f32 0.98x plain's peak (1.83x cast one by one),
    # bf16 1.00x (3.48x) at width 256 and batch 1,024. The f32 model is the size where
    # its matmul outputs outweigh the rest: at width 256 and batch 1,024 it measures
    # 1.03x.
    ws = jax.ShapeDtypeStruct((8, width, width), dtype)
    x = jax.ShapeDtypeStruct((batch, width), dtype)

    def model(ws, x):
        for i in range(ws.shape[0]):
            x = jax.nn.gelu(x @ ws[i])
        return jnp.sum(x.astype(jnp.float32) ** 2)

    plain = residual.compiled_memory(jax.grad(model), ws, x, target="v5e").peak
    peaks = {e: residual.compiled_memory(jax.grad(residual.with_hooks(
        model, policy=rp.Cast(jnp.bfloat16, elementwise=e))), ws, x, target="v5e").peak / plain
        for e in ("pack", "auto")}
    assert peaks["pack"] > 1.5, peaks
    assert peaks["auto"] == 1.0 if dtype == jnp.bfloat16 else peaks["auto"] <= 1.0, peaks


def _bf16_tanh_mlp_summed_in_float32(ws, x):
    for i in range(ws.shape[0]):
        x = jnp.tanh(x @ ws[i])
    return jnp.sum(x.astype(jnp.float32) ** 2)


@needs_tpu
def test_fp8_codes_of_an_unrolled_bfloat16_mlp_group_down_the_rows_on_a_tpu():
    # Along the last axis the backward spread each group's scale over its values
    # into float32 copies: 0.97x plain's peak on v5e here, and 1.02x at batch
    # 32,768 x width 1,024; down the rows 0.85x (0.76x).
    ws = jax.ShapeDtypeStruct((8, 512, 512), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((2048, 512), jnp.bfloat16)
    model = _bf16_tanh_mlp_summed_in_float32
    hooked = jax.grad(residual.with_hooks(model, policy=rp.Quantize(format="fp8_e4m3")))
    plain = residual.compiled_memory(jax.grad(model), ws, x, target="v5e")
    assert residual.compiled_memory(hooked, ws, x, target="v5e").peak <= 0.90 * plain.peak


@needs_tpu
@pytest.mark.slow
@pytest.mark.parametrize(("model", "dtype"), [(_bf16_tanh_mlp_summed_in_float32, jnp.bfloat16),
                                              (_gelu_mlp, jnp.float32)])
def test_int4_recomputes_float32_matrices_elementwise_and_stays_under_plain_on_a_tpu(
        model, dtype):
    # Packed, each float32 matrix's elementwise term groups down the rows with its
    # own temporaries: the GELU MLP's terms, the loss's `2 * x` of the bf16 MLP (and
    # with it that layer's bf16 tanh derivative, which recomputed alone would store
    # as many bytes). Recomputed (the default), they come back from the layer's
    # stored output. Measured on v5e, jax 0.12.0.1, as ratios to plain's peak:
    # 0.90x packed and 0.83x recomputed (bf16), 0.88x and 0.87x (GELU); 1.15x and
    # 1.35x packed while XLA moved unpacking into the ordering conditionals.
    ws = jax.ShapeDtypeStruct((8, 512, 512), dtype)
    x = jax.ShapeDtypeStruct((2048, 512), dtype)
    plain = residual.compiled_memory(jax.grad(model), ws, x, target="v5e").peak
    peaks = {e: residual.compiled_memory(jax.grad(residual.with_hooks(
        model, policy=rp.Quantize(bits=4, elementwise=e))), ws, x, target="v5e").peak / plain
        for e in ("auto", "pack")}
    assert peaks["auto"] <= peaks["pack"] and peaks["auto"] < 1.0, peaks


def _iterated_gelu_mlp(ws, x):
    """An unrolled GELU MLP iterating its stacked weights: `unstack` from jax 0.11 on."""
    for w in ws:
        x = jax.nn.gelu(x @ w)
    return jnp.sum(x**2)


@needs_tpu
@pytest.mark.parametrize("policy", [rp.Cast(jnp.bfloat16), rp.Quantize(bits=8)], ids=repr)
def test_stacked_weights_iterated_in_python_stay_under_plains_peak_on_a_tpu(policy):
    # Stacked at the end of the backward (JAX's transpose of `unstack`), the weight
    # gradients wait, and the TPU compiler holds every layer's unpacked floats until
    # they are computed. Measured on v5e, jax 0.12.0.1: 1.56x plain's peak under
    # `Cast`, 1.57x under int8; written into place slice by slice, 0.90x and 0.82x
    # (2.04x and 2.00x against 0.96x and 0.93x at width 1,024 and batch 4,096).
    ws = jax.ShapeDtypeStruct((8, 128, 128), jnp.float32)
    x = jax.ShapeDtypeStruct((512, 128), jnp.float32)
    plain = residual.compiled_memory(jax.grad(_iterated_gelu_mlp), ws, x, target="v5e").peak
    hooked = jax.grad(residual.with_hooks(_iterated_gelu_mlp, policy=policy))
    assert residual.compiled_memory(hooked, ws, x, target="v5e").peak <= plain


def _indexed_mlp(ws, x):
    """An unrolled MLP reading each layer's weight as a view, `ws[i]`."""
    for i in range(ws.shape[0]):
        x = jnp.tanh(x @ ws[i])
    return jnp.sum(x**2)


def _ensemble(fn):
    """The gradients of an ensemble: one model per stacked weights and input."""
    return jax.vmap(jax.grad(fn, (0, 1)))


def _per_example(fn):
    return jax.vmap(jax.grad(fn, (0, 1)), in_axes=(None, 0))


@needs_tpu
@pytest.mark.parametrize("policy", [rp.Cast(jnp.bfloat16), rp.Quantize(bits=8)], ids=repr)
def test_weight_views_under_vmap_stay_under_plains_peak_on_a_tpu(policy):
    # Under `vmap` the backward takes each layer's weight from the copy the compiler
    # made for the forward. Taken inside a conditional, the whole f32 weights were
    # copied into on-chip memory and kept through the backward: on v5e, jax 0.12.0.1,
    # the ensemble took 1.06x plain's peak under both policies (0.94x and 0.93x now).
    ws = jax.ShapeDtypeStruct((2, 6, 128, 128), jnp.float32)
    x = jax.ShapeDtypeStruct((2, 256, 128), jnp.float32)
    plain = residual.compiled_memory(_ensemble(_indexed_mlp), ws, x, target="v5e").peak
    hooked = _ensemble(residual.with_hooks(_indexed_mlp, policy=policy))
    assert residual.compiled_memory(hooked, ws, x, target="v5e").peak < plain


@needs_tpu
@pytest.mark.parametrize("batched", [_ensemble, _per_example], ids=lambda b: b.__name__)
def test_weight_views_taken_under_vmap_for_a_tpu_get_exact_gradients(batched):
    ws, x = mlp_params(layers=3, width=32, batch=16)
    ws_per_model, xs = jnp.stack([ws, -ws / 2]), jnp.stack([x, 2 * x])
    args = (ws_per_model if batched is _ensemble else ws, xs)
    report = residual.inspect(_indexed_mlp, ws, x, policy=Negate())
    assert "view" in {row.how for row in report.rows}
    hooked = residual.with_hooks(_indexed_mlp, policy=Negate())
    _, got = _traced_for_a_tpu_and_run_here(batched(hooked), *args)
    expected = _run_op_by_op(batched(_indexed_mlp), *args)
    assert tree_equal(jax.tree.unflatten(jax.tree.structure(expected), got), expected)


def _skipping_mlp(ws, x):
    """Three stacked weights, the middle one unused: its slot of the weight gradient
    is zeros, written when the backward's `stack` is reached."""
    first, _, last = ws
    return jnp.sum(jax.nn.gelu(jax.nn.gelu(x @ first) @ last) ** 2)


def _run_op_by_op(fn, *args):
    # Each operation on its own, so that equal programs give equal bits whatever XLA:CPU
    # would fuse on this machine's CPU.
    with jax.disable_jit():
        return fn(*args)


def _traced_for_a_tpu_and_run_here(fn, *args):
    with _target.resolve("v5e").tracing():
        traced = jax.make_jaxpr(fn)(*args)
    return str(traced), _run_op_by_op(jp.jaxpr_as_fun(traced), *args)


@needs_tpu
@pytest.mark.parametrize("model", [_iterated_gelu_mlp, _skipping_mlp], ids=lambda m: m.__name__)
def test_stacked_weights_written_slice_by_slice_get_exact_gradients(model):
    # Traced for a TPU, evaluated here: the weight gradient built slice by slice is
    # exactly the one `jax.grad` stacks, alone and per example under `vmap`.
    ws, x = mlp_params(layers=3, width=32, batch=16)
    hooked = jax.grad(residual.with_hooks(model, policy=Negate()), (0, 1))
    per_example = jax.vmap(hooked, in_axes=(None, 0))
    xs = jnp.stack([x, -2 * x])
    for fn, args, expected, written in [
        (hooked, (ws, x), _run_op_by_op(jax.grad(model, (0, 1)), ws, x),
         "dynamic_update_slice"),
        (per_example, (ws, xs),
         _run_op_by_op(jax.vmap(jax.grad(model, (0, 1)), in_axes=(None, 0)), ws, xs),
         "scatter"),
    ]:
        text, got = _traced_for_a_tpu_and_run_here(fn, *args)
        if jax.__version_info__ >= (0, 11):  # `for w in ws` slices on jax 0.10
            assert written in text
        assert tree_equal(jax.tree.unflatten(jax.tree.structure(expected), got), expected)


@needs_tpu
def test_stacked_weights_written_slice_by_slice_under_explicit_sharding():
    # The buffer the slices are written into is sharded as they are.
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    ws, x = mlp_params(layers=3, width=8, batch=8)
    with jax.set_mesh(mesh):
        ws = jax.device_put(ws, NamedSharding(mesh, P(None, "x")))
        x = jax.device_put(x, NamedSharding(mesh, P("x")))
        hooked = jax.grad(residual.with_hooks(_iterated_gelu_mlp, policy=Negate()))
        _, got = _traced_for_a_tpu_and_run_here(hooked, ws, x)
        assert tree_equal(got[0], _run_op_by_op(jax.grad(_iterated_gelu_mlp), ws, x))


@needs_tpu
@pytest.mark.parametrize(("policy", "target", "dtype", "recomputed"), [
    (rp.Quantize(bits=8), "v5e", jnp.float32, True),
    (rp.Quantize(format="fp8_e4m3"), "v5e", jnp.float32, True),
    (rp.Quantize(bits=4), "v5e", jnp.float32, True),
    (rp.Quantize(bits=4), "v5e", jnp.bfloat16, True),
    (rp.Quantize(bits=4), "v5e", jnp.float16, True),
    (rp.Quantize(bits=2), "v5e", jnp.bfloat16, True),
    (rp.Quantize(bits=2), "v5e", jnp.float16, True),
    (rp.Quantize(bits=2), "v5e", jnp.float32, True),
    (rp.Quantize(bits=4), "cpu", jnp.bfloat16, False),
    (rp.Quantize(bits=2), "cpu", jnp.bfloat16, False),
    (rp.Quantize(bits=8), "cpu", jnp.float32, False),
    (rp.Quantize(bits=8, elementwise="pack"), "v5e", jnp.float32, False),
    (rp.Cast(jnp.bfloat16), "v5e", jnp.float32, True),
    (rp.Cast(jnp.bfloat16), "cpu", jnp.float32, False),
    (rp.Cast(jnp.bfloat16, elementwise="recompute"), "cpu", jnp.float32, True),
    (rp.Offload(), "v5e", jnp.float32, True),
    (rp.Offload(), "cpu", jnp.float32, False),
    (rp.Offload(elementwise="pack"), "v5e", jnp.float32, False),
])
def test_policies_recompute_elementwise_residuals_by_default_on_a_tpu(
        policy, target, dtype, recomputed):
    # 4- and 2-bit codes of float32 recompute the matrices they group down the rows.
    ws, x = mlp_params(layers=2, width=256, batch=256, dtype=dtype)
    report = residual.inspect(_gelu_mlp, ws, x, policy=policy, target=target)
    hows = {r.how for r in report.rows if r.primitive != "dot_general"}
    assert ("recomputed" in hows) == recomputed, hows
    assert ("packed" in hows) == (not recomputed), hows


def _scanned_gelu_mlp(ws, x):
    h, _ = jax.lax.scan(lambda h, w: (jax.nn.gelu(h @ w), None), x, ws)
    return jnp.sum(h**2)


@needs_tpu
@pytest.mark.parametrize(("model", "x_shape", "recomputed"), [
    (_gelu_mlp, (256, 256), True), (_gelu_mlp, (4, 64, 256), True),
    (_scanned_gelu_mlp, (256, 256), False), (_gelu_mlp, (2, 4, 64, 256), False)],
    ids=["matrix", "three axes", "scan body", "four axes"])
def test_int4_on_one_tpu_chip_recomputes_unscanned_matrices_and_token_streams(
        model, x_shape, recomputed):
    # v5e, int4 on the zoo's flax NNX transformer unrolled: 0.62x plain's peak
    # recomputed against 0.66x packed at 8 sequences, 0.54x against 1.05x at 32.
    # Scanned, the zoo's float32 transformers measure 0.46x to 0.50x packed against
    # 0.45x to 0.54x recomputed, and the flax Linen CNN's 4-D activations 1.27x
    # against 2.89x.
    ws, _ = mlp_params(layers=2, width=256, batch=256)
    x = jax.random.normal(jax.random.key(1), x_shape)
    report = residual.inspect(model, ws, x, policy=rp.Quantize(bits=4), target="v5e",
                              compiled=False)
    hows = {r.how for r in report.rows if r.primitive != "dot_general"}
    assert ("recomputed" in hows) == recomputed, hows
    assert ("packed" in hows) == (not recomputed), hows


@needs_tpu
def test_a_recomputation_from_values_it_unpacks_is_not_ordered_again_on_a_tpu():
    # Each batch norm and ReLU is recomputed from its convolution's unpacked output.
    # Passed through a second ordering conditional, that float was copied whole to the
    # conditional's layout: int8 on this one-stage flax Linen CNN measured 1.15x
    # plain's peak (v5e, jax 0.12.0.1), 0.89x unpacked and read as it is; the zoo's
    # three-stage CNN at 32 images 1.74x against 1.28x.
    nn = pytest.importorskip("flax.linen")

    class Stage(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(2):
                x = nn.relu(nn.BatchNorm(use_running_average=False)(nn.Conv(32, (3, 3))(x)))
            with jax.numpy_dtype_promotion("standard"):  # flax divides by the window's size
                x = nn.avg_pool(x, (2, 2), (2, 2))
            return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))

    model = Stage()
    x = jnp.zeros((8, 64, 64, 3))
    variables = model.init(jax.random.key(0), x)

    def loss(params, stats, x):
        logits, _ = model.apply({"params": params, "batch_stats": stats}, x,
                                mutable=["batch_stats"])
        return jnp.mean(logits**2)

    args = (variables["params"], variables["batch_stats"], x)
    hooked = jax.grad(residual.with_hooks(loss, policy=rp.Quantize(bits=8)))
    plain = residual.compiled_memory(jax.grad(loss), *args, target="v5e")
    assert residual.compiled_memory(hooked, *args, target="v5e").peak < plain.peak


@needs_tpu
def test_a_jitted_step_traced_for_the_cpu_is_traced_again_for_a_tpu():
    # JAX's tracing cache is keyed by its trace context; without the target in it, the
    # TPU program would reuse decisions made while tracing for this host's CPU.
    ws, x = mlp_params(layers=2, width=256, batch=256)
    policy = rp.Quantize(bits=8)
    step = jax.jit(jax.grad(residual.with_hooks(_gelu_mlp, policy=policy)))
    residual.compiled_memory(step, ws, x)
    again = residual.compiled_memory(step, ws, x, target="v5e")
    fresh = residual.compiled_memory(
        jax.jit(jax.grad(residual.with_hooks(_gelu_mlp, policy=policy))), ws, x, target="v5e")
    assert again == fresh


@needs_tpu
@pytest.mark.slow
def test_quantize_int4_on_a_tpu_unrolled_mlp_keeps_every_array_in_its_layout():
    # Measured on v5e, jax 0.12.0.1: 1.03x plain's peak. Codes packed two per byte as
    # neighbours need a `[..., n, 2]` array to unpack, which the TPU pads to 128 lanes:
    # 2.20x plain's peak, most of it one such array per layer in the backward.
    ws, x = mlp_params(layers=4, width=1024, batch=4096)
    hooked = jax.grad(residual.with_hooks(unrolled_mlp, policy=rp.Quantize(bits=4)))
    plain = residual.compiled_memory(jax.grad(unrolled_mlp), ws, x, target="v5e")
    assert residual.compiled_memory(hooked, ws, x, target="v5e").peak <= 1.10 * plain.peak


@needs_tpu
@pytest.mark.slow
def test_small_groups_of_float32_codes_run_down_the_rows_on_a_tpu():
    # Measured on v5e, jax 0.12.0.1: 4-bit codes in groups of 16 with byte scales,
    # 0.72x plain's peak; grouped along the last axis, 1.00x, their statistics
    # spread over `[..., 16, 16]` arrays that fill an eighth of each 128-lane tile.
    ws, x = mlp_params(layers=8, width=256, batch=1024)
    policy = rp.Quantize(bits=4, group_size=16, scale_dtype=jnp.uint8)
    hooked = jax.grad(residual.with_hooks(unrolled_mlp, policy=policy))
    plain = residual.compiled_memory(jax.grad(unrolled_mlp), ws, x, target="v5e")
    assert residual.compiled_memory(hooked, ws, x, target="v5e").peak <= 0.80 * plain.peak


def _attention(ws, x):
    batch, seq, width = x.shape
    for wq, wk, wv in ws:
        q, k, v = (jnp.einsum("bsd,dhk->bshk", x, w) for w in (wq, wk, wv))
        p = jax.nn.softmax(jnp.einsum("bqhk,bshk->bhqs", q, k) / 8.0)
        x = x + jnp.einsum("bhqs,bshk->bqhk", p, v).reshape(batch, seq, width)
    return jnp.mean(x**2)


@needs_tpu
@pytest.mark.parametrize("policy", [rp.Cast(jnp.bfloat16), rp.Quantize(bits=8),
                                    rp.Quantize(format="fp8_e4m3"), rp.Quantize(bits=4)],
                         ids=["bf16", "int8", "fp8", "int4"])
def test_heads_narrower_than_a_tile_are_stored_lane_dense_on_a_tpu(policy):
    # Heads of 64 (`[batch, seq, 4, 64]`) fill half of each 128-lane tile; plain keeps
    # them in the matmul's layout, unpadded. v5e, jax 0.12.0.1: `Cast` stored them
    # padded 2x, 1.10x plain's peak; with the minor axes merged, 1.06x (the peak is
    # then on-chip memory's). int8 0.99x, fp8 0.89x, int4 0.75x.
    w = jax.ShapeDtypeStruct((256, 4, 64), jnp.float32)
    ws, x = [(w, w, w)] * 2, jax.ShapeDtypeStruct((8, 256, 256), jnp.float32)
    peak = residual.peak(jax.grad(residual.with_hooks(_attention, policy=policy)), ws, x,
                         target="v5e")
    plain = residual.compiled_memory(jax.grad(_attention), ws, x, target="v5e")
    assert not [r for r in peak.rows if r.kind == "stored" and r.padding >= 2], peak.text()
    assert peak.memory.peak <= 1.07 * plain.peak


@needs_tpu
@pytest.mark.parametrize(("policy", "lanes", "tolerance"), [
    (rp.Cast(jnp.bfloat16), 256, 0.01), (rp.Quantize(bits=8), 256, 0.01),
    (rp.Quantize(bits=4), 128, 0.1)], ids=["bf16", "int8", "int4"])
def test_merged_heads_come_back_in_their_own_shape(policy, lanes, tolerance):
    x = jax.random.normal(jax.random.key(0), (8, 16, 4, 64))
    info = residual.ResidualInfo(index=0, shape=x.shape, dtype=x.dtype)
    with _target.resolve("v5e").tracing():
        packed = policy.pack(x, info)
        back = policy.unpack(packed, info)
    codes = packed if isinstance(packed, jax.Array) else packed["codes"]
    assert codes.shape == (8, 16, lanes)
    assert back.shape == x.shape and back.dtype == x.dtype
    assert float(jnp.linalg.norm(back - x) / jnp.linalg.norm(x)) < tolerance


@needs_tpu
@pytest.mark.parametrize(("shape", "recomputed"), [
    ((64, 4, 64), True), ((8, 64, 4, 64), False)], ids=["to-a-matrix", "to-3d"])
def test_int4_recomputes_an_elementwise_residual_as_its_stored_shape_groups(shape,
                                                                           recomputed):
    # float32 int4 on one TPU recomputes elementwise matrices, which it groups down
    # the rows, and packs the rest: heads merged into a matrix are one.
    info = residual.ResidualInfo(index=0, shape=shape, dtype=jnp.dtype(jnp.float32),
                                 primitive="tanh")
    policy = rp.Quantize(bits=4)
    with _target.resolve("v5e").tracing():
        resolved = policy.resolve(info)
    assert (resolved is not policy) == recomputed, resolved


def _narrow_cnn(ws, x):
    for w in ws:
        x = jax.nn.relu(jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))
    return jnp.mean(x**2)


@needs_tpu
@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 2])
def test_byte_scales_of_a_narrow_axis_are_not_padded_to_whole_tiles_on_a_tpu(bits):
    # 32 channels in groups of 32 (byte scales): one group spans the axis. Reduced
    # over a window that wide, each statistic kept a minor axis of 1, which a TPU pads
    # to 128 lanes: v5e, jax 0.12.0.1, int4 2.56x plain's peak with five such arrays
    # at it; reduced over the axis, 1.58x and none (the flax Linen CNN: 4.47x -> 1.45x).
    ws = [jax.ShapeDtypeStruct((3, 3, 32, 32), jnp.float32)] * 2
    x = jax.ShapeDtypeStruct((16, 32, 32, 32), jnp.float32)
    hooked = jax.grad(residual.with_hooks(_narrow_cnn, policy=rp.Quantize(bits=bits)))
    peak = residual.peak(hooked, ws, x, target="v5e")
    plain = residual.compiled_memory(jax.grad(_narrow_cnn), ws, x, target="v5e")
    assert not [r for r in peak.rows if r.padding >= 64 and r.bytes >= 64 * 1024], peak
    assert peak.memory.peak <= 2 * plain.peak


@needs_tpu
@pytest.mark.slow
def test_relu_masks_beside_cast_floats_are_stored_as_bits_on_a_tpu():
    # Kept as bytes beside the cast floats, the masks cost more than their bytes: in
    # the flax Linen CNN XLA kept a float32 batch-norm output alive with them (2.62x
    # plain's peak; 1.94x as bits). Here (v5e, jax 0.12.0.1) 1.59x kept, 1.25x as bits.
    ws = [jax.ShapeDtypeStruct((3, 3, 32, 32), jnp.float32)] * 2
    x = jax.ShapeDtypeStruct((16, 32, 32, 32), jnp.float32)
    hooked = jax.grad(residual.with_hooks(normalized_relu_convs, policy=rp.Cast(jnp.bfloat16)))
    plain = residual.compiled_memory(jax.grad(normalized_relu_convs), ws, x, target="v5e")
    assert residual.compiled_memory(hooked, ws, x, target="v5e").peak <= 1.4 * plain.peak


@needs_tpu
def test_plan_sweep_on_a_target_is_monotone_and_predicted():
    ws, x = mlp_params(layers=4, width=256, batch=512)
    sweep = residual.plan_sweep(scan_mlp, ws, x, budgets=[None, 0.9, 1.0], target="v5e",
                                actions=ACTIONS)
    least, tight, loose = sweep.plans
    assert least.memory <= tight.memory <= loose.memory <= sweep.plain_memory
    assert loose.step_seconds <= (1 + 0.05) * min(least.step_seconds, tight.step_seconds)
    assert sweep.target == "v5e" and "peak memory on v5e" in str(sweep)
    assert "overhead: predicted" in str(sweep)


@needs_tpu
def test_plan_fits_a_chip_that_plain_jax_grad_does_not():
    # 16 layers of 1 GiB activations: plain jax.grad needs about 30 GiB on a 16 GiB v5e,
    # and its compiler refuses the program; recomputing the layers brings it under 15 GiB.
    ws = jax.ShapeDtypeStruct((16, 4096, 4096), jnp.float32)
    x = jax.ShapeDtypeStruct((65536, 4096), jnp.float32)
    with pytest.raises(_target.DoesNotFitError,
                       match=r"does not fit on one device of target 'v5e'") as refused:
        residual.compiled_memory(jax.grad(scan_mlp), ws, x, target="v5e")
    assert refused.value.required > 16 * 2**30
    p = residual.plan(scan_mlp, ws, x, budget="15 GiB", target="v5e", actions=["keep", "remat"])
    assert p.plain_memory == refused.value.required
    assert p.memory <= 15 * 2**30 and p.plain_step_seconds is None and p.step_seconds > 0
    assert residual.compiled_memory(jax.grad(residual.with_hooks(scan_mlp, policy=p)), ws, x,
                                    target="v5e").peak == p.memory


@pytest.mark.parametrize("target", [pytest.param("v5e:2x2", marks=needs_tpu),
                                    pytest.param("h100:4", marks=needs_gpu)])
def test_memory_is_per_device_on_a_slice(target):
    devices = _target.resolve(target).devices
    assert len(devices) == 4
    mesh = Mesh(np.array(devices), ("data",))
    ws = jax.ShapeDtypeStruct((4, 256, 256), jnp.float32, sharding=NamedSharding(mesh, P()))
    batch = jax.ShapeDtypeStruct((2048, 256), jnp.float32)
    split = jax.ShapeDtypeStruct(batch.shape, batch.dtype,
                                 sharding=NamedSharding(mesh, P("data")))
    one = residual.compiled_memory(jax.grad(scan_mlp), ws, batch, target=target)
    four = residual.compiled_memory(jax.grad(scan_mlp), ws, split, target=target)
    weights, inputs = 4 * 256 * 256 * 4, 2048 * 256 * 4
    assert one.arguments == weights + inputs and four.arguments == weights + inputs // 4
    # Each device holds a quarter of the batch's activations.
    assert four.beyond < 0.5 * one.beyond
    with pytest.raises(ValueError, match=r"sharded over a mesh of 8 devices.*has 4"):
        big = Mesh(np.array(_target.resolve(target.split(":")[0] + (
            ":2x4" if target.startswith("v5e") else ":8")).devices), ("data",))
        residual.compiled_memory(jax.grad(scan_mlp), ws, jax.ShapeDtypeStruct(
            batch.shape, batch.dtype, sharding=NamedSharding(big, P("data"))), target=target)


def _slice_step(policy, layout: str) -> tuple[dict[str, int], dict[str, int]]:
    """Collectives of a 3-layer MLP's sharded `jit(grad)` compiled for 4 TPU chips from
    this 1-device host: (under `policy`, plain)."""
    where = _target.resolve("v5e:2x2")
    mesh = Mesh(np.array(where.devices).reshape(2, 2), ("data", "model"))
    every = ("data", "model")
    w_spec, x_spec = {"data": (P(), P(every)), "fsdp": (P(None, every), P(every)),
                      "tensor": (P(None, None, "model"), P("data"))}[layout]
    ws = jax.ShapeDtypeStruct((3, 512, 512), jnp.float32, sharding=NamedSharding(mesh, w_spec))
    x = jax.ShapeDtypeStruct((1024, 512), jnp.float32, sharding=NamedSharding(mesh, x_spec))

    def counts(f):
        with where.tracing():  # policies decide for the TPU, not for this host
            return residual.collectives(jax.jit(jax.grad(f)).lower(ws, x).compile())

    return counts(residual.with_hooks(unrolled_mlp, policy=policy)), counts(unrolled_mlp)


@needs_tpu
@pytest.mark.parametrize("layout", ["data", "tensor"])
@pytest.mark.parametrize(("policy", "_"), POLICIES, ids=POLICY_IDS)
def test_no_collective_of_ours_on_a_tpu_slice(policy, _, layout):
    # What decides per shard (a group's NaN check, the backward's ordering) must decide
    # locally, or it becomes an all-reduce in every step.
    got, plain = _slice_step(policy, layout)
    # Tensor parallel: an activation may be gathered packed, so fewer gathers.
    gathers, plain_gathers = got.pop("all-gather", 0), plain.pop("all-gather", 0)
    assert gathers <= plain_gathers and got == plain, (gathers, plain_gathers, got, plain)


@needs_tpu
@pytest.mark.parametrize("policy", [
    rp.Cast(jnp.bfloat16), rp.Quantize(format="fp8_e4m3", elementwise="pack"), rp.Offload()],
    ids=repr)
def test_fsdp_shares_the_forwards_gathered_weights_on_a_tpu_slice(policy):
    # Stacked weights split over the chips, each layer's slice gathered for its matmul:
    # the backward's slice of the weights must be the forward's, not one taken again
    # after an ordering barrier (one more all-gather per layer). Integer `Quantize`
    # measures the same on jax 0.12's libtpu, but 5 to 6 more gathers on 0.10's.
    # Recomputing the last layer's `tanh` and the loss's `2 x` from the last matmul's
    # output (8-bit codes' default on a TPU: one residual stored instead of two) takes
    # one more here (4 against 3), as `jax.checkpoint` takes more: docs/multi-device.md.
    got, plain = _slice_step(policy, "fsdp")
    assert got["all-gather"] <= plain["all-gather"] and got == plain | {
        "all-gather": got["all-gather"]}, (got, plain)


@needs_tpu
@pytest.mark.parametrize("policy", [rp.Quantize(bits=8), rp.Quantize(format="fp8_e4m3")],
                         ids=["int8", "fp8"])
def test_fsdp_8_bit_codes_gather_each_weight_as_plain_does_on_a_tpu_slice(policy):
    # The weights split over 4 chips, the batch too. Grouped along the last axis, the
    # packed activations' grouping reshape was folded by XLA into the matmul that
    # made them, which then read its weight reshaped: gathered a second time (4
    # all-gathers against 3). Down the rows, each chip's rows are whole groups.
    assert _fsdp_collectives(unrolled_mlp, policy) == _fsdp_collectives(unrolled_mlp)


@needs_tpu
@pytest.mark.parametrize("policy", [rp.Remat(), rp.select([(rp.where(in_scan=True), rp.Remat())])],
                         ids=["Remat", "Remat per layer"])
def test_fsdp_recomputing_a_scan_gathers_each_weight_as_plain_does_on_a_tpu_slice(policy):
    # A layer's recomputation reads its weights and the stored carry. Passed through
    # the ordering barrier with the carry, the weights came out a new value that XLA
    # gathered again: 3 all-gathers a step more than plain's 6 on 3 layers. Only the
    # carry ties the recomputation now, and the backward shares the forward's copy.
    assert _fsdp_collectives(scan_mlp, policy) == _fsdp_collectives(scan_mlp)


def _fsdp_collectives(model, policy=None) -> dict[str, int]:
    """Collectives per step of `jit(grad(model))` on v5e:2x2: 3 stacked `512x512`
    weights split over the 4 chips (gathered per layer), a batch of 1024 split too."""
    where = _target.resolve("v5e:2x2")
    mesh = Mesh(np.array(where.devices), ("data",))
    ws = jax.ShapeDtypeStruct((3, 512, 512), jnp.float32,
                              sharding=NamedSharding(mesh, P(None, "data")))
    x = jax.ShapeDtypeStruct((1024, 512), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    fn = model if policy is None else residual.with_hooks(model, policy=policy)
    with where.tracing():
        return residual.collectives(jax.jit(jax.grad(fn)).lower(ws, x).compile(), per_step=True)


def _data_parallel_on_a_slice(layers: int, width: int, batch: int):
    """The slice v5e:2x2 and `(ws, x)` for it: weights replicated, the batch split."""
    where = _target.resolve("v5e:2x2")
    mesh = Mesh(np.array(where.devices), ("data",))
    ws = jax.ShapeDtypeStruct((layers, width, width), jnp.float32,
                              sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((batch, width), jnp.float32,
                             sharding=NamedSharding(mesh, P("data")))
    return where, (ws, x)


@needs_tpu
@pytest.mark.parametrize(("model", "policy", "slack"), [
    # Sharded over chips, 8-bit codes reshape into groups: reduced over windows of the
    # residual as it lies, the tanh MLP's int8 peak was 1.16x plain's (0.96x reshaped).
    (unrolled_mlp, rp.Quantize(bits=8), 1.0),
    # On several devices 4-bit codes of float32 recompute GELU's chain: packing every
    # residual, this MLP's int4 peak was 1.23x plain's; recomputed, 1.0001x (jax
    # 0.12.0.1: 10 KiB over plain's 78 MiB).
    pytest.param(_gelu_mlp, rp.Quantize(bits=4), 1.001, marks=pytest.mark.slow),
    # Offloading GELU's terms one by one, each is a device array XLA would not keep:
    # 1.49x plain's peak (FSDP 1.86x, tensor parallel 1.37x); recomputed, 0.92x.
    pytest.param(_gelu_mlp, rp.Offload(), 1.0, marks=pytest.mark.slow),
], ids=["int8 tanh", "int4 gelu", "offload gelu"])
def test_policies_on_a_data_parallel_tpu_slice_stay_at_plains_peak(model, policy, slack):
    where, args = _data_parallel_on_a_slice(layers=4, width=1024, batch=4096)

    def peak(f):
        with where.tracing():
            return residual.Memory.of(jax.jit(jax.grad(f)).lower(*args).compile()).peak

    assert peak(residual.with_hooks(model, policy=policy)) <= slack * peak(model)


@needs_tpu
@pytest.mark.parametrize("bits", [4, 2])
def test_low_bit_codes_of_float32_recompute_elementwise_residuals_on_a_tpu_slice(bits):
    # On one chip 4- and 2-bit codes of float32 in scan bodies pack every residual
    # (`test_int4_packs_float32_residuals_that_are_not_unscanned_matrices_on_one_tpu_chip`);
    # sharded over a slice's chips they recompute the elementwise ones.
    _, (ws, x) = _data_parallel_on_a_slice(layers=2, width=256, batch=1024)
    report = residual.inspect(_scanned_gelu_mlp, ws, x, policy=rp.Quantize(bits=bits),
                              target="v5e:2x2", compiled=False)
    # The body's elementwise residuals (its input and matmul outputs are packed).
    elementwise = {r.how for r in report.rows
                   if r.iterations > 1 and r.primitive not in (None, "dot_general")}
    assert elementwise == {"recomputed"}, elementwise


@needs_tpu
def test_unpinned_offload_compiles_for_a_slice_from_a_one_device_host():
    # Several devices are the mesh's, not this process's: a one-device sharding would
    # name this host's CPU inside a program for the TPU chips.
    got, plain = _slice_step(rp.Offload(memory_kind="unpinned_host"), "data")
    assert got == plain


@needs_tpu
def test_offloaded_per_row_statistics_of_a_scan_compile_for_a_tpu_and_come_back_exact():
    # Layers one group wide: int8's zero points are a byte per row (`u8[rows, 1]`),
    # which the TPU compiler fails to stack in host memory slice by slice ("Sublane
    # slicing size must be multiple of element packing factor"), alone on one chip
    # and on the narrow shards of a slice. Offloaded as 32-bit values, they compile,
    # and the gradient is bit for bit the one kept on the device.
    chained = rp.Chain(rp.Quantize(bits=8), rp.Offload())
    compiled = _target.resolve("v5e").compile(
        jax.grad(residual.with_hooks(scan_mlp, policy=chained)), mlp_params(4, 64, 512))
    assert compiled.memory_analysis().host_temp_size_in_bytes > 0
    ws, x = mlp_params(layers=3, width=64, batch=512)
    text, got = _traced_for_a_tpu_and_run_here(
        jax.grad(residual.with_hooks(scan_mlp, policy=chained)), ws, x)
    _, expected = _traced_for_a_tpu_and_run_here(
        jax.grad(residual.with_hooks(scan_mlp, policy=rp.Quantize(bits=8))), ws, x)
    assert "u32[" in text and tree_equal(got, expected)


@pytest.mark.parametrize("target", TARGETS)
def test_gradcheck_memory_on_a_target(target):
    ws, x = mlp_params(layers=4, width=256, batch=512)
    result = residual.gradcheck(scan_mlp, ws, x, policy=rp.Remat(), target=target)
    assert result.ok and result.target == target
    assert result.plain_memory == residual.compiled_memory(backward(scan_mlp), ws, x,
                                                           target=target)
    assert result.hooked_memory.platform == PLATFORM[target]


@pytest.mark.skipif(not (_installed("libtpu") or _installed("jax_plugins.xla_cuda12")),
                    reason="neither libtpu nor JAX's CUDA plugin is installed")
def test_the_extras_leave_plain_cpu_use_alone():
    # A fresh process without the variables this suite sets: JAX starts on the CPU with
    # libtpu and the CUDA plugin installed (each finds no device and stands aside).
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in (
        "ALLOW_MULTIPLE_LIBTPU_LOAD", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "JAX_PLATFORMS")}
    code = ("import jax, jax.numpy as jnp, residual\n"
            "from residual import policies as rp\n"
            "f = lambda x: jnp.sum(jnp.tanh(x) ** 2)\n"
            "r = residual.inspect(f, jnp.ones((256, 256)), policy=rp.Quantize(bits=8))\n"
            "print(jax.default_backend(), r.totals['target'],"
            " float(jax.grad(residual.with_hooks(f))(jnp.ones(3))[0]) > 0)\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["cpu", "cpu", "True"]


@pytest.mark.parametrize("target", TARGETS)
def test_unpinned_offload_compiles_for_one_chip_from_this_host(target):
    # A one-device sharding inside the program names the target's chip, not this host's
    # CPU. On a GPU, whose compiler offloads to pinned host memory only (a value placed
    # in unpinned host memory inside `jit` stays on the device), it is pinned memory:
    # `save_on_cpu()` saves there what `save_on_cpu(pin_memory=True)` does.
    ws, x = mlp_params(layers=4, width=256, batch=512)
    where = _target.resolve(target)
    host_bytes = {}
    for kind in ("pinned_host", "unpinned_host"):
        hooked = residual.with_hooks(scan_mlp, policy=rp.Offload(kind))
        compiled = where.compile(jax.grad(hooked), [ws, x])
        host_bytes[kind] = compiled.memory_analysis().host_temp_size_in_bytes
    assert host_bytes["unpinned_host"] > 0 and host_bytes["pinned_host"] > 0
    if PLATFORM[target] == "gpu":
        assert host_bytes["unpinned_host"] == host_bytes["pinned_host"]
        with residual.save_on_cpu():
            default = residual.compiled_memory(jax.grad(residual.with_hooks(scan_mlp)), ws, x,
                                               target=target)
        assert default == residual.compiled_memory(
            jax.grad(residual.with_hooks(scan_mlp, policy=rp.Offload())), ws, x, target=target)
