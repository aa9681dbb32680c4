"""Models built from other libraries' layers: memory and gradient error per policy.

For a flax NNX transformer (`nnx.scan` over blocks, and the same blocks unrolled), a
haiku transformer (`hk.layer_stack`), an equinox transformer (`lax.scan`), a keras-hub
GPT-2 (`GPT2Backbone`, JAX backend, unrolled) and a flax Linen CNN with BatchNorm
(unrolled), all at random init: the compiled `jit(grad)`'s peak memory under each
policy relative to plain `jax.grad` (compile-only; `--target` compiles for hardware
that need not be here), and the relative L2 error of the whole gradient, ||g -
g_plain|| / ||g_plain|| (run on this machine), with both computed in the same run.

    python benchmarks/zoo.py            # sizes where activations dominate (minutes on 2 cores)
    python benchmarks/zoo.py --small    # a quick run
    python benchmarks/zoo.py --target v5e

keras and keras-hub are in the `bench` extra (`pip install -e .[bench]`; keras-hub
pulls in tensorflow-text and tensorflow); without them the GPT-2 is skipped.
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
from _errors import relative_error

import residual
from residual import _target
from residual import policies as rp

POLICIES = {
    "Identity": rp.Identity(),
    "Cast(bf16)": rp.Cast(jnp.bfloat16),
    "Quantize int8": rp.Quantize(bits=8),
    # 4-bit defaults: groups of 32 with byte scales (a byte per group under a bfloat16
    # scale per 128 values). For comparison, groups of 64 with float32 scales, the
    # same bytes, with and without the square grid for mostly-small non-negative
    # groups (softmax probabilities), and groups of 16 for 11% more bytes.
    "Quantize int4": rp.Quantize(bits=4),
    "int4 g64 f32": rp.Quantize(bits=4, group_size=64, scale_dtype=jnp.float32),
    "int4 g64 uniform": rp.Quantize(bits=4, group_size=64, scale_dtype=jnp.float32,
                                    grid="uniform"),
    "int4 g16 bytes": rp.Quantize(bits=4, group_size=16),
}
# For a TPU, whose default (on one chip, for float32) recomputes elementwise chains for
# 8-bit codes and, at 4 bits, for matrices and token streams outside scan bodies (the
# unrolled transformer's activations) and packs the rest: both choices at each width.
ELEMENTWISE = {
    "int8 packed": rp.Quantize(bits=8, elementwise="pack"),
    "int4 packed": rp.Quantize(bits=4, elementwise="pack"),
    "int4 recomputed": rp.Quantize(bits=4, elementwise="recompute"),
}
# Recompute each layer from its input in the backward: only where the layers are one
# `lax.scan` (the unrolled CNN has no per-layer boundary a policy can see).
PER_LAYER_REMAT = {"Remat per layer": rp.select([(rp.where(in_scan=True), rp.Remat())])}


def measure(name, loss, args, policies, targets, target=None):
    plain = residual.compiled_memory(jax.grad(loss), *args, target=target)
    expected = jax.jit(jax.grad(loss))(*args)
    print(f"\n{name}: plain jax.grad peak {plain.peak / 2**20:.1f} MiB "
          f"({plain.beyond / 2**20:.1f} MiB beyond arguments and outputs)")
    print(f"  {'policy':18s} {'peak vs plain':>14s} {'beyond':>7s} {'grad error':>11s}")
    results = {}
    for label, policy in policies.items():
        hooked = jax.grad(residual.with_hooks(loss, policy=policy))
        memory = residual.compiled_memory(hooked, *args, target=target)
        ratio = memory.peak / plain.peak
        # Run here with the decisions of the target's program (`Cast` and 8-bit
        # `Quantize` recompute elementwise chains on a TPU), so error and memory are one
        # program's.
        with _target.resolve(target).tracing():
            error = relative_error(jax.jit(hooked)(*args), expected)
        results[label] = ratio, error
        print(f"  {label:18s} {ratio:14.3f} {memory.beyond / max(plain.beyond, 1):7.2f} "
              f"{error:11.2e}")
    return _targets.report(results, targets)


def main(small: bool, target: str | None = None) -> int:
    blocks, width, heads, seq, batch = (2, 64, 2, 32, 2) if small else (4, 256, 4, 256, 8)
    stages, channels, size, images = (2, 8, 16, 4) if small else (3, 32, 64, 32)
    transformer_targets = [
        (lambda r: r["Identity"][0] <= 1.0 and r["Identity"][1] == 0,
         "Identity: plain gradients, no more memory"),
        (lambda r: r["Quantize int8"][1] <= 0.01, "int8 gradient error <= 1%"),
        (lambda r: r["Quantize int4"][1] <= 0.06, "int4 gradient error <= 6%"),
        (lambda r: r["Quantize int8"][0] < 1.0, "int8 below plain memory"),
    ]
    shape = f"{blocks} blocks, width {width}, seq {seq}, batch {batch}"
    for_a_tpu = target is not None and _target.resolve(target).platform == "tpu"
    transformer_policies = POLICIES | (ELEMENTWISE if for_a_tpu else {})
    failed = 0
    failed += measure(
        f"flax NNX transformer (nnx.scan), {shape}",
        *models.nnx_transformer(blocks, width, heads, seq, batch),
        transformer_policies | PER_LAYER_REMAT, transformer_targets, target,
    )
    failed += measure(
        f"flax NNX transformer, the same blocks unrolled, {shape}",
        *models.nnx_transformer(blocks, width, heads, seq, batch, scan=False),
        transformer_policies, transformer_targets, target,
    )
    failed += measure(
        f"haiku transformer (hk.layer_stack), {shape}",
        *models.haiku_transformer(blocks, width, heads, seq, batch),
        transformer_policies | PER_LAYER_REMAT, transformer_targets, target,
    )
    loss, params, tokens = models.transformer(blocks, width, heads, seq, batch)
    failed += measure(
        f"equinox transformer (lax.scan), {shape}",
        loss, (params, tokens), transformer_policies | PER_LAYER_REMAT, transformer_targets,
        target,
    )
    try:
        gpt2 = models.keras_gpt2(blocks, width, heads, seq, batch)
    except ImportError as error:
        print(f"\nkeras-hub GPT-2 skipped: {error}. It needs keras and keras-hub "
              "(`pip install -e .[bench]`).")
    else:
        failed += measure(f"keras-hub GPT-2 (GPT2Backbone, JAX backend), {shape}", *gpt2,
                          transformer_policies, transformer_targets, target)
    failed += measure(
        f"flax Linen CNN + BatchNorm, {stages} stages x 2 convs, {channels} channels, "
        f"{size}x{size} images, batch {images}",
        *models.linen_cnn(stages, channels, size, images),
        POLICIES,
        [
            (lambda r: r["Identity"][0] <= 1.0 and r["Identity"][1] == 0,
             "Identity: plain gradients, no more memory"),
            (lambda r: r["Quantize int8"][1] <= 0.01, "int8 gradient error <= 1%"),
            (lambda r: r["Quantize int8"][0] < 1.0, "int8 below plain memory"),
        ],
        target,
    )
    where = f"memory compiled for {target}" if target else jax.devices()[0].platform
    print(f"\njax {jax.__version__}, {where}; {failed} target(s) missed")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="small sizes, a quick run")
    parser.add_argument("--target", default=None,
                        help="compile the memory figures for this hardware: v5e, v6e, h100, "
                        "... (default: the running backend)")
    options = parser.parse_args()
    raise SystemExit(main(options.small, options.target))
