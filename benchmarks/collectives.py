"""Collectives and per-device memory of sharded `jit(grad)` programs under each policy,
compiled for a TPU slice without the device, against plain `jax.grad` in the same run.

For each slice, mesh layout and model: the collectives one step of plain `jax.grad`'s
compiled program issues (count and kind, a loop's once a trip: `residual.collectives(...,
per_step=True)`), and for each policy the ones it adds or removes and its per-device
peak as a ratio to plain's. Needs libtpu
(`pip install 'residual[tpu]'`); nothing runs.

    python benchmarks/collectives.py                     # v5e:2x2 and v5e:4x4
    python benchmarks/collectives.py --targets v6e:2x4
    python benchmarks/collectives.py --small             # a quick run
    python benchmarks/collectives.py --layouts fsdp      # one mesh layout

The target checked at the end: no policy adds a collective (an activation gathered
packed, so fewer all-gathers than plain, is allowed).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).parent))
import _targets
from memory import POLICIES

import residual
from residual import _target, collectives
from residual import policies as rp

POLICIES = {**POLICIES, "Offload": rp.Offload(),
            "Chain(int8, Offload)": rp.Chain(rp.Quantize(bits=8), rp.Offload())}


RECOMPUTING = {"Remat", "Remat per layer", "keep dots, remat rest"}
# `select(where(in_scan=True), Remat())`: on a model without a scan it selects nothing.
SCAN_ONLY = {"Remat per layer"}
CHECKPOINT = jax.checkpoint_policies.nothing_saveable


def unrolled(activation, checkpoint=False):
    def layer(h, w):
        return activation(h @ w)

    def model(ws, x):
        for i in range(ws.shape[0]):
            x = (jax.checkpoint(layer, policy=CHECKPOINT) if checkpoint else layer)(x, ws[i])
        return jnp.sum(x**2)

    return model


def scanned(activation, checkpoint=False):
    def layer(h, w):
        return activation(h @ w), None

    def model(ws, x):
        h, _ = jax.lax.scan(jax.checkpoint(layer, policy=CHECKPOINT) if checkpoint else layer,
                            x, ws)
        return jnp.sum(h**2)

    return model


def layouts(devices):
    """Mesh layouts over `devices` by key: (name, mesh, weight spec, input spec), for
    weights stacked as `[layers, in, out]` and inputs `[batch, features]`."""
    n = len(devices)
    flat = Mesh(np.array(devices), ("data",))
    grid = Mesh(np.array(devices).reshape(2, n // 2), ("data", "model"))
    return {
        "data": ("data parallel", flat, P(), P("data")),
        "fsdp": ("FSDP (weights sharded, gathered per layer)", flat, P(None, "data"), P("data")),
        "tensor": ("tensor parallel (weights column-split)", grid, P(None, None, "model"),
                   P("data")),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="+", default=["v5e:2x2", "v5e:4x4"])
    parser.add_argument("--layouts", nargs="+", default=["data", "fsdp", "tensor"],
                        choices=["data", "fsdp", "tensor"])
    parser.add_argument("--small", action="store_true", help="smaller models, a quick run")
    args = parser.parse_args()
    batch, width = (1024, 512) if args.small else (4096, 1024)
    mlps = {f"{name}, {layers} layers": ((build(act), build(act, checkpoint=True)), layers)
            for name, build, act, layers in [("tanh MLP", unrolled, jnp.tanh, 4),
                                             ("GELU MLP", unrolled, jax.nn.gelu, 4),
                                             ("scan tanh MLP", scanned, jnp.tanh, 8)]}
    print(f"jax {jax.__version__}, compile-only; MLPs batch {batch} x width {width}, f32\n")
    added: list[str] = []
    for target in args.targets:
        devices = _target.resolve(target).devices
        for layout, mesh, w_spec, x_spec in map(layouts(devices).get, args.layouts):
            for model, (fn, layers) in mlps.items():
                ws = jax.ShapeDtypeStruct((layers, width, width), jnp.float32,
                                          sharding=NamedSharding(mesh, w_spec))
                x = jax.ShapeDtypeStruct((batch, width), jnp.float32,
                                         sharding=NamedSharding(mesh, x_spec))
                with _target.resolve(target).tracing():  # policies decide for the TPU
                    added += measure(f"{target}, {layout}, {model}", fn, ws, x,
                                     scanned=model.startswith("scan"))
    failed = _targets.report({}, [(lambda _: not added, (
        "no policy adds a collective to plain jax.grad's (those that recompute: to "
        "jax.checkpoint(nothing_saveable)'s per layer)"))])
    for line in added:
        print(f"    {line}")
    return failed


def measure(title: str, model, ws, x, scanned: bool) -> list[str]:
    def compiled(f):
        return jax.jit(jax.grad(f)).lower(ws, x).compile()

    fn, checkpointed = model
    plain = compiled(fn)
    plain_peak, plain_counts = residual.Memory.of(plain).peak, _per_step(plain)
    shown = ", ".join(f"{n} {k}" for k, n in sorted(plain_counts.items())) or "none"
    print(f"{title}: plain jax.grad {plain_peak / 2**20:.1f} MiB per device; {shown}")
    print(f"  {'policy':<24} {'peak vs plain':>13}  collectives per step vs plain")
    reference = compiled(checkpointed)
    _row("jax.checkpoint nothing", reference, plain_peak, plain_counts)
    added = []
    for label, policy in POLICIES.items():
        if label in SCAN_ONLY and not scanned:
            continue
        program = compiled(residual.with_hooks(fn, policy=policy))
        more = _row(label, program, plain_peak, plain_counts)
        if label in RECOMPUTING:
            more = _per_step(program) - _per_step(reference)
        added += [f"{title}: {label} " + _diff(more, Counter())] if more else []
    print()
    return added


def _row(label: str, program, plain_peak: int, plain_counts: Counter) -> Counter:
    counts = _per_step(program)
    more, fewer = counts - plain_counts, plain_counts - counts
    ratio = residual.Memory.of(program).peak / plain_peak
    print(f"  {label:<24} {ratio:>13.2f}  {_diff(more, fewer)}")
    return more


def _per_step(program) -> Counter:
    return collectives(program, per_step=True)


def _diff(more: Counter, fewer: Counter) -> str:
    return ", ".join([f"+{n} {k}" for k, n in more.items()]
                     + [f"-{n} {k}" for k, n in fewer.items()]) or "the same"


if __name__ == "__main__":
    sys.exit(main())
