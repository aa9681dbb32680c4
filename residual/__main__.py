"""`python -m residual demo` and `python -m residual inspect MODULE:FUNCTION --arg f32[...]`."""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .policies.named import NAMED, named

# `--policy`: "none", or a built-in policy by the name plans use.
POLICIES = ("none", *NAMED)

DESCRIPTION = """\
Saved-tensor hooks for JAX: see what the residuals (saved activations) of a function
cost, and what a policy (int8, bf16, remat, offload, ...) does to them."""

EXAMPLES = """\
examples:
  python -m residual demo
      train a small equinox model plainly and under int8 residuals (about a minute)
  python -m residual inspect mymodel:loss --arg f32[1024,1024] --arg f32[256,1024]
      list the residuals of `loss(w, x)` in mymodel.py, as plain jax.grad stores them
  python -m residual inspect mymodel:loss --arg f32[1024,1024] --arg f32[256,1024] \\
      --arg i32[256] --policy int8
      the same with integer labels as a third argument, under 8-bit quantization
  python -m residual inspect mymodel:loss --args mymodel:example_args --policy int8
      arguments that are pytrees (equinox models, dicts of parameters): `example_args`
      is a tuple of them, or a function returning one (arrays or jax.ShapeDtypeStruct)
  python -m residual inspect mymodel:loss --arg f32[1024,1024] --arg f32[256,1024] \\
      --policy int8 --target v5e
      the same compiled for a TPU v5e, on this machine (pip install 'residual[tpu]')

Nothing is executed: shapes are traced and the program compiled, never run."""

