"""On a GPU: each policy's memory and step time against plain `jax.grad` and
`jax.checkpoint`, what offloading moves and how fast, and where a step's time goes.

Three phases, each (model, policy) in processes of its own, since the device's
`peak_bytes_in_use` cannot be reset within one:

1. prepare, `--jobs` at a time: compile `jit(grad)` (into a persistent compilation
   cache that the later phases read back), read its compiled memory (`residual.Memory`,
   as on every other backend, and the bytes it places in host memory), run one step and
   read the device's measured peak. `residual.plan` makes its plans here, in a process
   of their own, with its predicted and timed step.
2. time, one process per model: plain's and the policy's steps alternate; the median of
   the paired ratios and its 10th to 90th percentile, with each step's median time. The
   first measures the host link (pinned host memory to device and back).
3. profile, in the transformer's process: one step of `Quantize(bits=8)` and one of
   `Offload()` under `jax.profiler`, summed per kernel, with how much of the copies'
   time overlaps compute.

    python benchmarks/gpu_check.py                     # every model and policy
    python benchmarks/gpu_check.py --small             # a quick run (also on CPU)
    python benchmarks/gpu_check.py --results r.jsonl --until 540   # stop timing at 540 s
    python benchmarks/gpu_check.py --models scan_mlp --rows "plan(budget=0.5)"  # one row

Results are JSON lines (`--results`), and a table at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import make_single_device_sharding

sys.path.insert(0, str(Path(__file__).parent))
import _models as models

import residual
from residual import policies as rp

CHECKPOINTS = {
    "jax.checkpoint nothing": jax.checkpoint_policies.nothing_saveable,
    "jax.checkpoint dots": jax.checkpoint_policies.dots_saveable,
    # JAX's own host offload: the outputs of matrix products without batch dimensions.
    "jax.checkpoint offload dots": jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        "device", "pinned_host"),
}
POLICIES = {
    "Quantize(bits=8)": rp.Quantize(bits=8),
    "Quantize(bits=4)": rp.Quantize(bits=4),
    "Quantize(fp8_e4m3)": rp.Quantize(format="fp8_e4m3"),
    "Cast(bfloat16)": rp.Cast(jnp.bfloat16),
    "Remat()": rp.Remat(),
    "Offload()": rp.Offload(),
    "Chain(Quantize(bits=8), Offload())": rp.Chain(rp.Quantize(bits=8), rp.Offload()),
}
SAVE_ON_CPU = "save_on_cpu(pin_memory=True)"
# The transformer is bfloat16 already, so `Cast(bfloat16)` would change nothing there; and
# `save_on_cpu(pin_memory=True)` is `Offload()` as a scope, measured once. `residual.plan`'s
# rows (`--budgets`) follow each model's.
ROWS = {
    "transformer": ["plain", *CHECKPOINTS, *(k for k in POLICIES if k != "Cast(bfloat16)"),
                    SAVE_ON_CPU],
    "scan_mlp": ["plain", *CHECKPOINTS, *POLICIES],
    "unrolled_mlp": ["plain", *CHECKPOINTS, "Quantize(bits=8)", "Cast(bfloat16)", "Offload()",
                     "Chain(Quantize(bits=8), Offload())"],
}
PROFILED = ("Quantize(bits=8)", "Offload()")


def plan_labels(budgets) -> list[str]:
    return [f"plan(budget={b})" for b in budgets]


def labels(name: str, budgets, rows=None) -> list[str]:
    """A model's rows, plain first; only those in `rows` (and plain) if given."""
    every = ROWS[name] + plan_labels(budgets)
    return [label for label in every if rows is None or label == "plain" or label in rows]


def is_plan(label: str) -> bool:
    return label.startswith("plan(")


def sizes(small: bool) -> dict:
    if small:
        return {"transformer": dict(blocks=2, width=64, heads=4, seq=64, batch=2),
                "mlp": dict(layers=8, width=256, batch=512)}
    return {"transformer": dict(blocks=12, width=1024, heads=16, seq=2048, batch=2),
            "mlp": dict(layers=8, width=4096, batch=16384)}


