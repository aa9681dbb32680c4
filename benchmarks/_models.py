"""The models the benchmarks measure: scan and unrolled tanh MLPs, transformers built from
equinox, flax NNX, haiku and keras-hub layers, a flax Linen CNN."""

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


def transformer(blocks=4, width=256, heads=4, seq=128, batch=8, seed=0, dtype=jnp.float32,
                checkpoint_policy=None):
    """(loss, params, tokens): a stack of blocks run by `lax.scan` over stacked params, in
    `dtype` (the loss summed in float32); with `checkpoint_policy`, each block under
    `jax.checkpoint(policy=checkpoint_policy)`."""
    keys = jax.random.split(jax.random.key(seed), blocks + 1)
    stacked = eqx.filter_vmap(lambda k: Block(width, heads, k))(keys[:blocks])
    params, static = eqx.partition(stacked, eqx.is_array)
    params = jax.tree.map(lambda a: a.astype(dtype), params)
    x = jax.random.normal(keys[-1], (batch, seq, width)).astype(dtype)

    def loss(params, x):
        def body(h, p):
            return jax.vmap(eqx.combine(p, static))(h), None

        if checkpoint_policy is not None:
            body = jax.checkpoint(body, policy=checkpoint_policy)
        h, _ = lax.scan(body, x, params)
        return jnp.mean(h**2 if h.dtype == jnp.float32 else h.astype(jnp.float32) ** 2)

    return loss, params, x


# Models built from other libraries' layers, for `zoo.py`. Each returns `(loss, args)`
# with `loss(*args)` a scalar to differentiate with respect to its first argument.


def nnx_transformer(blocks=4, width=256, heads=4, seq=128, batch=8, vocab=512, seed=0,
                    scan=True):
    """A flax NNX causal transformer: blocks stacked by `nnx.vmap`, run by `nnx.scan`
    (`scan=False`: the same blocks, unstacked, called one after the other)."""
    import optax
    from flax import nnx

    class NnxBlock(nnx.Module):
        def __init__(self, rngs):
            self.norm1 = nnx.LayerNorm(width, rngs=rngs)
            self.attention = nnx.MultiHeadAttention(heads, width, decode=False,
                                                    keep_rngs=False, rngs=rngs)
            self.norm2 = nnx.LayerNorm(width, rngs=rngs)
            self.up = nnx.Linear(width, 4 * width, rngs=rngs)
            self.down = nnx.Linear(4 * width, width, rngs=rngs)

        def __call__(self, x):
            mask = nnx.make_causal_mask(x[..., 0])
            x = x + self.attention(self.norm1(x), mask=mask)
            return x + self.down(nnx.gelu(self.up(self.norm2(x))))

    class NnxTransformer(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(vocab, width, rngs=rngs)

            @nnx.split_rngs(splits=blocks)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return NnxBlock(rngs)

            self.blocks = make(rngs)
            self.norm = nnx.LayerNorm(width, rngs=rngs)

        def __call__(self, tokens):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def layer(x, block):
                return block(x)

            x = layer(self.embed(tokens), self.blocks)
            return self.embed.attend(self.norm(x))

    class NnxUnrolled(NnxTransformer):
        # The same parameters as the scanned model, each block's taken out of the stack.
        def __call__(self, tokens):
            graphdef, stacked = nnx.split(self.blocks)
            x = self.embed(tokens)
            for i in range(blocks):
                x = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], stacked))(x)
            return self.embed.attend(self.norm(x))

    model = (NnxTransformer if scan else NnxUnrolled)(nnx.Rngs(seed))
    graphdef, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.PRNGKey(seed), (batch, seq + 1), 0, vocab)

    def loss(params, tokens):
        logits = nnx.merge(graphdef, params, copy=True)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss, (params, tokens)


def haiku_transformer(blocks=4, width=256, heads=4, seq=128, batch=8, seed=0):
    """A haiku causal transformer, its blocks in `hk.layer_stack` (one `lax.scan`)."""
    import haiku as hk

    def block(x):
        causal = jnp.tril(jnp.ones((1, 1, seq, seq), bool))
        h = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
        x = x + hk.MultiHeadAttention(heads, width // heads,
                                      w_init=hk.initializers.VarianceScaling())(
            h, h, h, mask=causal)
        h = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
        return x + hk.Linear(width)(jax.nn.gelu(hk.Linear(4 * width)(h)))

    def forward(x):
        return jnp.mean(hk.layer_stack(blocks)(block)(x) ** 2)

    model = hk.without_apply_rng(hk.transform(forward))
    x = jax.random.normal(jax.random.PRNGKey(seed), (batch, seq, width))
    params = model.init(jax.random.PRNGKey(seed + 1), x)
    return model.apply, (params, x)


def linen_cnn(stages=3, channels=32, size=64, batch=32, seed=0):
    """A flax Linen CNN, Conv + BatchNorm (batch statistics, `mutable`) + ReLU per layer."""
    import flax.linen as nn
    import optax

    class Cnn(nn.Module):
        @nn.compact
        def __call__(self, x):
            for stage in range(stages):
                for _ in range(2):
                    x = nn.Conv(channels << stage, (3, 3))(x)
                    x = nn.relu(nn.BatchNorm(use_running_average=False)(x))
                x = nn.avg_pool(x, (2, 2), (2, 2))
            return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))

    model = Cnn()
    x = jax.random.normal(jax.random.PRNGKey(seed), (batch, size, size, 3))
    labels = jnp.arange(batch) % 10
    variables = model.init(jax.random.PRNGKey(seed + 1), x)

    def loss(params, batch_stats, x, labels):
        logits, _ = model.apply({"params": params, "batch_stats": batch_stats}, x,
                                mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return loss, (variables["params"], variables["batch_stats"], x, labels)


def keras_gpt2(blocks=4, width=256, heads=4, seq=128, batch=8, vocab=512, seed=0):
    """A keras-hub `GPT2Backbone` (JAX backend, random init), its logits from the tied
    token embedding, next-token cross-entropy through `stateless_call`.

    Raises `ImportError` when keras or keras-hub is missing, and `RuntimeError` when
    keras was imported with another backend than JAX.
    """
    import os

    os.environ.setdefault("KERAS_BACKEND", "jax")  # read when keras is first imported
    import keras
    import keras_hub
    import optax

    if keras.backend.backend() != "jax":
        raise RuntimeError(
            f"keras runs on the {keras.backend.backend()!r} backend; this model needs "
            "JAX. Set KERAS_BACKEND=jax before keras is imported."
        )
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocab, num_layers=blocks, num_heads=heads, hidden_dim=width,
        intermediate_dim=4 * width, dropout=0.0, max_sequence_length=seq)
    tokens = jax.random.randint(jax.random.PRNGKey(seed), (batch, seq + 1), 0, vocab)
    trainable = [v.value for v in backbone.trainable_variables]
    non_trainable = [v.value for v in backbone.non_trainable_variables]
    embedding = [v.path for v in backbone.trainable_variables].index(
        "token_embedding/embeddings")

    def loss(trainable, non_trainable, tokens):
        inputs = {"token_ids": tokens[:, :-1], "padding_mask": jnp.ones_like(tokens[:, :-1])}
        hidden, _ = backbone.stateless_call(trainable, non_trainable, inputs)
        logits = hidden @ trainable[embedding].T
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss, (trainable, non_trainable, tokens)
