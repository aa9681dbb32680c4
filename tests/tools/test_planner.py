"""`residual.plan`: budgets met on the compiled program, never above plain, plans as values."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import residual
from residual._engine.record import recording
from residual._plan.checks import check_budget
from residual._plan.sweep import make_monotone
from residual._plan.timing import TIME_TIE
from residual._plan.value import Plan, code_key_of
from residual.policies import Identity

from ..helpers import (
    RUNNING_PLATFORM,
    mlp_params,
    offloading_y,
    peak_bytes,
    relative_error,
    scan_mlp,
    tree_equal,
    unrolled_mlp,
)

# Residuals of 32 KiB (batch 128 x width 64, float32): above the planner's 16 KiB floor
# for what is worth packing, small enough to compile in a fraction of a second.
WIDTH, BATCH = 64, 128


def _grad(loss, policy=None):
    fn = loss if policy is None else residual.with_hooks(loss, policy=policy)
    return jax.jit(jax.grad(fn))


@functools.cache
def _scan_args(layers=6):
    return mlp_params(layers, WIDTH, BATCH)


@functools.cache
def _scan_budget() -> float:
    """Halfway between the least memory a plan reaches and plain's (how low a plan
    goes depends on the JAX release's compiler)."""
    least = residual.plan(scan_mlp, *_scan_args(), budget=None)
    assert least.memory < least.plain_memory
    return round(0.5 * (1 + least.memory / least.plain_memory), 3)


@functools.cache
def _scan_plan():
    return residual.plan(scan_mlp, *_scan_args(), budget=_scan_budget())


@pytest.mark.slow
def test_budget_is_met_on_the_compiled_program():
    args = _scan_args()
    p = _scan_plan()
    plain = peak_bytes(jax.grad(scan_mlp), *args)
    hooked = peak_bytes(jax.grad(residual.with_hooks(scan_mlp, policy=p)), *args)
    assert p.plain_memory == plain
    assert p.memory == hooked
    assert hooked <= _scan_budget() * plain
    assert any(d.action != "keep" for d in p.decisions)
    assert p.budget == int(_scan_budget() * plain)
    assert p.compiles >= 2 and p.planning_seconds > 0


def test_budget_in_bytes_and_as_a_size_string():
    assert check_budget("6 GiB") == ("bytes", 6 * 2**30)
    assert check_budget("512MiB") == ("bytes", 512 * 2**20)
    assert check_budget("1.5 kb") == ("bytes", 1500)
    assert check_budget(4096) == ("bytes", 4096)
    assert check_budget(0.5) == ("fraction", 0.5)
    assert check_budget(None) is None


def test_scan_layers_are_one_decision():
    p = _scan_plan()
    in_scan = [d for d in p.decisions if d.in_scan]
    assert in_scan and all(d.iterations == 6 for d in in_scan)
    # One decision per residual of the body, not one per iteration.
    assert len({(d.code_key, d.index) for d in in_scan}) == len(in_scan)


def test_gradient_within_the_bound_and_reported():
    args = _scan_args()
    p = _scan_plan()
    got = _grad(scan_mlp, p)(*args)
    want = _grad(scan_mlp)(*args)
    error = relative_error(got, want)
    assert p.grad_error is not None and error <= p.max_grad_error == 1e-2
    assert abs(error - p.grad_error) <= 1e-6 + 1e-3 * p.grad_error


def test_lossless_actions_give_plain_gradients():
    # A zero error bound allows lossless actions only: keep, recompute, and offload where
    # the device has host memory of its own.
    args = mlp_params(4, WIDTH, BATCH)
    p = residual.plan(unrolled_mlp, *args, budget=None, max_grad_error=0)
    assert p.lossless and p.grad_error is not None
    assert all(d.action in ("keep", "remat", "offload") for d in p.decisions)
    assert p.memory <= p.plain_memory
    got = _grad(unrolled_mlp, p)(*args)
    want = _grad(unrolled_mlp)(*args)
    # On a GPU, float32 rounding of the gradient's scale: XLA:GPU sums in another order
    # in the other program (one of 16,384 entries 1e-6 apart on an H200, at -0.006).
    scale = np.abs(want).max() if RUNNING_PLATFORM == "gpu" else 1.0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * scale)


