"""Memory of `jit(grad)` under each policy, as ratios to plain `jax.grad` in the same run.

For each model: the residual bytes each policy stores (from `residual.inspect`) and the
compiled `jit(grad)`'s memory (`residual.Memory`: the peak, and its part beyond
arguments and outputs, per device), both relative to plain `jax.grad` compiled for the
same target, and `jax.checkpoint` with `nothing_saveable` / `dots_saveable` on the layer
body for comparison. Compile-only: nothing is run, so any target compiles here.

    python benchmarks/memory.py                 # the running backend, full sizes
    python benchmarks/memory.py --target v5e    # a TPU v5e (pip install 'residual[tpu]')
    python benchmarks/memory.py --target h100   # an H100 (residual[cuda], JAX_PLATFORMS=cpu)
    python benchmarks/memory.py --small         # a quick run
    python benchmarks/memory.py --layers 32     # deeper MLPs: stored activations dominate
    python benchmarks/memory.py --markdown      # also the docs' table, peak / beyond
    python benchmarks/memory.py --policies "Quantize int4"   # only these rows

The targets checked at the end (PASS/FAIL) are on the memory beyond arguments and
outputs (XLA:CPU's temp memory), and on the peak for "no policy above plain".
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
from residual import _target
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
    # 8-bit codes recompute the elementwise chains on a TPU by default, and pack every
    # residual elsewhere: both, on every target.
    "int8, every residual packed": rp.Quantize(bits=8, elementwise="pack"),
    # What a fusion stores packed (matmul and reduction outputs), the elementwise chains
    # between them recomputed.
    "int8, elementwise recomputed": rp.Quantize(bits=8, elementwise="recompute"),
    "int4, elementwise recomputed": rp.Quantize(bits=4, elementwise="recompute"),
}


# Every model's ratios, for `--markdown`: {model: {label: (peak ratio, beyond ratio)}},
# and plain's figures {model: Memory}.
TABLE: dict[str, dict[str, tuple[float, float]]] = {}
PLAIN: dict[str, residual.Memory] = {}
# `--policies`: measure only these rows (and check no target, as each needs its rows).
ONLY: set[str] | None = None


# For a TPU target: each column's plain and per-policy working values in device and
# on-chip memory (`residual.Peak.working`); the compiler's peak counts the larger.
WORKING: dict[str, dict[str, dict[str, int]]] = {}


def grad_memory(fn, *args, target=None) -> residual.Memory:
    return residual.compiled_memory(jax.grad(fn), *args, target=target)


def grad_peak(fn, *args, target=None) -> tuple[residual.Memory, dict[str, int]]:
    """The compiled memory of `jax.grad(fn)` and its working values per memory space:
    on a TPU read from the buffer assignment (one compile), elsewhere `beyond`."""
    if _target.resolve(target).platform != "tpu":
        memory = grad_memory(fn, *args, target=target)
        return memory, {"device": memory.beyond}
    p = residual.peak(jax.grad(fn), *args, target=target)
    return p.memory, p.working


def measure(name, model, args, targets, checkpoint_models=(), target=None, column=None):
    plain, plain_working = grad_peak(model, *args, target=target)
    spaces = list(plain_working) if len(plain_working) > 1 else []  # a TPU's two
    print(f"\n{name}: plain jax.grad peak {plain.peak / 2**20:.1f} MiB, "
          f"{plain.beyond / 2**20:.1f} MiB of it beyond arguments and outputs"
          + "".join(f", {space} {plain_working[space] / 2**20:.1f} MiB" for space in spaces))
    print(f"  {'policy':30s} {'stored/residual':>16s} {'peak vs plain':>14s} "
          f"{'beyond vs plain':>16s} {'peak MiB':>9s}"
          + "".join(f" {space + ' MiB':>13s}" for space in spaces))
    ratios, table = {}, TABLE.setdefault(column or name, {})
    PLAIN[column or name] = plain
    working = WORKING.setdefault(column or name, {"plain": plain_working})
    rows = [(label, residual.with_hooks(model, policy=policy), policy)
            for label, policy in POLICIES.items()]
    rows += [(label, checkpointed, None) for label, checkpointed in checkpoint_models]
    if ONLY is not None:
        rows, targets = [row for row in rows if row[0] in ONLY], []
    for label, fn, policy in rows:
        stored = "" if policy is None else "{:.2f}".format(residual.inspect(
            model, *args, policy=policy, compiled=False, target=target).totals["ratio"])
        hooked, working[label] = grad_peak(fn, *args, target=target)
        peak, beyond = hooked.peak / plain.peak, hooked.beyond / max(plain.beyond, 1)
        ratios[label] = beyond
        ratios[label, "peak"] = peak
        table[label] = peak, beyond
        print(f"  {label:30s} {stored:>16s} {peak:14.2f} {beyond:16.2f} "
              f"{hooked.peak / 2**20:9.1f}"
              + "".join(f" {working[label][space] / 2**20:13.1f}" for space in spaces))
    return _targets.report(ratios, targets)


def _vmap_memory(batched, fn, args, target) -> residual.Memory:
    grad = jax.grad(fn, argnums=(0, 1))
    return residual.compiled_memory(batched(grad), *args, target=target)


def measure_vmap(ws, x, target=None) -> int:
    """`vmap(grad)`: per-example gradients (weights shared) and an ensemble of 2 models."""
    examples = jnp.stack([x * (1 + i / 64) for i in range(64)])
    cases = {
        "per-example, 64 examples": (
            lambda g: jax.vmap(g, in_axes=(None, 0)), (ws, examples)),
        "ensemble of 2 models": (lambda g: jax.vmap(g), (jnp.stack([ws, 2 * ws]), examples[:2])),
    }
    layers, rows, width = ws.shape[0], x.shape[0], x.shape[1]
    print(f"\nunrolled MLP under vmap(grad), {layers} layers, {rows} rows x width {width} "
          "per example (peak / beyond arguments and outputs)")
    ratios = {}
    for name, (batched, args) in cases.items():
        plain = _vmap_memory(batched, models.unrolled_mlp, args, target)
        line = f"  {name:26s} plain {plain.peak / 2**20:6.1f} MiB"
        for label in ("Quantize int8", "Cast(bf16)"):
            hooked = _vmap_memory(batched, residual.with_hooks(
                models.unrolled_mlp, policy=POLICIES[label]), args, target)
            ratios[name, label] = hooked.peak / plain.peak
            line += (f"   {label} {ratios[name, label]:.2f} / "
                     f"{hooked.beyond / max(plain.beyond, 1):.2f}")
        print(line)
    return _targets.report(ratios, [
        (lambda r: max(r.values()) < 1.0, "every vmap case below plain jax.grad"),
    ])


def main(small: bool, target: str | None = None, markdown: bool = False,
         batch: int | None = None, layers: int | None = None) -> int:
    where = f"compiled for {target}" if target else f"{jax.devices()[0].platform}"
    print(f"jax {jax.__version__}, {where}")
    default_layers, default_batch, width = (8, 512, 256) if small else (8, 4096, 1024)
    batch, layers = batch or default_batch, layers or default_layers
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
    no_policy_above_plain = (lambda r: max(r[k, "peak"] for k in POLICIES) <= 1.0,
                             lambda r: "no policy's peak above plain jax.grad's" + "".join(
                                 f"; {k}: {r[k, 'peak']:.5f}x" for k in POLICIES
                                 if r[k, "peak"] > 1.0))
    failed = 0
    ws, x = models.mlp_params(layers, width, batch)
    failed += measure(
        f"scan MLP f32, {layers} layers, batch {batch} x width {width}",
        models.scan_mlp, (ws, x),
        [
            (lambda r: r["Quantize int8"] <= 0.45, "int8 <= 0.45x beyond"),
            (lambda r: r["Quantize int4"] <= 0.35, "int4 <= 0.35x beyond"),
            (lambda r: r["Quantize 2-bit"] <= 0.30, "2-bit <= 0.30x beyond"),
            remat_vs_checkpoint, no_policy_above_plain,
        ],
        checkpoints, target, f"scan MLP f32, {layers} x {batch} x {width}",
    )
    ws16, x16 = models.mlp_params(layers, width, batch, jnp.bfloat16)
    failed += measure(
        "scan MLP bf16", models.scan_mlp, (ws16, x16),
        [(lambda r: r["Quantize int8"] <= 0.6, "int8 <= 0.6x beyond"), no_policy_above_plain],
        checkpoints, target, "scan MLP bf16",
    )
    failed += measure(
        "unrolled MLP f32", models.unrolled_mlp, (ws, x),
        [no_policy_above_plain,
         (lambda r: r["Quantize int8"] <= 0.6, "int8 <= 0.6x beyond (aim)")],
        [
            ("jax.checkpoint nothing", models.checkpointed_unrolled_mlp(
                jax.checkpoint_policies.nothing_saveable)),
            ("jax.checkpoint dots", models.checkpointed_unrolled_mlp(
                jax.checkpoint_policies.dots_saveable)),
        ],
        target, "unrolled MLP f32",
    )
    if ONLY is None:
        failed += measure_vmap(*models.mlp_params(6, 128, 256), target=target)
    loss, params, tokens = models.transformer(blocks, t_width, 4, seq, t_batch)
    failed += measure(
        f"equinox transformer, {blocks} blocks (scan), width {t_width}, seq {seq}, "
        f"batch {t_batch}",
        loss, (params, tokens),
        [(lambda r: r["Quantize int8", "peak"] < 1.0, "int8 below plain")], (), target,
        f"equinox transformer, {blocks} blocks x {t_width}, seq {seq}",
    )
    print(f"\n{failed} target(s) missed")
    if markdown:
        print(_markdown(target or jax.devices()[0].platform))
    return 0


def _markdown(where: str) -> str:
    """The docs' table: a row per policy, a column per model, each cell the compiled peak
    and the part beyond arguments and outputs, as ratios to plain jax.grad's."""
    columns = list(TABLE)
    lines = [f"| {where}: peak / beyond | " + " | ".join(columns) + " |",
             "|---" * (len(columns) + 1) + "|",
             "| plain `jax.grad`, MiB | " + " | ".join(
                 f"{PLAIN[c].peak / 2**20:,.0f} ({PLAIN[c].beyond / 2**20:,.0f})"
                 for c in columns) + " |"]
    labels = list(dict.fromkeys(label for c in columns for label in TABLE[c]))
    for label in labels:
        cells = []
        for c in columns:
            if label not in TABLE[c]:
                cells.append("-")
                continue
            peak, beyond = TABLE[c][label]
            cells.append(f"{peak:.2f}" if round(peak, 2) == round(beyond, 2)
                         else f"{peak:.2f} / {beyond:.2f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if any("on-chip" in w["plain"] for w in WORKING.values()):
        lines += ["", _working_markdown(where)]
    return "\n".join(lines)


def _working_markdown(where: str) -> str:
    """On a TPU: each program's working values in device memory / on-chip memory (MiB),
    each space's own peak; the compiler's peak counts the larger."""
    columns = [c for c in WORKING if "on-chip" in WORKING[c]["plain"]]
    lines = [f"| {where}: device / on-chip MiB | " + " | ".join(columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    labels = list(dict.fromkeys(label for c in columns for label in WORKING[c]))
    for label in labels:
        cells = [f"{WORKING[c][label]['device'] / 2**20:,.0f} / "
                 f"{WORKING[c][label]['on-chip'] / 2**20:,.0f}" if label in WORKING[c]
                 else "-" for c in columns]
        name = "plain `jax.grad`" if label == "plain" else label
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--target", default=None,
                        help="compile for this hardware: v5e, v5e:2x2, v6e, v5p, v4, h100, "
                        "h200, a100, cpu (default: the running backend)")
    parser.add_argument("--markdown", action="store_true",
                        help="also print the docs' table (peak / beyond ratios)")
    parser.add_argument("--batch", type=int, default=None,
                        help="the MLPs' batch (default 4096): larger, the working values "
                        "outgrow a TPU's on-chip memory and device memory sets the peak")
    parser.add_argument("--layers", type=int, default=None,
                        help="the MLPs' layers (default 8): more, and the stored "
                        "activations are more of the peak")
    parser.add_argument("--policies", nargs="+", metavar="LABEL",
                        help="measure only these rows, e.g. 'Quantize int4' (no target "
                        "is checked then)")
    args = parser.parse_args()
    if args.policies:
        unknown = set(args.policies) - set(POLICIES) - {
            "jax.checkpoint nothing", "jax.checkpoint dots"}
        if unknown:
            parser.error(f"unknown rows {sorted(unknown)}; the rows are {list(POLICIES)} "
                         "and 'jax.checkpoint nothing', 'jax.checkpoint dots'")
        ONLY = set(args.policies)
    raise SystemExit(main(args.small, args.target, args.markdown, args.batch, args.layers))
