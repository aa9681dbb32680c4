"""`residual.plan` on the benchmark models: budgets asked vs compiled memory reached.

For each model and budget (a fraction of plain `jax.grad`'s temp memory, or the least
memory): the compiled `jit(grad)` temp memory the plan reaches, as a ratio to plain
(compile-only, `memory_analysis()`), its gradient error against plain `jax.grad` on
the example batch, the predicted step overhead, and the compiles and seconds the
planning took. Budgets share one planner per model (`residual.plan_sweep`).

    python benchmarks/planner.py            # full sizes
    python benchmarks/planner.py --small    # a quick run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).parent))
import _models as models

import residual

BUDGETS = (0.25, 0.5, 0.75, None)


def measure(name: str, loss, args) -> list[str]:
    sweep = residual.plan_sweep(loss, *args, budgets=BUDGETS)
    print(f"\n{name}: plain jit(grad) temp {sweep.plain_memory / 2**20:.2f} MiB; planned in "
          f"{sweep.planning_seconds:.1f} s, {sweep.compiles} compiles")
    print(f"  {'asked':>6s} {'reached':>8s} {'grad error':>11s} {'overhead':>9s}  actions")
    missed = []
    for budget, plan, reason in zip(sweep.budgets, sweep.plans, sweep.reasons):
        asked = "least" if budget is None else f"{budget:.2f}x"
        if plan is None:
            least = reason.split(" is ")[-1].split(" Raise")[0] if reason else ""
            print(f"  {asked:>6s} {'-':>8s} {'':>11s} {'':>9s}  not reachable: least {least}")
            continue
        ratio = plan.memory / sweep.plain_memory
        overhead = plan.predicted_step_overhead
        counts: dict[str, int] = {}
        for d in plan.decisions:
            counts[d.action] = counts.get(d.action, 0) + 1
        actions = ", ".join(f"{n} {a}" for a, n in sorted(counts.items()))
        print(f"  {asked:>6s} {ratio:7.2f}x {plan.grad_error or 0:11.2e} "
              f"{100 * (overhead or 0):8.1f}%  {actions}")
        if ratio > 1.0:
            missed.append(f"{name}: {asked} above plain")
        if budget is not None and ratio > budget:
            missed.append(f"{name}: {asked} not met")
    return missed


def main(small: bool) -> int:
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
    batch, width = (256, 128) if small else (1024, 512)
    missed = []
    for layers in (1, 8):
        args = models.mlp_params(layers, width, batch)
        for kind, loss in (("scan", models.scan_mlp), ("unrolled", models.unrolled_mlp)):
            missed += measure(f"{kind} MLP f32, {layers} layer(s), batch {batch} x width "
                              f"{width}", loss, args)
    if not small:
        loss, params, tokens = models.transformer()
        missed += measure("equinox transformer, 4 blocks (scan)", loss, (params, tokens))
    print(f"\n{len(missed)} target(s) missed" + "".join(f"\n  {m}" for m in missed))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    raise SystemExit(main(parser.parse_args().small))
