"""Every use of JAX internals in `residual`, in one place.

`residual` needs a few things no public JAX API offers: which kind of differentiation
is tracing a value, how to re-bind one jaxpr equation with its source information,
dead-code elimination of a jaxpr, and how the equations of control flow (`scan`,
`cond`, `jit`, `checkpoint`) hold their bodies and parameters, which changes between
releases. Equations are recognized by primitive object (from `jax.extend.core`), never
by name. `tests/foundation/test_jax_private.py` exercises each of them, so a JAX release that
changes them fails loudly there instead of deep in a trace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax._src import ad_checkpoint as _ad_checkpoint
from jax._src import config as _config
from jax._src import hijax as _hijax
from jax._src import source_info_util as _source_info
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax import lax as _lax
from jax.extend import core as _core
from jax.extend.core import primitives as _p

Literal = _core.Literal
Var = _core.Var
ClosedJaxpr = _core.ClosedJaxpr
Jaxpr = _core.Jaxpr
JaxprEqn = _core.JaxprEqn

# The primitives `residual` recognizes in a jaxpr.
scan_p = _p.scan_p
cond_p = _p.cond_p
# Loops: `Recompute` never runs one again (a scan's body is hooked per iteration instead).
LOOPS = frozenset({_p.scan_p, _p.while_p})
remat_p = _p.remat_p  # `jax.checkpoint`
name_p = _p.name_p  # `jax.ad_checkpoint.checkpoint_name`
broadcast_in_dim_p = _p.broadcast_in_dim_p
# JAX's upgrade flags (`jax_remat3`, `jax_custom_vjp3`, ...) bind "high-level"
# primitives: one `call_hi_primitive` equation whose `_prim` parameter is an object
# (`RematTraced`, `CheckpointName`) holding the parameters. `kind` names either sort.
call_hi_primitive_p = _hijax.call_hi_primitive_p
# `jax.checkpoint` and `checkpoint_name`, with and without `jax_remat3`.
REMATS = frozenset({remat_p, _ad_checkpoint.RematTraced})
# (`CheckpointNameFwd` names a residual of a `custom_vjp`'s forward from jax 0.11 on.)
NAMES = frozenset({name_p, _ad_checkpoint.CheckpointName}) | (
    {_ad_checkpoint.CheckpointNameFwd} if hasattr(_ad_checkpoint, "CheckpointNameFwd") else set()
)
# Calls whose body `residual` inlines: `jit`, and `closed_call` (named `eval_jaxpr`
# from jax 0.11 on, and used inside scan bodies there).
CALLS = frozenset({_p.jit_p, _p.closed_call_p, _p.call_p})
# Identity-like equations JAX inserts between a value and its use as a residual.
IDENTITIES = frozenset({_p.reduce_precision_p, _p.copy_p, _lax.optimization_barrier_p})
# What `cond` puts where another branch has a residual.
FILLERS = frozenset({_lax.empty_p, _lax.empty2_p})
# Slices and reshapes: a view of a value costs XLA nothing to keep if the value lives.
# `for w in ws` unstacks from jax 0.11 on (`unstack`, one output per slice); jax 0.10
# slices and squeezes.
VIEWS = frozenset({
    _p.slice_p, _p.squeeze_p, _p.reshape_p, _p.transpose_p, _p.dynamic_slice_p, _lax.unstack_p,
})
# Elementwise equations as cheap to recompute as to read.
CHEAP = frozenset({
    _p.add_p, _p.sub_p, _p.mul_p, _p.neg_p, _p.integer_pow_p, _p.square_p, _p.abs_p,
    _p.sign_p, _p.max_p, _p.min_p, _p.select_n_p, _p.convert_element_type_p,
}) | (
    # What tanh's derivative saves from jax 0.11 on (1 - y²); jax 0.10 saves 1 - y.
    {_lax.one_minus_square_p} if hasattr(_lax, "one_minus_square_p") else set()
)


def kind(eqn: JaxprEqn) -> Any:
    """What an equation applies: its primitive, or its high-level primitive's class."""
    if eqn.primitive is call_hi_primitive_p:
        return type(eqn.params["_prim"])
    return eqn.primitive


