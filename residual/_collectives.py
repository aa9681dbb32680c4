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


def collectives(program: jax.stages.Compiled | str, per_step: bool = False) -> Counter[str]:
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

    With `per_step`, each collective counts as often as one run of the program issues
    it: a loop's as many times as the loop runs (its trip count, as XLA knows it or
    as its condition and initial counter give it; once where neither does), a peeled
    iteration's copy once more, whatever its channel, and each branch of a conditional
    as if it ran. Two programs that issue the same collectives per step count alike
    however XLA peeled or cut their loops.

    Args:
        program: `jax.jit(f).lower(*args).compile()`, or the text of its optimized HLO
            (`compiled.as_text()`).
        per_step: count what one run issues instead of what the program holds.

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
    if per_step:
        return _per_step(text)
    counts: Counter[str] = Counter()
    seen: set[tuple[str, str, str]] = set()
    for match in _INSTRUCTION.finditer(text):
        kind, rest = match.groups()
        key = _key(kind, rest)
        if key is not None:
            if key in seen:
                continue
            seen.add(key)
        counts[kind] += 1
    return counts


def _key(kind: str, rest: str) -> tuple[str, str, str] | None:
    """The collective an instruction is a piece or copy of, or None if it names none.

    The partitioner gives each collective a channel of its own; its pieces and copies
    keep it (a chain without a channel is one collective too)."""
    chain, channel = _CHAIN.search(rest), _CHANNEL.search(rest)
    if channel is None and chain is None:
        return None
    return (kind, channel.group(1) if channel else "", "" if channel else chain.group(1))


_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_NAME = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_LOOP = re.compile(r"\bwhile\(%([\w.\-]+)\), condition=%([\w.\-]+), body=%([\w.\-]+)")
_CALLED = re.compile(r"\b(?:calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_CALLED_SETS = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_COUNTER_TEST = re.compile(r"compare\(%([\w.\-]+), %([\w.\-]+)\), direction=(LT|LE)")


def _per_step(text: str) -> Counter[str]:
    """`collectives(text, per_step=True)`."""
    bodies, entry = _computations(text)
    # Each computation's runs per step, and the computation that controls them: itself
    # where a loop or a branch runs it (and for ENTRY), else the one that inlines it
    # (a fusion, an asynchronous piece), where a chain's pieces run together.
    runs: dict[str, int] = {}
    control: dict[str, str] = {}

    def visit(name: str, times: int, owner: str) -> None:
        runs[name] = runs.get(name, 0) + times
        control.setdefault(name, owner)
        for line in bodies.get(name, ()):
            loop = _LOOP.search(line)
            if loop:
                init, condition, body = loop.groups()
                visit(body, times * _trips(line, init, bodies, name, condition), body)
                continue
            for called in _CALLED.findall(line):
                visit(called, times, called if "conditional(" in line else owner)
            for group in _CALLED_SETS.findall(line):
                for called in re.findall(r"%([\w.\-]+)", group):
                    visit(called, times, called)

    if entry is not None:
        visit(entry, 1, entry)
    counts: Counter[str] = Counter()
    seen: set[tuple] = set()
    for name, lines in bodies.items():
        for line in lines:
            match = _INSTRUCTION.search(line)
            if match is None or name not in runs:
                continue
            kind, rest = match.groups()
            key = _key(kind, rest)
            if key is not None:
                key = (*key, control[name])
                if key in seen:
                    continue
                seen.add(key)
            counts[kind] += runs[control[name]]
    return counts


def _computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    """Each computation's instruction lines, by name, and the name of ENTRY."""
    bodies: dict[str, list[str]] = {}
    entry = None
    current: list[str] | None = None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = bodies.setdefault(header.group(1), [])
            if line.startswith("ENTRY "):
                entry = header.group(1)
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return bodies, entry


def _trips(line: str, init: str, bodies: dict[str, list[str]], caller: str,
           condition: str) -> int:
    """How many times the loop of `while` instruction `line` runs: XLA's known trip
    count, or its condition's bound on a counter less the counter's initial constant;
    1 where neither is written."""
    known = _KNOWN_TRIPS.search(line)
    if known:
        return int(known.group(1))
    definitions = _definitions(bodies.get(condition, ()))
    for test in _COUNTER_TEST.finditer("\n".join(bodies.get(condition, ()))):
        left, right, direction = test.groups()
        index, bound = _tuple_index(definitions.get(left)), _constant(definitions, right)
        if index is None or bound is None:
            continue
        start = _tuple_operand_constant(_definitions(bodies.get(caller, ())), init, index)
        if start is not None:
            return max(bound - start + (direction == "LE"), 0)
    return 1


def _definitions(lines) -> dict[str, str]:
    """Each instruction's line, by the name it defines."""
    return {m.group(1): line for line in lines if (m := _NAME.match(line))}


def _tuple_index(line: str | None) -> int | None:
    match = line and re.search(r"get-tuple-element\(%[\w.\-]+\), index=(\d+)", line)
    return int(match.group(1)) if match else None


def _constant(definitions: dict[str, str], name: str) -> int | None:
    """The integer constant `name` is, through copies."""
    for _ in range(8):
        line = definitions.get(name, "")
        constant = re.search(r"\bconstant\((-?\d+)\)", line)
        if constant:
            return int(constant.group(1))
        copy = re.search(r"\bcopy\(%([\w.\-]+)\)", line)
        if copy is None:
            return None
        name = copy.group(1)
    return None


def _tuple_operand_constant(definitions: dict[str, str], name: str, index: int) -> int | None:
    """The integer constant at `index` of the tuple instruction `name`."""
    operands = re.search(r"\btuple\(([^)]*)\)", definitions.get(name, ""))
    if operands is None:
        return None
    names = re.findall(r"%([\w.\-]+)", operands.group(1))
    return _constant(definitions, names[index]) if index < len(names) else None
