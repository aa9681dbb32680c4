"""Models built from other libraries' layers: memory and gradient error per policy.

For a flax NNX transformer (`nnx.scan` over blocks, and the same blocks unrolled), a
haiku transformer (`hk.layer_stack`), an equinox transformer (`lax.scan`), a keras-hub
GPT-2 (`GPT2Backbone`, JAX backend, unrolled) and a flax Linen CNN with BatchNorm
(unrolled): XLA's temp memory of the compiled `jit(grad)` under each policy relative
to plain `jax.grad` (compile-only), and the relative L2 error of the whole gradient,
||g - g_plain|| / ||g_plain||, with both computed in the same run. All at random init.

    python benchmarks/zoo.py            # sizes where activations dominate (minutes on 2 cores)
    python benchmarks/zoo.py --small    # a quick run

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

import residual
from residual import policies as rp

POLICIES = {
    "Identity": rp.Identity(),
    "Cast(bf16)": rp.Cast(jnp.bfloat16),
    "Quantize int8": rp.Quantize(bits=8),
    "Quantize int4": rp.Quantize(bits=4),
    # The square grid for mostly-small non-negative groups (softmax probabilities) is
    # int4's default; without it, for comparison.
    "int4 uniform grid": rp.Quantize(bits=4, grid="uniform"),
}
# Recompute each layer from its input in the backward: only where the layers are one
# `lax.scan` (the unrolled CNN has no per-layer boundary a policy can see).
PER_LAYER_REMAT = {"Remat per layer": rp.select([(rp.where(in_scan=True), rp.Remat())])}


def relative_error(got, expected) -> float:
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(expected))
    num = sum(jnp.sum((a - b) ** 2) for a, b in pairs)
    den = sum(jnp.sum(b**2) for b in jax.tree.leaves(expected))
    return float(jnp.sqrt(num / den))


def measure(name, loss, args, policies, targets):
    plain = jax.jit(jax.grad(loss)).lower(*args).compile()
    plain_temp = plain.memory_analysis().temp_size_in_bytes
    expected = plain(*args)
    print(f"\n{name}: plain jax.grad temp {plain_temp / 2**20:.1f} MiB")
    print(f"  {'policy':18s} {'temp vs plain':>14s} {'grad error':>11s}")
    results = {}
    for label, policy in policies.items():
        compiled = jax.jit(jax.grad(residual.with_hooks(loss, policy=policy))).lower(
            *args).compile()
        ratio = compiled.memory_analysis().temp_size_in_bytes / plain_temp
        error = relative_error(compiled(*args), expected)
        results[label] = ratio, error
        print(f"  {label:18s} {ratio:14.3f} {error:11.2e}")
    return _targets.report(results, targets)


def main(small: bool) -> int:
    blocks, width, heads, seq, batch = (2, 64, 2, 32, 2) if small else (4, 256, 4, 256, 8)
    stages, channels, size, images = (2, 8, 16, 4) if small else (3, 32, 64, 32)
    transformer_targets = [
        (lambda r: r["Identity"][0] <= 1.0 and r["Identity"][1] == 0,
         "Identity: plain gradients, no more memory"),
        (lambda r: r["Quantize int8"][1] <= 0.01, "int8 gradient error <= 1%"),
        (lambda r: r["Quantize int4"][1] <= 0.10, "int4 gradient error <= 10%"),
        (lambda r: r["Quantize int8"][0] < 1.0, "int8 below plain memory"),
    ]
    shape = f"{blocks} blocks, width {width}, seq {seq}, batch {batch}"
    failed = 0
    failed += measure(
        f"flax NNX transformer (nnx.scan), {shape}",
        *models.nnx_transformer(blocks, width, heads, seq, batch),
        POLICIES | PER_LAYER_REMAT, transformer_targets,
    )
    failed += measure(
        f"flax NNX transformer, the same blocks unrolled, {shape}",
        *models.nnx_transformer(blocks, width, heads, seq, batch, scan=False),
        POLICIES, transformer_targets,
    )
    failed += measure(
        f"haiku transformer (hk.layer_stack), {shape}",
        *models.haiku_transformer(blocks, width, heads, seq, batch),
        POLICIES | PER_LAYER_REMAT, transformer_targets,
    )
    loss, params, tokens = models.transformer(blocks, width, heads, seq, batch)
    failed += measure(
        f"equinox transformer (lax.scan), {shape}",
        loss, (params, tokens), POLICIES | PER_LAYER_REMAT, transformer_targets,
    )
    try:
        gpt2 = models.keras_gpt2(blocks, width, heads, seq, batch)
    except ImportError as error:
        print(f"\nkeras-hub GPT-2 skipped: {error}. It needs keras and keras-hub "
              "(`pip install -e .[bench]`).")
    else:
        failed += measure(f"keras-hub GPT-2 (GPT2Backbone, JAX backend), {shape}", *gpt2,
                          POLICIES, transformer_targets)
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
    )
    print(f"\njax {jax.__version__}, {jax.devices()[0].platform}; {failed} target(s) missed")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="small sizes, a quick run")
    raise SystemExit(main(parser.parse_args().small))
