"""flax NNX objects as arguments of a hooked function, in every form a flax user passes them.

Each case runs a loss plainly and hooked under one transform, on fresh objects, and
compares what a user sees: the returned gradients and aux, the error raised if any, and
the caller's NNX objects afterwards. A hooked function must write state back exactly where
the plain one mutates the caller's objects, and nowhere else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import residual

from ..helpers import relative_l2, tree_equal


@pytest.fixture(autouse=True)
def _standard_promotion():
    # flax and optax are written for JAX's default dtype promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


class Cnn(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.head = nnx.Linear(8, 10, rngs=rngs)

    def __call__(self, x):
        x = self.dropout(nnx.relu(self.bn(self.conv(x))))
        return self.head(x.mean((1, 2)))


X = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
Y = jnp.arange(4) % 10


def cross_entropy(logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, Y).mean()


def fresh_model():
    return Cnn(nnx.Rngs(params=0, dropout=1))


# The losses, one per way of passing NNX objects. Each `make` returns fresh arguments.


def functional_loss(params, stats, rest, graphdef, x):
    """The functional pattern: merge a copy inside, never touch the caller's state."""
    model = nnx.merge(graphdef, params, stats, rest, copy=True)
    model.train()
    return cross_entropy(model(x))


def functional_loss_with_stats(params, stats, rest, graphdef, x):
    """The same, returning the updated statistics and RNG counts as aux."""
    model = nnx.merge(graphdef, params, stats, rest, copy=True)
    model.train()
    loss = cross_entropy(model(x))
    return loss, (nnx.state(model, nnx.BatchStat), nnx.state(model, nnx.RngState))


def functional_args():
    graphdef, params, stats, rest = nnx.split(fresh_model(), nnx.Param, nnx.BatchStat, ...)
    return (params, stats, rest, graphdef, X)


def merged_loss(params, rest, graphdef, x):
    """graphdef + States, merged without a copy: the model shares the States' Variables."""
    model = nnx.merge(graphdef, params, rest)
    model.eval()
    return cross_entropy(model(x))


def merged_train_loss(params, rest, graphdef, x):
    """The same in training mode: BatchNorm assigns to the caller's `rest`."""
    model = nnx.merge(graphdef, params, rest)
    model.train()
    return cross_entropy(model(x))


def merged_args():
    graphdef, params, rest = nnx.split(fresh_model(), nnx.Param, ...)
    return (params, rest, graphdef, X)


def module_loss(model, x):
    """A module itself: BatchNorm statistics and dropout RNG counts change in place."""
    model.train()
    return cross_entropy(model(x))


def module_args():
    return (fresh_model(), X)


def variable_loss(kernel, count, x):
    """Bare Variables: one read, one assigned to."""
    count[...] = count[...] + 1
    return jnp.sum(jnp.tanh(x.reshape(4, -1)[:, :8] @ kernel[...]) ** 2)


def variable_args():
    kernel = nnx.Param(jax.random.normal(jax.random.key(1), (8, 8)))
    return (kernel, nnx.Variable(jnp.zeros((), jnp.int32)), X)


def read_only_variable_loss(kernel, x):
    return jnp.sum(jnp.tanh(x.reshape(4, -1)[:, :8] @ kernel[...]) ** 2)


def read_only_variable_args():
    return (nnx.Param(jax.random.normal(jax.random.key(1), (8, 8))), X)


def remat_inside_loss(model, x):
    """`nnx.remat` inside the hooked function, around a part of the model."""
    model.train()
    features = nnx.remat(lambda m, x: nnx.relu(m.bn(m.conv(x))))(model, x)
    return cross_entropy(model.head(model.dropout(features).mean((1, 2))))


# The transforms a user puts around the loss.

TRANSFORMS = {
    "eager": lambda f: f,
    "jax.grad": lambda f: jax.grad(f),
    "jax.jit(jax.grad)": lambda f: jax.jit(jax.grad(f)),
    "jax.value_and_grad": lambda f: jax.value_and_grad(f),
    "jax.grad(has_aux)": lambda f: jax.grad(f, has_aux=True),
    "jax.jit(jax.grad(has_aux))": lambda f: jax.jit(jax.grad(f, has_aux=True)),
    "nnx.grad": lambda f: nnx.grad(f),
    "nnx.value_and_grad": lambda f: nnx.value_and_grad(f),
    "nnx.jit(nnx.grad)": lambda f: nnx.jit(nnx.grad(f)),
    "nnx.grad(nnx.remat)": lambda f: nnx.grad(nnx.remat(f)),
}