def params(eqn: JaxprEqn) -> dict[str, Any]:
    """An equation's parameters, a high-level primitive's own ones included."""
    if eqn.primitive is call_hi_primitive_p:
        return eqn.params["_prim"].params
    return eqn.params


def closed(jaxpr: Jaxpr | ClosedJaxpr) -> ClosedJaxpr:
    """A body as a `ClosedJaxpr`: jax 0.10 stores them closed, 0.11 on as open `Jaxpr`s
    whose constants are explicit operands of the equation."""
    if isinstance(jaxpr, ClosedJaxpr):
        return jaxpr
    if jaxpr.constvars:
        raise NotImplementedError(
            "`residual` met a jaxpr body with constants but no values for them; this JAX "
            f"release ({jax.__version__}) stores bodies in a way `residual` does not know."
        )
    return ClosedJaxpr(jaxpr, ())


@dataclasses.dataclass(frozen=True)
class Scan:
    """A `scan` equation's parts; operands are `num_consts` consts, `num_carry` carries, xs."""

    body: ClosedJaxpr  # one iteration: consts, carry, x -> carry, y
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: int | bool


def scan_parts(eqn: JaxprEqn) -> Scan:
    params = eqn.params
    if "num_consts" in params:  # jax 0.10
        num_consts, num_carry = params["num_consts"], params["num_carry"]
    else:  # jax 0.11 on: operands grouped as (consts, carry, xs) in a flat tree
        groups = params["ft_in"].update(list(range(len(eqn.invars)))).unpack()
        num_consts, num_carry = len(list(groups[0])), len(list(groups[1]))
    return Scan(closed(params["jaxpr"]), num_consts, num_carry, params["length"],
                params["reverse"], params["unroll"])


def cond_branches(eqn: JaxprEqn) -> list[ClosedJaxpr]:
    """A `cond`'s branches; its operands are the index, then the branches' inputs."""
    return [closed(b) for b in eqn.params["branches"]]


def call_body(eqn: JaxprEqn) -> ClosedJaxpr:
    """The body of a `jit` or `closed_call` equation, which takes the equation's operands."""
    params = eqn.params
    return closed(params["jaxpr"] if "jaxpr" in params else params["call_jaxpr"])


@dataclasses.dataclass(frozen=True)
class Remat:
    """A `jax.checkpoint` equation's body and the arguments that rebuild it."""

    body: ClosedJaxpr
    prevent_cse: bool
    policy: Any


def remat_parts(eqn: JaxprEqn) -> Remat:
    """The parts of a `jax.checkpoint` equation (`remat`, or `RematTraced` with remat3)."""
    p = params(eqn)
    # jax 0.10's `RematTraced` has no `prevent_cse`: it always prevents it.
    return Remat(closed(p["jaxpr"]), p.get("prevent_cse", True), p["policy"])


def checkpoint_name_of(eqn: JaxprEqn) -> str:
    """The tag of a `checkpoint_name` equation (`name_p`, or `CheckpointName`)."""
    return params(eqn)["name"]


def single_body(eqn: JaxprEqn) -> Jaxpr | None:
    """The body of a call-like equation (`jit`, `closed_call`, `checkpoint`, custom
    derivatives) when it takes exactly the equation's operands; `None` otherwise.

    Under `jax_custom_vjp3`/`jax_custom_jvp3` a custom derivative's primal is a traced
    function (`traced`) whose `jaxpr` is the body.
    """
    p = params(eqn)
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr", "traced"):
        body = p.get(key)
        body = body.jaxpr if isinstance(body, jax.stages.Traced) else body
        body = getattr(body, "jaxpr", body)
        if isinstance(body, Jaxpr) and len(body.invars) == len(eqn.invars):
            return body
    return None