def test_never_above_plain_where_packing_loses():
    # One layer: the activations are few, and a packed copy next to XLA's buffers
    # takes more than it saves; the plan keeps everything.
    def one_layer(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    w, x = mlp_params(1, WIDTH, BATCH)
    w = w[0]
    p = residual.plan(one_layer, w, x, budget=None)
    assert p.memory <= p.plain_memory == peak_bytes(jax.grad(one_layer), w, x)
    assert peak_bytes(jax.grad(residual.with_hooks(one_layer, policy=p)), w, x) <= p.memory
    if all(d.action == "keep" for d in p.decisions):
        assert tree_equal(_grad(one_layer, p)(w, x), _grad(one_layer)(w, x))


def test_least_memory_is_no_more_than_any_single_policy_within_the_bound():
    # Recomputing a residual can make the engine store the value it is recomputed from
    # (tanh's from the matmul before it), which a sum of stored bytes does not see: the
    # plan must still go at least as low as a single policy chosen by hand.
    from residual.policies import Cast, Quantize, Remat

    args = _scan_args()
    least = residual.plan(scan_mlp, *args, budget=None)
    want = _grad(scan_mlp)(*args)
    for policy in (Cast(jnp.bfloat16), Quantize(bits=8), Remat()):
        if relative_error(_grad(scan_mlp, policy)(*args), want) <= least.max_grad_error:
            memory = peak_bytes(jax.grad(residual.with_hooks(scan_mlp, policy=policy)), *args)
            assert least.memory <= memory, policy


def test_plan_is_the_fastest_measured_of_the_one_action_plans_that_fit():
    # Predicted times rank plans less surely than the gaps between them: the plans that
    # take one action everywhere (a policy chosen by hand) that fit are timed with the
    # finalists, and the plan returned is the fastest of them all, or as fast (within
    # timing noise) and at least as accurate.
    from residual._plan.checks import check_actions
    from residual._plan.planner import Planner

    planner = Planner(scan_mlp, _scan_args(), 0, check_actions(None), 1e-2)
    target = int(_scan_budget() * planner.plain)
    result = planner.run(("bytes", target))
    compiled = planner.programs.compiled_memory  # compiled: in reach
    fitting = [p for p in planner._uniform if p in compiled
               and compiled[p] <= target and planner._error(p) <= 1e-2]
    assert fitting
    for p in fitting:
        assert p in planner.programs.step_ratio
        ratio, theirs = planner.programs.step_ratio[result], planner.programs.step_ratio[p]
        assert ratio <= (1 + TIME_TIE) * theirs
        assert ratio <= theirs or planner._error(result) <= planner._error(p)
    assert result.step_seconds == pytest.approx(
        planner.programs.step_ratio[result] * result.plain_step_seconds)
    assert f"{100 * result.step_overhead:+.1f}% against plain" in str(result)


def test_recomputing_scan_bodies_reaches_what_remat_on_the_body_does():
    # Recomputing the residuals one by one stores the values they are recomputed from;
    # `Remat` on the whole body recomputes them from its inputs. A lossless plan must
    # reach that.
    from residual.policies import Remat, select, where

    args = _scan_args()
    p = residual.plan(scan_mlp, *args, budget=None, max_grad_error=0)
    body = select([(where(in_scan=True), Remat())])
    assert p.memory <= peak_bytes(jax.grad(residual.with_hooks(scan_mlp, policy=body)), *args)
    assert tree_equal(_grad(scan_mlp, p)(*args), _grad(scan_mlp)(*args)) or (
        relative_error(_grad(scan_mlp, p)(*args), _grad(scan_mlp)(*args)) < 1e-6)
    assert Plan.from_json(p.to_json()) == p


def test_round_trip_errors_see_through_xla_folding_casts():
    # XLA folds a cast to bfloat16 and straight back (excess precision): measured that
    # way, a bf16 round trip would look exact, and the error bound would mean nothing.
    p = residual.plan(scan_mlp, *_scan_args(), budget=None, actions=["bf16"])
    errors = [d.error for d in p.decisions if d.action == "bf16"]
    assert errors and all(1e-4 < e < 1e-2 for e in errors)


def test_budget_at_or_above_plain_keeps_everything():
    args = _scan_args()
    p = residual.plan(scan_mlp, *args, budget=1.0)
    assert all(d.action == "keep" for d in p.decisions)
    assert p.memory == p.plain_memory and p.grad_error == 0
    assert p.step_seconds == p.plain_step_seconds  # plain's own program, not timed again
    assert tree_equal(_grad(scan_mlp, p)(*args), _grad(scan_mlp)(*args))


def test_infeasible_budget_names_the_least_memory_reached():
    with pytest.raises(ValueError, match=r"least compiled memory reached .* is [\d.]+ KiB"):
        residual.plan(scan_mlp, *_scan_args(), budget=0.01)


BUDGETS = (0.3, 0.6, 0.8, 0.9, 1.0, None)


@functools.cache
def _sweep():
    return residual.plan_sweep(scan_mlp, *mlp_params(4, WIDTH, BATCH), budgets=BUDGETS)


@pytest.mark.slow
def test_sweep_is_monotone():
    budgets = BUDGETS
    sweep = _sweep()
    assert len(sweep.plans) == len(budgets)
    feasible = [(b, p) for b, p in zip(budgets, sweep.plans) if p is not None and b is not None]
    assert len(feasible) >= 3
    for (b1, p1), (b2, p2) in itertools.pairwise(feasible):
        assert b1 < b2
        assert p1.memory <= p2.memory
        # Measured, as the sweep orders them: a larger budget's plan is slower only
        # within the planner's timing tie, and then more accurate.
        if p2.step_seconds > p1.step_seconds:
            assert p2.grad_error < p1.grad_error
    for k, (_, p) in enumerate(feasible[1:], 1):
        fastest = min(q.step_seconds for _, q in feasible[:k])
        assert p.step_seconds <= (1 + TIME_TIE) * fastest
    for b, p in feasible:
        assert p.memory <= b * sweep.plain_memory
    least = sweep.plans[-1]
    assert least.memory <= min(p.memory for _, p in feasible)
    for reason, p in zip(sweep.reasons, sweep.plans):
        assert (reason is None) == (p is not None)
    assert "budget" in str(sweep)


def _timed(budget: int, seconds: float, error: float) -> Plan:
    return Plan(memory=budget, budget=budget, step_seconds=seconds, grad_error=error)


def test_sweep_step_allowance_does_not_add_up():
    # Each plan is within 5% of the next smaller budget's and more accurate: alone, each
    # step up is a tie the more accurate plan wins, but the largest budget would be 12%
    # slower than the smallest.
    plans = [_timed(30, 1.00, 4e-3), _timed(40, 1.04, 3e-3), _timed(50, 1.08, 2e-3),
             _timed(60, 1.12, 1e-3)]
    make_monotone(plans, [0, 1, 2, 3], [30, 40, 50, 60])
    assert [p.memory for p in plans] == [30, 40, 40, 40]
    assert [p.budget for p in plans] == [30, 40, 50, 60]
    # Faster by more than the tie: the smaller budget's plan is taken, whatever its error.
    plans = [_timed(30, 1.00, 4e-3), _timed(40, 1.10, 0.0)]
    make_monotone(plans, [0, 1], [30, 40])
    assert plans[1].memory == 30
    # A smaller budget whose plan uses more memory takes the larger budget's.
    plans = [_timed(50, 1.00, 0.0), _timed(40, 1.00, 0.0)]
    make_monotone(plans, [0, 1], [50, 60])
    assert plans[0].memory == 40 and plans[0].budget == 50


def test_sweep_plot():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    fig = _sweep().plot()
    assert fig.axes[0].get_xlabel().startswith("compiled memory")
    matplotlib.pyplot.close(fig)


def test_plan_round_trips_through_json_and_repr():
    args = _scan_args()
    p = _scan_plan()
    loaded = Plan.from_json(p.to_json())
    assert loaded == p and hash(loaded) == hash(p)
    assert loaded.memory == p.memory and loaded.grad_error == p.grad_error
    assert eval(repr(p), vars(residual)) == p  # every name a repr shows is exported
    assert tree_equal(_grad(scan_mlp, loaded)(*args), _grad(scan_mlp, p)(*args))
    assert json.loads(p.to_json())["format"] == "residual.Plan"


def test_plan_is_a_policy_anywhere_a_policy_goes():
    args = _scan_args()
    p = _scan_plan()
    assert isinstance(p, residual.Policy)
    hooked = residual.with_hooks(scan_mlp)
    with residual.saved_tensors_hooks(policy=p):
        in_scope = jax.grad(hooked)(*args)
    assert tree_equal(in_scope, _grad(scan_mlp, p)(*args))


def test_plan_matches_every_residual_of_a_fresh_trace():
    args = mlp_params(4, WIDTH, BATCH)
    p = residual.plan(unrolled_mlp, *args, budget=1.0)

    def step(ws, x):  # another call site, another jit: a fresh trace
        return jax.jit(jax.grad(residual.with_hooks(unrolled_mlp, policy=Identity())))(ws, x)

    with recording() as records:
        step(*args)
    seen = {(code_key_of(r.info), r.info.index) for r in records}
    for d in p.decisions:
        assert (d.code_key, d.index) in seen
        info = next(r.info for r in records
                    if (code_key_of(r.info), r.info.index) == (d.code_key, d.index))
        assert p.action_for(info) == d.action
    # Unrolled layers share their code and differ by occurrence.
    assert max(d.occurrence for d in p.decisions) == 3


def test_unknown_residuals_are_kept():
    info = residual.ResidualInfo(index=0, shape=(4, 4), dtype=np.dtype("float32"),
                                 primitive="exp")
    assert Plan().resolve(info) is None
    assert Plan().action_for(info) == "keep"


def test_offload_decisions_give_plain_gradients():
    # Host memory is the device's own on CPU, so the planner never offers offloading
    # there; a plan that names it still computes plain gradients.
    args = _scan_args()
    decisions = tuple(dataclasses.replace(d, action="offload") for d in _scan_plan().decisions)
    offloaded = Plan(decisions)
    np.testing.assert_allclose(_grad(scan_mlp, offloaded)(*args), _grad(scan_mlp)(*args),
                               rtol=1e-6)


def test_shapes_only_use_nominal_errors():
    ws, x = mlp_params(4, WIDTH, BATCH)
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (ws, x)]
    p = residual.plan(scan_mlp, *shapes, budget=None)
    assert p.grad_error is None and p.memory <= p.plain_memory
    assert p.predicted_step_overhead is None
    assert p.step_seconds is None and p.step_overhead is None
    assert "residual groups" in str(p) and "<pre>" in p._repr_html_()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"budget": 1.5}, ValueError, r"fraction of plain .* in \(0, 1\], but got 1.5"),
        ({"budget": 0}, ValueError, r"`budget` in bytes must be positive, but got 0"),
        ({"budget": "lots"}, ValueError, r"size such as '6 GiB' .* but got 'lots'"),
        ({"budget": True}, TypeError, r"`budget` must be .* but got True"),
        ({"budget": [0.5]}, TypeError, r"`budget` must be .* but got list"),
        ({"max_grad_error": -1.0}, ValueError, r"`max_grad_error` must be a finite number"),
        ({"max_grad_error": "1%"}, TypeError, r"`max_grad_error` must be a number"),
        ({"actions": "int8"}, TypeError, r"`actions=\['int8'\]`"),
        ({"actions": ["zip"]}, ValueError, r"actions from .* but got 'zip'"),
        ({"argnums": 1.5}, TypeError, r"`argnums` must be an int or a sequence of ints"),
        ({"argnums": (0, 2)}, ValueError, r"names argument 2, but `loss` got 2 example"),
    ],
)
def test_bad_arguments_raise_early(kwargs, error, match):
    with pytest.raises(error, match=match):
        residual.plan(scan_mlp, jnp.ones((2, 4, 4)), jnp.ones((2, 4)), **kwargs)