# (loss, arguments, transform, what plain JAX/flax does there): every case a user meets.
CASES = [
    (functional_loss, functional_args, "eager", "works"),
    (functional_loss, functional_args, "jax.grad", "works"),
    (functional_loss, functional_args, "jax.jit(jax.grad)", "works"),
    (functional_loss, functional_args, "jax.value_and_grad", "works"),
    (functional_loss_with_stats, functional_args, "jax.grad(has_aux)", "works"),
    (functional_loss_with_stats, functional_args, "jax.jit(jax.grad(has_aux))",
     "works"),
    (merged_loss, merged_args, "jax.grad", "works"),
    (merged_loss, merged_args, "jax.jit(jax.grad)", "works"),
    (merged_loss, merged_args, "nnx.grad", "works"),
    (merged_train_loss, merged_args, "eager", "works"),
    (merged_train_loss, merged_args, "jax.grad", "raises"),
    (module_loss, module_args, "eager", "works"),
    (module_loss, module_args, "nnx.grad", "works"),
    (module_loss, module_args, "nnx.value_and_grad", "works"),
    (module_loss, module_args, "nnx.jit(nnx.grad)", "works"),
    (module_loss, module_args, "nnx.grad(nnx.remat)", "works"),
    # A module under plain `jax.grad` is a pytree of new Variables that belong to the
    # caller's trace level: mutating them is flax's TraceContextError, hooked or not.
    (module_loss, module_args, "jax.grad", "raises"),
    (remat_inside_loss, module_args, "nnx.grad", "works"),
    (remat_inside_loss, module_args, "nnx.jit(nnx.grad)", "works"),
    (variable_loss, variable_args, "eager", "works"),
    (variable_loss, variable_args, "nnx.grad", "works"),
    (variable_loss, variable_args, "jax.grad", "raises"),
    (read_only_variable_loss, read_only_variable_args, "jax.grad", "works"),
    (read_only_variable_loss, read_only_variable_args, "jax.jit(jax.grad)", "works"),
    (read_only_variable_loss, read_only_variable_args, "nnx.grad", "works"),
]


def as_arrays(tree):
    """`tree` with NNX objects as their state and PRNG keys as their data, to compare."""
    tree = jax.tree.map(lambda a: nnx.state(a) if isinstance(a, nnx.Module) else a, tree,
                        is_leaf=lambda a: isinstance(a, nnx.Module))
    return jax.tree.map(
        lambda a: jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key)
        else jnp.asarray(a), tree)


def caller_objects(args):
    """The NNX objects among `args`: what the caller holds after the call."""
    return as_arrays([a for a in args if isinstance(a, nnx.Module | nnx.Variable | nnx.State)])


def run(loss, make, transform):
    """(result or the error's type, the caller's NNX objects after the call)."""
    args = make()
    try:
        result = as_arrays(TRANSFORMS[transform](loss)(*args))
    except Exception as error:  # the plain call's error is the expectation
        result = type(error)
    return result, caller_objects(args)


@pytest.mark.parametrize(("loss", "make", "transform", "plain_does"), CASES,
                         ids=[f"{c[0].__name__}-{c[2]}" for c in CASES])
def test_a_hooked_function_treats_nnx_arguments_as_the_plain_one(loss, make, transform,
                                                                  plain_does):
    packed = []

    def pack(x):
        packed.append(x.shape)
        return x

    expected, expected_objects = run(loss, make, transform)
    got, got_objects = run(residual.with_hooks(loss, pack, lambda x: x), make, transform)
    if plain_does == "raises":
        assert isinstance(expected, type) and issubclass(expected, Exception), expected
        assert got is expected
    else:
        assert not isinstance(expected, type), f"plain {transform} raised {expected}"
        assert not isinstance(got, type), f"hooked {transform} raised {got}"
        assert jax.tree.structure(got) == jax.tree.structure(expected)
        # Bit for bit under `jit`; eager plain `jax.grad` runs op by op, the hooked
        # backward as one compiled call, and the last bits differ.
        assert relative_l2(got, expected) < 1e-6
        # The hooks ran wherever there was a residual to save.
        assert bool(packed) == (transform != "eager")
    assert tree_equal(got_objects, expected_objects)


def test_the_caller_state_changes_as_under_the_plain_call():
    # The cases above compare hooked with plain; here, that the comparison has teeth:
    # plain calls do change the caller's statistics and counts where a module is given,
    # and leave a functional State untouched.
    before = nnx.state(fresh_model())
    model = fresh_model()
    residual.with_hooks(module_loss, lambda x: x, lambda x: x)(model, X)
    after = nnx.state(model)
    assert not tree_equal(after["bn"]["mean"], before["bn"]["mean"])
    assert tree_equal(after["conv"]["kernel"], before["conv"]["kernel"])
    args = functional_args()
    stats_before = as_arrays(args[1])
    jax.jit(jax.grad(residual.with_hooks(functional_loss, lambda t: t, lambda t: t)))(*args)
    assert tree_equal(as_arrays(args[1]), stats_before)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(8, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)

    def __call__(self, x):
        return self.dropout(jnp.tanh(self.bn(self.linear(x))))


def stacked_blocks():
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return Block(rngs)

    return make(nnx.Rngs(params=0, dropout=1))


@pytest.mark.parametrize("where", ["around the scan", "inside the scan body"])
def test_nnx_scan_over_blocks_with_state_as_plain(where):
    x = jax.random.normal(jax.random.key(2), (4, 8))

    def loss(blocks, x, hooks):
        body = Block.__call__
        if hooks and where == "inside the scan body":
            body = residual.with_hooks(body, lambda t: t, lambda t: t)

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def layer(block, h):
            return body(block, h)

        return jnp.sum(layer(blocks, x) ** 2)

    def train(hooks):
        blocks = stacked_blocks()
        fn = lambda b, x: loss(b, x, hooks)  # noqa: E731
        if hooks and where == "around the scan":
            fn = residual.with_hooks(fn, lambda t: t, lambda t: t)
        grads = nnx.jit(nnx.grad(fn))(blocks, x)
        return as_arrays(grads), as_arrays(nnx.state(blocks))

    (grads, state), (plain_grads, plain_state) = train(True), train(False)
    assert relative_l2(grads, plain_grads) < 1e-6
    # Each block's statistics and dropout counts moved, as in the plain run.
    assert tree_equal(state, plain_state)
    assert not tree_equal(state, as_arrays(nnx.state(stacked_blocks())))
