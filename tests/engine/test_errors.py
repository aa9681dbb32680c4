"""Bad input gets a clear error, early, and leaves nothing broken behind.

Every case below is followed by a correct call (`_still_works`): the hook stack is
empty, no hook marker is left in JAX's name stack, and hooked gradients are right.
"""

from __future__ import annotations

import dataclasses
import re
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual
from residual import policies as rp
from residual._jax_private import current_scope_names
from residual._scope import _STACK

X = jnp.linspace(0.1, 1.0, 4)
# How the engine names a residual of `_loss` in messages: index, type and producer.
RESIDUAL = (r"residual #\d+ float32\[4\] \(output of `(mul|cos|sin|integer_pow)`"
            r"( in the derivative of `\w+`)? at [^)]*test_errors")


def _loss(x):
    return jnp.sum(jnp.sin(x) ** 2)


def _identity(v):
    return v


def _still_works():
    assert _STACK.get() == ()
    assert current_scope_names() == ()
    expected = jax.grad(_loss)(X)
    g = residual.with_hooks(_loss, lambda x: x * 4, lambda p: p / 4)
    np.testing.assert_allclose(jax.grad(g)(X), expected, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(g))(X), expected, rtol=1e-6)
    with residual.saved_tensors_hooks(_identity, _identity):
        np.testing.assert_array_equal(jax.grad(residual.with_hooks(_loss))(X), expected)


@dataclasses.dataclass
class _Unfrozen(residual.Policy):
    scale: float = 4.0

    def pack(self, x, info):
        return x * self.scale

    def unpack(self, packed, info):
        return packed / self.scale


def _both_modes(f):
    return [("eager", jax.grad(f)), ("jit", jax.jit(jax.grad(f)))]