def sub_jaxprs(eqn: JaxprEqn) -> list[Jaxpr]:
    """Every jaxpr held in an equation's parameters (bodies, branches).

    A `custom_vjp`'s primal under `jax_custom_vjp3` is a traced function (`traced`),
    whose jaxpr is its `jaxpr` attribute.
    """
    subs = []
    for value in params(eqn).values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            item = item.jaxpr if isinstance(item, jax.stages.Traced) else item
            if isinstance(item, ClosedJaxpr):
                subs.append(item.jaxpr)
            elif isinstance(item, Jaxpr):
                subs.append(item)
    return subs


def differentiation_mode(values: Sequence[Any]) -> str | None:
    """How the innermost differentiation of `values` works: "forward", "reverse" or None.

    Reverse mode (`grad`, `vjp`, `jacrev`) traces with JAX's linearize trace, marked
    `is_vjp`; `jax.linearize` uses the same trace unmarked, and its linear function
    runs forward, so it counts as forward mode, as do `jvp` and `jacfwd` (JVP trace).
    Other traces (jit, vmap) are looked through.
    """
    trace = _core.find_top_trace(list(values))
    while trace is not None:
        if isinstance(trace, _ad.LinearizeTrace):
            return "reverse" if trace.is_vjp else "forward"
        if isinstance(trace, _ad.JVPTrace):
            # Without direct linearization, reverse mode also starts with a JVP trace.
            return "forward" if _config.use_direct_linearize.value else "reverse"
        trace = getattr(trace, "parent_trace", None)
    return None


