"""What a compiler's fusion recomputes rather than stores, for the policies that do as it does.

A TPU compiler fuses elementwise chains (`tanh`, GELU's terms, softmax's `exp`, a loss's
`2 * x`) into the work around them and stores little of them; a policy that packs
each residual of such a chain forces every one into memory. `Quantize` and `Cast`
can instead recompute those residuals in the backward from the values they are
computed from (`elementwise="recompute"`), which is their default on a TPU.
"""

from __future__ import annotations

from typing import Any

from .._placement import program_platform
from .._policy import Policy, check_choice
from .remat import RematWhereSmaller

# What a fusion computes again from its operands rather than store: recomputing these
# from the packed matmul and reduction outputs costs elementwise work only.
ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "square", "sqrt",
    "rsqrt", "cbrt", "integer_pow", "pow", "exp", "exp2", "log", "log1p", "expm1", "tanh",
    "logistic", "erf", "erfc", "sin", "cos", "select_n", "convert_element_type",
    "one_minus_square", "clamp", "floor", "ceil", "round", "is_finite",
})
# What recomputing them may run again: elementwise work, views and broadcasts, and
# row reductions (a softmax's maximum); never a matmul or a loop.
RECOMPUTABLE = ELEMENTWISE | {
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "slice",
    "reduce_max", "reduce_min", "reduce_sum", "stop_gradient", "copy", "iota",
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
}

CHOICES = ("auto", "pack", "recompute")


def check_elementwise(elementwise: Any, auto: str) -> None:
    """Raises unless `elementwise` is one of `CHOICES`; `auto` says what "auto" does."""
    check_choice("elementwise", elementwise, CHOICES, ": 'pack' packs every residual, "
                 f"'recompute' recomputes elementwise ones from the packed values, 'auto' {auto}")


def recomputes(elementwise: str, auto: bool) -> bool:
    """Whether a policy's `elementwise` choice recomputes; `auto`: what "auto" does here."""
    return auto if elementwise == "auto" else elementwise == "recompute"


def resolved(policy: Policy, info: Any, recompute: bool) -> Policy:
    """What `policy` stores `info`'s residual with: where it recomputes elementwise
    residuals and this is one, recomputed from the values it is computed from where that
    stores fewer bytes, else packed by `policy`."""
    if recompute and info.primitive in ELEMENTWISE:
        return RematWhereSmaller(instead=policy, recomputes_through=RECOMPUTABLE)
    return policy


def for_a_tpu() -> bool:
    """Whether the program being traced is for a TPU."""
    return program_platform() == "tpu"