def test_bad_loss_and_missing_arguments():
    with pytest.raises(TypeError, match=r"`loss` must be a function"):
        residual.plan(jnp.ones(3), jnp.ones(3))
    with pytest.raises(TypeError, match=r"needs example arguments"):
        residual.plan(scan_mlp)
    with pytest.raises(TypeError, match=r"`budgets` must be a non-empty list"):
        residual.plan_sweep(scan_mlp, jnp.ones((2, 4, 4)), jnp.ones((2, 4)), budgets=0.5)


def test_a_model_holding_what_grad_cannot_take_is_refused_with_the_fix():
    # A flax NNX module with dropout holds its random-number state (uint32), an equinox
    # MLP its activation function: `jax.grad` takes neither.
    model = nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)),
                           nnx.Dropout(0.1, rngs=nnx.Rngs(dropout=1)))
    with pytest.raises(TypeError,
                       match=r"`plan` .* argument 0 .* leaf .*rngs.* dtype uint32.*nnx\.split"):
        residual.plan(lambda m, x: jnp.sum(m(x) ** 2), model, jnp.ones((2, 4)))
    mlp = eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(0))
    with pytest.raises(TypeError,
                       match=r"`plan_sweep` .* leaf .*activation.* a \w+.*eqx\.partition"):
        residual.plan_sweep(lambda m, x: jnp.sum(jax.vmap(m)(x) ** 2), mlp, jnp.ones((2, 4)),
                            budgets=[None])
    with pytest.raises(TypeError,
                       match=r"argument 1 \(`argnums`\), which is an array of dtype int32"):
        residual.plan(lambda w, n: jnp.sum(w * n), jnp.ones(3), jnp.arange(3), argnums=1)


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="CPU has no separate host")
def test_offload_is_unavailable_on_cpu():
    with pytest.raises(ValueError, match=r"includes 'offload'.*unavailable on this backend"):
        residual.plan(scan_mlp, jnp.ones((2, 4, 4)), jnp.ones((2, 4)), actions=["offload"])