# Arguments: refused when `with_hooks`, a scope or a policy is constructed. -------------


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: residual.with_hooks(_loss, 3, _identity), TypeError,
         r"`pack` must be callable, but got int: 3"),
        (lambda: residual.with_hooks(_loss, _identity, "unpack"), TypeError,
         r"`unpack` must be callable, but got str: 'unpack'"),
        (lambda: residual.with_hooks(_loss, _identity), TypeError,
         r"got `pack` without `unpack`.*Pass `unpack` too"),
        (lambda: residual.with_hooks(_loss, unpack=_identity), TypeError,
         r"got `unpack` without `pack`.*Pass `pack` too"),
        (lambda: residual.with_hooks(_loss, _identity, _identity, policy=rp.Remat()),
         TypeError, r"`with_hooks` takes either `pack` and `unpack` or `policy`, not both"),
        (lambda: residual.with_hooks(_loss, policy=_identity), TypeError,
         r"`policy` must be a `residual.Policy`.*got function"),
        (lambda: residual.with_hooks("loss"), TypeError,
         r"`with_hooks` wraps a function, but got str: 'loss'\. Pass the function"),
        (lambda: residual.with_hooks(None, _identity, _identity)(X), TypeError,
         r"`with_hooks` wraps a function, but got ArrayImpl"),
        (lambda: residual.saved_tensors_hooks(), TypeError,
         r"`saved_tensors_hooks` needs hooks.*disable_saved_tensors_hooks"),
        (lambda: residual.saved_tensors_hooks(_identity), TypeError,
         r"`saved_tensors_hooks` got `pack` without `unpack`"),
        (lambda: residual.saved_tensors_hooks(_identity, _identity, policy=rp.Remat()),
         TypeError, r"`saved_tensors_hooks` takes either"),
        (lambda: residual.disable_saved_tensors_hooks(3), TypeError,
         r"`error_message` must be a str, got int"),
        (lambda: rp.select([rp.Remat()]), TypeError, r"rule 0 of `select` must be a"),
        (lambda: rp.select([(rp.where(), "remat")]), TypeError,
         r"the policy must be a `residual.Policy`"),
        (lambda: rp.where(min_bytes=10, max_bytes=1), ValueError, r"nothing would match"),
        (lambda: rp.where(source=12), TypeError,
         r"`source` must be a glob string such as 'model\.py:\*', but got 12"),
        (lambda: rp.where(name="a", then=rp.Remat()), TypeError,
         r"unknown condition\(s\) `then`.*pair it with its policy in `rp\.select"),
        (lambda: rp.Chain(rp.Remat()), TypeError, r"two or more policies"),
        (lambda: rp.Offload("gpu_memory"), ValueError,
         r"`memory_kind` must be a host memory.*" + re.escape(
             str([m.kind for m in jax.devices()[0].addressable_memories()]))),
        (lambda: rp.Offload(1), TypeError, r"`memory_kind` must be a string.*got int: 1"),
        # Field types, each named, at construction rather than inside a trace.
        (lambda: rp.Quantize(bits=4.0), TypeError,
         r"`bits` must be an int, but got float: 4\.0\. Pass `Quantize` a whole number"),
        (lambda: rp.Quantize(bits=True), TypeError, r"`bits` must be an int, but got bool"),
        (lambda: rp.Quantize(stochastic=True, seed="a"), TypeError,
         r"`seed` must be an int, but got str: 'a'"),
        (lambda: rp.Quantize(stochastic="yes"), TypeError,
         r"`stochastic` must be True or False, but got str: 'yes'"),
        (lambda: rp.Quantize(group_size=True), TypeError, r"`group_size` must be an int"),
        (lambda: rp.Quantize(min_bytes=1.5), TypeError, r"`min_bytes` must be an int"),
        (lambda: rp.Quantize(format=8), TypeError, r"`format` must be a string.*got int: 8"),
        (lambda: rp.Quantize(scale_dtype="half-ish"), TypeError,
         r"`scale_dtype` must be a dtype.*got str: 'half-ish'"),
        (lambda: rp.Cast(None), TypeError, r"`Cast\(dtype\)` needs a floating-point dtype"),
        (lambda: rp.Profile(log=[]), TypeError,
         r"`log` must be a `residual.policies.ProfileLog`, but got list"),
        (lambda: rp.Chain(rp.Offload(), rp.Quantize(bits=8)), TypeError,
         r"`Chain` argument 1, Quantize\(bits=8, \.\.\.\), comes after Offload.*host memory"
         r".*Offload last: `Chain\(Quantize\(bits=8, \.\.\.\), Offload"),
        (lambda: rp.Chain(rp.Offload(), rp.Cast(jnp.bfloat16)), TypeError,
         r"`Chain` argument 1, Cast.*comes after Offload"),
        (lambda: rp.Chain(rp.select([(rp.where(dtype=jnp.float32), rp.Offload())]),
                          rp.Quantize(bits=8)), TypeError, r"comes after select"),
        (lambda: rp.Chain(_Unfrozen(), rp.Offload()), TypeError,
         r"argument 0 must be hashable.*_Unfrozen is a dataclass that is not frozen.*"
         r"@dataclasses\.dataclass\(frozen=True\)"),
        (lambda: rp.select([(rp.where(), _Unfrozen())]), TypeError,
         r"the policy of rule 0 of `select` must be hashable.*frozen=True"),
        (lambda: rp.select([], default=_Unfrozen()), TypeError,
         r"`default` must be hashable.*frozen=True"),
        (lambda: residual.with_hooks(_loss, policy=_Unfrozen()), TypeError,
         r"`policy` must be hashable.*_Unfrozen is a dataclass that is not frozen.*"
         r"`@dataclasses\.dataclass\(frozen=True\)`"),
        (lambda: residual.saved_tensors_hooks(policy=_Unfrozen()), TypeError,
         r"`policy` must be hashable.*`@dataclasses\.dataclass\(frozen=True\)`"),
    ],
)
def test_bad_arguments_fail_at_construction(call, error, message):
    with pytest.raises(error, match=message):
        call()
    _still_works()


# `unpack` breaking its contract: a HookError at trace time naming the residual. --------


@pytest.mark.parametrize(
    ("unpack", "received"),
    [
        (lambda p: None, r"it returned NoneType: None\. Return the restored array"),
        (lambda p: 1.0, r"it returned float: 1\.0"),
        (lambda p: (p,), r"it returned tuple"),
        (lambda p: np.zeros((4,), np.float64),
         r"it returned float64\[4\] instead of float32\[4\]\. Cast it back"),
        (lambda p: p.astype(jnp.int8), r"int8\[4\] instead of float32\[4\]\. Did `unpack` "
         r"forget to dequantize"),
        (lambda p: p[:2], r"float32\[2\] instead of float32\[4\]"),
        (lambda p: p[:1], r"float32\[1\] instead of float32\[4\]\. A shape that merely "
         r"broadcasts would give a silently wrong gradient"),
        (lambda p: p[None], r"float32\[1,4\] instead of float32\[4\]"),
        (lambda p: p.astype(jnp.float16), r"float16\[4\] instead of float32\[4\]"),
    ],
    ids=["None", "number", "tuple", "numpy-float64", "int8", "shorter", "broadcastable",
         "extra-axis", "float16"],
)
def test_unpack_returning_the_wrong_thing(unpack, received):
    g = residual.with_hooks(_loss, _identity, unpack)
    for mode, grad in _both_modes(g):
        with pytest.raises(residual.HookError) as err:
            grad(X)
        message = str(err.value).replace(" ", "")
        assert re.search(r"`unpack`mustreturnanarrayofshape\(4,\)anddtypefloat32", message), mode
        assert re.search(RESIDUAL, str(err.value)), (mode, str(err.value))
        assert re.search(received.replace(" ", "").replace("\\.", "\\."), message), (
            mode, str(err.value))
    _still_works()


