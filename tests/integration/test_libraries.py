"""Models built from flax NNX, flax Linen, haiku, equinox and keras layers, under `with_hooks`.

Each is compared with plain `jax.grad` of the same function: bit for bit under identity
hooks, within a stated tolerance under `Cast(bf16)` and `Quantize(bits=8)`; and the
compiled backward under identity hooks uses no more memory (beyond arguments and outputs)
than plain `jax.grad`.
Shapes are small; `Quantize` gets `min_bytes=0` so that it acts on them.
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import residual
from residual import policies as rp

from ..helpers import RUNNING_PLATFORM, relative_l2, same_as_plain, tree_allclose, tree_equal

pytestmark = pytest.mark.slow  # most tests here take 15 s or more

IDENTITY = rp.Identity()
BF16 = rp.Cast(jnp.bfloat16)
INT8 = rp.Quantize(bits=8, min_bytes=0)
# Relative L2 error of the whole gradient vs plain `jax.grad`, measured at these sizes
# (largest of the models below): bf16 0.4%, int8 1.6%. Bounds leave room for other seeds.
BF16_TOLERANCE = 0.02
INT8_TOLERANCE = 0.1
@pytest.fixture(autouse=True)
def _standard_promotion():
    # These libraries (and optax) are written for JAX's default dtype promotion; the
    # strict mode the other tests run under would stop them before any hook runs.
    with jax.numpy_dtype_promotion("standard"):
        yield


def compiled_grad(fn, *args):
    return jax.jit(jax.grad(fn, has_aux=True)).lower(*args).compile()


def check_against_plain(loss, *args, memory_slack: float = 1.0, identity_error: float = 0.0):
    """Gradients and aux of `loss` (returning `(value, aux)`) under each policy vs plain.

    Identity hooks: bit for bit (or within a relative error of `identity_error`, for
    programs XLA fuses differently around the hooks), and the compiled backward's memory
    beyond arguments and outputs is at most `memory_slack` times plain `jax.grad`'s.
    """
    plain = compiled_grad(loss, *args)
    hooked = compiled_grad(residual.with_hooks(loss, policy=IDENTITY), *args)
    expected = plain(*args)
    got = hooked(*args)
    if identity_error:
        assert relative_l2(got[0], expected[0]) <= identity_error
        assert tree_equal(got[1], expected[1])
    else:
        assert tree_equal(got, expected)
    for policy, tolerance in ((BF16, BF16_TOLERANCE), (INT8, INT8_TOLERANCE)):
        grads, aux = jax.jit(jax.grad(residual.with_hooks(loss, policy=policy),
                                      has_aux=True))(*args)
        error = relative_l2(grads, expected[0])
        assert 0 < error < tolerance, f"{policy}: relative error {error:.4f}"
        # Auxiliary outputs (updated statistics) come from the forward pass, which the
        # policy leaves alone; XLA may fuse it differently around the packing (an ulp).
        assert tree_allclose(aux, expected[1])
    # At these sizes (60 to 150 KiB beyond arguments and outputs) XLA:GPU keeps a few KiB
    # more around the hooks: 1.012x and 1.053x of plain for the haiku transformer on an
    # H200.
    slack = max(memory_slack, 1.06) if RUNNING_PLATFORM == "gpu" else memory_slack
    hooked_memory = residual.Memory.of(hooked).beyond
    plain_memory = residual.Memory.of(plain).beyond
    assert hooked_memory <= slack * plain_memory, (hooked_memory, plain_memory)


# flax NNX: a causal transformer, blocks stacked with `nnx.vmap` and run by `nnx.scan`
# over `nnx.remat`-ed blocks.


class NnxBlock(nnx.Module):
    def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        mask = nnx.make_causal_mask(x[..., 0])
        x = x + self.dropout(self.attention(self.norm1(x), mask=mask))
        return x + self.dropout(self.down(nnx.gelu(self.up(self.norm2(x)))))


class NnxTransformer(nnx.Module):
    def __init__(self, vocab: int, width: int, heads: int, layers: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, width, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return NnxBlock(width, heads, rngs)

        self.blocks = blocks(rngs)
        self.norm = nnx.LayerNorm(width, rngs=rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def layer(x, block):
            return block(x)

        return self.embed.attend(self.norm(layer(self.embed(tokens), self.blocks)))


def nnx_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def train_nnx(policy, *, deterministic: bool, steps: int = 2):
    """(losses, gradients of the first step, model) after `steps` steps of adam."""
    model = NnxTransformer(vocab=32, width=16, heads=2, layers=2,
                           rngs=nnx.Rngs(params=0, dropout=1))
    if deterministic:
        model.eval()
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    loss_fn = nnx_loss if policy is None else residual.with_hooks(nnx_loss, policy=policy)

    @nnx.jit
    def step(model, optimizer, tokens):
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
        optimizer.update(model, grads)
        return loss, grads

    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 9), 0, 32)
    losses, first = [], None
    for _ in range(steps):
        loss, grads = step(model, optimizer, tokens)
        losses.append(loss)
        first = grads if first is None else first
    return losses, first, model


def test_flax_nnx_transformer_trains_as_plain_without_dropout():
    plain_losses, plain_grads, plain_model = train_nnx(None, deterministic=True)
    losses, grads, model = train_nnx(IDENTITY, deterministic=True)
    assert same_as_plain(grads, plain_grads)
    assert same_as_plain(losses, plain_losses)
    assert same_as_plain(nnx.state(model, nnx.Param), nnx.state(plain_model, nnx.Param))
    for policy, tolerance in ((BF16, BF16_TOLERANCE), (INT8, INT8_TOLERANCE)):
        _, grads, _ = train_nnx(policy, deterministic=True, steps=1)
        error = relative_l2(grads, plain_grads)
        assert 0 < error < tolerance, f"{policy}: relative error {error:.4f}"


def test_flax_nnx_transformer_with_dropout_trains_as_plain():
    plain_losses, plain_grads, plain_model = train_nnx(None, deterministic=False)
    losses, grads, model = train_nnx(IDENTITY, deterministic=False)
    assert tree_equal(grads, plain_grads)
    assert tree_equal(losses, plain_losses)
    # The dropout RNG counts advance as in plain training: each step draws new masks.
    assert tree_equal(nnx.state(model, nnx.RngCount), nnx.state(plain_model, nnx.RngCount))
    assert tree_equal(nnx.state(model, nnx.Param), nnx.state(plain_model, nnx.Param))


class NnxBatchNormMlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(8, 32, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.down = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.norm(self.up(x))))


def test_flax_nnx_batch_norm_statistics_update_through_the_hooks():
    x = jax.random.normal(jax.random.PRNGKey(0), (16, 8))

    def loss_fn(model, x):
        return jnp.mean(model(x) ** 2)

    plain, hooked = (NnxBatchNormMlp(nnx.Rngs(0)) for _ in range(2))
    expected = nnx.grad(loss_fn)(plain, x)
    # The module goes into the hooked function as it goes into plain `nnx.grad`; the
    # statistics it updates in place come back out.
    got = nnx.grad(residual.with_hooks(loss_fn, policy=IDENTITY))(hooked, x)
    # Bit-identical on jax 0.10. jax 0.12 sums in another order: the last bits differ,
    # and the first layer's bias, whose gradient under BatchNorm is zero in exact
    # arithmetic, holds other rounding noise (1e-9 against 1e-1 elsewhere).
    assert relative_l2(got, expected) < 1e-6
    stats = nnx.state(hooked, nnx.BatchStat)
    assert tree_equal(stats, nnx.state(plain, nnx.BatchStat))
    assert not tree_equal(stats, nnx.state(NnxBatchNormMlp(nnx.Rngs(0)), nnx.BatchStat))


def test_flax_nnx_module_passed_twice_and_a_variable_update_as_under_plain_nnx_grad():
    x = jax.random.normal(jax.random.PRNGKey(0), (16, 8))

    def loss_fn(a, b, x, scale):
        return jnp.mean(a(x) * b(x)) * scale[...]

    plain, hooked = (NnxBatchNormMlp(nnx.Rngs(0)) for _ in range(2))
    scale = nnx.Variable(jnp.float32(2.0))
    expected = nnx.grad(loss_fn, argnums=(0, 1))(plain, plain, x, scale)
    got = nnx.grad(residual.with_hooks(loss_fn, policy=IDENTITY), argnums=(0, 1))(
        hooked, hooked, x, scale)
    assert relative_l2(got, expected) < 1e-6
    stats = nnx.state(hooked, nnx.BatchStat)
    assert tree_equal(stats, nnx.state(plain, nnx.BatchStat))
    assert not tree_equal(stats, nnx.state(NnxBatchNormMlp(nnx.Rngs(0)), nnx.BatchStat))


def test_inspect_takes_a_flax_nnx_module_as_it_is():
    model = NnxBatchNormMlp(nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(0), (16, 8))
    report = residual.inspect(lambda m, x: jnp.mean(m(x) ** 2), model, x, policy=INT8)
    assert any(row.primitive == "rsqrt" for row in report.rows)
    assert report.totals["residual_bytes"] > 0


def test_flax_nnx_emits_no_scopes_but_source_globs_select_its_layers():
    model = NnxBlock(16, 2, nnx.Rngs(0))
    model.eval()
    graphdef, state = nnx.split(model)

    def loss(state, x):
        return jnp.mean(nnx.merge(graphdef, state, copy=True)(x) ** 2)

    x = jnp.ones((2, 8, 16))
    rows = residual.inspect(loss, state, x, compiled=False).rows
    assert {row.scope for row in rows} == {""}
    norms = rp.select([(rp.where(source="normalization.py:*"), BF16)])
    chosen = residual.inspect(loss, state, x, policy=norms, compiled=False).rows
    # `where(source=...)` matches any frame: flax's normalization.py picks the norms
    # alone; the report shows the user's own line, so count the rows the rule chose.
    picked = [row for row in chosen if row.policy != "-"]
    assert picked and len(picked) < len(chosen)
    assert all(row.primitive != "dot_general" for row in picked)
    # A rule on the user's method picks what the flax layers it calls compute: the
    # norms, the attention's softmax, the MLP. The softmax saves its `exp`, or (JAX's
    # `jax_softmax_custom_jvp`, the default from jax 0.12.1) its probabilities, a `div`.
    block = rp.select([(rp.where(source="*(NnxBlock.__call__)"), BF16)])
    chosen = residual.inspect(loss, state, x, policy=block, compiled=False).rows
    in_block = [row for row in chosen if row.policy != "-"]
    assert len(in_block) > len(picked)
    softmax = "div" if jax.config.jax_softmax_custom_jvp else "exp"
    # Attention weights: [batch, heads, queries, keys].
    assert any(row.primitive == softmax and row.shape[-2:] == (8, 8) for row in in_block)
    assert "rsqrt" in {row.primitive for row in in_block}


# flax Linen: a CNN with BatchNorm, its statistics updated with `mutable=["batch_stats"]`.


class LinenCnn(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        for features in (8, 16):
            x = nn.Conv(features, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            x = nn.avg_pool(nn.relu(x), (2, 2), (2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def linen_cnn():
    model = LinenCnn()
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 16, 16, 3))
    labels = jnp.arange(8) % 10
    variables = model.init(jax.random.PRNGKey(1), x, train=False)

    def loss(params, batch_stats, x, labels):
        logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, x,
                                      train=True, mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, updates["batch_stats"]

    return loss, (variables["params"], variables["batch_stats"], x, labels)


def test_flax_linen_batch_norm_cnn_matches_plain_grad():
    loss, args = linen_cnn()
    check_against_plain(loss, *args)


def test_flax_linen_modules_are_scopes():
    loss, args = linen_cnn()
    scopes = {row.scope for row in residual.inspect(loss, *args, compiled=False).rows}
    assert {"LinenCnn/BatchNorm_0", "LinenCnn/BatchNorm_1"} <= scopes


# haiku: `transform_with_state` with BatchNorm and dropout, blocks in `hk.layer_stack`.


class HaikuBlock(hk.Module):
    def __call__(self, x, is_training: bool):
        width, seq = x.shape[-1], x.shape[1]
        h = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
        causal = jnp.tril(jnp.ones((1, 1, seq, seq), bool))
        h = hk.MultiHeadAttention(2, width // 2, w_init=hk.initializers.VarianceScaling())(
            h, h, h, mask=causal)
        x = x + h
        h = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)(
            hk.Linear(4 * width)(x), is_training)
        h = jax.nn.gelu(h)
        if is_training:
            h = hk.dropout(hk.next_rng_key(), 0.1, h)
        return x + hk.Linear(width)(h)


def haiku_model(remat: bool):
    def forward(x, is_training):
        block = lambda x: HaikuBlock()(x, is_training)  # noqa: E731
        stack = hk.layer_stack(2)(hk.remat(block) if remat else block)
        return jnp.mean(stack(x) ** 2)

    model = hk.transform_with_state(forward)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 16))
    params, state = model.init(jax.random.PRNGKey(1), x, True)

    def loss(params, state, rng, x):
        return model.apply(params, state, rng, x, True)

    return loss, (params, state, jax.random.PRNGKey(2), x)


@pytest.mark.parametrize("remat", [False, True], ids=["layer_stack", "layer_stack+remat"])
def test_haiku_transformer_with_state_and_dropout_matches_plain_grad(remat):
    loss, args = haiku_model(remat)
    # Identity hooks compile to a few hundred bytes more memory (beyond arguments and
    # outputs: XLA:CPU's temp) than plain here (140112 vs 139904 bytes without
    # `hk.remat`, 64784 vs 64640 with it, and 66000 vs 65216 with it on jax 0.12.1). With
    # `hk.remat`, jax 0.11 fuses the rematerialized body differently around the hooks:
    # a few gradient entries differ in the last bit (1e-7 relative).
    check_against_plain(loss, *args, memory_slack=1.02 if remat else 1.01,
                        identity_error=1e-6 if remat else 0.0)


def test_haiku_modules_are_scopes():
    loss, args = haiku_model(remat=False)
    scopes = {row.scope for row in residual.inspect(loss, *args, compiled=False).rows}
    assert {"haiku_block/layer_norm", "haiku_block/multi_head_attention"} <= scopes
    mlp_only = rp.select([(rp.where(scope="haiku_block/batch_norm*"), INT8)])
    rows = residual.inspect(loss, *args, policy=mlp_only, compiled=False).rows
    picked = {row.scope for row in rows if row.policy != "-"}
    assert picked and all(scope.startswith("haiku_block/batch_norm") for scope in picked)


# equinox: pre-norm causal transformer blocks, unrolled.


class EqxBlock(eqx.Module):
    attention: eqx.nn.MultiheadAttention
    norm1: eqx.nn.LayerNorm
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, width, heads, key):
        k1, k2 = jax.random.split(key)
        self.attention = eqx.nn.MultiheadAttention(heads, width, key=k1)
        self.norm1 = eqx.nn.LayerNorm(width)
        self.norm2 = eqx.nn.LayerNorm(width)
        self.mlp = eqx.nn.MLP(width, width, 4 * width, 1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x):
        h = jax.vmap(self.norm1)(x)
        mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        x = x + self.attention(h, h, h, mask=mask)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


def test_equinox_transformer_matches_plain_grad():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    blocks = [EqxBlock(16, 2, k) for k in keys[:2]]
    x = jax.random.normal(keys[2], (4, 8, 16))

    def loss(blocks, x):
        for block in blocks:
            x = jax.vmap(block)(x)
        return jnp.mean(x**2), None

    params, static = eqx.partition(blocks, eqx.is_array)
    check_against_plain(lambda p, x: loss(eqx.combine(p, static), x), params, x)


# equinox: a convolution and a BatchNorm keeping moving averages (its default mode), whose
# state update returns a constant the trace makes a literal.


class EqxConvNorm(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm

    def __init__(self, key):
        self.conv = eqx.nn.Conv2d(3, 8, 3, padding=1, key=key)
        self.norm = eqx.nn.BatchNorm(8, axis_name="batch", mode="ema")

    def __call__(self, x, state):
        h, state = self.norm(jax.nn.relu(self.conv(x)), state)
        return jnp.tanh(h), state


def test_equinox_batch_norm_state_matches_plain_grad():
    model, state = eqx.nn.make_with_state(EqxConvNorm)(jax.random.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_array)
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 3, 8, 8))

    def loss(params, state, x):
        batched = jax.vmap(eqx.combine(params, static), axis_name="batch",
                           in_axes=(0, None), out_axes=(0, None))
        y, state = batched(x, state)
        return jnp.mean(y**2), state

    check_against_plain(loss, params, state, x)


# keras 3 with the JAX backend: `stateless_call` is a pure function of the variables.


@pytest.fixture
def keras(monkeypatch):
    """keras on the JAX backend (its default, TensorFlow, is not installed)."""
    monkeypatch.setenv("KERAS_BACKEND", "jax")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip("keras was imported with another backend")
    return keras


def test_keras_stateless_call_matches_plain_grad(keras):
    model = keras.Sequential([
        keras.Input((8, 16)),
        keras.layers.LayerNormalization(),
        keras.layers.Dense(64, activation="gelu"),
        keras.layers.Dropout(0.1),
        keras.layers.Dense(16),
    ])
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 8, 16))
    trainable = [v.value for v in model.trainable_variables]
    other = [v.value for v in model.non_trainable_variables]

    def loss(trainable, other, x):
        y, other = model.stateless_call(trainable, other, x, training=True)
        return jnp.mean(y**2), other

    check_against_plain(loss, trainable, other, x)


def test_keras_cnn_with_batch_norm_matches_plain_grad(keras):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((16, 16, 3)),
        keras.layers.Conv2D(8, 3, padding="same"),
        keras.layers.BatchNormalization(),  # moving statistics: non-trainable state
        keras.layers.ReLU(),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(16, 3, padding="same", activation="silu"),
        keras.layers.GroupNormalization(groups=4),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10),
    ])
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 16, 16, 3))
    labels = jax.random.randint(jax.random.PRNGKey(1), (8,), 0, 10)
    trainable = [v.value for v in model.trainable_variables]
    other = [v.value for v in model.non_trainable_variables]

    def loss(trainable, other, x, labels):
        logits, other = model.stateless_call(trainable, other, x, training=True)
        return jnp.mean(keras.losses.sparse_categorical_crossentropy(
            labels, logits, from_logits=True)), other

    check_against_plain(loss, trainable, other, x, labels)
