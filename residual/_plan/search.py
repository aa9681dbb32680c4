"""The choice of an action per group of least predicted time (or bytes) under caps on
stored bytes and gradient error: a small mixed-integer program (scipy's `milp`)."""

from __future__ import annotations

import numpy as np

from .costs import Group


def cheapest_choice(groups: list[Group], byte_cap: float, error_cap: float,
                    minimize: str = "seconds") -> dict[tuple, str] | None:
    """The choice of least predicted time (or bytes) within the byte and error caps."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    columns = [(i, a, o) for i, g in enumerate(groups) for a, o in g.options.items()]
    if not columns:
        return {}
    n = len(columns)
    stored = np.array([o.stored for _, _, o in columns], float)
    seconds = np.array([o.seconds for _, _, o in columns], float)
    squared = np.array([o.error ** 2 for _, _, o in columns], float)
    # Ties go to keeping: a change that buys nothing is not made.
    changed = np.array([a != "keep" for _, a, _ in columns], float)
    if minimize == "seconds":
        objective = seconds + 1e-9 * changed
    else:
        objective = stored / max(stored.max(), 1) + 1e-6 * seconds / max(seconds.max(),
                                                                            1e-12)
    one = np.zeros((len(groups), n))
    for j, (i, _, _) in enumerate(columns):
        one[i, j] = 1
    constraints = [LinearConstraint(one, 1, 1),
                   LinearConstraint(stored[None], -np.inf, byte_cap),
                   LinearConstraint(squared[None], -np.inf,
                                    error_cap**2 + 1e-18)]
    result = milp(objective, constraints=constraints, integrality=np.ones(n),
                  bounds=Bounds(0, 1))
    if result.x is None:
        return None
    return {groups[i].key: a for (i, a, _), x in zip(columns, result.x) if x > 0.5}
