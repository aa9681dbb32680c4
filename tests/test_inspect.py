"""`residual.inspect`, `residual.gradcheck` and the command line."""

from __future__ import annotations

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual
from residual import policies as rp
from residual.__main__ import main
from tests.helpers import mlp_params, scan_mlp, unrolled_mlp

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
    assert t["hooked_temp_bytes"] < t["plain_temp_bytes"] and 0 < t["temp_ratio"] < 1
    assert any(r.policy.startswith("Quantize(bits=8") for r in report.rows)
    text = str(report)
    assert re.search("tanh|one_minus_square", text)
    assert "compiled backward temp memory" in text and "x" in text
    html = report._repr_html_()
    assert html.count("<tr>") == len(report.rows) + 1 and "Quantize" in html


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
    assert report.totals["plain_temp_bytes"] > 0


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


def test_gradcheck_uses_finite_differences_in_float64():
    with jax.enable_x64(True):
        x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float64)
        result = residual.gradcheck(lambda v: jnp.sum(jnp.sin(v) ** 2), x, policy=rp.Remat())
        assert result.ok and result.finite_differences is True


def test_cli_inspect(tmp_path, monkeypatch, capsys):
    (tmp_path / "tinymodel.py").write_text(
        "import jax.numpy as jnp\n"
        "def loss(w, x):\n"
        "    return jnp.sum(jnp.tanh(x @ w) ** 2)\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", "tinymodel:loss", "--shape", "32x32", "--shape", "8x32",
                 "--policy", "int8"]) == 0
    out = capsys.readouterr().out
    assert re.search("tanh|one_minus_square", out)
    assert "Quantize(bits=8" in out and "temp memory" in out


def test_cli_demo_runs(capsys):
    with jax.numpy_dtype_promotion("standard"):  # optax's losses mix dtypes
        assert main(["demo", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "gradcheck OK" in out and "final loss ratio" in out and "x of plain jax.grad" in out
