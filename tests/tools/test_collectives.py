"""`residual.collectives`: each collective of a compiled program counted once, by kind."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import residual
from residual import _target
from residual import policies as rp

from ..foundation.test_target import needs_tpu

# XLA:TPU's text for one all-gather overlapped with a matmul (shapes and attributes cut
# short): started in one fusion, continued in two more that each repeat the instruction;
# an all-reduce and an all-gather of the GPU's and CPU's asynchronous form beside it.
CHAINED = """
%fused_computation.1 (param_0.1: bf16[8,4]) -> (bf16[8,4], bf16[8,16]) {
  %param_0.1 = bf16[8,4]{0,1:T(8,128)(2,1)S(1)} parameter(0)
  %all-gather.34 = bf16[8,16]{0,1} all-gather(%param_0.1), channel_id=7, chain_id="0"
  ROOT %custom-call.1 = (bf16[8,4], bf16[8,16]) custom-call(%all-gather.34)
}
%async_collective_fusion.2 (param_0.2: bf16[8,4]) -> bf16[8,16] {
  %param_0.2 = bf16[8,4]{0,1:T(8,128)(2,1)S(1)} parameter(0)
  ROOT %all-gather.36 = bf16[8,16]{0,1} all-gather(%param_0.2), channel_id=7, chain_id="0"
}
%async_collective_fusion.3 (param_0.3: bf16[8,4]) -> bf16[8,16] {
  %param_0.3 = bf16[8,4]{0,1:T(8,128)(2,1)S(1)} parameter(0)
  ROOT %all-gather.38 = bf16[8,16]{0,1} all-gather(%param_0.3), channel_id=7, chain_id="0"
}
ENTRY %main (p: bf16[8,4], q: f32[16]) -> (bf16[8,16], f32[16], f32[64]) {
  %p = bf16[8,4]{0,1} parameter(0)
  %q = f32[16]{0} parameter(1)
  %all-gather.49 = bf16[8,16]{0,1} all-gather(%p), channel_id=2, op_name="f/all-gather(x)"
  %all-reduce.1 = f32[16]{0} all-reduce(%q), channel_id=3, to_apply=%add
  %all-gather-start = (f32[16]{0}, f32[64]{0}) all-gather-start(%q), channel_id=4
  %all-gather-done = f32[64]{0} all-gather-done(%all-gather-start)
  %all-gather-fusion.1 = bf16[8,16]{0,1} fusion(%all-gather.49), calls=%all-gather.1
  ROOT %tuple = (bf16[8,16], f32[16], f32[64]) tuple(%all-gather-fusion.1, %all-reduce.1)
}
"""


# A loop whose last iteration XLA peeled off: the body's all-reduce is written again
# after the loop for that iteration, under the body's channel; another all-reduce beside.
PEELED = """
%body (param: (s32[], f32[16])) -> (s32[], f32[16]) {
  %x = f32[16]{0} get-tuple-element(%param), index=1
  %all-reduce.3 = f32[16]{0} all-reduce(%x), channel_id=6, to_apply=%add
}
ENTRY %main (p: f32[16]) -> (f32[16], f32[16]) {
  %while = (s32[], f32[16]) while(%init), condition=%cond, body=%body
  %last = f32[16]{0} get-tuple-element(%while), index=1
  %all-reduce.4 = f32[16]{0} all-reduce(%last), channel_id=6, to_apply=%add
  %all-reduce.5 = f32[16]{0} all-reduce(%p), channel_id=8, to_apply=%add
}
"""


# The same loop written out whole: its counter starts at 1 (the peeled iteration is the
# first), its condition stops it before 8, and XLA gave the copy a channel of its own.
PEELED_STEP = """
%cond (param: (s32[], f32[16])) -> pred[] {
  %bound = s32[]{:T(128)} constant(8)
  %param = (s32[]{:T(128)}, f32[16]{0}) parameter(0)
  %counter = s32[]{:T(128)} get-tuple-element(%param), index=0
  ROOT %lt = pred[]{:T(512)} compare(%counter, %bound), direction=LT
}
%fused (p: f32[16]) -> f32[16] {
  %p = f32[16]{0} parameter(0)
  ROOT %all-gather.2 = f32[16]{0} all-gather(%p), channel_id=6, chain_id="0"
}
%body (param: (s32[], f32[16])) -> (s32[], f32[16]) {
  %x = f32[16]{0} get-tuple-element(%param), index=1
  %all-reduce.3 = f32[16]{0} all-reduce(%x), channel_id=6, to_apply=%add
  %piece = f32[16]{0} fusion(%x), kind=kLoop, calls=%fused
  %done = f32[16]{0} fusion(%piece), kind=kLoop, calls=%fused
}
ENTRY %main (p: f32[16]) -> (f32[16], f32[16]) {
  %one = s32[]{:T(128)} constant(1)
  %start = s32[]{:T(128)} copy(%one)
  %peeled = f32[16]{0} all-reduce(%p), channel_id=9, to_apply=%add
  %init = (s32[]{:T(128)}, f32[16]{0}) tuple(%start, %peeled)
  %while = (s32[], f32[16]) while(%init), condition=%cond, body=%body
  %k = t while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_per_step_counts_a_loops_collectives_once_a_trip_and_a_peeled_copy_once():
    # 7 trips of the loop (from 1 to 8) and 3 of the one XLA knows, a chain of two
    # pieces counted once a trip; the peeled copy once, whatever its channel.
    assert residual.collectives(PEELED_STEP, per_step=True) == {
        "all-reduce": 1 + 7 + 3, "all-gather": 7 + 3}
    assert residual.collectives(PEELED_STEP) == {"all-reduce": 2, "all-gather": 1}


def test_a_chain_counts_once_and_names_or_metadata_not_at_all():
    assert residual.collectives(CHAINED) == {"all-gather": 3, "all-reduce": 1}


def test_a_peeled_loop_iterations_copy_counts_with_the_loops_collective():
    assert residual.collectives(PEELED) == {"all-reduce": 2}


def test_anything_but_a_compiled_program_or_its_text_is_refused():
    with pytest.raises(TypeError, match=r"expects a compiled program.*got Lowered"):
        residual.collectives(jax.jit(jnp.sin).lower(1.0))


def test_one_device_holds_none():
    compiled = jax.jit(jax.grad(lambda x: jnp.sum(jnp.tanh(x) ** 2))).lower(
        jnp.ones((8, 8))).compile()
    assert residual.collectives(compiled) == {}


def _channels(text: str, kinds: str = "gather|reduce") -> list[str]:
    """The channel of every instruction of these kinds (`all-gather` ...) in HLO text."""
    return re.findall(r"all-(?:" + kinds + r")\(%.*\bchannel_id=(\d+)", text)


def _unrolled_mlp(ws, x):
    for i in range(ws.shape[0]):
        x = jnp.tanh(x @ ws[i])
    return jnp.sum(x.astype(jnp.float32) ** 2)


def _scan_plain_and_offloaded(ws, x):
    """A scanned tanh MLP's gradient compiled for v5e:2x2, plain and under `Offload`."""

    def mlp(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.sum(h**2)

    with _target.resolve("v5e:2x2").tracing():
        return tuple(jax.jit(jax.grad(f)).lower(ws, x).compile()
                     for f in (mlp, residual.with_hooks(mlp, policy=rp.Offload())))


def _slice(*axes: str) -> Mesh:
    devices = _target.resolve("v5e:2x2").devices
    return Mesh(np.array(devices).reshape(2, 2) if len(axes) == 2 else np.array(devices), axes)


@needs_tpu
def test_a_tpu_programs_collectives_counted_by_construction():
    mesh = _slice("data")

    def gather_and_sum(x):
        whole = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))
        summed = jax.shard_map(lambda s: jax.lax.psum(s, "data"), mesh=mesh,
                               in_specs=P("data"), out_specs=P())(x)
        return whole, summed

    x = jax.ShapeDtypeStruct((512, 128), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    compiled = jax.jit(gather_and_sum).lower(x).compile()
    assert residual.collectives(compiled) == {"all-gather": 1, "all-reduce": 1}


@needs_tpu
@pytest.mark.parametrize("policy", [rp.Quantize(bits=8), rp.Quantize(bits=4)], ids=["int8", "int4"])
def test_a_bfloat16_tensor_parallel_step_keeps_plains_collectives_on_a_tpu_slice(policy):
    # XLA:TPU overlaps the backward's gathers with its matmuls, cut into as many pieces as
    # the compute around them allows, and packing changes that compute: the pieces
    # differ from plain's, the collectives do not.
    mesh = _slice("data", "model")
    ws = jax.ShapeDtypeStruct((4, 512, 512), jnp.bfloat16,
                              sharding=NamedSharding(mesh, P(None, None, "model")))
    x = jax.ShapeDtypeStruct((2048, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))

    with _target.resolve("v5e:2x2").tracing():
        plain = jax.jit(jax.grad(_unrolled_mlp)).lower(ws, x).compile()
        hooked = jax.jit(jax.grad(residual.with_hooks(_unrolled_mlp, policy=policy))).lower(
            ws, x).compile()
    for program in (plain, hooked):
        text = program.as_text()
        gathers = _channels(text, "gather")
        assert 'chain_id="' in text and len(gathers) > len(set(gathers))  # pieces of chains
        # Each collective the partitioner made has a channel of its own.
        assert residual.collectives(program)["all-gather"] == len(set(gathers)), text
    assert residual.collectives(hooked) == residual.collectives(plain)


@needs_tpu
def test_a_scan_whose_iteration_xla_peels_keeps_plains_collectives_on_a_tpu_slice():
    # Offloading the scan's residuals, XLA peels the forward loop's first iteration and the
    # backward's last: the loops run one trip fewer and the peeled iterations repeat
    # their collectives, each run as often per step as plain's.
    mesh = _slice("data", "model")
    ws = jax.ShapeDtypeStruct((8, 256, 256), jnp.float32,
                              sharding=NamedSharding(mesh, P(None, None, "model")))
    x = jax.ShapeDtypeStruct((512, 256), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    plain, hooked = _scan_plain_and_offloaded(ws, x)
    text = hooked.as_text()
    assert "loop_peel" in text and "loop_peel" not in plain.as_text()
    entry = text.index("\nENTRY")
    peeled, looped = set(_channels(text[entry:])), set(_channels(text[:entry]))
    assert peeled & looped  # the same collectives, in the loop and beside it
    assert residual.collectives(hooked) == residual.collectives(plain)
    # Per step, plain's loops issue each of their collectives once a layer. The peeled
    # last backward iteration issues one all-reduce fewer: the cotangent of the input
    # `x`, which the loop computes on its last trip and nothing reads.
    plain_steps = residual.collectives(plain, per_step=True)
    assert plain_steps == {k: 8 * n for k, n in residual.collectives(plain).items()}
    hooked_steps = residual.collectives(hooked, per_step=True)
    assert plain_steps - hooked_steps == {"all-reduce": 1}
    assert not hooked_steps - plain_steps


@needs_tpu
@pytest.mark.parametrize("bits", [4, 2])
def test_byte_scales_keep_plains_collectives_on_shards_of_64_columns_of_a_tpu_slice(bits):
    # Width 512 over 8 model shards of v5e:4x4: 64 columns, two groups of 32 each.
    devices = _target.resolve("v5e:4x4").devices
    mesh = Mesh(np.array(devices).reshape(2, 8), ("data", "model"))
    ws = jax.ShapeDtypeStruct((4, 512, 512), jnp.float32,
                              sharding=NamedSharding(mesh, P(None, None, "model")))
    x = jax.ShapeDtypeStruct((1024, 512), jnp.float32, sharding=NamedSharding(mesh, P("data")))

    with _target.resolve("v5e:4x4").tracing():
        plain = jax.jit(jax.grad(_unrolled_mlp)).lower(ws, x).compile()
        policy = rp.Quantize(bits=bits)
        hooked = jax.jit(jax.grad(residual.with_hooks(_unrolled_mlp, policy=policy))).lower(
            ws, x).compile()
    assert residual.collectives(hooked) == residual.collectives(plain)


@needs_tpu
def test_an_fsdp_scan_under_offload_issues_no_collective_more_per_step_on_a_tpu_slice():
    # Each layer's weights gathered for its matmul. XLA peels the forward's first
    # iteration and gives the loop's copy of the gather a channel of its own, so the
    # program holds one gather more than plain's; per step it issues one fewer, the
    # backward's last iteration reading the gather of the peeled first.
    mesh = _slice("data")
    ws = jax.ShapeDtypeStruct((8, 512, 512), jnp.float32,
                              sharding=NamedSharding(mesh, P(None, "data")))
    x = jax.ShapeDtypeStruct((1024, 512), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    plain, hooked = _scan_plain_and_offloaded(ws, x)
    assert residual.collectives(hooked) - residual.collectives(plain) == {"all-gather": 1}
    plain_steps = residual.collectives(plain, per_step=True)
    assert plain_steps == {"all-gather": 16, "all-reduce": 8}
    assert plain_steps - residual.collectives(hooked, per_step=True) == {"all-gather": 1}
    assert not residual.collectives(hooked, per_step=True) - plain_steps