def model(name: str, small: bool, checkpoint_policy=None):
    """(loss, args) of a model, its layers under `jax.checkpoint(policy=...)` if given."""
    if name == "transformer":
        loss, params, x = models.transformer(**sizes(small)["transformer"], dtype=jnp.bfloat16,
                                             checkpoint_policy=checkpoint_policy)
        return loss, (params, x)
    ws, x = models.mlp_params(**sizes(small)["mlp"])
    plain, checkpointed = {
        "scan_mlp": (models.scan_mlp, models.checkpointed_scan_mlp),
        "unrolled_mlp": (models.unrolled_mlp, models.checkpointed_unrolled_mlp),
    }[name]
    return (plain if checkpoint_policy is None else checkpointed(checkpoint_policy)), (ws, x)


def build(name: str, label: str, small: bool, work: Path):
    """(fn, args, scope): the function whose `grad` a row measures, and the context its
    tracing needs."""
    if label in CHECKPOINTS:
        return (*model(name, small, CHECKPOINTS[label]), contextlib.nullcontext())
    loss, args = model(name, small)
    if label == "plain":
        return loss, args, contextlib.nullcontext()
    if label == SAVE_ON_CPU:
        return residual.with_hooks(loss), args, residual.save_on_cpu(pin_memory=True)
    policy = load_plan(name, label, small, work) if is_plan(label) else POLICIES[label]
    return residual.with_hooks(loss, policy=policy), args, contextlib.nullcontext()


def plan_path(name: str, label: str, small: bool, work: Path) -> Path:
    budget = label.split("=")[1].rstrip(")")
    return work / f"plan-{name}-{budget}{'-small' if small else ''}.pkl"


def make_plan(name: str, label: str, small: bool, work: Path) -> dict:
    loss, args = model(name, small)
    budget = float(label.split("=")[1].rstrip(")"))
    plan = residual.plan(loss, *args, budget=budget)
    plan_path(name, label, small, work).write_bytes(pickle.dumps(plan))
    return {"planned_peak": plan.memory, "plan_plain_peak": plan.plain_memory,
            "predicted_step_s": (plan.plain_step_seconds or 0) + plan.predicted_seconds,
            "plan_timed_step_s": plan.step_seconds, "plan_plain_step_s": plan.plain_step_seconds,
            "plan_compiles": plan.compiles, "planning_s": plan.planning_seconds,
            "plan_grad_error": plan.grad_error}


def load_plan(name: str, label: str, small: bool, work: Path):
    return pickle.loads(plan_path(name, label, small, work).read_bytes())


def compile_step(fn, args, scope):
    with scope:
        return jax.jit(jax.grad(fn)).lower(*args).compile()


def prepare(name: str, label: str, small: bool, work: Path) -> dict:
    """Compiled and measured memory of one step."""
    row = {}
    if is_plan(label):
        row = json.loads(plan_path(name, label, small, work).with_suffix(".json").read_text())
    fn, args, scope = build(name, label, small, work)
    start = time.perf_counter()
    step = compile_step(fn, args, scope)
    compile_s = time.perf_counter() - start
    memory = residual.Memory.of(step)
    host = getattr(step.memory_analysis(), "host_temp_size_in_bytes", 0) or 0
    jax.block_until_ready(step(*args))
    stats = jax.devices()[0].memory_stats() or {}
    return {**row, "model": name, "policy": label, "compiled_peak": memory.peak,
            "host_bytes": host, "measured_peak": stats.get("peak_bytes_in_use"),
            "compile_s": round(compile_s, 1), "device": jax.devices()[0].device_kind,
            "jax": jax.__version__}


