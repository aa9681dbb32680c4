"""`python -m residual demo`: a small equinox model trained with optax under hooks."""

from __future__ import annotations

import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from ._gradcheck import gradcheck
from ._inspect import inspect
from ._transform import with_hooks
from .policies import Quantize


class Block(eqx.Module):
    """A pre-norm residual MLP block."""

    norm: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width: int, key):
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(width)
        self.up = eqx.nn.Linear(width, 4 * width, key=k1)
        self.down = eqx.nn.Linear(4 * width, width, key=k2)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class Model(eqx.Module):
    """Blocks stacked with `eqx.filter_vmap` and run by `lax.scan`, then a linear head."""

    blocks: Block
    head: eqx.nn.Linear

    def __init__(self, width: int, depth: int, classes: int, key):
        keys = jax.random.split(key, depth + 1)
        self.blocks = eqx.filter_vmap(lambda k: Block(width, k))(keys[:depth])
        self.head = eqx.nn.Linear(width, classes, key=keys[-1])

    def __call__(self, x):
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def step(h, p):
            with jax.named_scope("block"):
                return eqx.combine(p, static)(h), None

        h, _ = jax.lax.scan(step, x, params)
        return self.head(h)


def loss_fn(model: Model, x, y):
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def main(steps: int = 30, width: int = 128, depth: int = 4, batch: int = 256) -> None:
    key = jax.random.key(0)
    k_model, k_data, k_w = jax.random.split(key, 3)
    model = Model(width, depth, 10, k_model)
    # A toy task that is not solved in a few steps: labels of a random nonlinear
    # teacher, with a third of them noisy.
    k_w1, k_w2, k_noise = jax.random.split(k_w, 3)
    x = jax.random.normal(k_data, (batch, width))
    teacher = jnp.tanh(x @ jax.random.normal(k_w1, (width, width))) @ jax.random.normal(
        k_w2, (width, 10)
    )
    y = jnp.argmax(teacher + 3.0 * jax.random.gumbel(k_noise, teacher.shape), axis=-1)
    policy = Quantize(bits=8)
    params, static = eqx.partition(model, eqx.is_array)

    def loss_of_params(params, x, y):
        return loss_fn(eqx.combine(params, static), x, y)

    print(f"residual demo: {depth} residual MLP blocks (scan), width {width}, batch {batch}")
    print(f"policy: {policy!r}\n")
    report = inspect(loss_of_params, params, x, y, policy=policy)
    print(report, "\n")

    check = gradcheck(loss_of_params, params, x, y, policy=policy)
    print(check, "\n")

    optimizer = optax.adam(3e-4)
    hooked = with_hooks(loss_of_params, policy=policy)
    curves = {}
    for name, loss in (("plain jax.grad", loss_of_params), ("int8 residuals", hooked)):

        @jax.jit
        def step(params, state, loss=loss):
            value, grads = jax.value_and_grad(loss)(params, x, y)
            updates, state = optimizer.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

        p, state = params, optimizer.init(params)
        start = time.perf_counter()
        losses = []
        for _ in range(steps):
            p, state, value = step(p, state)
            losses.append(float(value))
        curves[name] = (losses, time.perf_counter() - start)

    print(f"training {steps} steps with optax.adam (a noisy toy task):")
    for name, (losses, seconds) in curves.items():
        print(f"  {name:16s} loss {losses[0]:.4f} -> {losses[-1]:.4f}  ({seconds:.1f} s)")
    plain_final = curves["plain jax.grad"][0][-1]
    hooked_final = curves["int8 residuals"][0][-1]
    print(f"  final loss ratio (int8 / plain): {hooked_final / plain_final:.4f}")
    t = report.totals
    print(
        f"\ncompiled backward temp memory: {t['temp_ratio']:.2f}x of plain jax.grad "
        f"({t['hooked_temp_bytes'] / 2**20:.2f} MiB vs {t['plain_temp_bytes'] / 2**20:.2f} MiB, "
        "measured in this run)"
    )