# `f32[4096,1024]`, `int32[8]`, `bf16[]`: a dtype and a shape, as JAX prints them.
_SPEC = re.compile(r"^\s*([a-z][a-z0-9_]*)\s*\[\s*([0-9,\s]*)\]\s*$")
_SHORT_DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
                 "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64", "u8": "uint8",
                 "u32": "uint32", "pred": "bool"}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (2 for bad arguments, as argparse)."""
    parser, inspect_parser = _parsers()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from ._demo import main as run_demo

        run_demo(steps=args.steps, width=args.width, depth=args.depth, batch=args.batch)
        return 0
    fn = _load(inspect_parser, args.function, "FUNCTION", want_callable=True)
    if args.args_from and args.arg:
        inspect_parser.error("give the arguments either with --arg or with --args, not both")
    if args.args_from:
        arguments = _load(inspect_parser, args.args_from, "NAME", want_callable=False)
        if callable(arguments):
            arguments = arguments()
        if not isinstance(arguments, tuple):
            inspect_parser.error(
                f"--args {args.args_from} must be a tuple of arguments (or a function "
                f"returning one), but it is a {type(arguments).__name__}; for one argument, "
                "write `(x,)`"
            )
    elif args.arg:
        arguments = tuple(_spec(inspect_parser, s, args.dtype) for s in args.arg)
    else:
        inspect_parser.error("give the function's arguments: one --arg per argument "
                             "(e.g. --arg f32[256,1024]), or --args MODULE:NAME")
    from ._errors import TargetUnavailableError
    from ._inspect.analysis import inspect as inspect_fn
    from ._target import DoesNotFitError, resolve

    try:
        resolve(args.target)
    except (ValueError, TargetUnavailableError) as e:
        inspect_parser.error(f"--target {args.target}: {e}")
    policy = None if args.policy == "none" else named(args.policy)
    try:
        report = inspect_fn(fn, *arguments, policy=policy, compiled=not args.no_compile,
                            target=args.target)
    except (TargetUnavailableError, DoesNotFitError) as e:
        inspect_parser.error(str(e))
    except Exception as e:  # the user's function, called with the arguments given
        shown = ", ".join(_describe(a) for a in arguments)
        inspect_parser.error(
            f"{args.function}({shown}) failed: {type(e).__name__}: {str(e).splitlines()[0]}\n"
            "Check that there is one argument per parameter, with the shapes and dtypes "
            "the function expects."
        )
    print(report.text(width=None if args.wide else 100))
    return 0


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The command line's parser, and its `inspect` command's (to report errors there)."""
    parser = argparse.ArgumentParser(
        prog="python -m residual", description=DESCRIPTION, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="train a small equinox model plainly and under int8 residuals",
        description="Trains an equinox MLP (residual blocks run by lax.scan) with optax, "
        "plainly and under Quantize(bits=8), and prints the residual report, a gradient "
        "check, and the memory, step-time and loss ratios.",
    )
    demo.add_argument("--steps", type=_positive, default=30, help="training steps (30)")
    demo.add_argument("--width", type=_positive, default=128, help="model width (128)")
    demo.add_argument("--depth", type=_positive, default=4, help="residual blocks (4)")
    demo.add_argument("--batch", type=_positive, default=256, help="batch size (256)")
    inspect = commands.add_parser(
        "inspect", help="list the residuals of a function and what a policy does to them",
        description="Lists every residual `jax.grad` of FUNCTION saves, and what --policy "
        "stores instead;\ncompiles both programs and compares their peak memory, on this "
        "machine's backend or on --target.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    inspect.add_argument("function", metavar="MODULE:FUNCTION",
                         help="the function to differentiate, e.g. mymodel:loss (mymodel.py "
                         "in the current directory, or an installed module)")
    inspect.add_argument("--arg", "--shape", action="append", default=[], metavar="SPEC",
                         help="one argument, as dtype[shape]: f32[4096,1024], i32[256], f32[] "
                         "for a scalar (or 4096x1024, of --dtype); once per argument")
    inspect.add_argument("--args", dest="args_from", metavar="MODULE:NAME",
                         help="the arguments as a tuple of pytrees, or a function returning "
                         "one (for equinox models, dicts of parameters)")
    inspect.add_argument("--dtype", default="float32",
                         help="dtype of the --arg specs written as 4096x1024 (float32)")
    inspect.add_argument("--policy", choices=sorted(POLICIES), default="none",
                         help="none (plain jax.grad), bf16, int8/int4/int2 or fp8 "
                         "(Quantize), remat, offload")
    inspect.add_argument("--no-compile", action="store_true",
                         help="skip compiling (no memory figures; faster)")
    inspect.add_argument("--target", metavar="NAME",
                         help="compile for this hardware, which need not be here: v5e, "
                         "v5e:2x2, v6e, v5p, v4, h100, h100:8, h200, a100 (TPUs need "
                         "residual[tpu], GPUs residual[cuda]); the running backend if "
                         "not given")
    inspect.add_argument("--wide", action="store_true",
                         help="every column whole, however wide the table")
    return parser, inspect


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _load(parser: argparse.ArgumentParser, target: str, what: str, want_callable: bool) -> Any:
    """`module:name`, imported, or a clear error saying what went wrong."""
    module_name, _, name = target.partition(":")
    if not module_name or not name:
        parser.error(f"expected MODULE:{what} (e.g. mymodel:loss), but got {target!r}")
    if "" not in sys.path:
        sys.path.insert(0, "")  # modules in the current directory, as `python -m` finds them
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        parser.error(f"cannot import {module_name!r}: {e}. Run from the directory that holds "
                     f"{module_name.replace('.', '/')}.py, or install its package")
    value = module
    for part in name.split("."):
        if not hasattr(value, part):
            parser.error(f"{module_name!r} ({getattr(module, '__file__', '?')}) has no "
                         f"{name!r}")
        value = getattr(value, part)
    if want_callable and not callable(value):
        parser.error(f"{target} must be a function, but it is a {type(value).__name__}")
    return value


def _spec(parser: argparse.ArgumentParser, text: str, default_dtype: str):
    """`f32[8,128]` (or `8x128`, of `default_dtype`) as a `jax.ShapeDtypeStruct`."""
    match = _SPEC.match(text)
    if match:
        dtype_name, dims = match.groups()
        shape_text = [d for d in dims.replace(" ", "").split(",") if d]
    elif re.fullmatch(r"\s*(\d+\s*(x\s*\d+\s*)*)?", text.lower()):
        dtype_name, shape_text = default_dtype, [d for d in text.lower().split("x") if d.strip()]
    else:
        parser.error(f"--arg {text!r}: expected dtype[shape] such as f32[256,1024], i32[256] "
                     "or f32[] (a scalar), or a shape such as 256x1024")
    try:
        dtype = jnp.dtype(_SHORT_DTYPES.get(dtype_name, dtype_name))
    except TypeError:
        parser.error(f"--arg {text!r}: unknown dtype {dtype_name!r}; use f32, bf16, f16, "
                     "i32, i8, bool or a numpy name such as float32")
    return jax.ShapeDtypeStruct(tuple(int(d) for d in shape_text), dtype)


def _describe(value) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{jnp.dtype(value.dtype).name}[{','.join(map(str, value.shape))}]"
    return type(value).__name__


if __name__ == "__main__":
    raise SystemExit(main())
