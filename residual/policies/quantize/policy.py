"""`Quantize`: store residuals as 8-, 4- or 2-bit integer codes, or fp8, with per-group scales."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..._engine.ordering import devices_spanned, several_devices
from ..._info import ResidualInfo
from ..._policy import Policy, check_bool, check_int
from .. import _fusion
from .._complex import from_parts, is_complex, parts, parts_info
from .._defaults import worth_packing
from .._lanes import stored_shape
from ..mask_bits import MASK_BITS
from .checks import FP8, check_byte_scales, check_format, check_grid, checked_scale_dtype
from .grid import SUPER, SUPER_SHARDED, byte_scale_values, fp8_codes, int_codes, int_values
from .layout import fits_rows, layout_of
from .noise import salt_of
from .packing import pack_codes, unpack_codes
from .ranges import as_they_are, cond, finite_range, finite_ranges


@dataclasses.dataclass(frozen=True)
class Quantize(Policy):
    """Stores floating-point residuals as low-bit codes with a scale per group.

    Each residual is cut into groups of at most `group_size` consecutive elements
    along one axis: the last axis when `group_size` divides it; for a shorter last
    axis, an earlier axis that `group_size` divides (else one group per row); a
    longer one is cut into near-equal groups, padded with a few zeros. No scale ever
    spans the whole tensor, and codes keep the residual's layout (sharded
    activations stay sharded). On one device, where `group_size` divides the rows
    and 128 the last axis, groups run `group_size` rows of one column instead: one
    feature across tokens, which keeps a channel's outliers out of the other
    channels' groups. 4- and 2-bit codes do so in a program for a CPU, and for a
    GPU outside scan bodies (a transformer's int4 gradient error, CPU, groups of 64
    with float32 scales: 6.7% -> 5.6% on flax NNX, 7.6% -> 6.2% on GPT-2, in the
    same memory); in a program for a TPU,
    int8 codes of any float and 4- and 2-bit codes of a float32 matrix, outside scan
    bodies, where the compiler then keeps the statistics lane-dense (see the
    policies page). With `format="int"`, a group spanning $[lo, hi]$ is
    stored as codes of the nearest of $2^b$ evenly spaced values $(c - z) s$ (affine
    quantization: a scale $s$ and a zero point $z$ per group), packed into
    `uint8`: one code per byte for `bits=8`, two for 4, four for 2. With 8-bit codes
    the grid spans $[\\min(lo, 0), \\max(hi, 0)]$ with zero among its values. At 4
    and 2 bits the grid spans about $[lo, hi]$ itself: the zero point may be a fraction
    of a code (1/8 at 4 bits) where the group has both signs, and lie beyond the codes
    where it has one sign and stays away from zero (a GELU's gate, `tanh` outputs
    near 1), so no value moves by more than about $(hi - lo) / (2 (2^b - 1))$ (more,
    at 4 bits, for a group farther from zero than 4 times its range). Groups
    reaching zero from one side (a causal mask, ReLU, probabilities) keep zero as a
    code: their zeros stay exactly zero. With an fp8 `format`,
    $x / s$ is stored in JAX's float8 dtype, $s = m / \\max_\\text{fp8}$.

    - Memory per element, float32 residual, the defaults: int8 1.08 B (0.27x; groups
      of 64, float32 scales), int4 0.58 B (0.14x) and 2-bit 0.33 B (0.08x) (groups
      of 32, byte scales), fp8 1.06 B.
    - Byte scales, `scale_dtype=jnp.uint8` (the default for 4- and 2-bit codes),
      store each group's step as one byte `k`, $S \\cdot 2^{-k/16}$ (the nearest such
      step), under one bfloat16 $S$, the largest step, per 128 elements along the
      grouped axis: small groups for little memory. At 4 bits, groups of 32 take
      the bytes of groups of 64 with float32 scales (0.58 B per element), and on
      the benchmark zoo's transformers (CPU) bring the gradient error from 2.0-6.2%
      down to 1.8-5.4%; `group_size=16` takes 0.64 B (0.16x) for 1.5-4.5%. A step
      comes back within 2.2% of the group's own, so a group of one value comes
      back within about 1% of it (exactly, with float scales). Where no whole
      number of groups fills 128 elements (13 groups along an axis of 200), fewer
      share a super-group, down to one (6.2 bits per value). In a program over
      several devices a super-group spans 64 elements (0.59 B per element at 4
      bits), so that shards of 64 keep theirs; an axis sharded into pieces of fewer
      than 64 elements splits super-groups across devices, and their largest step
      is then an all-reduce: pass `scale_dtype=jnp.float32` there.
    - In a program for one TPU, a residual whose minor axis leaves the chip's
      128-lane tiles part empty (attention heads of 64) is quantized with its minor
      axes merged (`[batch, seq, 4, 64]` as `[batch, seq, 256]`) where `group_size`
      divides its last axis: the same groups along it, with codes and statistics
      lane-dense (the unrolled flax NNX transformer, 32 sequences of 256 on v5e:
      int8 0.87x plain's peak -> 0.64x, fp8 0.85x -> 0.61x, int4 1.26x -> 1.17x).
      8-bit codes then group down the rows where a TPU's do (one feature across
      `group_size` tokens).
    - A complex residual is quantized as its real and imaginary parts, stacked on a
      new leading axis: no group mixes the two. (In a program for a TPU, 4- and
      2-bit codes of a complex matrix group along its last axis, where those of a
      float32 matrix group down its rows.)
    - Row statistics are stored as they are: a residual whose last axis has size 1,
      what a reduction with `keepdims=True` leaves (softmax row sums
      `[batch, heads, queries, 1]` from `jax.nn.softmax` and
      `jax.nn.dot_product_attention`, LayerNorm/RMSNorm statistics
      `[batch, tokens, 1]`). Each scales a whole row in the backward and they can
      span orders of magnitude across rows (causal row sums run from 1 to the
      sequence length), while they take `1 / row length` of the memory of the rows
      they summarize.
    - Non-finite values: scales only look at finite values, so a NaN or Inf never
      changes any other group. A group holding one is marked (negative scale),
      keeps code 0 for them and gives them back as NaN (an Inf comes back as NaN
      too: the gradient still shows the divergence at the same position); its
      finite values use the $2^b - 1$ codes of a grid centred on zero. fp8 keeps
      non-finite values as the fp8 dtype does (`e5m2` keeps Inf; `e4m3` has no Inf
      and gives NaN).
    - `grid="auto"` (the default; 4- and 2-bit codes): a group of values none of
      them negative whose mean is below a quarter of its largest, $m$ (softmax
      probabilities, `exp` outputs, squares, ReLU outputs: mostly small next to a
      few large ones), is stored on a square grid instead, values $s c^2$ for codes
      $c = 0 .. 2^b - 1$ with $s = m / (2^b - 1)^2$: steps grow from $s$ near zero to
      about $2m / (2^b - 1)$ at the top. For such a group that quarter is where the
      square grid's mean squared error, about $4 \bar{x} / m$ times the uniform
      grid's, drops below it. Zero stays a code, and the zero-point byte marks the
      group (255). `grid="uniform"` keeps every group on the evenly spaced grid;
      8-bit codes always use it.
    - `stochastic=True` (integer formats) rounds up with probability equal to the
      fractional part, so the dequantized value is unbiased. Each element's draw is a
      hash of its own bits, its position, `seed` and the residual's index: the same
      inputs give the same draws (reproducible), new activations give new draws (it
      varies from step to step), nobody threads keys through the model, and no shard
      of a sharded residual waits for another's.
    - `elementwise="recompute"` packs only what a compiler's fusion would store (the
      outputs of matmuls, convolutions, reductions, and inputs) and recomputes the
      elementwise chains between them (`tanh`, GELU's terms, softmax's `exp`) in the
      backward from the unpacked values, as `Remat` does, wherever that stores fewer
      bytes (not where it would store the matmul output a `tanh` is recomputed from
      instead of the `tanh` output), and never runs a matmul or loop again for them.
      TPU compilers fuse those chains and store little of them, so packing each one
      adds memory there. `elementwise="auto"` (the default) recomputes them in a
      program compiled for a TPU for 8-bit codes (int8, fp8), for 4- and 2-bit
      codes of 16-bit floats and of float32 matrices (2-D) and token streams
      (`[batch, sequence, width]`) outside scan bodies, and at every width in a
      program partitioned over several devices (`ResidualInfo.devices`); it packs
      every other residual: on CPU and GPU, and on one TPU chip 4- and 2-bit codes
      of float32 in scan bodies or of more axes (a CNN's activations). See the
      policies page for the figures.

    Built-in defaults: only floating-point residuals of at least `min_bytes` that are
    not kept alive anyway (`ResidualInfo.kept_alive`: weights, loop-invariant
    operands) and are not row statistics are quantized; boolean masks of at least
    `min_bytes` (a ReLU's) are stored as bits, exactly, beside the floats quantized. Residuals
    already in host memory (offloaded by a `jax.checkpoint` policy inside the hooked
    function, `ResidualInfo.in_host_memory`) are stored as they are: XLA does not
    compute on them there. To quantize and offload, chain the two in that order,
    `Chain(Quantize(...), Offload())`.

    Args:
        bits: 8, 4 or 2 for `format="int"`; 8 for fp8.
        format: `"int"`, `"fp8_e4m3"` or `"fp8_e5m2"`.
        group_size: the most elements one scale covers (default 32 with byte
            scales, else 64).
        stochastic: unbiased stochastic rounding instead of round-to-nearest.
        scale_dtype: `jnp.float32`, `jnp.bfloat16`, or `jnp.uint8` (byte scales under
            a bfloat16 scale per 128 elements; 4- and 2-bit codes). Default: `jnp.uint8`
            for 4- and 2-bit codes, else `jnp.float32`.
        seed: base seed of stochastic rounding.
        min_bytes: residuals smaller than this (per iteration) are stored as they are:
            they cost little, and they are where quantization hurts most.
        grid: `"auto"` (a square grid for the groups it suits, 4- and 2-bit codes) or
            `"uniform"` (evenly spaced values only).
        elementwise: `"auto"` (recompute on a TPU for 8-bit codes, for 4- and
            2-bit codes of 16-bit floats and of float32 matrices outside scan
            bodies, and at every width on several devices; else pack),
            `"pack"` (every residual) or `"recompute"` (elementwise ones recomputed
            from the packed values).

    Raises:
        TypeError: a field of the wrong type (`bits=4.0`, `stochastic="yes"`, `seed="a"`,
            `grid=None`; `True` is not an int here).
        ValueError: an unsupported `bits`, `format`, `group_size`, `scale_dtype` or `grid`
            (`jnp.uint8` scales with 8-bit or fp8 codes).

    Examples:
        >>> import jax, jax.numpy as jnp, residual
        >>> from residual import policies as rp
        >>> f = residual.with_hooks(lambda x: jnp.sum(jnp.tanh(x) ** 2), policy=rp.Quantize(bits=8))
        >>> g = jax.grad(f)(jnp.linspace(-1, 1, 128))

        Softmax probabilities are mostly small: 4-bit codes on the square grid keep
        them closer than the uniform grid does.

        >>> p = jax.nn.softmax(2 * jax.random.normal(jax.random.key(0), (64, 256)))
        >>> info = residual.ResidualInfo(index=0, shape=p.shape, dtype=p.dtype)
        >>> def error(policy):
        ...     q = policy.unpack(policy.pack(p, info), info)
        ...     return float(jnp.linalg.norm(q - p) / jnp.linalg.norm(p))
        >>> error(rp.Quantize(bits=4)) < 0.8 * error(rp.Quantize(bits=4, grid="uniform"))
        True

    References:
        Chen et al., "ActNN: Reducing Training Memory Footprint via 2-Bit Activation
        Compressed Training", ICML 2021. Liu et al., "GACT: Activation Compressed
        Training for Generic Network Architectures", ICML 2022.
    """

    # `pack` reads its input in a `lax.cond` (the NaN-safe branch) and outside it.
    reads_twice = True

    bits: int = 8
    format: str = "int"
    group_size: int | None = None
    stochastic: bool = False
    scale_dtype: Any = None
    seed: int = 0
    min_bytes: int = 16384
    grid: str = "auto"
    elementwise: str = "auto"

    def __post_init__(self):
        # Types first, each naming its field: a float `bits` or a string `seed` would
        # otherwise fail only inside a trace, in a JAX message that names neither.
        object.__setattr__(self, "bits", check_int("Quantize", "bits", self.bits))
        check_format(self.format, self.bits)
        # Below 8 bits, byte scales by default: groups of 32 in the bytes that float32
        # scales take for groups of 64, and a smaller gradient error on every model
        # measured (the policies page).
        low_bits = self.format == "int" and self.bits < 8
        scale_dtype = self.scale_dtype
        if scale_dtype is None:
            scale_dtype = jnp.uint8 if low_bits else jnp.float32
        object.__setattr__(self, "scale_dtype", checked_scale_dtype(scale_dtype))
        if self.group_size is None:
            object.__setattr__(self, "group_size", 32 if self._byte_scales else 64)
        for label in ("group_size", "seed", "min_bytes"):
            minimum = {"group_size": 1, "min_bytes": 0}.get(label)
            value = check_int("Quantize", label, getattr(self, label), minimum=minimum)
            object.__setattr__(self, label, value)
        object.__setattr__(self, "stochastic", check_bool("Quantize", "stochastic",
                                                          self.stochastic))
        check_grid(self.grid)
        _fusion.check_elementwise(self.elementwise, auto="recomputes them on a TPU for 8-bit "
                                  "codes, for 4- and 2-bit codes of 16-bit floats or of "
                                  "float32 matrices outside scan bodies, and for every "
                                  "code on several devices, and packs them elsewhere")
        if self.format != "int" and self.stochastic:
            raise ValueError(
                "`stochastic=True` is implemented for `format='int'`; fp8 rounds to nearest."
            )
        check_byte_scales(self.scale_dtype, self.format, self.bits)

    def resolve(self, info: ResidualInfo) -> Policy | None:
        if info.dtype == np.dtype(bool) and info.nbytes >= self.min_bytes:
            return MASK_BITS.resolve(info)
        if not worth_packing(info) or info.nbytes < self.min_bytes:
            return None
        if _is_row_statistic(info.shape):
            return None
        return _fusion.resolved(self, info, self._recomputes_elementwise(info))

    def _recomputes_elementwise(self, info: ResidualInfo) -> bool:
        """Whether an elementwise residual is recomputed rather than packed.

        `"auto"` recomputes it in a program for a TPU, whose compiler fuses elementwise
        chains and stores little of them, for 8-bit codes (a transformer's int8 peak,
        v5e: 0.26x plain's recomputed, 0.64x packed), and for 4- and 2-bit codes of a
        16-bit float (int4 on a bf16 equinox transformer, 8 blocks of 512: 0.23x
        against 0.33x on v5e; 4 blocks of 512, v6e: 0.24x against 0.44x); it packs
        it elsewhere. 4- and 2-bit codes of float32 on one chip recompute matrices
        (2-D as stored, `_lane_dense`) outside scan bodies (`_by_rows`), which they
        group down the rows, where each packed term takes temporary float and mask
        arrays in the forward (a bf16 tanh MLP summed in float32, 8 layers of 512:
        int4 0.83x plain's peak recomputed against 1.02x packed on v5e; an unrolled
        8-layer f32 GELU MLP 1.00x either way at batch 4,096 x width 1,024, 0.87x at
        2,048 x 512), and token streams outside scan bodies (`_is_token_stream`: the
        zoo's flax NNX transformer unrolled, int4 0.62x against 0.66x packed at 8
        sequences, 0.54x against 1.05x at 32, 2-bit 0.49x against 0.95x); they pack
        the rest: the flax Linen CNN's 4-D activations measured 1.27x packed against
        2.89x recomputed, the zoo's scanned NNX and equinox transformers 0.50x and
        0.46x against 0.54x and 0.47x (v5e; haiku's 0.46x against 0.45x).
        Recomputing is measured to cost the memory benchmarks' models nothing on CPU
        and H100, and at 4 bits the zoo's errors within half a point of packing's;
        the other backends' defaults wait for the whole zoo's figures.

        On several devices 4- and 2-bit codes of float32 recompute too: data parallel
        on v5e:2x2, 8 sequences of 256 per chip, int4 takes 0.54x plain's peak
        recomputed against 0.67x packed on the flax NNX transformer (`nnx.scan`),
        0.75x against 1.02x unrolled, 0.50x against 0.66x on haiku's, 0.48x
        against 0.67x on equinox's (v6e:2x4: 0.45x to 0.84x against 0.54x to 1.18x,
        2-bit codes as well); on MLPs (batch 4096 x width 1024) 1.00x against
        1.23x (GELU, data parallel and FSDP); tensor parallel tanh loses (0.96x
        against 0.93x; at batch 1024 x width 512, 0.97x against 0.95x, and 1.00x
        against 0.97x on v5e:4x4). The zoo's int4 gradient errors, recomputed, are
        within half a point of packing's (the guides' table).
        """
        return _fusion.recomputes(self.elementwise, auto=_fusion.for_a_tpu() and (
            self._eight_bits or _is_16_bit(info.dtype) or info.devices > 1
            or self._by_rows(self._lane_dense(info)) or _is_token_stream(info)))

    def _windows(self, sharded: bool) -> bool:
        """Whether groups reduce over windows of the residual as it lies (`Layout.reduce`):
        in a program for a TPU, except 8-bit codes of a residual sharded over several
        devices, which reshape into groups.

        Measured compile-only on v5e:2x2 (4-layer MLPs, batch 4096 x width 1024, f32),
        reshaped against windows, as a ratio to plain's peak: int8 on the data-parallel
        tanh MLP 0.96x against 1.16x, GELU 1.00x against 1.08x; tensor parallel tanh
        0.91x against 1.13x, with the same collectives; FSDP tanh 1.01x against 1.29x
        and GELU 1.00x against 1.21x, with one more all-gather of the weights each.
        Scanned MLPs measure the same either way. 4-bit codes lose reshaped (GELU
        data parallel 1.27x against 1.23x, FSDP 1.56x against 1.23x).
        """
        return _fusion.for_a_tpu() and not (sharded and self._eight_bits)

    @property
    def _byte_scales(self) -> bool:
        """Whether scales are bytes, which also asks the layout to reduce a group as
        long as the last axis over it on a TPU (`Layout.reduce`): byte scales derive
        several per-group arrays from each statistic, each padded 128x over a window
        (the flax Linen CNN, v5e, int4: 1.45x plain's peak against 4.47x), where int8's
        float scales measured better over the window (the equinox transformer's heads
        of 64: 0.43x against 0.47x)."""
        return self.scale_dtype == np.dtype(jnp.uint8)

    @property
    def _eight_bits(self) -> bool:
        return self.format != "int" or self.bits == 8

    def _by_rows(self, info: ResidualInfo) -> bool:
        """Whether the codes group down the rows (`layout_of`): 4- and 2-bit codes of
        any float in a program for a CPU, and for a GPU outside scan bodies; in a
        program for a TPU, for a residual outside a scan body, int8 codes of any
        float and 4- and 2-bit codes of a float32 matrix. (On several devices, where
        the groups stay on one: `_rows_stay_local`.)

        Down the rows, a group is one feature across `group_size` tokens: activation
        outliers live in a few channels (Dettmers et al., LLM.int8(); Xiao et al.,
        SmoothQuant), and along the last axis each one widens the grid of every group
        it falls in. On CPU, int4's gradient error on the benchmark zoo's
        transformers falls from 6.7% to 5.6% (flax NNX, scanned and unrolled), 2.1%
        to 2.0% (haiku), 3.5% to 3.5% (equinox), 7.6% to 6.2% (keras-hub GPT-2), in
        the same compiled memory. Compiled for an H100 it takes the same memory
        outside scan bodies (the unrolled flax NNX transformer: 0.55x plain's peak
        either way), but in a scan body the GPU compiler transposes each residual
        to reduce its groups and holds the float copy (scanned flax NNX
        transformer: 0.28x against 0.23x).

        On a TPU the layout is what counts. Measured compile-only against groups
        along the last axis, as a ratio to plain's peak: int8 on unrolled MLPs drops
        below plain (v6e f32 0.96x against 1.01x, v6e bf16 0.82x against 1.02x, v5e
        bf16 0.80x against 1.06x; v5e f32 1.00x against 0.99x), while scan bodies
        rise (v5e scan MLP 0.70x against 0.61x). At 4 bits float32 gains, most with
        small groups, whose statistics spread over a 16-wide axis fill an eighth of
        each 128-lane tile (the tests' unrolled tanh MLP, width 1024, batch 4096;
        v5e, groups of 16 with byte scales: 8 layers 0.94x against 1.21x, 4 layers
        1.00x against 1.25x; the default, 4 layers: 1.00x against 1.00x, v6e 0.98x
        against 1.03x), while bfloat16 loses (v5e, 8 layers: 0.93x against 0.74x),
        and so do a transformer's `[batch, sequence, width]` residuals (v5e,
        unrolled flax NNX transformer, int4: 0.77x against 0.67x). fp8 codes group
        down the rows outside scan bodies on several chips (`_rows_stay_local`), and
        on one for a 16-bit float: along the last axis the backward spreads each
        group's float32 scale over its values by a reshape the TPU's tiles turn into
        copies (unrolled bf16 MLP, 8 layers x 32,768 x 1,024: 0.76x plain's peak
        against 1.02x on v5e, 0.81x against 1.07x on v6e; at batch 4,096 0.76x
        against 0.86x and 0.77x against 0.88x; 32 layers 0.73x against 0.79x and
        0.84x against 0.89x). A float32 one keeps the last axis: down the rows the
        unrolled f32 MLP at batch 4,096 rises above plain on v6e (1.01x against
        0.97x), and the unrolled flax NNX transformer loses (v5e 0.63x against 0.62x).
        """
        if self.format != "int":
            return (_fusion.for_a_tpu() and not info.in_scan
                    and (info.devices > 1 or _is_16_bit(info.dtype)))
        platform = _fusion.program_platform()
        if platform != "tpu":
            return self.bits < 8 and not (platform == "gpu" and info.in_scan)
        if info.in_scan:
            return False
        return self.bits == 8 or (info.dtype == np.dtype(np.float32)
                                  and len(info.shape) == 2)

    def _rows_stay_local(self, info: ResidualInfo, devices: int) -> bool:
        """Whether codes may group down the rows (`_by_rows`) on `devices`: always on
        one; on several, 8-bit codes that recompute the elementwise chains (a TPU's
        default), where any split of the rows over the devices holds whole groups
        (`fits_rows`), so that each group's statistics stay on its device.

        Along the last axis XLA folds the reshape into groups into the matmul that made
        the residual, which then reads its weight reshaped: with FSDP the weight is
        gathered a second time. Measured compile-only on v5e:2x2 (4-layer MLPs, batch
        4096 x width 1024, f32, jax 0.12.0.1), down the rows against along the last
        axis: FSDP tanh 1.00x plain's peak with plain's gathers against 1.01x with one
        more, GELU 1.00x with 2 more against 3 (`Chain(int8, Offload)`: none against 1,
        1 against 2); data and tensor parallel the same peaks and collectives. fp8:
        FSDP tanh plain's gathers against 1 more, GELU 1 against 2, data-parallel GELU
        1.07x against 1.06x. Packing every residual (`elementwise="pack"`) loses down
        the rows (int8, data-parallel GELU 1.20x against 1.02x, FSDP 1.45x against
        1.20x) and keeps the last axis.
        """
        return devices == 1 or (self._eight_bits and self._recomputes_elementwise(info)
                                and fits_rows(info.shape, self.group_size, devices))

    def pack(self, x: jnp.ndarray, info: ResidualInfo) -> dict[str, jnp.ndarray]:
        if is_complex(info):
            return self.pack(parts(x), parts_info(info))
        merged = self._lane_dense(info)
        if merged is not info:
            return self.pack(x.reshape(merged.shape), merged)
        devices = devices_spanned([x])
        sharded = devices > 1
        rows = self._by_rows(info) and self._rows_stay_local(info, devices)
        layout = layout_of(x.shape, self.group_size, windows=self._windows(sharded),
                           rows=rows, whole_axis=self._byte_scales)
        if sharded and rows:
            # Down the rows on several devices, over windows: reshaping a sharded row
            # axis into groups aborts the TPU partitioner on a tensor-parallel mesh
            # ("ReplicateOnLastTileDim should not be called for HloShardingV3").
            layout = dataclasses.replace(layout, windows=True)
        salt = salt_of(self.seed, info.index) if self.stochastic else None
        if sharded:
            # Each group's range and NaN check are its own: a predicate over the whole
            # residual would be an all-reduce across the devices, in every step.
            groups = layout.group(x.astype(jnp.float32))
            packed = self._codes(groups, *finite_ranges(groups, layout), salt, layout,
                                 super_span=SUPER_SHARDED)
        elif _is_16_bit(x.dtype):
            # The conditional reads the 16-bit float as it is and widens it inside, into
            # fused arithmetic: widened before, XLA would materialize a float32 copy as
            # the conditional's operand (TPU: twice the residual's bytes beside it).
            packed = self._pack_one_device(layout.group(x), salt, layout)
        else:
            packed = self._pack_one_device(layout.group(x.astype(jnp.float32)), salt, layout)
        # Codes keep the residual's layout (`[..., last]`, or `[..., last * bits / 8]`
        # bytes, the last axis padded to whole groups when it must be) and scales
        # its axes with the grouped one divided by the group size: under `jit` with
        # sharded activations they stay sharded like the residual. Merging axes (a
        # flat `(groups, group_size)` or a `ravel`) would make XLA's partitioner
        # replicate a residual sharded along its last axis (tensor parallelism).
        codes = packed.pop("codes").reshape(layout.padded)
        if self.format == "int":
            codes = pack_codes(codes, self.bits, layout.block)
        return {"codes": codes, **{k: layout.stored(v) for k, v in packed.items()}}

    def _lane_dense(self, info: ResidualInfo) -> ResidualInfo:
        """`info` with the shape the codes are made in: on one TPU, with its minor axes
        merged (`stored_shape`) where `group_size` divides its last axis, so that no
        group along the merged axis spans two of its rows. The codes then group as
        the merged shape does (`_by_rows`, `fits_rows`): heads `[batch, seq, 4, 64]`
        of int8 down the merged rows, tokens, where a 64-wide axis could not."""
        shape = stored_shape(info)
        if shape == tuple(info.shape) or info.shape[-1] % self.group_size:
            return info
        return dataclasses.replace(info, shape=shape)

    def _pack_one_device(self, groups, salt, layout):
        """Codes and statistics, with one check of the whole residual for NaN and Inf
        (cheaper than per group, and on one device no other device waits for it)."""
        # Plain max and min read the data directly: no float temporary the size of
        # the residual. An Inf shows in them, a NaN only mostly: XLA's CPU reductions
        # may skip one, depending on where it lies, so the clean branch checks again.
        # In a 16-bit float's own dtype, max and min are exact.
        hi = layout.reduce(groups, -jnp.inf, lax.max).astype(jnp.float32)
        lo = layout.reduce(groups, jnp.inf, lax.min).astype(jnp.float32)
        clean = jnp.all(jnp.isfinite(hi) & jnp.isfinite(lo))
        # The `cond` is the only other reader of `groups`: more readers outside it
        # let XLA schedule several residuals' reductions early and keep their floats
        # alive together (in scanned layers).
        fast = functools.partial(self._pack_clean, salt=salt, layout=layout)
        slow = functools.partial(self._pack_any, salt=salt, layout=layout)
        return cond(clean, fast, slow, groups, lo, hi)

    # XLA allocates the buffers of both branches for the conditional as a whole: a
    # float the size of the residual computed in the NaN-safe branch would count in
    # every call, clean data included. Both branches compute their codes into the
    # conditional's output, and their other values are per-group statistics.

    def _pack_clean(self, groups, lo, hi, salt, layout):
        """No NaN or Inf seen by max and min: every code is a value, unless a sum,
        which no NaN escapes whatever the order of its additions, shows one after all."""
        exact = functools.partial(_finite_range, layout=layout)
        # A finite sum that overflows costs time only.
        check = jnp.isfinite(jnp.sum(groups, dtype=jnp.float32))
        lo, hi, broken = cond(check, as_they_are, exact, groups, lo, hi)
        return self._codes(groups.astype(jnp.float32), lo, hi, broken, salt, layout)

    def _pack_any(self, groups, lo, hi, salt, layout):
        """Some values are NaN or Inf: scales from the finite ones, code 0 for the rest."""
        return self._codes(groups.astype(jnp.float32), *_finite_range(groups, lo, hi, layout),
                           salt, layout)

    @property
    def _square_grid(self) -> bool:
        """Whether some groups may go on the square grid (a static choice)."""
        return self.format == "int" and self.bits < 8 and self.grid == "auto"

    def _codes(self, groups, lo, hi, broken, salt, layout,
               super_span: int = SUPER) -> dict[str, jnp.ndarray]:
        """Codes and per-group scales (and zero points) for groups spanning `[lo, hi]`.

        `lo` and `hi` from the finite values, one per group as `layout.reduce` gives
        them; `broken` marks the groups holding a NaN or Inf; byte scales share a
        step per `super_span` elements.
        """
        if self.format != "int":
            return fp8_codes(groups, lo, hi, layout, FP8[self.format], self.scale_dtype)
        return int_codes(groups, lo, hi, broken, layout, bits=self.bits,
                         scale_dtype=self.scale_dtype, square_grid=self._square_grid,
                         salt=salt, super_span=super_span)

    def unpack(self, packed: dict[str, jnp.ndarray], info: ResidualInfo) -> jnp.ndarray:
        if is_complex(info):
            return from_parts(self.unpack(packed, parts_info(info)), info)
        merged = self._lane_dense(info)
        if merged is not info:
            return self.unpack(packed, merged).reshape(info.shape)
        sharded = several_devices([packed["codes"]])
        layout = layout_of(info.shape, self.group_size, windows=self._windows(sharded),
                           whole_axis=self._byte_scales)
        by_rows = layout_of(info.shape, self.group_size, rows=True)
        if sharded:
            by_rows = dataclasses.replace(by_rows, windows=True)  # as `pack` grouped them
        if (self._by_rows(info) and fits_rows(info.shape, self.group_size)
                and packed["scale"].shape == by_rows.stored_shape):
            # `pack` grouped down the rows (it alone knew whether the residual was
            # sharded); statistics along the last axis never take this shape.
            layout = by_rows
        if "super_scale" in packed:
            scale = layout.unstored(byte_scale_values(
                packed["scale"], packed["super_scale"], layout.axis))
        else:
            scale = layout.unstored(packed["scale"].astype(jnp.float32))
        if self.format != "int":
            values = layout.regroup(packed["codes"].astype(jnp.float32)) * layout.spread(scale)
            return layout.ungroup(values).astype(info.dtype)
        size = math.prod(layout.padded)
        codes = layout.regroup(unpack_codes(packed["codes"], self.bits, size, layout.block))
        values = int_values(codes, layout.unstored(packed["zero"]), scale, layout, self.bits,
                            self._square_grid)
        return layout.ungroup(values).astype(info.dtype)


def _is_token_stream(info: ResidualInfo) -> bool:
    """Whether the residual is a sequence model's `[batch, sequence, width]` activation
    outside a scan body."""
    return len(info.shape) == 3 and not info.in_scan


def _is_16_bit(dtype: Any) -> bool:
    """Whether a float residual is a 16-bit one: bfloat16 or float16."""
    return jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize == 2


def _is_row_statistic(shape: tuple[int, ...]) -> bool:
    """A trailing axis of size 1: what a reduction with `keepdims=True` leaves.

    Softmax row sums (`[batch, heads, queries, 1]`, from `jax.nn.softmax` and
    `jax.nn.dot_product_attention`) and normalization statistics (`[batch, tokens,
    1]`) each scale a whole row in the backward, and across rows they can span
    orders of magnitude (the causal row sums run from 1 to the sequence length). So
    `Quantize` stores them as they are: they take `1 / row length` of the memory of
    the rows they summarize.
    """
    return len(shape) >= 1 and shape[-1] == 1


def _finite_range(groups, lo, hi, layout):
    """`finite_range` of the groups in their own dtype (max and min are exact in it), the
    ranges as float32."""
    lo, hi, broken = finite_range(groups, lo, hi, layout)
    return lo.astype(jnp.float32), hi.astype(jnp.float32), broken
