"""`python -m residual demo` and `python -m residual inspect MODULE:FUNCTION --shape ...`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp

POLICIES = {
    "none": lambda rp: None,
    "bf16": lambda rp: rp.Cast(jnp.bfloat16),
    "int8": lambda rp: rp.Quantize(bits=8),
    "int4": lambda rp: rp.Quantize(bits=4),
    "int2": lambda rp: rp.Quantize(bits=2),
    "fp8": lambda rp: rp.Quantize(format="fp8_e4m3"),
    "remat": lambda rp: rp.Remat(),
    "offload": lambda rp: rp.Offload(),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m residual")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small equinox model under int8 residuals")
    demo.add_argument("--steps", type=int, default=30)
    inspect = commands.add_parser("inspect", help="list the residuals of a function")
    inspect.add_argument("target", help="MODULE:FUNCTION, e.g. mypkg.model:loss")
    inspect.add_argument(
        "--shape", action="append", required=True,
        help="an argument's shape, e.g. 4096x1024 (repeat once per argument; '' for a scalar)",
    )
    inspect.add_argument("--dtype", default="float32")
    inspect.add_argument("--policy", choices=sorted(POLICIES), default="none")
    inspect.add_argument("--no-compile", action="store_true", help="skip compiled memory")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from ._demo import main as run_demo

        run_demo(steps=args.steps)
        return 0

    from . import policies as rp
    from ._inspect import inspect as inspect_fn

    module_name, _, function_name = args.target.partition(":")
    if not function_name:
        parser.error(f"target must be MODULE:FUNCTION, but got {args.target!r}")
    sys.path.insert(0, "")
    fn = getattr(importlib.import_module(module_name), function_name)
    dtype = jnp.dtype(args.dtype)
    specs = [jax.ShapeDtypeStruct(_shape(s), dtype) for s in args.shape]
    report = inspect_fn(fn, *specs, policy=POLICIES[args.policy](rp), compiled=not args.no_compile)
    print(report)
    return 0


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.lower().split("x") if d)


if __name__ == "__main__":
    raise SystemExit(main())