def link_bandwidth(nbytes: int = 1 << 30) -> dict:
    """Bytes per second of copies between the device and pinned host memory."""
    device = jax.devices()[0]
    try:
        host = make_single_device_sharding(device, memory_kind="pinned_host")
        on_device = make_single_device_sharding(device, memory_kind="device")
        x = jax.block_until_ready(jnp.ones(nbytes // 4, jnp.float32))
        copied = jax.block_until_ready(jax.device_put(x, host))
        times = {"to_host": [], "to_device": []}
        for _ in range(5):
            start = time.perf_counter()
            jax.block_until_ready(jax.device_put(x, host))
            times["to_host"].append(time.perf_counter() - start)
            start = time.perf_counter()
            jax.block_until_ready(jax.device_put(copied, on_device))
            times["to_device"].append(time.perf_counter() - start)
    except Exception as error:  # a backend without host memory kinds
        return {"link_error": f"{type(error).__name__}: {error}"[:300]}
    return {f"link_{k}_GBps": round(nbytes / float(np.median(v)) / 1e9, 1)
            for k, v in times.items()}


def timed(step, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(step(*args))
    return time.perf_counter() - start


def time_model(name: str, small: bool, work: Path, seconds_per_row: float, link: bool,
               budgets=(), rows=None):
    """Prints a JSON line per row: the paired step-time ratio to plain."""
    if link:
        print(json.dumps({"model": "link", **link_bandwidth()}), flush=True)
    loss, args = model(name, small)
    plain = compile_step(loss, args, contextlib.nullcontext())
    for label in labels(name, budgets, rows)[1:]:
        if is_plan(label) and not plan_path(name, label, small, work).exists():
            continue
        try:
            time_row(name, label, small, work, seconds_per_row, plain, args)
        except Exception as error:  # one row's failure (out of memory, say) ends no other
            print(json.dumps({"model": name, "policy": label,
                              "error": f"{type(error).__name__}: {error}"[:500]}), flush=True)


def time_row(name, label, small, work, seconds_per_row, plain, args):
    fn, policy_args, scope = build(name, label, small, work)
    step = compile_step(fn, policy_args, scope)
    for _ in range(2):
        timed(plain, args), timed(step, args)
    once = timed(plain, args) + timed(step, args)
    pairs = int(min(20, max(5, seconds_per_row / once)))
    plain_s, policy_s = [], []
    for _ in range(pairs):
        plain_s.append(timed(plain, args))
        policy_s.append(timed(step, args))
    ratios = np.array(policy_s) / np.array(plain_s)
    print(json.dumps({
        "model": name, "policy": label, "step_ratio": float(np.median(ratios)),
        "step_p10": float(np.percentile(ratios, 10)),
        "step_p90": float(np.percentile(ratios, 90)), "pairs": pairs,
        "plain_ms": 1e3 * float(np.median(plain_s)),
        "policy_ms": 1e3 * float(np.median(policy_s))}), flush=True)
    if name == "transformer" and label in PROFILED:
        print(json.dumps({"model": name, "policy": label,
                          "profile": profile(step, args, work / f"trace-{label[:8]}")}),
              flush=True)


def profile(step, args, directory: Path) -> dict:
    """One step under `jax.profiler`: device time per kernel, and how much of the time
    spent copying to or from the host overlaps compute kernels."""
    jax.block_until_ready(step(*args))
    with jax.profiler.trace(str(directory), create_perfetto_trace=True):
        jax.block_until_ready(step(*args))
    traces = sorted(directory.rglob("perfetto_trace.json.gz"))
    if not traces:
        return {"error": f"no perfetto trace under {directory}"}
    trace = json.loads(gzip.decompress(traces[-1].read_bytes()))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid for pid, n in names.items() if "/device:GPU" in n}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in devices]
    threads = {(e["pid"], e["tid"]): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    per_stream: dict[str, float] = {}
    for e in kernels:
        stream = threads.get((e["pid"], e.get("tid")), str(e.get("tid")))
        per_stream[stream] = per_stream.get(stream, 0.0) + float(e.get("dur", 0)) / 1e3
    copies = [e for e in kernels if "memcpy" in e["name"].lower()]
    compute = [e for e in kernels if "memcpy" not in e["name"].lower()
               and "memset" not in e["name"].lower()]
    per_name: dict[str, float] = {}
    for e in kernels:
        per_name[e["name"]] = per_name.get(e["name"], 0.0) + float(e.get("dur", 0))
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:15]
    copy_busy, compute_busy = _union(copies), _union(compute)
    return {
        "processes": sorted(set(names.values()))[:8],
        "kernels": len(kernels), "compute_ms": _length(compute_busy) / 1e3,
        "copy_ms": _length(copy_busy) / 1e3,
        "copy_overlapping_compute_ms": _length(_intersect(copy_busy, compute_busy)) / 1e3,
        "streams_ms": {k: round(v, 2) for k, v in per_stream.items()},
        "top_ms": [(n[:90], round(d / 1e3, 2)) for n, d in top],
    }


def _union(events) -> list[tuple[float, float]]:
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events)
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _intersect(a, b) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(spans) -> float:
    return sum(b - a for a, b in spans)