def bind_equation(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Binds one equation again, keeping its name stack and source line."""
    params = eqn.primitive.get_bind_params(eqn.params)
    name_stack = _source_info.current_name_stack() + eqn.source_info.name_stack
    with (
        _source_info.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager,
    ):
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def name_stack_context(eqn: JaxprEqn):
    """A context that makes new equations carry `eqn`'s name stack and source line."""
    name_stack = _source_info.current_name_stack() + eqn.source_info.name_stack
    return _source_info.user_context(eqn.source_info.traceback, name_stack=name_stack)


def scope_names(eqn: JaxprEqn) -> list[str]:
    """The `jax.named_scope` names around an equation, outermost first."""
    return [
        entry.name
        for entry in eqn.source_info.name_stack.stack
        if isinstance(entry, _source_info.Scope)
    ]


def user_source(eqn: JaxprEqn) -> str | None:
    """`"file.py:12 (function)"` of the user code that produced `eqn`, if known."""
    frame = _source_info.user_frame(eqn.source_info.traceback)
    if frame is None:
        return None
    return frame_label(frame.file_name, frame.start_line, frame.function_name)


def frame_label(file_name: str, line: int, function: str) -> str:
    """`"file.py:12 (function)"`, as `user_source` spells a frame."""
    return f"{file_name.rsplit('/', 1)[-1]}:{line} ({function})"


def dce(jaxpr: Jaxpr, used_outputs: Sequence[bool]) -> tuple[Jaxpr, list[bool]]:
    """Dead-code elimination: the slice of `jaxpr` that computes `used_outputs`."""
    return _pe.dce_jaxpr(jaxpr, list(used_outputs))


def jaxpr_as_fun(closed: ClosedJaxpr):
    return _core.jaxpr_as_fun(closed)


def is_extended_dtype(dtype: Any) -> bool:
    """PRNG key data and other extended dtypes, which hooks never see."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def current_scope_names() -> tuple[str, ...]:
    """The `jax.named_scope` names active where the caller is being traced."""
    return tuple(
        entry.name
        for entry in _source_info.current_name_stack().stack
        if isinstance(entry, _source_info.Scope)
    )


def tangent_dtype(dtype):
    """The dtype of cotangents for values of `dtype` (float0 for integers)."""
    return _core.primal_dtype_to_tangent_dtype(dtype)


def varying_axes(value) -> frozenset:
    """The manual (`shard_map`) mesh axes `value` varies over; empty outside `shard_map`.

    JAX 0.10 keeps them in `jax.typeof(x).mat.varying`; earlier releases had
    `jax.typeof(x).vma`.
    """
    aval = jax.typeof(value)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def source_frames(eqn: JaxprEqn) -> list[tuple[str, int, str]]:
    """(full file name, line, function) of the frames that traced `eqn`, innermost first.

    JAX's own frames and the standard library's are left out; other libraries' are not.
    """
    return [
        (frame.file_name, frame.start_line, frame.function_name)
        for frame in _source_info.user_frames(eqn.source_info.traceback)
    ]


def hide_from_tracebacks(directory: str) -> None:
    """Leaves frames of files under `directory` out of the tracebacks JAX filters.

    As equinox does for its own frames: an error raised at trace time (a `HookError`
    for a wrong `unpack`) then ends at the user's code, not inside `residual`. JAX
    filters tracebacks at its API boundaries (`jit`, `grad`, ...) unless
    `JAX_TRACEBACK_FILTERING=off`.
    """
    from jax._src import traceback_util

    traceback_util.register_exclusion(directory)


def is_staged() -> bool:
    """Whether the caller is being traced into a program (`jit`, `make_jaxpr`, a scan body).

    False in eager mode, under eager `grad` or `vmap` too: each operation then runs on
    its own, so nothing can fuse or reorder it.
    """
    trace = _core.find_top_trace([])
    while trace is not None:
        if isinstance(trace, _pe.DynamicJaxprTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def stack_axis(eqn: JaxprEqn) -> int | None:
    """The axis of a `stack` equation (`jnp.stack`, and the transpose of `unstack`), or
    None for any other."""
    if eqn.primitive is _lax.stack_p:
        return eqn.params["axis"]
    return None


def optimized_cost_analysis(compiled: jax.stages.Compiled) -> dict[str, float]:
    """XLA's generic cost analysis (`HloCostAnalysis`, FLOPs and bytes accessed) of a
    compiled program's optimized HLO, run by the CPU client: for compile-only GPU
    programs, whose `cost_analysis()` is None (no loaded executable to ask)."""
    from jax._src import xla_bridge
    from jax._src.lib import _jax

    modules = compiled.runtime_executable().hlo_modules()
    return dict(_jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), modules[0]))


# XLA's dump file suffixes for a compiled module: the optimized module with its
# metadata, its buffer assignment and its live ranges (`<platform>_after_optimizations`
# on CPU and GPU, `after_optimizations` on TPU).
DUMPS = {
    "module": "after_optimizations.txt",
    "assignment": "after_optimizations-buffer-assignment.txt",
    "live_ranges": "after_optimizations-live-range.txt",
}


def compile_with_dumps(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, dict[str, str]]:
    """`lowered.compile()`, and XLA's texts of the compiled module (`DUMPS`'s keys).

    XLA writes them with its debug option `xla_dump_to`, passed per compilation;
    dumping does not change the compiled program. JAX exposes no buffer assignment
    otherwise (`serialized_buffer_assignment_proto` is empty on the releases tried).
    """
    import glob
    import os
    import re
    import tempfile

    # Only the program's own module: XLA:CPU compiles some fusions as modules of their own.
    name = str(lowered.compiler_ir().operation.attributes["sym_name"]).strip('"')
    with tempfile.TemporaryDirectory(prefix="residual-xla-") as folder:
        compiled = lowered.compile(compiler_options={
            "xla_dump_to": folder, "xla_dump_hlo_as_text": True,
            "xla_dump_hlo_pass_re": "", "xla_dump_hlo_module_re": f"^{re.escape(name)}$",
        })
        found = {}
        for key, suffix in DUMPS.items():
            paths = sorted(p for p in glob.glob(os.path.join(folder, f"*{suffix}"))
                           if p.endswith(suffix) and (key != "module" or "-" not in
                                                      os.path.basename(p).rsplit(".", 2)[-2]))
            if not paths:
                names = sorted(os.listdir(folder))
                raise RuntimeError(
                    f"XLA wrote no '*{suffix}' for this program (it wrote {names[:12]}): "
                    "this JAX release names or writes its dumps differently. Please report "
                    "it with your jax and jaxlib versions."
                )
            with open(paths[-1]) as f:
                found[key] = f.read()
    return compiled, found