def test_bad_json_and_decisions():
    with pytest.raises(ValueError, match=r"expects the text `Plan.to_json\(\)` wrote"):
        Plan.from_json("{}")
    with pytest.raises(ValueError, match=r"expects the text .* but got 'not json'"):
        Plan.from_json("not json")
    with pytest.raises(TypeError, match=r"`decisions` must be a tuple of `PlanDecision`s"):
        Plan([])


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_measured_rates_drop_an_accelerators_fixed_call_time(monkeypatch, backend):
    # Every timed call takes 1 ms of launch and dispatch beside 1 ps per byte or FLOP of
    # work. On the CPU a rate is one size's time over its work; on an accelerator, the
    # slope between two sizes, so each byte costs 1 ps there and not the 1 ms.
    from residual._plan import costs

    def timings(actions, rows, side):
        work = {"bandwidth": 2 * rows * 1024 * 4, "flops": 2 * side**3,
                **{a: rows * 1024 * 4 for a in actions}}
        return {"seconds": {k: 1e-3 + 1e-12 * w for k, w in work.items()}, "work": work}

    monkeypatch.setattr(costs, "_timings", timings)
    monkeypatch.setattr(costs.jax, "default_backend", lambda: backend)
    rates = costs.measured_rates.__wrapped__(("int8",))
    if backend == "cpu":
        assert rates["int8"] == pytest.approx((1e-3 + 1e-12 * 2**21) / 2**21)
    else:
        assert rates["int8"] == pytest.approx(1e-12) and rates["bandwidth"] == pytest.approx(1e-12)
        assert rates["flops"] == pytest.approx(1e12)


def test_the_planner_leaves_residuals_already_in_host_memory_where_they_are():
    # `offloading_y` puts its `y` in host memory; `sin(x)` leaves its derivative on the
    # device. Only the device residual is the planner's to decide.
    def loss(x):
        return offloading_y(x) + jnp.sum(jnp.sin(x) ** 2)

    plan = residual.plan(loss, jnp.ones((BATCH, WIDTH)), budget=None)
    assert plan.decisions, plan
    assert all(d.primitive != "device_put" for d in plan.decisions), plan
