"""`ResidualInfo`: everything a policy may know about one residual."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class ResidualInfo:
    """What a policy may know about one residual, fixed when the forward is traced.

    A residual is a value the forward pass saves for the backward pass. `residual`
    finds them by tracing the function, so everything here is static metadata: no
    values, only where the residual came from and what it looks like.

    Attributes:
        index: position of the residual among those of the hooked function (or of the
            scan body it was produced in), in JAX's own order.
        shape: the residual's shape, as seen by one iteration for a scan body.
        dtype: the residual's dtype: a NumPy dtype, or one of JAX's extended dtypes
            (a typed PRNG key such as `key<fry>`, `float0`) for residuals no policy
            packs.
        primitive: name of the JAX primitive that produced it (`"tanh"`,
            `"dot_general"`, ...), or `None` when it is an input of the hooked function
            (`is_input`) or a constant of it (an array it closes over).
        source: `"file.py:12 (function)"` of the innermost code that produced it (a
            library's line for a residual made inside a library's layer), or `None`.
        frames: every frame on the call stack that produced it, innermost first, in
            the form of `source`: the library's lines, then the model's, then the
            training script's. JAX's own frames are left out.
        scope: the region path built from enclosing `jax.named_scope`s, e.g.
            `"block0/mlp"`; `""` at the top level.
        name: the `jax.ad_checkpoint.checkpoint_name` tag of the value, if any.
        is_input: the residual is one of the hooked function's inputs (for a scan body:
            its carry, per-iteration slice or loop-invariant operand).
        kept_alive: the value stays alive without this residual (an input of the
            outermost hooked function, or a scan body's loop-invariant or sliced
            operand), so packing it adds memory instead of saving it. Built-in policies
            leave such residuals alone.
        in_scan: the residual was produced inside a `lax.scan` body and is stored once
            per iteration.
        derivative_of: the user's operation whose derivative rule computed it, when it
            is not a value of the forward itself (`"tanh"` for the `sub` JAX saves as
            `1 - tanh(x)`), else `None`.
        devices: how many devices the program computing it may be partitioned over:
            the size of the mesh its sharding names, or the run's device count
            (every process's; not for a compile-only target) where that is larger;
            1 when neither spans more.
        in_host_memory: the residual is already in host memory, where a
            `jax.checkpoint` offloading policy inside the hooked function put it: the
            device holds none of it, and a device cannot compute on it. `Cast`,
            `Quantize` and `Offload` leave such residuals where they are, and the
            planner offers them no action of their own.
    """

    index: int
    shape: tuple[int, ...]
    dtype: np.dtype
    primitive: str | None = None
    source: str | None = None
    scope: str = ""
    name: str | None = None
    is_input: bool = False
    kept_alive: bool = False
    in_scan: bool = False
    derivative_of: str | None = None
    frames: tuple[str, ...] = ()
    devices: int = 1
    in_host_memory: bool = False

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes the residual takes unpacked (per iteration inside a scan body)."""
        return self.size * itemsize(self.dtype)

    def describe(self) -> str:
        """One line naming the residual, used in error messages and notes."""
        what = (f"output of `{self.primitive}`" if self.primitive is not None
                else "input" if self.is_input else "constant")
        if self.derivative_of is not None:
            what += f" in the derivative of `{self.derivative_of}`"
        where = f" at {self.source}" if self.source else ""
        scope = f" in scope '{self.scope}'" if self.scope else ""
        name = f" named '{self.name}'" if self.name else ""
        dims = ", ".join(str(d) for d in self.shape)
        return (
            f"residual #{self.index} {dtype_name(self.dtype)}[{dims}] "
            f"({what}{where}{scope}{name})"
        )


@functools.cache
def itemsize(dtype: Any) -> int:
    """Bytes per element, extended dtypes included.

    A typed PRNG key (`jax.random.key`) takes the bytes of its key data
    (`jax.random.key_data`: two uint32 for `threefry`); `float0` (the tangent type of
    integers) takes none. NumPy refuses extended dtypes (`np.dtype('key<fry>')`
    raises), so they never reach it.
    """
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
        return math.prod(data.shape) * data.dtype.itemsize
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return int(getattr(dtype, "itemsize", 0))
    return np.dtype(dtype).itemsize


def dtype_name(dtype: Any) -> str:
    """`float32`, `key<fry>`, `float0`: how reports and messages name a dtype."""
    if dtype == jax.dtypes.float0:
        return "float0"  # NumPy calls it `void`
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return str(dtype)
    return np.dtype(dtype).name
