"""Overhead of identity hooks: compiled peak memory, step time and trace+compile time.

With identity hooks, `jit(grad)` of an 8-layer MLP (unrolled) and of a scan model must
compile to the same peak memory (`residual.Memory`) as plain `jax.grad`, run within 3% of
its step time, and trace plus compile within 2x. Ratios are measured in this run.

    python benchmarks/overhead.py [--small]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).parent))
import _models as models

import residual


def identity(x):
    return x


def compile_seconds(fn, args) -> tuple[float, object]:
    start = time.perf_counter()
    compiled = jax.jit(jax.grad(fn)).lower(*args).compile()
    return time.perf_counter() - start, compiled


def step_seconds(compiled, args, repeats: int) -> float:
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(small: bool) -> int:
    layers, batch, width = (8, 256, 256) if small else (8, 2048, 1024)
    ws, x = models.mlp_params(layers, width, batch)
    failed = 0
    for name, model in (("unrolled MLP", models.unrolled_mlp), ("scan MLP", models.scan_mlp)):
        hooked = residual.with_hooks(model, identity, identity)
        # Interleave the two so that machine noise hits both alike.
        plain_compile, plain = compile_seconds(model, (ws, x))
        hooked_compile, compiled = compile_seconds(hooked, (ws, x))
        plain_compile = min(plain_compile, compile_seconds(model, (ws, x))[0])
        hooked_compile = min(hooked_compile, compile_seconds(hooked, (ws, x))[0])
        plain_mem = residual.Memory.of(plain).peak
        hooked_mem = residual.Memory.of(compiled).peak
        plain_t = [step_seconds(plain, (ws, x), 10)]
        hooked_t = [step_seconds(compiled, (ws, x), 10)]
        for _ in range(2):
            plain_t.append(step_seconds(plain, (ws, x), 10))
            hooked_t.append(step_seconds(compiled, (ws, x), 10))
        step_ratio = min(hooked_t) / min(plain_t)
        compile_ratio = hooked_compile / plain_compile
        mem_ratio = hooked_mem / plain_mem
        print(f"{name}, {layers} layers, batch {batch} x width {width}, identity hooks:")
        print(f"  peak memory     {mem_ratio:.3f}x  ({hooked_mem} vs {plain_mem} bytes)")
        print(f"  step time       {step_ratio:.3f}x  ({min(hooked_t) * 1e3:.2f} vs "
              f"{min(plain_t) * 1e3:.2f} ms, best median of 3 x 10)")
        print(f"  trace+compile   {compile_ratio:.2f}x  ({hooked_compile:.2f} vs "
              f"{plain_compile:.2f} s)")
        checks = [(mem_ratio == 1.0, "same peak memory"), (step_ratio <= 1.03, "step within 3%"),
                  (compile_ratio <= 2.0, "trace+compile within 2x")]
        for ok, label in checks:
            failed += not ok
            print(f"  {'PASS' if ok else 'FAIL'}: {label}")
    print(f"{failed} target(s) missed")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    raise SystemExit(main(parser.parse_args().small))