def _child(*argv: str, small: bool, work: Path) -> list[str]:
    return [sys.executable, __file__, *argv, "--work", str(work)] + (
        ["--small"] if small else [])


def run_all(args) -> list[dict]:
    """The three phases, each row's results as JSON lines in `args.results`."""
    began = time.perf_counter()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []

    def keep(output: str) -> None:
        for line in output.splitlines():
            if line.startswith("{"):
                results.append(json.loads(line))
                print(line, flush=True)
                with open(args.results, "a") as f:
                    f.write(line + "\n")

    prepare_all(args, work, keep, began)
    for i, name in enumerate(args.models):
        left = args.until - (time.perf_counter() - began)
        if left < 20:
            print(f"{name}: no time left to time it", flush=True)
            continue
        command = _child("--time", name, small=args.small, work=work) + [
            "--seconds-per-row", str(args.seconds_per_row), "--budgets", *args.budgets] + (
            ["--link"] if i == 0 else []) + (["--rows", *args.rows] if args.rows else [])
        errors = work / f"time-{name}.err"
        with open(errors, "w") as err, subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=err, text=True) as process:
            try:
                out, _ = process.communicate(timeout=None if left == float("inf") else left)
            except subprocess.TimeoutExpired:
                process.kill()
                out, _ = process.communicate()
                print(f"{name}: timing stopped at the deadline", flush=True)
            keep(out)
            if process.returncode and process.returncode > 0:
                print(f"{name}: timing failed\n{errors.read_text()[-1500:]}", flush=True)
    return results


def prepare_all(args, work: Path, keep, began: float) -> None:
    """Phase 1: `args.jobs` processes at a time, plans first (they take longest); a plan's
    row is prepared in the same slot once its plan is made."""
    jobs = []
    for name in args.models:
        for label in labels(name, args.budgets, args.rows):
            commands = [_child("--prepare", name, label, small=args.small, work=work)]
            if is_plan(label):
                commands.insert(0, _child("--plan", name, label, small=args.small, work=work))
            jobs.insert(0 if is_plan(label) else len(jobs), (name, label, commands))
    running: list[tuple[str, str, list, subprocess.Popen]] = []
    logs = work / "logs"
    logs.mkdir(exist_ok=True)

    def start(name, label, commands):
        # Output to files, not pipes: a child that logs much would block on a full pipe.
        stem = logs / f"{name}-{len(list(logs.iterdir()))}"
        with open(f"{stem}.out", "w") as out, open(f"{stem}.err", "w") as err:
            process = subprocess.Popen(commands[0], stdout=out, stderr=err, text=True)
        process.out, process.err = f"{stem}.out", f"{stem}.err"
        running.append((name, label, commands[1:], process))

    while jobs or running:
        late = time.perf_counter() - began > args.prepare_until
        if late:
            for name, label, _ in jobs:
                print(f"{name} {label}: not prepared before the deadline", flush=True)
            jobs = []
        while jobs and len(running) < args.jobs:
            start(*jobs.pop(0))
        time.sleep(0.5)
        for item in list(running):
            name, label, rest, process = item
            if process.poll() is None and not late:
                continue
            running.remove(item)
            if process.poll() is None:
                process.kill()
                print(f"{name} {label}: stopped at the prepare deadline", flush=True)
                continue
            if process.returncode:
                err = Path(process.err).read_text()
                print(f"{name} {label}: failed\n{err[-1500:]}", flush=True)
            elif rest:
                start(name, label, rest)
            else:
                keep(Path(process.out).read_text())


