"""`residual.inspect`, `residual.gradcheck` and the command line."""

from __future__ import annotations

import contextlib
import io
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual
from residual import policies as rp
from tests.helpers import RUNNING_PLATFORM, mlp_params, relative_error, scan_mlp, unrolled_mlp

# What tanh's derivative saves: y (and 1 - y) on jax 0.10, 1 - y² from jax 0.11 on.
_TANH = {"tanh", "one_minus_square"}

_SHAPE = re.compile(r"^(\w+)\[([\d,]*)\]")


def _jax_saved_bytes(f, *args) -> int:
    """Total bytes of the residuals JAX itself reports saving."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(f, *args)
    total = 0
    for line in out.getvalue().splitlines():
        match = _SHAPE.match(line)
        dtype, dims = match.groups()
        size = int(np.prod([int(d) for d in dims.split(",") if d]))
        total += size * jnp.dtype({"f32": "float32", "i32": "int32", "bool": "bool",
                                  "bf16": "bfloat16", "f16": "float16"}[dtype]).itemsize
    return total


@pytest.mark.parametrize("model", [scan_mlp, unrolled_mlp])
def test_totals_agree_with_jax_print_saved_residuals(model):
    ws, x = mlp_params(layers=3, width=32, batch=8)
    report = residual.inspect(model, ws, x, compiled=False)
    assert report.totals["residual_bytes"] == _jax_saved_bytes(model, ws, x)


def test_report_rows_scan_iterations_and_policy_effect():
    ws, x = mlp_params(layers=4, width=64, batch=32)
    report = residual.inspect(scan_mlp, ws, x, policy=rp.Quantize(bits=8, min_bytes=0))
    body = [r for r in report.rows if r.iterations == 4]
    assert body and all(r.shape == (32, 64) for r in body)
    assert any(r.primitive in _TANH and r.source.startswith("helpers.py:") for r in body)
    t = report.totals
    assert t["stored_bytes"] < 0.7 * t["residual_bytes"]  # the weights (half) are kept
    assert t["hooked_peak_bytes"] < t["plain_peak_bytes"] and 0 < t["peak_ratio"] < 1
    assert t["hooked_beyond_bytes"] < t["plain_beyond_bytes"]
    assert t["beyond_ratio"] < t["peak_ratio"]
    assert t["target"] == jax.devices()[0].platform
    assert any(r.policy.startswith("Quantize(bits=8") for r in report.rows)
    text = str(report)
    assert re.search("tanh|one_minus_square", text)
    assert f"compiled jit(grad) peak memory on {RUNNING_PLATFORM}" in text
    html = report._repr_html_()
    sections = len({r.section for r in report.rows} - {""})
    assert html.count("<tr>") == len(report.rows) + 1 + sections and "Quantize" in html
    assert "packed: stored as what the policy" in html  # the legend


def test_report_plot_is_a_figure():
    import matplotlib

    matplotlib.use("Agg")
    ws, x = mlp_params(layers=2, width=32, batch=8)
    fig = residual.inspect(scan_mlp, ws, x, policy=rp.Remat(), compiled=False).plot()
    assert len(fig.axes[0].patches) >= 2
    with pytest.raises(ValueError, match="`by` must be 'scope' or 'primitive'"):
        residual.inspect(scan_mlp, ws, x, compiled=False).plot(by="file")


def test_inspect_works_on_shape_specs_without_running_anything():
    specs = [jax.ShapeDtypeStruct((3, 16, 16), jnp.float32), jax.ShapeDtypeStruct((4, 16),
                                                                                 jnp.float32)]
    report = residual.inspect(scan_mlp, *specs, policy=rp.Cast(jnp.bfloat16))
    assert report.totals["plain_beyond_bytes"] > 0


def test_gradcheck_passes_good_hooks_and_names_the_worst_residual_of_bad_ones():
    ws, x = mlp_params(layers=2, width=64, batch=8)
    good = residual.gradcheck(scan_mlp, ws, x, policy=rp.Quantize(bits=8, min_bytes=0))
    assert good.ok and good.grad_rel_error < 0.05 and good.residuals
    assert all(c.max_rel_error < 0.02 for c in good.residuals)
    bad = residual.gradcheck(scan_mlp, ws, x, pack=lambda v: v * 2, unpack=lambda p: p)
    assert not bad.ok and bad.residuals[0].max_rel_error == pytest.approx(1.0)
    assert "FAILED" in repr(bad) and "residual #" in repr(bad)
    with pytest.raises(AssertionError, match="gradcheck FAILED"):
        residual.gradcheck(scan_mlp, ws, x, pack=lambda v: v * 2, unpack=lambda p: p,
                           raise_on_failure=True)


def test_gradcheck_measures_both_parts_of_complex_residuals():
    # A residual whose real part is zero: its whole round-trip error is imaginary.
    def f(x, c):
        s = jax.lax.complex(jnp.zeros_like(x), jnp.sin(x))
        return jnp.sum(jnp.real(s * s * c))

    x = jax.random.normal(jax.random.key(0), (16, 64))
    c = jnp.ones((16, 64), jnp.complex64)
    result = residual.gradcheck(f, x, c, policy=rp.Quantize(bits=4, min_bytes=0))
    assert any(r.max_rel_error > 0.01 for r in result.residuals), result


def test_gradcheck_judges_each_argument_whole_not_a_bias_whose_gradient_is_noise():
    # A bias before a batch norm has a true gradient of zero: rounding noise, which
    # no two programs share. The parameters, one argument, agree to rounding.
    def loss(params, x):
        h = x @ params["w1"] + params["b1"]
        h = (h - h.mean(0)) / jnp.sqrt(h.var(0) + 1e-5)
        return jnp.mean((jnp.tanh(h) @ params["w2"]) ** 2)

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (32, 64)) / 6, "b1": jnp.full(64, 0.1),
              "w2": jax.random.normal(k2, (64, 8)) / 8}
    x = jax.random.normal(k3, (16, 32))
    for policy in (rp.Identity(), rp.Remat(), rp.Quantize(bits=8, min_bytes=0)):
        result = residual.gradcheck(loss, params, x, policy=policy)
        assert result.ok, result
    # Each argument is still judged on its own: hooks that spoil only the gradient of
    # a small argument (doubling the residual `cos(b)`), next to a large one, fail.
    def two(w, b):
        return 1e3 * jnp.sum(jnp.tanh(x @ w)) + jnp.sum(jnp.sin(b))

    b = jnp.linspace(0.0, 1.0, 7)  # the only residual of 7 elements
    spoil = residual.gradcheck(two, params["w1"], b, unpack=lambda p: p,
                               pack=lambda r: r * 2 if r.shape == b.shape else r)
    assert not spoil.ok and spoil.grad_rel_error == pytest.approx(1.0, rel=1e-5)


def test_a_model_holding_functions_is_refused_with_the_fix():
    mlp = eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(0))
    x = jnp.ones((2, 4))

    def loss(m, x):
        return jnp.sum(jax.vmap(m)(x) ** 2)

    for tool in (residual.inspect, residual.gradcheck):
        with pytest.raises(TypeError, match=r"argument 0 holds .*activation.*eqx\.partition"):
            tool(loss, mlp, x, policy=rp.Identity())
    params, static = eqx.partition(mlp, eqx.is_array)
    assert residual.gradcheck(lambda p, x: loss(eqx.combine(p, static), x), params, x,
                              policy=rp.Identity()).ok


def test_gradcheck_uses_finite_differences_in_float64():
    with jax.enable_x64(True):
        x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float64)
        result = residual.gradcheck(lambda v: jnp.sum(jnp.sin(v) ** 2), x, policy=rp.Remat())
        assert result.ok and result.finite_differences is True


def _two_scans(ws, x):
    """Two scans, the first with a scan inside its body: three bodies, each numbered apart."""

    def outer(h, w):
        def inner(g, _):
            return jnp.tanh(g @ w), None

        h, _ = jax.lax.scan(inner, h, None, length=3)
        return jnp.sin(h), None

    h, _ = jax.lax.scan(outer, x, ws)
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, ws)
    return jnp.sum(h**2)


def test_report_numbers_each_row_once_in_order_and_counts_every_iteration():
    ws, x = mlp_params(layers=2, width=64, batch=64)
    report = residual.inspect(_two_scans, ws, x, policy=rp.Quantize(bits=8, min_bytes=0),
                              compiled=False)
    labels = [r.label for r in report.rows]
    assert len(set(labels)) == len(labels)
    sections = list(dict.fromkeys(r.section for r in report.rows))
    # The function first, then each scan body after the one around it, in program order.
    assert sections == ["", "body1", "body2", "body3"]
    assert {r.iterations for r in report.rows if r.section == "body2"} == {6}
    assert {r.iterations for r in report.rows if r.section in ("body1", "body3")} == {2}
    for section in sections:
        indices = [r.index for r in report.rows if r.section == section]
        assert indices == sorted(indices)
        prefix = f"{section}[" if section else ""
        assert all(r.label == (f"{prefix}{r.index}]" if section else str(r.index))
                   for r in report.rows if r.section == section)
    # `size` and `stored` both count every iteration: a packed row is smaller, never larger.
    tanh = next(r for r in report.rows if r.section == "body2" and r.primitive in _TANH)
    assert tanh.total_bytes == 6 * 64 * 64 * 4 and tanh.how == "packed"
    assert tanh.total_bytes / 4 <= tanh.stored_bytes < tanh.total_bytes / 3
    t = report.totals
    assert t["residual_bytes"] == sum(r.total_bytes for r in report.rows)
    assert t["stored_bytes"] == sum(r.stored_bytes for r in report.rows)
    text = str(report)
    assert max(len(line) for line in text.splitlines()) <= 100
    line = next(line for line in text.splitlines() if line.startswith(tanh.label + " "))
    stored = f"{tanh.stored_bytes / 1024:.1f} KiB"
    assert re.search(rf"96\.0 KiB +packed +{re.escape(stored)}", line)  # one unit on both sides
    wide = report.text(width=None)
    assert max(len(line) for line in wide.splitlines()) > 100 and "Quantize" in wide


def test_report_says_how_each_residual_is_kept():
    ws, x = mlp_params(layers=3, width=64, batch=32)
    # Unrolled: tanh's 1 - y (or 1 - y²) is derived from the next layer's stored input.
    report = residual.inspect(unrolled_mlp, ws, x, policy=rp.Quantize(bits=8, min_bytes=0),
                              compiled=False)
    hows = {r.how for r in report.rows}
    assert {"kept", "packed", "derived"} <= hows
    assert all(r.stored_bytes == 0 for r in report.rows if r.how == "derived")
    plain = residual.inspect(scan_mlp, ws, x, compiled=False)
    assert {r.how for r in plain.rows} == {"kept"} and "derived: " not in str(plain)
    remat = residual.inspect(scan_mlp, ws, x, policy=rp.Remat(), compiled=False)
    assert "recomputed" in {r.how for r in remat.rows}
    assert "recomputed: not stored" in str(remat)


def test_report_names_constants_and_derives_them_instead_of_storing():
    def attention(q, k, v):
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True) ** 2)

    args = [jax.random.normal(jax.random.key(i), (2, 128, 4, 32)) for i in range(3)]
    policy = rp.Quantize(bits=8, min_bytes=0)
    report = residual.inspect(attention, *args, policy=policy, compiled=False)
    # Only the inputs are called inputs: `where`'s derivative saves a broadcast of zeros
    # the shape of the attention logits, made inside jax's own `jit`.
    assert {r.shape for r in report.rows if r.primitive is None} <= {(2, 128, 4, 32)}
    zeros = [r for r in report.rows if r.shape == (1, 2, 4, 128, 128) and r.dtype == "float32"
             and r.primitive == "broadcast_in_dim"]
    assert len(zeros) == 1 and zeros[0].source.startswith("test_inspect.py:")
    # A constant is made again in the backward, not stored, and the gradient is the
    # one the policy gives the other residuals.
    assert zeros[0].how == "derived" and zeros[0].stored_bytes == 0
    expected = jax.grad(attention, argnums=(0, 1, 2))(*args)
    got = jax.jit(jax.grad(residual.with_hooks(attention, policy=policy),
                           argnums=(0, 1, 2)))(*args)
    assert relative_error(got, expected) < 0.01
    exact = jax.jit(jax.grad(residual.with_hooks(attention, policy=rp.Identity()),
                             argnums=(0, 1, 2)))(*args)
    assert relative_error(exact, expected) < 1e-6


def test_report_says_constant_for_an_array_the_function_closes_over():
    c = jax.random.normal(jax.random.key(0), (64, 64))
    inner = jax.jit(lambda x: jnp.sin(x * c))
    report = residual.inspect(lambda x: jnp.sum(inner(x)), jnp.ones((64, 64)),
                              compiled=False)
    constant = [r for r in report.rows if r.primitive is None]
    assert len(constant) == 1 and not constant[0].is_input
    assert "(constant)" in str(report) and "(input)" not in str(report)


def test_report_sources_name_the_users_file_not_a_librarys():
    import equinox as eqx

    layer = eqx.nn.Linear(64, 64, key=jax.random.key(0))

    def loss(layer, x):
        return jnp.sum(jnp.tanh(jax.vmap(layer)(x)) ** 2)

    report = residual.inspect(loss, layer, jnp.ones((32, 64)), compiled=False)
    sources = {r.source for r in report.rows if r.primitive is not None}
    assert sources and all(s.startswith("test_inspect.py:") for s in sources), sources
    assert any("(test_report_sources_name_the_users_file_not_a_librarys.loss)" in s
               for s in sources)


def test_report_data_forms():
    ws, x = mlp_params(layers=2, width=32, batch=8)
    report = residual.inspect(scan_mlp, ws, x, policy=rp.Cast(jnp.bfloat16), compiled=False)
    rows = report.to_dicts()
    assert [d["label"] for d in rows] == [r.label for r in report.rows]
    assert {"label", "section", "index", "how", "total_bytes", "stored_bytes"} <= set(rows[0])


def test_report_to_dataframe_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pandas", None)
    report = residual.inspect(lambda v: jnp.sum(jnp.sin(v)), jnp.ones(4), compiled=False)
    with pytest.raises(ImportError, match=r"needs pandas.*report.to_dicts\(\)"):
        report.to_dataframe()


def test_inspect_and_gradcheck_say_why_nothing_was_packed():
    ws, x = mlp_params(layers=2, width=32, batch=8)
    policy = rp.Quantize(bits=8)
    report = residual.inspect(scan_mlp, ws, x, policy=policy, compiled=False)
    assert report.totals["stored_bytes"] == report.totals["residual_bytes"]
    (note,) = report.notes
    assert re.search(r"Quantize\(bits=8\) packed nothing: of \d+ residuals, \d+ are smaller "
                     r"than its `min_bytes=16384`", note)
    assert "min_bytes=0" in note and "The largest is 1.0 KiB" in note
    assert "packed nothing" in str(report)
    check = residual.gradcheck(scan_mlp, ws, x, policy=policy)
    assert check.ok and not check.residuals
    assert "packed nothing" in repr(check) and "min_bytes=0" in repr(check)
    packs = residual.gradcheck(scan_mlp, ws, x, policy=rp.Quantize(bits=8, min_bytes=0))
    assert "packed nothing" not in repr(packs)


@pytest.mark.parametrize("model", [scan_mlp, _two_scans], ids=["scan", "scans in a scan"])
def test_nothing_packed_names_the_region_that_decided(model):
    ws, x = mlp_params(layers=2, width=32, batch=8)

    def loss(ws, x):  # the scans' bodies and the loss after them, in the region
        with residual.saved_tensors_hooks(policy=rp.Identity()):
            return model(ws, x)

    policy = rp.Quantize(bits=8, min_bytes=0)
    (note,) = residual.inspect(loss, ws, x, policy=policy, compiled=False).notes
    assert re.search(r"of \d+ residuals, .*\d+ are decided by a `saved_tensors_hooks` "
                     r"region in the function, not by this policy", note), note
    assert "by the policy itself" not in note
    # A region of the policy itself decides as the policy would: the reason is its own.
    (note,) = residual.inspect(
        lambda ws, x: _in_region(rp.Quantize(bits=8), model, ws, x), ws, x,
        policy=rp.Quantize(bits=8), compiled=False).notes
    assert "smaller than its `min_bytes=16384`" in note and "region" not in note, note


def _in_region(policy, model, *args):
    with residual.saved_tensors_hooks(policy=policy):
        return model(*args)
