"""`residual.peak` and `inspect(..., peak=True)`: what is live at the compiled program's peak,
on programs whose peak is known by construction, on CPU and on a TPU compiled for without one.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual
from residual import policies as rp
from residual._policy import Policy
from tests.foundation.test_target import needs_gpu, needs_tpu
from tests.helpers import xfail_on_gpu


def _mlp(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w)  # the stored activations' line
    return jnp.sum(x**2)


_LINE = _mlp.__code__.co_firstlineno + 2


def _scan_mlp(ws, x):
    def body(x, w):
        return jnp.tanh(x @ w), None

    return jnp.sum(jax.lax.scan(body, x, ws)[0] ** 2)


def _adds_up(p: residual.Peak, within: float = 0.01) -> bool:
    total = sum(r.bytes for r in p.rows)
    return abs(total - p.memory.peak) <= within * p.memory.peak


@pytest.mark.parametrize("program", ["mlp", "mlp int8", "scan", "scan int8"])
def test_rows_add_up_to_the_compilers_peak(program):
    fn = _scan_mlp if program.startswith("scan") else _mlp
    ws = jnp.ones((4, 256, 256)) if program.startswith("scan") else [jnp.ones((256, 256))] * 4
    if program.endswith("int8"):
        fn = residual.with_hooks(fn, policy=rp.Quantize(bits=8))
    x = jnp.ones((1024, 256))
    p = residual.peak(jax.grad(fn), ws, x)
    assert p.memory == residual.compiled_memory(jax.grad(fn), ws, x)
    assert _adds_up(p), (sum(r.bytes for r in p.rows), p.memory.peak)
    assert p.timeline.max() == p.live_bytes <= p.memory.peak
    assert p.position == int(np.argmax(p.timeline))
    assert "as the compiler's peak" in p.text()
    assert p.working == {"device": p.memory.beyond}


def test_one_big_temporary_is_the_largest_row():
    x = jnp.ones((1024, 64))
    p = residual.peak(lambda x: jnp.sort(x @ x.T, axis=1)[:, :4], x)
    largest = p.rows[0]
    assert (largest.kind, largest.array, largest.bytes) == ("forward", "f32[1024,1024]", 4 * 2**20)
    assert p.backward is None and _adds_up(p)


@xfail_on_gpu("the GPU compiler fuses tanh into the matmul's epilogue, so the stored "
              "buffer is named by the matmul")
def test_stored_activations_are_one_row_with_their_source_line():
    layers, ws, x = 6, [jnp.ones((256, 256))] * 6, jnp.ones((2048, 256))
    p = residual.peak(jax.grad(_mlp), ws, x)
    stored = [r for r in p.rows if r.kind == "stored"]
    assert stored, p.text()
    row = max(stored, key=lambda r: r.bytes)
    # Each layer's tanh output but the last is stored (the last is squared at once).
    assert (row.array, row.count, row.op) == ("f32[2048,256]", layers - 1, "tanh"), p.text()
    assert row.source == f"test_peak.py:{_LINE}"
    assert row.bytes == (layers - 1) * x.nbytes
    arguments = [r for r in p.rows if r.kind == "argument"]
    assert sum(r.bytes for r in arguments) == p.memory.arguments
    assert p.backward is not None and p.backward > 0


def test_quantize_shrinks_what_is_stored_at_the_peak():
    ws, x = jnp.ones((6, 256, 256)), jnp.ones((2048, 256))
    plain = residual.peak(jax.grad(_scan_mlp), ws, x)
    int8 = residual.peak(jax.grad(residual.with_hooks(_scan_mlp, policy=rp.Quantize(bits=8))),
                         ws, x)
    stored = {name: sum(b for k, b in p.by_kind().items() if k == "stored")
              for name, p in (("plain", plain), ("int8", int8))}
    assert stored["plain"] >= 12 * 2**20  # six f32[2048,256] carries and six tanh outputs
    assert stored["int8"] < 0.5 * stored["plain"], stored


def test_a_lowered_program_is_read_as_it_is():
    ws, x = [jnp.ones((128, 128))] * 2, jnp.ones((256, 128))
    lowered = jax.jit(jax.grad(_mlp)).lower(ws, x)
    p = residual.peak(lowered)
    assert p.memory == residual.Memory.of(lowered.compile()) and _adds_up(p)
    with pytest.raises(TypeError, match=r"jax.jit\(f\).lower\(\*args\)"):
        residual.peak(lowered.compile())
    with pytest.raises(TypeError, match="a lowered program and arguments too"):
        residual.peak(lowered, ws, x)
    with pytest.raises(TypeError, match="expects a function"):
        residual.peak(3)


def test_text_html_dicts_and_plot():
    p = residual.peak(jax.grad(_mlp), [jnp.ones((128, 128))] * 3, jnp.ones((512, 128)))
    text = p.text(width=100)
    assert all(len(line) <= 100 for line in text.splitlines()), text
    assert "^ the peak" in text and "| the backward's start" in text
    assert "<table>" in p._repr_html_()
    rows = p.to_dicts()
    assert sum(r["bytes"] for r in rows) == sum(r.bytes for r in p.rows)
    fields = {"kind", "array", "count", "bytes", "unpadded", "op", "source", "padding"}
    assert fields <= set(rows[0])
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    assert p.plot().axes


@dataclasses.dataclass(frozen=True)
class _KeepsTheFloat(Policy):
    """Packs to bfloat16 but keeps the float beside it: a decision without effect."""

    def pack(self, x, info):
        return x.astype(jnp.bfloat16), x

    def unpack(self, packed, info):
        return packed[1]


@dataclasses.dataclass(frozen=True)
class _Bfloat16(Policy):
    def pack(self, x, info):
        return x.astype(jnp.bfloat16)

    def unpack(self, packed, info):
        return packed.astype(info.dtype)


def test_a_packed_residual_whose_float_is_kept_is_flagged():
    ws, x = [jnp.ones((256, 256))] * 4, jnp.ones((1024, 256))
    kept = residual.inspect(_mlp, ws, x, policy=_KeepsTheFloat(), peak=True)
    packed = [r for r in kept.rows if r.how == "packed"]
    inputs = [r for r in packed if r.is_input]
    activations = [r for r in packed if not r.is_input and r.primitive == "tanh"]
    notes = kept.peak.notes
    assert len([n for n in notes if "argument stays alive" in n]) == len(inputs) == 5, notes
    # XLA recomputes the last layer's cheap residuals from its output itself; the stored
    # tanh outputs are the floats kept next to their packed copies.
    flagged = [n for n in notes if "packed, but the float is still kept" in n]
    assert len(flagged) >= len(activations) >= 3, notes
    count = len(inputs) + len(flagged)
    assert any(f"{count} of {len(packed)} decisions took no effect" in n for n in kept.notes)
    cast = residual.inspect(_mlp, ws, x, policy=_Bfloat16(), peak=True)
    assert not [n for n in cast.peak.notes if "still kept" in n], cast.peak.notes
    assert "at the peak:" in cast.text()


@xfail_on_gpu("XLA:GPU keeps each layer's matmul output (a split-K reduction's result), not "
              "its tanh, and computes tanh again inside the next matmul's fusion: the "
              "recomputation takes effect, and nothing is flagged (seen compiling for an H100 "
              "from a CPU host and on an H200)")
def test_a_recomputed_residual_the_compiler_keeps_anyway_is_flagged():
    # A step that also returns the loss computes every activation in the forward; XLA
    # then keeps them for the backward instead of recomputing them (common-subexpression
    # elimination), which an unrolled MLP's peak does not punish. The gradient alone
    # needs the activations for nothing but the backward: there, they are recomputed.
    from residual._inspect import peak as _peak
    from residual._target import resolve

    layers = 6
    ws, x = [jnp.full((256, 256), 0.01)] * layers, jnp.ones((512, 256))
    remat = residual.with_hooks(_mlp, policy=rp.Remat())
    rows = residual.inspect(_mlp, ws, x, policy=rp.Remat(), compiled=False).rows
    here = resolve(None)
    step = here.compile_with_dumps(jax.value_and_grad(remat), (ws, x))
    flagged = _peak.unkept_decisions(*_peak.read(*step, here.label), rows)
    # A tanh kept per layer. Where JAX names the last one's residual after the loss's
    # `mul` (jax 0.12), that row is not flagged: only rows of the primitive that made
    # a kept float are.
    tanh = {r.label for r in rows if r.how == "recomputed" and r.primitive == "tanh"}
    assert {n.split()[1] for n in flagged} == tanh and len(tanh) >= layers - 1, flagged
    assert all("recomputed, but the compiler keeps" in n for n in flagged), flagged
    report = residual.inspect(_mlp, ws, x, policy=rp.Remat(), peak=True)
    assert not [n for n in report.peak.notes if "recomputed, but" in n], report.peak.notes
    scan = residual.inspect(_scan_mlp, jnp.stack(ws), x, policy=rp.Remat(), peak=True)
    assert [r for r in scan.rows if r.how == "recomputed"]
    assert not [n for n in scan.peak.notes if "recomputed, but" in n], scan.peak.notes


def test_inspect_peak_needs_the_compiled_program():
    with pytest.raises(ValueError, match="drop `compiled=False`"):
        residual.inspect(_mlp, [jnp.ones((8, 8))], jnp.ones((4, 8)), compiled=False, peak=True)


@needs_tpu
def test_tpu_rows_and_quantize_statistics_in_whole_tiles():
    """On TPU the rows are the arguments, the outputs and the working values of the
    memory space whose peak the compiler counts. A TPU tiles the two minor axes of every
    array (f32 in 8x128 tiles); Quantize groups these float32 residuals down their
    rows, so its per-group statistics, `f32[rows / 64, columns]`, fill whole tiles, and
    never reshapes the residual into groups, so it takes no padding in the forward."""
    ws = [jax.ShapeDtypeStruct((512, 512), jnp.float32)] * 2
    x = jax.ShapeDtypeStruct((1024, 512), jnp.float32)
    plain = residual.peak(jax.grad(_mlp), ws, x, target="v5e")
    assert plain.target == "v5e" and plain.memory.platform == "tpu"
    assert _adds_up(plain), plain.text()
    int4 = residual.peak(jax.grad(residual.with_hooks(_mlp, policy=rp.Quantize(bits=4))),
                         ws, x, target="v5e")
    assert _adds_up(int4), int4.text()
    assert "as the compiler's peak" in int4.text()
    # Small working values fit in on-chip memory, whose peak is then the larger one.
    for p in (plain, int4):
        assert p.working["on-chip"] > p.working["device"], p.working
        assert p.memory.beyond == pytest.approx(p.working["on-chip"], rel=0.01), p.working
        assert any("on-chip memory's values at its peak" in n for n in p.notes), p.notes
        assert {r.space for r in p.rows
                if r.kind not in ("argument", "output", "unplaced")} == {1}, p.text()
    # Reshaping the residual into `[1024, 8, 64]` groups (as Quantize once did) put a
    # float the residual's size, padded 2x, and statistics padded 16x at this peak.
    big = 0.01 * int4.memory.peak
    assert not [r for r in int4.rows if r.kind in ("forward", "stored") and r.padding >= 1.5
                and r.bytes >= big], int4.text()
    # The rows padded 2x or more are named in a note, and only they.
    padded = [r for r in int4.rows if r.padding >= 2 and r.bytes >= big]
    assert bool(padded) == any("padded 2x or more" in n for n in int4.notes), int4.text()


@needs_tpu
def test_tpu_peak_of_stored_activations_in_device_memory():
    # Eight layers' f32[4096,1024] tanh outputs, stacked by the scan, are too large
    # for on-chip memory: device memory's peak is the larger, and the rows are its own.
    ws = jax.ShapeDtypeStruct((8, 1024, 1024), jnp.float32)
    x = jax.ShapeDtypeStruct((4096, 1024), jnp.float32)
    p = residual.peak(jax.grad(_scan_mlp), ws, x, target="v5e")
    assert _adds_up(p), p.text()
    assert any("device memory's values at its peak" in n for n in p.notes), p.notes
    assert p.memory.beyond == pytest.approx(p.working["device"], rel=0.01), p.working
    assert p.working["on-chip"] < p.working["device"], p.working
    stored = [r for r in p.rows if r.kind == "stored"]
    assert stored and all(r.space == 0 for r in p.rows), p.text()
    assert sum(r.unpadded for r in stored) >= 8 * 4096 * 1024 * 4, p.text()


@needs_gpu
def test_h100_rows_add_up_to_the_compilers_peak():
    ws = [jax.ShapeDtypeStruct((512, 512), jnp.float32)] * 3
    x = jax.ShapeDtypeStruct((1024, 512), jnp.float32)
    p = residual.peak(jax.grad(_mlp), ws, x, target="h100")
    assert p.memory.platform == "gpu" and _adds_up(p), p.text()
    stored = [r for r in p.rows if r.kind == "stored"]
    assert stored and stored[0].source == f"test_peak.py:{_LINE}", p.text()


@needs_tpu
def test_tpu_offload_that_keeps_a_device_copy_is_flagged():
    # Measured on v5e, jax 0.12.0.1: offloading an unrolled MLP's residuals (its `tanh`
    # derivatives recomputed, a TPU's default) leaves the compiled peak at 1.06x plain's,
    # with the 4 offloaded floats flagged: they stay on the device next to their host
    # copies.
    ws = [jax.ShapeDtypeStruct((1024, 1024), jnp.float32)] * 4
    x = jax.ShapeDtypeStruct((2048, 1024), jnp.float32)
    report = residual.inspect(_mlp, ws, x, policy=rp.Offload(), peak=True, target="v5e")
    offloaded = {r.label for r in report.rows if r.how == "packed" and not r.is_input}
    decided = [r for r in report.rows if r.how in ("packed", "recomputed")]
    flagged = [n for n in report.peak.notes if "a device copy is kept" in n]
    assert report.totals["peak_ratio"] >= 1.0 and flagged, report.peak.notes
    assert {n.split()[1] for n in flagged} <= offloaded
    assert f"{len(flagged)} of {len(decided)} decisions took no effect" in report.text()


def test_inspect_peak_on_a_scan_counts_the_body_residuals_kept_as_they_are():
    # A scan body's residuals are counted per array type with the packed ones: those
    # stored as they are (here too small to pack) must count as kept, not be flagged.
    from tests.helpers import mlp_params, scan_mlp

    ws, x = mlp_params(layers=4, width=64, batch=64)
    report = residual.inspect(scan_mlp, ws, x, policy=rp.Quantize(bits=8, min_bytes=2**20),
                              peak=True)
    in_body = [r for r in report.rows if r.section and r.how == "kept"]
    assert in_body and not [r for r in report.rows if r.how == "packed"]
    assert not [n for n in report.peak.notes if "still kept" in n], report.peak.notes
    assert "at the peak:" in report.text()