def table(results: list[dict]) -> str:
    """Markdown: a row per (model, policy), memory and time as ratios to plain."""
    rows: dict[tuple[str, str], dict] = {}
    for r in results:
        if "policy" in r and "profile" not in r:
            rows.setdefault((r["model"], r["policy"]), {}).update(r)
            if "plain_ms" in r:  # plain's step, timed beside each row
                rows.setdefault((r["model"], "plain"), {}).setdefault("plain_ms", r["plain_ms"])
    order = {(name, label): i for i, (name, label) in enumerate(
        (name, label) for name in ROWS for label in ROWS[name])}
    rows = dict(sorted(rows.items(), key=lambda kv: (list(ROWS).index(kv[0][0]),
                                                     order.get(kv[0], len(order)))))
    lines = ["| model | policy | compiled peak | vs plain | measured peak | vs plain | "
             "to host and back | step vs plain (p10-p90) | step ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (name, label), r in rows.items():
        plain = rows.get((name, "plain"), {})

        def ratio(key, r=r, plain=plain):
            return (f"{r[key] / plain[key]:.2f}" if r.get(key) and plain.get(key) else "-")

        def mib(value):
            return f"{value / 2**20:,.0f} MiB" if value else "-"

        moved = 2 * r.get("host_bytes", 0)
        step = (f"{r['step_ratio']:.2f} ({r['step_p10']:.2f}-{r['step_p90']:.2f})"
                if "step_ratio" in r else ("1.00" if label == "plain" else "-"))
        ms = f"{r['policy_ms']:.1f}" if "policy_ms" in r else (
            f"{r['plain_ms']:.1f}" if "plain_ms" in r else "-")
        lines.append(f"| {name} | {label} | {mib(r.get('compiled_peak'))} | "
                     f"{ratio('compiled_peak')} | {mib(r.get('measured_peak'))} | "
                     f"{ratio('measured_peak')} | {mib(moved)} | {step} | {ms} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--models", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--jobs", type=int, default=3, help="prepare processes at a time")
    parser.add_argument("--prepare-until", type=float, default=float("inf"),
                        help="seconds from the start after which preparing stops")
    parser.add_argument("--until", type=float, default=float("inf"),
                        help="seconds from the start after which timing stops")
    parser.add_argument("--seconds-per-row", type=float, default=8.0,
                        help="time each row's paired steps for about this long (5 to 20 pairs)")
    parser.add_argument("--budgets", nargs="*", default=["0.5", "0.25"],
                        help="`residual.plan` budgets, as fractions of plain's peak")
    parser.add_argument("--rows", nargs="+", metavar="POLICY",
                        help="measure only these rows (and plain), as the table names them")
    parser.add_argument("--results", default="gpu_check.jsonl")
    parser.add_argument("--work", default="/tmp/residual-gpu-check")
    parser.add_argument("--plan", nargs=2, metavar=("MODEL", "POLICY"))
    parser.add_argument("--prepare", nargs=2, metavar=("MODEL", "POLICY"))
    parser.add_argument("--time", metavar="MODEL")
    parser.add_argument("--link", action="store_true")
    args = parser.parse_args()
    known = {label for name in args.models for label in labels(name, args.budgets)}
    if args.rows and not set(args.rows) <= known:
        parser.error(f"--rows: no row named {sorted(set(args.rows) - known)}; the rows of "
                     f"{args.models} are {sorted(known)}")
    work = Path(args.work)
    jax.config.update("jax_compilation_cache_dir", str(work / "cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if args.plan:
        row = make_plan(*args.plan, args.small, work)
        plan_path(*args.plan, args.small, work).with_suffix(".json").write_text(json.dumps(row))
        return 0
    if args.prepare:
        print(json.dumps(prepare(*args.prepare, args.small, work)))
        return 0
    if args.time:
        time_model(args.time, args.small, work, args.seconds_per_row, args.link, args.budgets,
                   args.rows)
        return 0
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    results = run_all(args)
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, sizes {sizes(args.small)}")
    print(table(results))
    for r in results:
        if "profile" in r or r.get("model") == "link":
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
