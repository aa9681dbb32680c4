"""Differential fuzzing against plain `jax.grad`: random programs, shapes and dtypes.

A program is a random sequence of shape-preserving steps `x <- op(x, w)` on two
inputs of the same shape, drawn from elementwise maths, reductions broadcast back,
matmul/einsum, gathers and scatters, sorting, concatenation, reshapes, `where`, and
control flow whose bodies are random programs themselves (`scan` as a carry loop and
over rows, `fori_loop`, `cond`, `jax.checkpoint`, inner `jit`). Shapes include
scalars and size-0 arrays. Gradients are taken with respect to both inputs, to the
third order, and with Python numbers as inputs and cotangents.

The profile (tests/conftest.py) is bounded in CI; `RESIDUAL_FUZZ_PROFILE=long`
runs many more examples.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import residual
from residual import policies as rp
from residual._info import ResidualInfo

pytestmark = pytest.mark.slow  # many examples, each traced and compiled


def _last(x):
    return x.shape[-1] if x.ndim else 0


def _keep_reduction(reduce):
    def op(x, w):
        if not x.size:  # `max` of nothing has no value
            return x
        return x * reduce(x, axis=-1, keepdims=True) if x.ndim else x * reduce(x)

    return op


def _mean_abs(x, axis=None, keepdims=False):
    return jnp.mean(jnp.abs(x), axis=axis, keepdims=keepdims)


def _logsumexp(x, axis=None, keepdims=False):
    return jax.nn.logsumexp(x, axis=axis, keepdims=keepdims) * 0.1


def _scatter(x, w):
    return x.at[..., 0].add(jnp.sin(w[..., -1])) if _last(x) else x


def _gather(x, w):
    n = _last(x)
    return x[..., (jnp.arange(n) * 3 + 1) % n] * w if n else x


def _matmul(x, w):
    n = _last(x)
    if not n:
        return x * w
    m = jnp.ones((n, n), x.dtype) / jnp.asarray(n, x.dtype)
    return jnp.tanh(x @ m) + w


def _einsum(x, w):
    if not x.ndim:
        return x * w
    return jnp.einsum("...i,...i->...", x, jnp.cos(w))[..., None] * x * 0.5


def _concat(x, w):
    if not x.ndim:
        return x + w
    return jnp.concatenate([x[..., ::-1], w * x], -1)[..., _last(x) // 2 :][..., : _last(x)]


def _cumsum_first_axis(x, w):
    if not x.ndim:
        return x
    return jnp.moveaxis(jnp.cumsum(jnp.moveaxis(x * w, -1, 0), axis=0), 0, -1) * 0.5


def _dynamic_slice_update(x, w):
    n = _last(x)
    if n < 2:
        return x
    part = lax.dynamic_slice_in_dim(x, 1, n - 1, axis=-1)
    return lax.dynamic_update_slice_in_dim(x, jnp.tanh(part * w[..., :1]), 0, axis=-1)


ELEMENTWISE = {
    "sin": lambda x, w: jnp.sin(x),
    "tanh": lambda x, w: jnp.tanh(x),
    "exp": lambda x, w: jnp.exp(0.1 * x),
    "x_tanh_x": lambda x, w: x * jnp.tanh(x),
    "sigmoid": lambda x, w: jax.nn.sigmoid(x),
    "gelu": lambda x, w: jax.nn.gelu(x),
    "softplus": lambda x, w: jax.nn.softplus(x),
    "abs": lambda x, w: jnp.abs(x),
    "relu": lambda x, w: jax.nn.relu(x),
    "log1p_sq": lambda x, w: jnp.log1p(x * x),
    "rsqrt": lambda x, w: lax.rsqrt(1 + x * x),
    "clip": lambda x, w: jnp.clip(x, -0.5, 0.7),
    "mul": lambda x, w: x * w,
    "add": lambda x, w: x + w,
    "div": lambda x, w: x / (1 + w * w),
    "maximum": lambda x, w: jnp.maximum(x, w),
}
STRUCTURE = {
    "sum_keep": _keep_reduction(jnp.mean),
    "max_keep": _keep_reduction(jnp.max),
    "mean_abs_keep": _keep_reduction(_mean_abs),
    "logsumexp_keep": _keep_reduction(_logsumexp),
    "matmul": _matmul,
    "einsum": _einsum,
    "gather": _gather,
    "scatter": _scatter,
    "sort": lambda x, w: jnp.sort(x * w, axis=-1) if x.ndim else x * w,
    "concat": _concat,
    "cumsum": _cumsum_first_axis,
    "dynamic_slice": _dynamic_slice_update,
    "reshape": lambda x, w: jnp.reshape(jnp.reshape(x, (-1,)) * 1.5, x.shape),
    "where": lambda x, w: jnp.where(x > w, x * x, jnp.sin(w * x)),
}
LEAVES = sorted(ELEMENTWISE) + sorted(STRUCTURE)
CONTROL = ["scan_carry", "scan_rows", "fori", "cond", "checkpoint", "jit"]


def _control(kind, bodies):
    run = [_program(b) for b in bodies]

    def op(x, w):
        if kind == "scan_carry":
            return lax.scan(lambda c, _: (run[0](c, w), None), x, None, length=3)[0]
        if kind == "scan_rows":  # residuals stacked per iteration, size-0 rows too
            if not x.ndim:
                return run[0](x, w)
            return lax.scan(lambda c, xw: (c, run[0](*xw)), 0.0, (x, w))[1]
        if kind == "fori":
            return lax.fori_loop(0, 2, lambda i, c: run[0](c, w), x)
        if kind == "cond":
            return lax.cond(jnp.sum(x) > jnp.sum(w), run[0], run[1], x, w)
        if kind == "checkpoint":
            return jax.checkpoint(run[0])(x, w)
        return jax.jit(run[0])(x, w)

    return op


def programs(depth=2):
    leaf = st.sampled_from(LEAVES)
    if depth == 0:
        return st.lists(leaf, min_size=1, max_size=3).map(tuple)
    body = programs(depth - 1)
    control = st.tuples(st.sampled_from(CONTROL), st.tuples(body, body))
    return st.lists(st.one_of(leaf, leaf, control), min_size=1, max_size=4).map(tuple)


def _program(ops):
    def run(x, w):
        for op in ops:
            x = (ELEMENTWISE.get(op) or STRUCTURE[op])(x, w) if isinstance(op, str) else (
                _control(op[0], op[1])(x, w))
        return x

    return run


def _loss(ops):
    run = _program(ops)

    def f(x, w):
        return jnp.sum(run(x, w).astype(jnp.float32))

    return f


SHAPES = [(), (0,), (1,), (3,), (2, 5), (4, 0), (0, 3), (1, 3, 4)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# Relative to the largest entry (`_close`): 5 to 100 rounding steps of each dtype
# (float32's 1e-5 is 84): remat recomputes, XLA may fuse the recomputation at higher
# precision than the stored float16 residual, and sums in its own order.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 1e-2, jnp.float64: 1e-12}


@st.composite
def cases(draw, dtypes=DTYPES, depth=2):
    ops = draw(programs(depth))
    shape = draw(st.sampled_from(SHAPES))
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**16))
    return ops, shape, dtype, seed


def _inputs(shape, dtype, seed):
    kx, kw = jax.random.split(jax.random.key(seed))
    return tuple(jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in (kx, kw))


def _grad(f):
    return jax.grad(f, argnums=(0, 1))


def _same(a, b):
    return all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
        for x, y in zip(a, b)
    )


def _close(got, expected, tol):
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype
        g, e = np.asarray(g, np.float64), np.asarray(e, np.float64)
        scale = max(1.0, float(np.max(np.abs(e[np.isfinite(e)]), initial=0.0)))
        np.testing.assert_allclose(g, e, rtol=tol, atol=tol * scale, equal_nan=True)


def _identity(v):
    return v


def _times_four(v):
    return v * 4 if jnp.issubdtype(v.dtype, jnp.floating) else v


def _quarter(p):
    return p / 4 if jnp.issubdtype(p.dtype, jnp.floating) else p


def _runs(ops, kinds) -> bool:
    """Whether the program runs a control operation of one of these kinds, at any depth."""
    return any(
        not isinstance(op, str) and (op[0] in kinds or any(_runs(b, kinds) for b in op[1]))
        for op in ops
    )


LOOPS = ("scan_carry", "scan_rows", "fori")


def _has_loop(ops) -> bool:
    """Whether the program runs a scan or `fori_loop` (which `with_hooks` rebuilds)."""
    return _runs(ops, LOOPS)


def _assert_identical_gradients(ops, got, expected, dtype):
    """Bit-identical, run one operation at a time, but for conds and loops (docs/limitations.md).

    A `lax.cond` stays one compiled operation under `disable_jit`, its hooked branch
    fused by XLA its own way, so a program with one is close, not identical. A loop is
    rebuilt with a hooked body, whose backward sums the cotangent of an operand it
    reads (`w`, closed over or sliced per row) before the loop adds it to the rest;
    JAX adds each term to the running total in turn. Float addition is not
    associative, so the last bits of `w`'s gradient may differ there, and only there:
    `x` only flows through the loop's carry, whose cotangent is never summed.
    """
    if _runs(ops, ("cond",)):
        _close(got, expected, TOL[dtype])
    elif _has_loop(ops):
        assert _same(got[:1], expected[:1])
        _close(got[1:], expected[1:], TOL[dtype])
    else:
        assert _same(got, expected)


def _assert_identical_one_op_at_a_time(ops, g, f, args, dtype):
    # `lax.scan` of no rows raises under `disable_jit`, its output type unknown; empty
    # inputs have no values to compare anyway.
    if all(a.size for a in args):
        with jax.disable_jit():
            _assert_identical_gradients(ops, _grad(g)(*args), _grad(f)(*args), dtype)


@given(cases())
def test_identity_hooks_compute_what_jax_grad_computes(case):
    ops, shape, dtype, seed = case
    f, args = _loss(ops), _inputs(shape, dtype, seed)
    g = residual.with_hooks(f, _identity, _identity)
    # One operation at a time, the same operations: the same bits.
    _assert_identical_one_op_at_a_time(ops, g, f, args, dtype)
    # Compiled (under `jit`, and eagerly where JAX compiles a function such as
    # `jnp.einsum` whole), XLA fuses the hooked program its own way and may sum a
    # reduction in another order: an `einsum` then `sin` differs in the last bits.
    _close(_grad(g)(*args), _grad(f)(*args), TOL[dtype])
    _close(jax.jit(_grad(g))(*args), jax.jit(_grad(f))(*args), TOL[dtype])


def test_compiled_identity_hooks_may_differ_from_jax_grad_in_the_last_bits_only():
    # The smallest program the fuzzer found where XLA sums differently (jax 0.12.0.1 and
    # 0.12.1): up to 8 units in the last place of the largest entry, measured. The day
    # XLA compiles both alike this fails, and docs/limitations.md is to say so.
    f, args = _loss(("einsum", "sin")), _inputs((2, 5), jnp.float32, 0)
    g = residual.with_hooks(f, _identity, _identity)
    with jax.disable_jit():
        assert _same(_grad(g)(*args), _grad(f)(*args))
    got, expected = jax.jit(_grad(g))(*args), jax.jit(_grad(f))(*args)
    ulps = [float(np.max(np.abs(np.asarray(a) - np.asarray(b)))
                  / np.spacing(np.max(np.abs(np.asarray(b))))) for a, b in zip(got, expected)]
    assert 0 < max(ulps) <= 16, ulps


def test_loop_invariant_cotangents_differ_in_summation_order_only():
    # The smallest program the fuzzer found where `w`'s gradient is not bit-identical.
    ops = (("scan_carry", (("add", "div"), ("abs",))),)
    x, w = jnp.float32(1.0040143), jnp.float32(-2.4424558)
    f = _loss(ops)
    got = _grad(residual.with_hooks(f, _identity, _identity))(x, w)
    expected = _grad(f)(x, w)
    assert _has_loop(ops)
    assert got[0] == expected[0]
    assert abs(float(got[1]) - float(expected[1])) <= 2 * abs(np.spacing(np.float32(expected[1])))


@given(cases())
def test_invertible_hooks_and_remat_are_close(case):
    ops, shape, dtype, seed = case
    f, args = _loss(ops), _inputs(shape, dtype, seed)
    expected = jax.jit(_grad(f))(*args)
    # Powers of two make the round trip exact, but XLA may fuse the two programs
    # differently: equal to the last bit or two (allclose).
    inverted = jax.jit(_grad(residual.with_hooks(f, _times_four, _quarter)))(*args)
    _close(inverted, expected, TOL[dtype])
    remat = jax.jit(_grad(residual.with_hooks(f, policy=rp.Remat())))(*args)
    _close(remat, expected, TOL[dtype])
    # Batched: the ordering conditionals keep one predicate per batch under `vmap`.
    batch = tuple(jnp.stack([a, -a]) for a in args)
    inverted = jax.jit(jax.vmap(_grad(residual.with_hooks(f, _times_four, _quarter))))(*batch)
    _close(inverted, jax.jit(jax.vmap(_grad(f)))(*batch), TOL[dtype])


# Third derivatives compile three nested backward passes per program, and eager calls
# compile each loop and conditional anew: fewer examples.
_FEWER = settings(max_examples=max(1, settings.default.max_examples // 4))


def _third_order(f, v):
    """`d/dx (v . d/dx (v . grad f))`: three reverse-mode passes, as `grad(grad(grad))`."""
    def hvp(x, w):
        return jax.grad(lambda y: jnp.vdot(jax.grad(f)(y, w), v))(x)

    return jax.grad(lambda x, w: jnp.vdot(hvp(x, w), v), argnums=(0, 1))


@_FEWER
@given(cases(dtypes=[jnp.float32], depth=1))
def test_third_order_derivatives_match_plain(case):
    ops, shape, _, seed = case
    f, (x, w) = _loss(ops), _inputs(shape, jnp.float32, seed)
    v = jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)
    g = residual.with_hooks(f, _identity, _identity)
    _close(jax.jit(_third_order(g, v))(x, w), jax.jit(_third_order(f, v))(x, w),
           TOL[jnp.float32])


@_FEWER
@given(cases(dtypes=[jnp.float32], depth=1))
def test_python_scalar_inputs_and_cotangents(case):
    ops, _, _, seed = case
    f = _loss(ops)
    x, w = (float(a) for a in _inputs((), jnp.float32, seed))
    g = residual.with_hooks(f, _identity, _identity)
    _assert_identical_gradients(ops, _grad(g)(x, w), _grad(f)(x, w), jnp.float32)
    _assert_identical_gradients(ops, jax.vjp(g, x, w)[1](1.0), jax.vjp(f, x, w)[1](1.0),
                                jnp.float32)


# One level of control flow: through nested loops (nine applications of an expanding
# map, say) the rounding of every residual compounds without bound, and no fixed
# error bound would hold. The contract of a quantizer itself, per residual, is the
# round-trip test below.
@given(cases(dtypes=[jnp.float32], depth=1))
def test_quantized_gradients_stay_near_plain(case):
    ops, shape, _, seed = case
    f, args = _loss(ops), _inputs(shape, jnp.float32, seed)
    expected = _flat(jax.jit(_grad(f))(*args))
    finite = np.isfinite(expected)
    errors = {}
    for bits in (8, 4):
        policy = rp.Quantize(bits=bits, min_bytes=0)
        got = _flat(jax.jit(_grad(residual.with_hooks(f, policy=policy)))(*args))
        # Finite exactly where plain JAX is (an Inf may come back as NaN: documented).
        assert np.array_equal(np.isfinite(got), finite), bits
        errors[bits] = np.linalg.norm(got[finite] - expected[finite])
    # The gradient is linear in each residual, so its error follows the quantization
    # step, which is 18 times smaller at 8 bits than at 4: a wrong residual's error
    # would not shrink. Either the error is within a loose bound of the gradient's
    # size, or it shrinks with the step (it can exceed the bound where the gradient
    # is a small difference of large terms: 0.0013 from terms near 1, say).
    scale = np.linalg.norm(expected[finite])
    follows_the_step = errors[8] <= errors[4] / 4
    assert errors[8] <= 0.2 * scale + 1e-5 or follows_the_step, errors
    assert errors[4] <= 1.5 * scale + 1e-5 or follows_the_step, errors


def _flat(grads) -> np.ndarray:
    """All the gradients as one float64 vector (their errors are bounded together)."""
    return np.concatenate([np.asarray(g, np.float64).ravel() for g in grads])


@dataclasses.dataclass(frozen=True)
class _RoundTrip:
    shape: tuple[int, ...]
    log_scale: float
    group_size: int
    bits: int


@given(st.builds(
    _RoundTrip,
    shape=st.sampled_from([(), (0,), (7,), (3, 64), (2, 128), (5, 48)]),
    log_scale=st.floats(-20, 20),
    group_size=st.sampled_from([16, 32, 64]),
    bits=st.sampled_from([8, 4, 2]),
), st.integers(0, 2**16))
def test_quantize_round_trip_error_is_the_documented_half_step(rt, seed):
    # Documented: codes are the nearest of 2^b evenly spaced values, zero among them,
    # over the group's range (and zero); the step is at most that range over 2^b - 2,
    # so no value moves by more than m / (2^b - 2), m the group's absmax.
    x = jax.random.normal(jax.random.key(seed), rt.shape) * jnp.float32(2.0**rt.log_scale)
    policy = rp.Quantize(bits=rt.bits, group_size=rt.group_size, min_bytes=0)
    info = ResidualInfo(index=0, shape=rt.shape, dtype=np.dtype(np.float32))
    back = np.asarray(jax.jit(lambda v: policy.unpack(policy.pack(v, info), info))(x))
    x = np.asarray(x)
    assert back.shape == x.shape and back.dtype == x.dtype
    if not x.size:
        return
    if x.ndim and x.shape[-1] % rt.group_size == 0:
        groups = x.reshape(-1, rt.group_size)
        err = np.abs(back.reshape(-1, rt.group_size) - groups)
        m = np.max(np.abs(groups), axis=1, keepdims=True)
    else:
        err, m = np.abs(back - x), np.max(np.abs(x))
    assert np.all(err <= m / (2**rt.bits - 2) * (1 + 1e-5))


@given(cases(dtypes=[jnp.float64]))
def test_float64_with_x64_identity_hooks_compute_what_jax_grad_computes(case):
    ops, shape, _, seed = case
    with jax.enable_x64(True):
        f = _loss(ops)
        args = _inputs(shape, jnp.float64, seed)
        g = residual.with_hooks(f, _identity, _identity)
        _assert_identical_one_op_at_a_time(ops, g, f, args, jnp.float64)
        got, expected = jax.jit(_grad(g))(*args), jax.jit(_grad(f))(*args)
        assert got[0].dtype == jnp.float64
        _close(got, expected, TOL[jnp.float64])
        _close(jax.jit(_grad(residual.with_hooks(f, policy=rp.Remat())))(*args), expected,
               TOL[jnp.float64])
