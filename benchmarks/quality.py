"""What each policy costs in accuracy: gradient error, and training loss after a few hundred steps.

Relative gradient error ||g - g_plain|| / ||g_plain|| on an 8-layer scan MLP and on an
equinox transformer; then a small equinox model trained with optax.adam for 300 steps
with plain gradients and under int8 / int4 residuals, with the final losses' ratio
(targets: int8 within 2%, int4 within 5%).

    python benchmarks/quality.py [--steps 300]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).parent))
import _models as models
from _errors import relative_error

import residual
from residual import policies as rp
from residual._demo import Model, loss_fn

FORMATS = {
    "Cast(bf16)": rp.Cast(jnp.bfloat16),
    "int8": rp.Quantize(bits=8),
    "int8 stochastic": rp.Quantize(bits=8, stochastic=True),
    "fp8 e4m3": rp.Quantize(format="fp8_e4m3"),
    "fp8 e5m2": rp.Quantize(format="fp8_e5m2"),
    "int4": rp.Quantize(bits=4),
    "int4 stochastic": rp.Quantize(bits=4, stochastic=True),
    "2-bit": rp.Quantize(bits=2),
}


def gradient_errors() -> None:
    ws, x = models.mlp_params(8, 512, 1024)
    loss, params, tokens = models.transformer(blocks=2, width=128, seq=64, batch=4)
    cases = [("scan MLP 8x1024x512", models.scan_mlp, (ws, x)),
             ("transformer 2 blocks", loss, (params, tokens))]
    print(f"{'policy':18s}" + "".join(f"{name:>24s}" for name, _, _ in cases))
    plain = [jax.jit(jax.grad(f))(*args) for _, f, args in cases]
    for label, policy in FORMATS.items():
        errors = [
            relative_error(jax.jit(jax.grad(residual.with_hooks(f, policy=policy)))(*args), p)
            for (_, f, args), p in zip(cases, plain)
        ]
        print(f"{label:18s}" + "".join(f"{e:24.2e}" for e in errors))


def training(steps: int) -> None:
    """Online training on fresh batches of a noisy teacher: the loss settles at a floor."""
    key = jax.random.key(0)
    k_model, k_w1, k_w2, k_eval = jax.random.split(key, 4)
    width, batch = 128, 256
    model = Model(width, 4, 10, k_model)
    w1 = jax.random.normal(k_w1, (width, width)) / jnp.sqrt(width)
    w2 = jax.random.normal(k_w2, (width, 10))

    def sample(k):
        kx, kn = jax.random.split(k)
        x = jax.random.normal(kx, (batch, width))
        logits = jnp.tanh(x @ w1) @ w2
        return x, jnp.argmax(logits + jax.random.gumbel(kn, logits.shape), axis=-1)

    params, static = eqx.partition(model, eqx.is_array)

    def loss(params, x, y):
        return loss_fn(eqx.combine(params, static), x, y)

    optimizer = optax.adam(1e-3)
    held_out = [sample(k) for k in jax.random.split(k_eval, 8)]
    finals = {}
    for label, policy in (("plain", None), ("int8", rp.Quantize(bits=8)),
                          ("int4", rp.Quantize(bits=4))):
        fn = loss if policy is None else residual.with_hooks(loss, policy=policy)

        @jax.jit
        def step(p, state, k, fn=fn):
            value, grads = jax.value_and_grad(fn)(p, *sample(k))
            updates, state = optimizer.update(grads, state, p)
            return optax.apply_updates(p, updates), state, value

        p, state = params, optimizer.init(params)
        for k in jax.random.split(jax.random.key(1), steps):
            p, state, _ = step(p, state, k)
        finals[label] = sum(float(loss(p, x, y)) for x, y in held_out) / len(held_out)
    print(f"\ntraining {steps} steps on fresh batches, optax.adam, 4 residual MLP blocks "
          "(scan), width 128; held-out loss:")
    for label, value in finals.items():
        print(f"  {label:6s} {value:.4f}  ({value / finals['plain']:.4f}x plain)")
    for label, bound in (("int8", 0.02), ("int4", 0.05)):
        ok = abs(finals[label] / finals["plain"] - 1) <= bound
        print(f"  {'PASS' if ok else 'FAIL'}: {label} within {bound:.0%} of plain")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    with jax.numpy_dtype_promotion("standard"):
        gradient_errors()
        training(args.steps)
