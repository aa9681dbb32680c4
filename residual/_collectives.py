"""`collectives`: how many of each cross-device collective a compiled program holds."""

from __future__ import annotations

import re
from collections import Counter

import jax

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# The instruction's opcode: its name then its operands (`all-gather(%x)`), which no
# shape, name or attribute of another instruction spells.
_INSTRUCTION = re.compile(r"(?<![\w.-])(" + "|".join(KINDS) + r")(?:-start)?\(%(.*)$",
                          re.MULTILINE)
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_CHAIN = re.compile(r'\bchain_id="([^"]*)"')


def collectives(program: jax.stages.Compiled | str) -> Counter[str]:
    """The collectives of a compiled program, by kind: `{"all-gather": 12, ...}`.

    Each collective the program issues counts once, as its compiler wrote it (one in a
    loop's body counts once, however many times the loop runs). XLA:TPU runs a
    collective that overlaps compute as a chain: a start, continuation fusions that
    each repeat the collective's instruction, and a done; such a chain is one
    collective, whatever number of pieces the scheduler cut it into. Compare a hooked
    program's count with plain `jax.grad`'s to see what a policy adds to a sharded step.

    Args:
        program: `jax.jit(f).lower(*args).compile()`, or the text of its optimized HLO
            (`compiled.as_text()`).

    Raises:
        TypeError: `program` is neither.
    """
    if isinstance(program, jax.stages.Compiled):
        text = program.as_text()
    elif isinstance(program, str):
        text = program
    else:
        raise TypeError(
            "`collectives` expects a compiled program, `jax.jit(f).lower(*args).compile()`, "
            f"or its HLO text (`compiled.as_text()`), but got {type(program).__name__}.")
    counts: Counter[str] = Counter()
    chains: set[tuple[str, str, str]] = set()
    for match in _INSTRUCTION.finditer(text):
        kind, rest = match.groups()
        chain, channel = _CHAIN.search(rest), _CHANNEL.search(rest)
        if chain is not None:
            # A piece of an asynchronous chain: the chain counts once.
            key = (kind, channel.group(1) if channel else "", chain.group(1))
            if key in chains:
                continue
            chains.add(key)
        counts[kind] += 1
    return counts
