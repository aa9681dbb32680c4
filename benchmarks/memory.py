"""Memory of `jit(grad)` under each policy, as ratios to plain `jax.grad` in the same run.

For each model: the residual bytes each policy stores (from `residual.inspect`) and
XLA's temp memory of the compiled backward (`compiled.memory_analysis()`), both
relative to plain `jax.grad`, and `jax.checkpoint` with `nothing_saveable` /
`dots_saveable` on the layer body for comparison. Compile-only: nothing is run.

    python benchmarks/memory.py            # full sizes (a few minutes on 2 cores)
    python benchmarks/memory.py --small    # a quick run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
import _models as models
import _targets

import residual
from residual import policies as rp

POLICIES = {
    "Identity": rp.Identity(),
    "Cast(bf16)": rp.Cast(jnp.bfloat16),
    "Quantize int8": rp.Quantize(bits=8),
    "Quantize int4": rp.Quantize(bits=4),
    "Quantize 2-bit": rp.Quantize(bits=2),
    "Quantize fp8": rp.Quantize(format="fp8_e4m3"),
    "Remat": rp.Remat(),
    "Remat per layer": rp.select([(rp.where(in_scan=True), rp.Remat())]),
    "keep dots, remat rest": rp.select(
        [(rp.where(primitive="dot_general"), rp.Identity())], default=rp.Remat()
    ),
}


def temp_bytes(fn, *args) -> int:
    return jax.jit(jax.grad(fn)).lower(*args).compile().memory_analysis().temp_size_in_bytes


def measure(name, model, args, targets, checkpoint_models=()):
    plain = temp_bytes(model, *args)
    print(f"\n{name}: plain jax.grad temp {plain / 2**20:.1f} MiB")
    print(f"  {'policy':24s} {'stored/residual':>16s} {'temp vs plain':>14s} {'temp MiB':>9s}")
    ratios = {}
    for label, policy in POLICIES.items():
        report = residual.inspect(model, *args, policy=policy, compiled=False)
        stored = report.totals["ratio"]
        hooked = temp_bytes(residual.with_hooks(model, policy=policy), *args)
        ratios[label] = hooked / plain
        print(f"  {label:24s} {stored:16.2f} {ratios[label]:14.2f} {hooked / 2**20:9.1f}")
    for label, checkpointed in checkpoint_models:
        hooked = temp_bytes(checkpointed, *args)
        ratios[label] = hooked / plain
        print(f"  {label:24s} {'':16s} {ratios[label]:14.2f} {hooked / 2**20:9.1f}")
    return _targets.report(ratios, targets)


def _vmap_temp_bytes(batched, fn, args) -> int:
    grad = jax.grad(fn, argnums=(0, 1))
    return jax.jit(batched(grad)).lower(*args).compile().memory_analysis().temp_size_in_bytes


def measure_vmap(ws, x) -> int:
    """`vmap(grad)`: per-example gradients (weights shared) and an ensemble of 2 models."""
    examples = jnp.stack([x * (1 + i / 64) for i in range(64)])
    cases = {
        "per-example, 64 examples": (
            lambda g: jax.vmap(g, in_axes=(None, 0)), (ws, examples)),
        "ensemble of 2 models": (lambda g: jax.vmap(g), (jnp.stack([ws, 2 * ws]), examples[:2])),
    }
    layers, rows, width = ws.shape[0], x.shape[0], x.shape[1]
    print(f"\nunrolled MLP under vmap(grad), {layers} layers, {rows} rows x width {width} "
          "per example")
    ratios = {}
    for name, (batched, args) in cases.items():
        plain = _vmap_temp_bytes(batched, models.unrolled_mlp, args)
        line = f"  {name:26s} plain {plain / 2**20:6.1f} MiB"
        for label in ("Quantize int8", "Cast(bf16)"):
            hooked = residual.with_hooks(models.unrolled_mlp, policy=POLICIES[label])
            ratios[name, label] = _vmap_temp_bytes(batched, hooked, args) / plain
            line += f"   {label} {ratios[name, label]:.2f}x"
        print(line)
    return _targets.report(ratios, [
        (lambda r: max(r.values()) < 1.0, "every vmap case below plain jax.grad"),
    ])


def main(small: bool) -> int:
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
    layers, batch, width = (8, 512, 256) if small else (8, 4096, 1024)
    blocks, t_width, seq, t_batch = (4, 128, 64, 4) if small else (4, 256, 256, 16)
    checkpoints = [
        ("jax.checkpoint nothing", models.checkpointed_scan_mlp(
            jax.checkpoint_policies.nothing_saveable)),
        ("jax.checkpoint dots", models.checkpointed_scan_mlp(
            jax.checkpoint_policies.dots_saveable)),
    ]
    remat_vs_checkpoint = (
        lambda r: r["Remat per layer"] <= 1.05 * r["jax.checkpoint nothing"],
        "Remat per layer within 5% of jax.checkpoint(nothing_saveable) on the layer body",
    )
    failed = 0
    ws, x = models.mlp_params(layers, width, batch)
    failed += measure(
        f"scan MLP f32, {layers} layers, batch {batch} x width {width}",
        models.scan_mlp, (ws, x),
        [
            (lambda r: r["Quantize int8"] <= 0.45, "int8 <= 0.45x"),
            (lambda r: r["Quantize int4"] <= 0.35, "int4 <= 0.35x"),
            (lambda r: r["Quantize 2-bit"] <= 0.30, "2-bit <= 0.30x"),
            remat_vs_checkpoint,
        ],
        checkpoints,
    )
    ws16, x16 = models.mlp_params(layers, width, batch, jnp.bfloat16)
    failed += measure(
        "scan MLP bf16", models.scan_mlp, (ws16, x16),
        [(lambda r: r["Quantize int8"] <= 0.6, "int8 <= 0.6x")], checkpoints,
    )
    failed += measure(
        "unrolled MLP f32", models.unrolled_mlp, (ws, x),
        [
            (lambda r: max(r[k] for k in POLICIES) <= 1.0, "no policy above plain jax.grad"),
            (lambda r: r["Quantize int8"] <= 0.6, "int8 <= 0.6x (aim)"),
        ],
        [
            ("jax.checkpoint nothing", models.checkpointed_unrolled_mlp(
                jax.checkpoint_policies.nothing_saveable)),
            ("jax.checkpoint dots", models.checkpointed_unrolled_mlp(
                jax.checkpoint_policies.dots_saveable)),
        ],
    )
    failed += measure_vmap(*models.mlp_params(6, 128, 256))
    loss, params, tokens = models.transformer(blocks, t_width, 4, seq, t_batch)
    failed += measure(
        f"equinox transformer, {blocks} blocks (scan), width {t_width}, seq {seq}, "
        f"batch {t_batch}",
        loss, (params, tokens),
        [(lambda r: r["Quantize int8"] < 1.0, "int8 below plain")],
    )
    print(f"\n{failed} target(s) missed")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    raise SystemExit(main(parser.parse_args().small))
