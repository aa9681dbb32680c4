"""How reports write byte sizes and arrays, each in one way."""

from __future__ import annotations

from collections.abc import Sequence


def sizes(a: float, b: float) -> tuple[str, str]:
    """`a` and `b` bytes in the unit that suits the larger, so the two compare at a glance."""
    unit, scale = "B", 1
    for name, size_of_unit in (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30)):
        if max(a, b) >= size_of_unit:
            unit, scale = name, size_of_unit
    if unit == "B":
        return f"{a:.0f} B", f"{b:.0f} B"
    return tuple(f"{n / scale:.1f} {unit}" if n else "0" for n in (a, b))


def size(n: float) -> str:
    """`n` bytes as a table shows them: `1.5 MiB`."""
    return sizes(n, n)[0]


def precise_size(n: float) -> str:
    """`n` bytes to a hundredth of a MiB, for budgets and the figures compared with them."""
    if n >= 2**20:
        return f"{n / 2**20:.2f} MiB"
    if n >= 2**10:
        return f"{n / 2**10:.1f} KiB"
    return f"{n:.0f} B"


def array_label(dtype: str, shape: Sequence[int]) -> str:
    """`f32[256,128]`, `u8[64]`, as `jax.ad_checkpoint.print_saved_residuals` writes them."""
    short = (dtype.replace("bfloat", "bf").replace("float", "f").replace("uint", "u")
             .replace("complex", "c").replace("int", "i"))
    return f"{short}[{','.join(map(str, shape))}]"