def test_a_policy_breaking_the_contract_is_named_too():
    @dataclasses.dataclass(frozen=True)
    class Forgetful(residual.Policy):
        def pack(self, x, info):
            return x.astype(jnp.bfloat16)

        def unpack(self, packed, info):
            return packed  # forgot the cast back

    g = residual.with_hooks(_loss, policy=Forgetful())
    with pytest.raises(residual.HookError, match=RESIDUAL + r".*bfloat16\[4\] instead of"):
        jax.jit(jax.grad(g))(X)
    _still_works()


def test_a_residual_made_by_a_derivative_rule_names_the_users_operation():
    # For `tanh`, JAX saves `1 - tanh(x)`: a `sub` the user never wrote.
    def model(x):
        return jnp.sum(jnp.tanh(x))

    line = model.__code__.co_firstlineno + 1
    profile = rp.Profile()
    jax.grad(residual.with_hooks(model, policy=profile))(X)
    seen = [i.describe() for i in profile.log.infos]
    # (`sub`, or one fused primitive in newer JAX releases)
    derived = rf"output of `\w+` in the derivative of `tanh` at test_errors\.py:{line}"
    assert any(re.search(derived, d) for d in seen), seen
    # A subtraction the user wrote is named as it is.
    profile = rp.Profile()
    jax.grad(residual.with_hooks(lambda x: jnp.sum((1 - jnp.tanh(x)) * x), policy=profile))(X)
    assert any(re.search(r"output of `sub` at", i.describe()) for i in profile.log.infos)


def test_hook_error_is_shown_as_residual_hook_error():
    assert repr(residual.HookError) == "<class 'residual.HookError'>"
    g = residual.with_hooks(_loss, _identity, lambda p: p[:1])
    with pytest.raises(residual.HookError) as err:
        jax.jit(jax.grad(g))(X)
    assert "".join(traceback.format_exception_only(err.value)).startswith("residual.HookError")


def test_numpy_array_of_the_right_dtype_is_accepted():
    g = residual.with_hooks(_loss, lambda x: np.asarray(x), lambda p: np.asarray(p))
    np.testing.assert_array_equal(jax.grad(g)(X), jax.grad(_loss)(X))


# Hooks that raise: the original type, plus a note naming the residual. -----------------


