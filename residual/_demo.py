"""`python -m residual demo`: a small equinox model trained with optax under hooks."""

from __future__ import annotations

import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from ._engine.transform import with_hooks
from ._gradcheck import gradcheck
from ._inspect.analysis import inspect
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
    """Inspects, checks and trains the model, plain and under int8 residuals; prints a summary."""
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

    print(f"residual demo: an equinox model of {depth} residual MLP blocks run by lax.scan,")
    print(f"width {width}, batch {batch}, float32, trained with optax.adam on a noisy toy task.")
    print(f"Policy: Quantize(bits=8): each float residual of at least {policy.min_bytes // 1024}"
          f" KiB is stored as int8,\nwith a float32 scale per {policy.group_size} values.\n")
    report = inspect(loss_of_params, params, x, y, policy=policy)
    print(report, end="\n\n")

    check = gradcheck(loss_of_params, params, x, y, policy=policy)
    worst = check.residuals[0] if check.residuals else None
    print(
        f"gradcheck {'OK' if check.ok else 'FAILED'}: the gradient is within "
        f"{check.grad_rel_error:.2%} of plain jax.grad's (tolerance {check.rtol:.0%});"
        + (f"\nworst round trip unpack(pack(x)): {worst.max_rel_error:.2%} of max |x|, "
           f"residual {_label(worst.info)} ({worst.info.primitive})." if worst else "")
        + "\n"
    )

    print(f"Training {steps} steps each, compiled first, then timed step by step:")
    curves = _train(loss_of_params, with_hooks(loss_of_params, policy=policy), params, x, y,
                    steps)
    for name, (losses, times) in curves.items():
        print(f"  {name:15s} loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"{1e3 * statistics.median(times):6.1f} ms per step (median)")
    (plain_losses, plain_times), (int8_losses, int8_times) = curves.values()
    t = report.totals
    plain_mib, int8_mib = t["plain_peak_bytes"] / 2**20, t["hooked_peak_bytes"] / 2**20
    step_ratio = statistics.median(int8_times) / statistics.median(plain_times)
    print("\nSummary, int8 residuals against plain jax.grad, both measured in this run:")
    print(f"  memory     {t['peak_ratio']:7.2f}x  compiled jit(grad) peak memory, "
          f"{int8_mib:.1f} MiB against {plain_mib:.1f} MiB\n"
          f"             {t['beyond_ratio']:7.2f}x  of it beyond arguments and outputs")
    print(f"  step time  {step_ratio:7.2f}x  median step after compilation")
    print(f"  loss       {int8_losses[-1] / plain_losses[-1]:7.4f}x  final training loss")


def _label(info) -> str:
    """The residual's number as the report shows it (the demo has one scan body)."""
    return f"body[{info.index}]" if info.in_scan else str(info.index)


def _train(plain, hooked, params, x, y, steps: int) -> dict[str, tuple[list, list]]:
    """Losses and step times of `steps` optax steps with each loss, steps interleaved."""
    optimizer = optax.adam(3e-4)

    def make_step(loss):
        def step(params, state):
            value, grads = jax.value_and_grad(loss)(params, x, y)
            updates, state = optimizer.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

        return jax.jit(step).lower(params, optimizer.init(params)).compile()

    runs = {"plain jax.grad": make_step(plain), "int8 residuals": make_step(hooked)}
    states = {name: (params, optimizer.init(params)) for name in runs}
    curves: dict[str, tuple[list, list]] = {name: ([], []) for name in runs}
    # Interleaved, so that the load on the machine weighs on both alike.
    for _ in range(steps):
        for name, step in runs.items():
            start = time.perf_counter()
            p, state, value = jax.block_until_ready(step(*states[name]))
            curves[name][1].append(time.perf_counter() - start)
            curves[name][0].append(float(value))
            states[name] = (p, state)
    return curves
