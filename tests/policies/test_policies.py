"""The shared policy contract (optax's `_common_test` idea), run on every policy of
`tests/policies_under_test.py`: the built-ins, plain hooks and a user-written one."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import residual
from residual import policies as rp
from tests.helpers import (
    mlp_params,
    offloading_y,
    relative_error,
    scan_mlp,
    tree_equal,
    unrolled_mlp,
)
from tests.policies_under_test import IDS, POLICIES


def _check(got, expected, bound):
    if bound == 0.0:
        assert tree_equal(got, expected)
    else:
        assert relative_error(got, expected) <= bound


@pytest.mark.parametrize(("policy", "bound"), POLICIES, ids=IDS)
@pytest.mark.parametrize("model", [scan_mlp, unrolled_mlp])
def test_grad_and_jit_match_plain_grad(policy, bound, model):
    ws, x = mlp_params(layers=3, width=64, batch=16)
    g = residual.with_hooks(model, policy=policy)
    _check(jax.grad(g)(ws, x), jax.grad(model)(ws, x), bound)
    _check(jax.jit(jax.grad(g))(ws, x), jax.jit(jax.grad(model))(ws, x), bound)


@pytest.mark.parametrize(("policy", "bound"), POLICIES, ids=IDS)
@pytest.mark.parametrize("model", [scan_mlp, unrolled_mlp])
def test_second_derivatives_match_plain(policy, bound, model):
    # Hessian-vector products, reverse over reverse (jitted) and forward over reverse
    # (eager). A higher derivative differentiates the stored residuals too: a lossy
    # policy may change their values, never drop their derivative.
    ws, x = mlp_params(layers=3, width=64, batch=16)
    v = jax.random.normal(jax.random.key(1), ws.shape)
    g = residual.with_hooks(model, policy=policy)

    def reverse(f):
        return jax.jit(jax.grad(lambda ws: jnp.vdot(jax.grad(f)(ws, x), v)))(ws)

    def forward(f):
        return jax.jvp(lambda ws: jax.grad(f)(ws, x), (ws,), (v,))[1]

    _check(reverse(g), reverse(model), bound)
    # Eagerly, the differentiated backward and plain's sum in other orders (an ulp).
    _check(forward(g), forward(model), max(bound, 1e-6))


@pytest.mark.parametrize(("policy", "bound"), POLICIES, ids=IDS)
def test_vmap_of_grad(policy, bound):
    ws, x = mlp_params(layers=2, width=64, batch=8)
    xs = jnp.stack([x, 2 * x])
    g = residual.with_hooks(scan_mlp, policy=policy)
    got = jax.vmap(jax.grad(g), in_axes=(None, 0))(ws, xs)
    _check(got, jax.vmap(jax.grad(scan_mlp), in_axes=(None, 0))(ws, xs), bound)


@pytest.mark.parametrize(("policy", "bound"), POLICIES, ids=IDS)
def test_as_a_scope_and_in_a_region_of_a_scan_body(policy, bound):
    ws, x = mlp_params(layers=2, width=64, batch=8)
    f = residual.with_hooks(scan_mlp)
    with residual.saved_tensors_hooks(policy=policy):
        got = jax.jit(jax.grad(f))(ws, x)
    _check(got, jax.jit(jax.grad(scan_mlp))(ws, x), bound)

    def region_mlp(ws, x):
        def layer(h, w):
            with residual.saved_tensors_hooks(policy=policy):
                h = jnp.tanh(h @ w)
            return h, None

        return jnp.sum(lax.scan(layer, x, ws)[0] ** 2)

    _check(jax.grad(residual.with_hooks(region_mlp))(ws, x), jax.grad(scan_mlp)(ws, x), bound)


@pytest.mark.parametrize(("policy", "bound"), POLICIES, ids=IDS)
def test_hashable_equal_by_value_and_no_retracing(policy, bound):
    assert hash(policy) == hash(policy)
    assert policy == policy
    ws, x = mlp_params(layers=2, width=64, batch=8)
    traces = []
    g = residual.with_hooks(scan_mlp, policy=policy)

    @jax.jit
    def step(ws, x):
        traces.append(1)
        return ws - 0.1 * jax.grad(g)(ws, x)

    for _ in range(4):
        ws = step(ws, x)
    assert len(traces) == 1


def test_policies_compare_by_value():
    assert rp.Quantize(bits=4, min_bytes=0) == rp.Quantize(bits=4, min_bytes=0)
    assert hash(rp.Quantize(bits=4, min_bytes=0)) == hash(rp.Quantize(bits=4, min_bytes=0))
    assert rp.Quantize(bits=4, min_bytes=0) != rp.Quantize(bits=8, min_bytes=0)
    assert rp.Cast(jnp.bfloat16) == rp.Cast("bfloat16")
    assert rp.where(dtype=jnp.float32) == rp.where(dtype=(jnp.float32,))
    assert rp.Offload() == rp.Offload("pinned_host")


def test_where_source_selects_by_file_and_function():
    def attention(x):
        return jnp.tanh(x) * 2.0

    def f(x):
        return jnp.sum(jnp.sin(attention(x)) ** 2)

    info = residual.ResidualInfo(0, (4,), jnp.dtype("float32"), source="model.py:12 (Block.mlp)")
    assert rp.where(source="model.py:*")(info) and rp.where(source="*(Block.mlp)")(info)
    assert not rp.where(source="train.py:*")(info)
    assert not rp.where(source="*")(residual.ResidualInfo(0, (4,), jnp.dtype("float32")))
    # Made inside a library's layer: every frame on the way there matches.
    inner = residual.ResidualInfo(0, (4,), jnp.dtype("float32"),
                                  source="linear.py:40 (Linear.__call__)",
                                  frames=("linear.py:40 (Linear.__call__)",
                                          "model.py:12 (Block.mlp)", "train.py:3 (loss)"))
    assert all(rp.where(source=glob)(inner)
               for glob in ("linear.py:*", "*(Block.mlp)", "train.py:*"))
    assert not rp.where(source="data.py:*")(inner)
    # Only the residuals made in `attention` (a local function: `<locals>.attention`)
    # are cast; the policy is a hashable value.
    cast = rp.select([(rp.where(source="*.attention)"), rp.Cast(jnp.bfloat16))])
    assert hash(cast) == hash(rp.select([(rp.where(source="*.attention)"),
                                          rp.Cast(jnp.bfloat16))]))
    profile = rp.Profile()
    x = jnp.linspace(-1.0, 1.0, 8)
    jax.grad(residual.with_hooks(f, policy=rp.Chain(profile, rp.Identity())))(x)
    chosen = {i.primitive: i.source.endswith(".attention)") for i in profile.log.infos
              if cast.resolve(i) is not None}
    # tanh's derivative saves y and 1 - y (jax 0.10), or 1 - y² (jax 0.11 on).
    seen = [(i.primitive, i.source) for i in profile.log.infos]
    assert chosen and all(chosen.values()), seen
    assert set(chosen) <= {"tanh", "sub", "one_minus_square"}, seen


@pytest.mark.parametrize("chain", [
    rp.Chain(rp.Quantize(bits=8, min_bytes=0), rp.Cast(jnp.bfloat16, elementwise="recompute")),
    rp.Chain(rp.Cast(jnp.bfloat16), rp.Quantize(bits=8, min_bytes=0, elementwise="recompute")),
], ids=["int8-then-cast", "cast-then-int8"])
def test_a_later_stage_that_recomputes_elementwise_residuals_packs_their_arrays(chain):
    # The first stage's arrays (an elementwise residual's codes and scales, or its cast)
    # reach the later stage with the residual's primitive, for which that stage would
    # recompute: a packed array cannot be, so the stage packs it.
    ws = [jax.random.normal(jax.random.key(i), (64, 64)) / 8 for i in range(3)]
    x = jax.random.normal(jax.random.key(9), (128, 64))

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.sum(x**2)

    report = residual.inspect(loss, ws, x, policy=chain, compiled=False)
    assert {r.primitive for r in report.rows if r.how == "packed"} >= {"tanh"}, report
    got = jax.jit(jax.grad(residual.with_hooks(loss, policy=chain)))(ws, x)
    assert relative_error(got, jax.grad(loss)(ws, x)) <= 0.02


@pytest.mark.parametrize(
    "policy",
    [rp.Cast(jnp.bfloat16), rp.Quantize(bits=8, min_bytes=0), rp.Quantize(bits=2, min_bytes=0),
     rp.Offload()],
)
def test_builtins_leave_integers_and_kept_alive_inputs_alone(policy):
    profile = rp.Profile()

    def f(w, x, idx):
        h = jnp.tanh(x @ w)
        return jnp.sum(h[idx] ** 2)

    w, x, idx = jnp.ones((4, 4)) * 0.1, jnp.ones((3, 4)), jnp.array([0, 2])
    jax.grad(residual.with_hooks(f, policy=rp.Chain(profile, rp.Identity())))(w, x, idx)
    infos = profile.log.infos
    assert any(i.kept_alive for i in infos) and any(i.dtype == jnp.int32 for i in infos)
    # Offloading keeps values exactly, so it moves integer residuals too.
    approximates = not policy.lossless
    for info in infos:
        integer = not jnp.issubdtype(info.dtype, jnp.floating)
        if info.kept_alive or (integer and approximates):
            assert policy.resolve(info) is None, info
        else:
            assert policy.resolve(info) is not None, info


PACKING_POLICIES = [
    rp.Quantize(bits=8, min_bytes=0), rp.Quantize(bits=4, stochastic=True, min_bytes=0),
    rp.Chain(rp.Quantize(bits=8, min_bytes=0), rp.Offload()),
    rp.Cast(jnp.bfloat16, elementwise="pack"), rp.Chain(rp.Cast(jnp.bfloat16), rp.Offload()),
]


@pytest.mark.parametrize("policy", PACKING_POLICIES,
                         ids=["int8", "int4-stochastic", "int8-then-offload", "bf16",
                              "bf16-then-offload"])
def test_packing_policies_leave_residuals_already_in_host_memory_alone(policy):
    x = jnp.linspace(-1.0, 1.0, 256).reshape(4, 64)
    hooked = residual.with_hooks(offloading_y, policy=policy)
    for grad in (jax.grad, lambda h: jax.jit(jax.grad(h))):
        # Left as they are, the gradients are plain's exactly.
        assert tree_equal(grad(hooked)(x), grad(offloading_y)(x))
    report = residual.inspect(offloading_y, x, policy=policy, compiled=False)
    [offloaded] = [r for r in report.rows if r.primitive == "device_put"]
    assert offloaded.how == "kept", report
    assert "1 is in host memory already" in str(report), report


def test_where_selects_residuals_already_in_host_memory():
    x = jnp.linspace(-1.0, 1.0, 256).reshape(4, 64)
    policy = rp.select([(rp.where(in_host_memory=True), rp.Remat())], default=rp.Identity())
    report = residual.inspect(offloading_y, x, policy=policy, compiled=False)
    recomputed = [r.primitive for r in report.rows if r.how == "recomputed"]
    assert recomputed == ["device_put"], report


def _two_layers(ws, x):
    with jax.named_scope("block0"):
        x = jnp.tanh(x @ ws[0])

    def layer(h, w):
        return jnp.sin(h @ w), None

    x, _ = lax.scan(layer, x, ws[1:])
    return jnp.sum(x**2)


def test_a_rule_matching_no_residual_warns_once_with_what_there_is():
    ws, x = jnp.ones((3, 8, 8)) / 8, jnp.ones((4, 8))
    policy = rp.select([(rp.where(scope="block1/*"), rp.Remat())], default=rp.Identity())
    g = jax.jit(jax.grad(residual.with_hooks(_two_layers, policy=policy)))
    with pytest.warns(UserWarning) as caught:
        g(ws, x)
        g(ws, x)  # cached: not traced again, no second warning
    assert len(caught) == 1
    message = str(caught[0].message)
    assert re.search(r"`select` rule \(where\(scope='block1/\*'\), Remat\(\)\) matched none of "
                     r"the \d+ residuals", message)
    assert "scopes: 'block0';" in message and "_two_layers.<locals>.layer)" in message
    assert "'cos'" in message
    assert "'tanh'" in message or "'one_minus_square'" in message  # jax 0.10 / 0.11 on


def test_a_scope_rule_on_a_model_without_scopes_suggests_source():
    def f(x):
        return jnp.sum(jnp.tanh(x) ** 2)

    policy = rp.select([(rp.where(scope="*attention*"), rp.Remat())])
    with pytest.warns(UserWarning, match=r"No residual has a scope.*flax NNX and keras.*"
                                         r"`source=`"):
        jax.grad(residual.with_hooks(f, policy=policy))(jnp.ones(8))


def test_rules_matching_only_in_a_scan_body_or_only_outside_do_not_warn():
    # filterwarnings = error: any warning fails this test.
    ws, x = jnp.ones((3, 8, 8)) / 8, jnp.ones((4, 8))
    policy = rp.select([(rp.where(in_scan=True), rp.Remat()),
                        (rp.where(scope="block0"), rp.Cast(jnp.bfloat16)),
                        (rp.where(primitive="mul"), rp.Identity())])
    jax.grad(residual.with_hooks(_two_layers, policy=policy))(ws, x)
    jax.grad(jax.jit(residual.with_hooks(_two_layers, policy=policy)))(ws, x)
    residual.inspect(_two_layers, ws, x, policy=policy, compiled=False)


def _fourier_layer(h, layer):
    # A Fourier neural operator's layer: a complex spectrum weighs the lowest modes.
    w, spectrum = layer
    modes = jnp.fft.rfft(h, axis=-1)[..., : spectrum.shape[-1]] * spectrum
    return jnp.tanh(h @ w + jnp.fft.irfft(modes, n=h.shape[-1], axis=-1))


def _fourier_model(params, x):
    """Two Fourier layers in a scan, one unrolled: complex residuals both ways."""
    ws, spectra = params
    x, _ = lax.scan(lambda h, layer: (_fourier_layer(h, layer), None), x, (ws[1:], spectra[1:]))
    return jnp.sum(_fourier_layer(x, (ws[0], spectra[0])) ** 2)


def _fourier_params():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(3), 4)
    spectra = lax.complex(jax.random.normal(k1, (3, 16)), jax.random.normal(k2, (3, 16))) / 2
    return (jax.random.normal(k3, (3, 64, 64)) / 8, spectra), jax.random.normal(k4, (32, 64))


@pytest.mark.parametrize(("policy", "bound"), POLICIES, ids=IDS)
def test_complex_residuals_match_plain(policy, bound):
    params, x = _fourier_params()
    g = residual.with_hooks(_fourier_model, policy=policy)
    # Lossless policies agree to an ulp: the FFTs fuse differently around the hooks.
    assert relative_error(jax.jit(jax.grad(g))(params, x),
                          jax.jit(jax.grad(_fourier_model))(params, x)) <= max(bound, 1e-6)


@pytest.mark.parametrize(("policy", "bound"), [
    (rp.Identity(), 1e-6), (rp.Cast(jnp.bfloat16), 1e-2),
    (rp.Quantize(bits=8, min_bytes=0), 1e-2), (rp.Quantize(bits=4, min_bytes=0), 2e-1)],
    ids=["identity", "bf16", "int8", "int4"])
def test_complex_residuals_second_derivatives_match_plain(policy, bound):
    params, x = _fourier_params()
    v = jax.tree.map(lambda p: jnp.full_like(p, 0.1), params)

    def hvp(f):
        def along_v(params):
            return sum(jnp.real(jnp.vdot(g, t)) for g, t in
                       zip(jax.tree.leaves(jax.grad(f)(params, x)), jax.tree.leaves(v)))
        return jax.jit(jax.grad(along_v))(params)

    g = residual.with_hooks(_fourier_model, policy=policy)
    assert relative_error(hvp(g), hvp(_fourier_model)) <= bound