@pytest.mark.parametrize("which", ["pack", "unpack"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_hook_raising_keeps_its_type_and_gains_a_note(which, mode):
    def boom(v):
        raise ZeroDivisionError(f"inside {which}")

    hooks = (boom, _identity) if which == "pack" else (_identity, boom)
    grad = dict(_both_modes(residual.with_hooks(_loss, *hooks)))[mode]
    with pytest.raises(ZeroDivisionError, match=f"inside {which}") as err:
        grad(X)
    notes = [n for n in getattr(err.value, "__notes__", []) if "raised by" in n]
    assert len(notes) == 1, err.value.__notes__
    assert re.search(rf"raised by `{which}` for " + RESIDUAL, notes[0]), notes[0]
    _still_works()


def test_policy_without_pack_raises_not_implemented_with_a_note():
    class Unfinished(residual.Policy):
        pass

    with pytest.raises(NotImplementedError, match=r"Unfinished must implement `pack") as err:
        jax.grad(residual.with_hooks(_loss, policy=Unfinished()))(X)
    assert any("raised by `pack`" in n for n in err.value.__notes__)
    _still_works()


# What `pack` may return. --------------------------------------------------------------


def test_unhashable_static_values_in_pack_results_are_fine_under_jit():
    # By design: static parts of `pack`'s result stay in Python at trace time, so any
    # object works, hashable or not, and the compiled step is reused.
    traces = []

    def pack(x):
        traces.append(1)
        return {"data": x, "meta": [1, {"unhashable": []}], "obj": object()}

    def unpack(p):
        assert p["meta"] == [1, {"unhashable": []}]
        return p["data"]

    g = jax.jit(jax.grad(residual.with_hooks(_loss, pack, unpack)))
    np.testing.assert_array_equal(g(X), jax.grad(_loss)(X))
    n = len(traces)
    np.testing.assert_array_equal(g(X + 1), jax.grad(_loss)(X + 1))
    assert len(traces) == n  # no retrace


def test_tracer_leaked_from_another_trace_in_a_pack_result():
    leaked = []

    @jax.jit
    def elsewhere(y):
        leaked.append(y * 2)
        return y

    elsewhere(X)
    g = residual.with_hooks(_loss, lambda x: (x, leaked[0]), lambda p: p[0])
    for mode, grad in _both_modes(g):
        if mode == "eager" and jax.config.jax_remat3:
            # The tag on stored values is a high-level primitive under `jax_remat3`,
            # and JAX checks no operand of those for leaks: the leaked value, which
            # `unpack` never reads, passes unseen and the gradient is plain's.
            assert jnp.allclose(grad(X), jax.grad(_loss)(X), rtol=1e-6)
            continue
        with pytest.raises(jax.errors.UnexpectedTracerError, match="escape"):
            grad(X)
    _still_works()


# Differentiating integers: exactly JAX's own error. ----------------------------------


@pytest.mark.parametrize("hooks", [dict(pack=_identity, unpack=_identity),
                                   dict(policy=rp.Quantize(bits=8, min_bytes=0))],
                         ids=["hooks", "policy"])
def test_integer_inputs_differentiated_give_jax_own_error(hooks):
    n = jnp.arange(3)

    def f(n):
        return jnp.sum(n * 2.0)

    for wrap in (lambda h: h, jax.jit):
        with pytest.raises(TypeError) as plain:
            wrap(jax.grad(f))(n)
        with pytest.raises(TypeError) as hooked:
            wrap(jax.grad(residual.with_hooks(f, **hooks)))(n)
        assert str(hooked.value) == str(plain.value)
        assert "grad requires real- or complex-valued inputs" in str(hooked.value)
    _still_works()


# Scopes used wrongly. ----------------------------------------------------------------


def test_scope_exited_out_of_order_is_refused_without_undoing_anything():
    outer = residual.saved_tensors_hooks(lambda x: x * 2, _identity)
    inner = residual.saved_tensors_hooks(_identity, _identity)
    outer.__enter__()
    inner.__enter__()
    before = (_STACK.get(), current_scope_names())
    with pytest.raises(RuntimeError, match=re.escape("exited out of order")):
        outer.__exit__(None, None, None)
    # Nothing was undone: not the hook stack, not JAX's name stack.
    assert (_STACK.get(), current_scope_names()) == before
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)
    with pytest.raises(RuntimeError, match="exited more often than it was entered"):
        outer.__exit__(None, None, None)
    _still_works()


def test_hooks_inside_disable_and_disable_inside_hooks():
    with residual.disable_saved_tensors_hooks("no hooks in the optimizer"):
        with pytest.raises(RuntimeError, match=r"^no hooks in the optimizer$"):
            with residual.saved_tensors_hooks(_identity, _identity):
                pass
        assert len(_STACK.get()) == 1
    with residual.saved_tensors_hooks(_identity, _identity):
        with pytest.raises(RuntimeError, match=r"^not here$"):
            with residual.disable_saved_tensors_hooks("not here"):
                pass
    _still_works()


def test_unhashable_policy_in_a_scope():
    @dataclasses.dataclass(frozen=True)
    class Listy(residual.Policy):
        levels: list

        def pack(self, x, info):
            return x

        def unpack(self, packed, info):
            return packed

    with pytest.raises(TypeError, match=r"Hooks must be hashable.*Make policy fields tuples"):
        with residual.saved_tensors_hooks(policy=Listy([1, 2])):
            pass
    _still_works()


def test_a_failed_trace_does_not_poison_jit_caches():
    # The same jitted step under a broken scope, a good one, the broken one again.
    step = jax.jit(jax.grad(residual.with_hooks(_loss)))
    bad = residual.saved_tensors_hooks(_identity, lambda p: p[:1])
    with bad, pytest.raises(residual.HookError):
        step(X)
    with residual.saved_tensors_hooks(lambda x: x * 4, lambda p: p / 4):
        np.testing.assert_allclose(step(X), jax.grad(_loss)(X), rtol=1e-6)
    with bad, pytest.raises(residual.HookError):
        step(X)
    np.testing.assert_array_equal(step(X), jax.grad(_loss)(X))
    _still_works()
