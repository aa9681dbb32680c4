"""The models the benchmarks measure: scan and unrolled tanh MLPs, an equinox transformer."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax


def mlp_params(layers, width, batch, dtype=jnp.float32, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    ws = (jax.random.normal(k1, (layers, width, width)) / jnp.sqrt(width)).astype(dtype)
    x = jax.random.normal(k2, (batch, width)).astype(dtype)
    return ws, x


def scan_mlp(ws, x):
    def layer(h, w):
        return jnp.tanh(h @ w), None

    h, _ = lax.scan(layer, x, ws)
    return jnp.sum(h.astype(jnp.float32) ** 2)


def unrolled_mlp(ws, x):
    for i in range(ws.shape[0]):
        x = jnp.tanh(x @ ws[i])
    return jnp.sum(x.astype(jnp.float32) ** 2)


def checkpointed_scan_mlp(policy):
    """`scan_mlp` with `jax.checkpoint(policy=...)` on the layer body."""

    def model(ws, x):
        def layer(h, w):
            return jnp.tanh(h @ w), None

        h, _ = lax.scan(jax.checkpoint(layer, policy=policy), x, ws)
        return jnp.sum(h.astype(jnp.float32) ** 2)

    return model


def checkpointed_unrolled_mlp(policy):
    """`unrolled_mlp` with `jax.checkpoint(policy=...)` on each layer."""

    def layer(h, w):
        return jnp.tanh(h @ w)

    def model(ws, x):
        for i in range(ws.shape[0]):
            x = jax.checkpoint(layer, policy=policy)(x, ws[i])
        return jnp.sum(x.astype(jnp.float32) ** 2)

    return model


class Block(eqx.Module):
    attention: eqx.nn.MultiheadAttention
    norm1: eqx.nn.LayerNorm
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width, heads, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attention = eqx.nn.MultiheadAttention(heads, width, key=k1)
        self.norm1 = eqx.nn.LayerNorm(width)
        self.norm2 = eqx.nn.LayerNorm(width)
        self.up = eqx.nn.Linear(width, 4 * width, key=k2)
        self.down = eqx.nn.Linear(4 * width, width, key=k3)

    def __call__(self, x):
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(lambda t: self.down(jax.nn.gelu(self.up(t))))(h)


def transformer(blocks=4, width=256, heads=4, seq=128, batch=8, seed=0):
    """(loss, params, tokens): a stack of blocks run by `lax.scan` over stacked params."""
    keys = jax.random.split(jax.random.key(seed), blocks + 1)
    stacked = eqx.filter_vmap(lambda k: Block(width, heads, k))(keys[:blocks])
    params, static = eqx.partition(stacked, eqx.is_array)
    x = jax.random.normal(keys[-1], (batch, seq, width))

    def loss(params, x):
        def body(h, p):
            return jax.vmap(eqx.combine(p, static))(h), None

        h, _ = lax.scan(body, x, params)
        return jnp.mean(h**2)

    return loss, params, x
