"""The `Quantize` policy, one concern a module:

    policy.py    Quantize itself: which residuals, and pack/unpack as the engine calls them
    checks.py    its arguments, checked as it is built
    layout.py    how a residual of any shape is cut into groups along one axis
    ranges.py    each group's range, NaN and Inf set apart
    grid.py      the values codes stand for: zero points, the square grid, fp8 scales
    packing.py   4- and 2-bit codes packed into bytes
    noise.py     stochastic rounding's random bytes

To add a code format: `checks.FORMATS`, a `grid` function for its codes and values, and
the branches of `Quantize._codes` and `Quantize.unpack`.
"""

from .policy import Quantize as Quantize
