"""What a scanned MLP's peak would be if its layers stored one packed residual each.

`with_hooks` packs every residual a `lax.scan` body stores: for `tanh(h @ w)` that is
the layer's input `h` (for the weight's gradient) and tanh's derivative `1 - y**2`, two
codes per layer. But `y` is the next layer's input, stored anyway: a backward loop that
carries the unpacked input of the layer after (the step it ran just before) can compute
`1 - y**2` from it and store nothing else. This benchmark writes that VJP by hand, with
`Quantize`'s own `pack` and `unpack`, and compiles it beside plain `jax.grad` and
`with_hooks` under the same policy, as ratios to plain's peak / peak beyond arguments
and outputs, with each one's gradient error against plain's on a small copy of the
model (on the running backend). It shows what an engine that derives a body's
residuals from the next iteration's stored input could reach on this model; nothing in
the library does so yet.

    python benchmarks/scan_one_residual.py --target v5e      # pip install 'residual[tpu]'
    python benchmarks/scan_one_residual.py --target v5e --batch 16384
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).parent))
import _models as models
from _errors import relative_error

import residual
from residual import policies as rp


def one_residual_per_layer(policy: rp.Quantize):
    """`models.scan_mlp` with a VJP that stores each layer's input packed by `policy`
    and nothing else."""

    def info(h):
        return residual.ResidualInfo(index=0, shape=h.shape, dtype=np.dtype(h.dtype),
                                     in_scan=True)

    @jax.custom_vjp
    def layers(ws, x):
        h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return h

    def forward(ws, x):
        h, stored = lax.scan(lambda h, w: (jnp.tanh(h @ w), policy.pack(h, info(h))), x, ws)
        return h, (ws, stored, h)

    def backward(saved, g):
        ws, stored, last = saved

        def step(carry, layer):
            g, y = carry  # the cotangent of this layer's output, and that output
            w, packed = layer
            h = policy.unpack(packed, info(last))  # this layer's input
            dz = g * (1 - y * y)
            return (dz @ w.T, h), h.T @ dz

        (dx, _), dws = lax.scan(step, (g, last), (ws, stored), reverse=True)
        return dws, dx

    layers.defvjp(forward, backward)
    return lambda ws, x: jnp.sum(layers(ws, x).astype(jnp.float32) ** 2)


def main(target: str | None, batch: int) -> None:
    for dtype, bits in [(jnp.float32, 8), (jnp.float32, 4), (jnp.bfloat16, 8)]:
        policy = rp.Quantize(bits=bits)
        by_hand = one_residual_per_layer(policy)
        small = models.mlp_params(4, 256, 512, dtype)
        hooked = residual.with_hooks(models.scan_mlp, policy=policy)
        # In float32, so that a bfloat16 gradient's error is not rounded away.
        grads = [jax.tree.map(lambda g: g.astype(jnp.float32),
                              jax.jit(jax.grad(f, argnums=(0, 1)))(*small))
                 for f in (models.scan_mlp, hooked, by_hand)]
        ws, x = models.mlp_params(8, 1024, batch, dtype)
        plain = residual.peak(jax.grad(models.scan_mlp), ws, x, target=target).memory
        print(f"scan MLP {jnp.dtype(dtype).name}, 8 x {batch} x 1024, int{bits}: plain "
              f"{plain.peak / 2**20:,.0f} MiB ({plain.beyond / 2**20:,.0f} beyond)")
        rows = [("with_hooks", hooked, grads[1]),
                ("one residual per layer", by_hand, grads[2])]
        for label, fn, grad in rows:
            memory = residual.peak(jax.grad(fn), ws, x, target=target).memory
            print(f"  {label:24} {memory.peak / plain.peak:.2f} / "
                  f"{memory.beyond / plain.beyond:.2f}   gradient error "
                  f"{relative_error(grad, grads[0]):.1e} (4 layers, 512 x 256)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default=None,
                        help="compile for this hardware: v5e, v6e, h100, cpu (default: the "
                        "running backend)")
    parser.add_argument("--batch", type=int, default=4096)
    args = parser.parse_args()
    main(args.target, args.batch)
