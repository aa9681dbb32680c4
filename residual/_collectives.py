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
    loop's body counts once, however many times the loop runs). XLA may write one
    collective several times, under one channel: XLA:TPU runs a collective that
    overlaps compute as a chain (a start, continuation fusions that each repeat the
    collective's instruction, a done), and a loop whose first or last iteration it peels
    off repeats its body's collectives beside it for that iteration. Each channel counts
    once, whatever number of pieces or copies it was cut into; a copy XLA gives a
    channel of its own counts apart (on an FSDP scan under `Offload`, the peeled
    iteration's gather of the weights does). Compare a hooked program's count with plain
    `jax.grad`'s to see what a policy adds to a sharded step.

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
    seen: set[tuple[str, str, str]] = set()
    for match in _INSTRUCTION.finditer(text):
        kind, rest = match.groups()
        chain, channel = _CHAIN.search(rest), _CHANNEL.search(rest)
        if channel is not None or chain is not None:
            # The partitioner gives each collective a channel of its own; its pieces and
            # copies keep it (a chain without a channel is one collective too).
            key = (kind, channel.group(1) if channel else "", "" if channel else chain.group(1))
            if key in seen:
                continue
            seen.add(key)
        counts[kind] += 1
    return counts
