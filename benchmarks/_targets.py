"""The pass/fail lines a benchmark prints for its targets."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def report(results: dict, targets: Sequence[tuple[Callable[[dict], bool],
                                                  str | Callable[[dict], str]]]) -> int:
    """Prints PASS or FAIL for each `(check, description)` target; returns the misses.
    A description may be a function of the results, to name what missed."""
    failed = 0
    for check, description in targets:
        ok = check(results)
        failed += not ok
        text = description(results) if callable(description) else description
        print(f"  {'PASS' if ok else 'FAIL'}: {text}")
    return failed
