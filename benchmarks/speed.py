"""Step time of `jit(grad)` under each policy, as ratios to plain `jax.grad` in the same run.

What a policy costs in compute: packing in the forward, unpacking (or recomputing) in
the backward. Each program is compiled once, then plain and hooked steps alternate, one
each, 20 times, so that machine noise hits both alike; the figure is the median of the
20 paired ratios, with their quartiles. CPU figures: on a GPU the balance of matmuls
against elementwise packing work differs, so measure there before relying on them.

    python benchmarks/speed.py            # 8-layer scan MLP and a 4-block transformer
    python benchmarks/speed.py --small    # a quick run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
import _models as models
import _targets

import residual
from residual import policies as rp

POLICIES = {
    "Cast(bf16)": rp.Cast(jnp.bfloat16),
    "Quantize int8": rp.Quantize(bits=8),
    "Quantize int8 stochastic": rp.Quantize(bits=8, stochastic=True),
    "Quantize int4": rp.Quantize(bits=4),
    "Quantize fp8": rp.Quantize(format="fp8_e4m3"),
    "Remat per layer": rp.select([(rp.where(in_scan=True), rp.Remat())]),
}


def compiled_step(fn, args):
    return jax.jit(jax.grad(fn)).lower(*args).compile()


def seconds(step, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(step(*args))
    return time.perf_counter() - start


def paired_ratios(hooked, plain, args, pairs: int = 20) -> tuple[list[float], float, float]:
    """Hooked/plain step-time ratios of `pairs` alternating steps, and the median times."""
    for step in (plain, hooked):
        jax.block_until_ready(step(*args))  # warm-up
    plain_t, hooked_t = [], []
    for _ in range(pairs):
        plain_t.append(seconds(plain, args))
        hooked_t.append(seconds(hooked, args))
    ratios = [h / p for h, p in zip(hooked_t, plain_t)]
    return ratios, statistics.median(hooked_t), statistics.median(plain_t)


def measure(name, model, args, targets) -> int:
    plain = compiled_step(model, args)
    print(f"\n{name}")
    print(f"  {'policy':26s} {'step vs plain':>14s} {'quartiles':>12s} {'hooked ms':>10s} "
          f"{'plain ms':>9s}")
    medians = {}
    for label, policy in POLICIES.items():
        hooked = compiled_step(residual.with_hooks(model, policy=policy), args)
        ratios, hooked_t, plain_t = paired_ratios(hooked, plain, args)
        q1, medians[label], q3 = statistics.quantiles(ratios, n=4)
        print(f"  {label:26s} {medians[label]:14.2f} {q1:5.2f}-{q3:<6.2f} "
              f"{hooked_t * 1e3:10.1f} {plain_t * 1e3:9.1f}")
    return _targets.report(medians, targets)


def main(small: bool) -> int:
    layers, batch, width = (8, 256, 256) if small else (8, 1024, 1024)
    blocks, t_width, seq, t_batch = (2, 64, 32, 2) if small else (4, 256, 128, 8)
    print(f"{jax.devices()[0].platform}, {jax.device_count()} device(s)")
    failed = 0
    ws, x = models.mlp_params(layers, width, batch)
    failed += measure(
        f"scan MLP f32, {layers} layers, batch {batch} x width {width}",
        models.scan_mlp, (ws, x),
        [(lambda r: r["Quantize int8"] <= 1.5, "int8 within 1.5x plain's step time")],
    )
    loss, params, tokens = models.transformer(blocks, t_width, 4, seq, t_batch)
    failed += measure(
        f"equinox transformer, {blocks} blocks (scan), width {t_width}, seq {seq}, "
        f"batch {t_batch}",
        loss, (params, tokens),
        [(lambda r: r["Quantize int8"] <= 1.5, "int8 within 1.5x plain's step time")],
    )
    print(f"\n{failed} target(s) missed")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    raise SystemExit(main(parser.parse_args().small))
