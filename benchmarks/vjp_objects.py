"""Hooks built on JAX's own residual objects alone, against `residual.with_hooks`.

`jax.vjp` returns a `VJP` pytree whose leaves are the residuals: `args_res` (inputs saved
as they are) and `opaque_residuals` (everything computed). A custom VJP whose forward
runs `jax.vjp` and packs each opaque residual, and whose backward unpacks them and calls
the `VJP`, is saved-tensor hooks in public API only. This measures what it gives: XLA's
temp memory of the compiled `jit(grad)` under int8 and bf16, as ratios to plain
`jax.grad` in the same run, beside `residual.with_hooks` with the same policy.

    python benchmarks/vjp_objects.py            # full sizes (a few minutes on 2 cores)
    python benchmarks/vjp_objects.py --small    # a quick run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
import _models as models
from _errors import relative_error

import residual
from residual import policies as rp

POLICIES = {"Quantize int8": rp.Quantize(bits=8), "Cast(bf16)": rp.Cast(jnp.bfloat16)}


def vjp_object_hooks(f, policy):
    """`f` with its opaque residuals packed by `policy`, using `jax.vjp`'s object alone.

    The policy sees each residual's shape and dtype only (the object says nothing of
    where a residual came from), and packs it once the whole forward has run.
    """
    infos: list[residual.ResidualInfo] = []

    @jax.custom_vjp
    def hooked(*args):
        return f(*args)

    def forward(*args):
        out, vjp = jax.vjp(f, *args)
        infos[:] = [residual.ResidualInfo(index=i, shape=r.shape, dtype=r.dtype)
                    for i, r in enumerate(vjp.opaque_residuals)]
        packed = []
        for r, info in zip(vjp.opaque_residuals, infos):
            chosen = policy.resolve(info) if jnp.issubdtype(r.dtype, jnp.floating) else None
            packed.append(chosen.pack(r, info) if chosen is not None else r)
        return out, vjp.replace(opaque_residuals=packed)

    def backward(vjp, cotangent):
        restored = []
        for p, info in zip(vjp.opaque_residuals, infos):
            chosen = (policy.resolve(info) if jnp.issubdtype(info.dtype, jnp.floating)
                      else None)
            restored.append(chosen.unpack(p, info) if chosen is not None else p)
        return vjp.replace(opaque_residuals=restored)(cotangent)

    hooked.defvjp(forward, backward)
    return hooked


def temp_bytes(fn, *args) -> int:
    return jax.jit(jax.grad(fn)).lower(*args).compile().memory_analysis().temp_size_in_bytes


def measure(name, loss, args):
    plain = temp_bytes(loss, *args)
    expected = jax.jit(jax.grad(loss))(*args)
    print(f"\n{name}: plain jax.grad temp {plain / 2**20:.1f} MiB")
    print(f"  {'policy':14s} {'with_hooks':>11s} {'VJP object':>11s} {'error (VJP object)':>19s}")
    for label, policy in POLICIES.items():
        ours = temp_bytes(residual.with_hooks(loss, policy=policy), *args) / plain
        theirs_fn = vjp_object_hooks(loss, policy)
        theirs = temp_bytes(theirs_fn, *args) / plain
        error = relative_error(jax.jit(jax.grad(theirs_fn))(*args), expected)
        print(f"  {label:14s} {ours:10.2f}x {theirs:10.2f}x {error:19.1e}")


def main(small: bool) -> int:
    if not hasattr(jax.vjp(jnp.sin, 1.0)[1], "replace"):
        print(f"jax {jax.__version__}: `jax.vjp`'s object has no `replace` (jax 0.11 on)")
        return 0
    layers, width, batch = (4, 128, 256) if small else (8, 1024, 4096)
    ws, x = models.mlp_params(layers, width, batch)
    measure(f"scan MLP, {layers} x ({batch} x {width})", models.scan_mlp, (ws, x))
    measure(f"unrolled MLP, {layers} x ({batch} x {width})", models.unrolled_mlp, (ws, x))
    blocks, dim, heads, seq, batch = (2, 64, 2, 64, 2) if small else (4, 256, 4, 256, 8)
    loss, params, tokens = models.transformer(blocks, dim, heads, seq, batch)
    measure(f"equinox transformer, {blocks} blocks x {dim}, seq {seq}, scan", loss,
            (params, tokens))
    print(f"\njax {jax.__version__}, {jax.devices()[0].platform}, compile-only memory")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="small sizes, a quick run")
    raise SystemExit(main(parser.parse_args().small))
