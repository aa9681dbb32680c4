"""On a GPU: each policy's compiled peak against the peak the device measures, its step
time against plain's, and whether `residual.peak`'s rows add up to the compiled peak.

Each (model, policy) runs in a process of its own: the device's `peak_bytes_in_use`
cannot be reset within one. Step time is a paired ratio: plain and the policy's steps
alternate in one process, and the median of the pairs is reported with its spread.

    python benchmarks/gpu_check.py                 # every model and policy
    python benchmarks/gpu_check.py --small         # a quick run (also on CPU)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import _models as models

import residual
from residual import policies as rp

POLICIES = {
    "plain": None,
    "int8": rp.Quantize(bits=8),
    "int4": rp.Quantize(bits=4),
    "bf16": rp.Cast(jnp.bfloat16),
    "offload": rp.Offload(),
}


def model(name: str, small: bool):
    if name == "scan_mlp":
        ws, x = models.mlp_params(8, 256 if small else 4096, 512 if small else 16384)
        return models.scan_mlp, (ws, x)
    loss, *args = models.transformer(blocks=2 if small else 12, width=64 if small else 1024,
                                     heads=4 if small else 16, seq=64 if small else 1024,
                                     batch=2 if small else 8)
    return loss, tuple(args)


def one(name: str, policy_name: str, small: bool, pairs: int) -> dict:
    loss, args = model(name, small)
    policy = POLICIES[policy_name]
    fn = loss if policy is None else residual.with_hooks(loss, policy=policy)
    step = jax.jit(jax.grad(fn))
    plain_step = jax.jit(jax.grad(loss))
    compiled = residual.compiled_memory(jax.grad(fn), *args)
    at_peak = residual.peak(jax.grad(fn), *args)
    rows = sum(r.bytes for r in at_peak.rows)
    jax.block_until_ready(step(*args))
    stats = jax.devices()[0].memory_stats() or {}
    measured = stats.get("peak_bytes_in_use")
    jax.block_until_ready(plain_step(*args))
    ratios = []
    for _ in range(pairs):
        t0 = time.perf_counter()
        jax.block_until_ready(plain_step(*args))
        t1 = time.perf_counter()
        jax.block_until_ready(step(*args))
        t2 = time.perf_counter()
        ratios.append((t2 - t1) / (t1 - t0))
    return {"model": name, "policy": policy_name, "compiled_peak": compiled.peak,
            "rows": rows, "measured_peak": measured, "step_ratio": float(np.median(ratios)),
            "step_spread": [float(np.percentile(ratios, 10)), float(np.percentile(ratios, 90))],
            "device": jax.devices()[0].device_kind, "jax": jax.__version__}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "POLICY"))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*args.one, args.small, args.pairs)))
        return 0
    results = []
    for name in ("scan_mlp", "transformer"):
        for policy_name in POLICIES:
            command = [sys.executable, __file__, "--one", name, policy_name,
                       "--pairs", str(args.pairs)] + (["--small"] if args.small else [])
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                print(f"{name} {policy_name}: failed\n{done.stderr[-2000:]}")
                continue
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            r = results[-1]
            print(json.dumps(r), flush=True)
    print(f"\n{results[0]['device'] if results else '?'}, jax {jax.__version__}")
    print("model        policy    compiled peak  vs plain  measured peak  vs plain  "
          "rows/compiled  step vs plain (p10-p90)")
    plain = {r["model"]: r for r in results if r["policy"] == "plain"}
    for r in results:
        p = plain.get(r["model"])
        measured = r["measured_peak"]
        print(f"{r['model']:12} {r['policy']:8} {r['compiled_peak'] / 2**20:10.0f} MiB"
              f"  {r['compiled_peak'] / p['compiled_peak']:7.2f}"
              + (f"  {measured / 2**20:10.0f} MiB  {measured / p['measured_peak']:7.2f}"
                 if measured and p["measured_peak"] else "           -        -")
              + f"  {r['rows'] / r['compiled_peak']:13.3f}"
              + f"  {r['step_ratio']:.2f} ({r['step_spread'][0]:.2f}-{r['step_spread'][1]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
