"""The compiled program's buffers: what XLA placed where, and when each is live.

Read from the text XLA writes for a compiled module (`xla_dump_to`): the optimized
module with its metadata, the buffer assignment (every value's allocation, offset
and size as the target lays it out) and the live ranges (every value's first and
last position in the program's order). `_jax_private.compile_with_dumps` produces
the texts; this module turns them into `Buffer`s and live bytes over time.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import numpy as np

# Memory spaces (XLA's colors): 0 is the device's main memory (HBM, or the CPU's
# RAM). TPUs also use on-chip memory (1) and a semaphore space (2), and put
# offloaded (`pinned_host`) buffers in 5.
DEVICE = 0
ON_CHIP = 1
HOST = 5

_VALUE = re.compile(
    r"^ value: <\d+ ([^ >{]+)(\{[\d,]*\})?(?: \(\w+\))? @\d+> \(size=(\d+),offset=(\d+)\): (.*)$")
_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+), (?:color (\d+), )?(.*)$")
_RANGE = re.compile(r"^\s+([^\s{]+)(\{[\d,]*\}):(\d+)-(\d+)$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+(?: \S+)*?) ([\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_SOURCE = re.compile(r'source_file="([^"]*)" source_line=(\d+)')
_ARRAY = re.compile(r"^([a-z]+\d*)\[([\d,]*)\]")
_ITEM_BITS = {"pred": 8, "s4": 4, "u4": 4, "s2": 2, "u2": 2, "f4e2m1fn": 4}


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One value of the compiled program, where XLA placed it and when it is live.

    Attributes:
        name: the HLO instruction that defines it (with `{i}` for a tuple's element).
        shape: its HLO shape, `"f32[512,256]"` (layout dropped).
        bytes: bytes as the target lays it out (tiles and padding included).
        unpadded: bytes of its elements alone.
        start, end: its first and last positions in the program's order (inclusive).
        allocation: the allocation it lives in, and `offset` its place there.
        space: the memory space (`DEVICE`, `HOST`, or a TPU's on-chip spaces).
        role: `"argument"`, `"output"`, `"constant"` or `"temporary"`, as allocated.
        op_name: JAX's name of the operation that made it (`jit(f)/jvp()/tanh`).
        stack: the `file:line`s of the Python stack that made it, innermost first (empty
            when the metadata does not say).
    """

    name: str
    shape: str
    bytes: int
    unpadded: int
    start: int
    end: int
    allocation: int
    offset: int
    space: int
    role: str
    op_name: str = ""
    stack: tuple[str, ...] = ()

    def live_at(self, position: int) -> bool:
        return self.start <= position <= self.end

    @property
    def dtype(self) -> str:
        return self.shape.split("[", 1)[0]


@dataclasses.dataclass(frozen=True)
class Program:
    """The buffers of one compiled program and its instructions' order."""

    buffers: tuple[Buffer, ...]
    order: tuple[str, ...]
    op_names: dict[str, str]

    def slots(self, space: int | None = DEVICE,
              roles: Iterable[str] | None = None) -> dict[tuple[int, int], list[Buffer]]:
        """The buffers of `space` (any, when `None`) whose role is one of `roles` (any,
        when `None`), by the place XLA put them: `(allocation, offset)`. Values at one
        place share its memory (a loop's carry, an in-place update)."""
        slots: dict[tuple[int, int], list[Buffer]] = {}
        for b in self.buffers:
            if (space is None or b.space == space) and (roles is None or b.role in roles):
                slots.setdefault((b.allocation, b.offset), []).append(b)
        return slots

    def live_bytes(self, space: int = DEVICE, roles: Iterable[str] | None = None) -> np.ndarray:
        """Bytes of `space` live at each position of the program's order (of buffers
        whose role is one of `roles`, when given).

        Values XLA placed at the same allocation and offset (a loop's carry, an
        in-place update) share memory: counted once, at the largest of their sizes.
        """
        length = len(self.order) + 1
        live = np.zeros(length, dtype=np.int64)
        for group in self.slots(space, roles).values():
            sizes = np.zeros(length, dtype=np.int64)
            for b in group:
                sizes[b.start:b.end + 1] = np.maximum(sizes[b.start:b.end + 1], b.bytes)
            live += sizes
        return live

    def live_at(self, position: int, space: int = DEVICE) -> list[Buffer]:
        """The buffers of `space` live at `position`, one per shared slot (the largest).

        Values that follow one another in a slot without a gap (a loop's carry, an
        in-place update) are one buffer in memory: the one returned spans them all.
        """
        found = []
        for group in self.slots(space).values():
            live = [b for b in group if b.live_at(position)]
            if not live:
                continue
            start, end = min(b.start for b in live), max(b.end for b in live)
            for b in sorted(group, key=lambda b: b.start):  # widen over adjacent values
                if b.start <= end + 1 and b.end >= start - 1:
                    start, end = min(start, b.start), max(end, b.end)
            largest = max(live, key=lambda b: b.bytes)
            found.append(dataclasses.replace(largest, start=start, end=end))
        return sorted(found, key=lambda b: -b.bytes)


def parse(module: str, assignment: str, live_ranges: str) -> Program:
    """A `Program` from XLA's texts for one compiled module."""
    metadata = _instructions(module)
    frames = _frames(module)
    order = _order(live_ranges)
    ranges = _ranges(live_ranges)
    buffers = []
    for value in _values(assignment):
        key = value["name"] + value["index"]
        if key not in ranges:
            continue  # assigned but never live in the entry's order (dead code)
        start, end = ranges[key]
        op_name, source = metadata.get(value["name"], ("", None))
        stack: tuple[str, ...] = ()
        if source is not None and source.startswith("#"):
            stack = frames.get(int(source[1:]), ())
        elif source is not None:
            stack = (source,)
        buffers.append(Buffer(
            name=key.removesuffix("{}"), shape=value["shape"], bytes=value["size"],
            unpadded=_unpadded_bytes(value["shape"]), start=start, end=end,
            allocation=value["allocation"], offset=value["offset"], space=value["space"],
            role=value["role"], op_name=op_name, stack=stack,
        ))
    return Program(tuple(buffers), order, {k: v[0] for k, v in metadata.items()})


def _values(assignment: str) -> Iterable[dict]:
    allocation = role = None
    space = DEVICE
    for line in assignment.splitlines():
        if m := _ALLOCATION.match(line):
            allocation, space = int(m.group(1)), int(m.group(3) or 0)
            rest = m.group(4)
            role = ("argument" if "parameter" in rest else
                    "output" if "output" in rest else
                    "constant" if "constant" in rest else "temporary")
        elif (m := _VALUE.match(line)) and allocation is not None:
            shape = m.group(5).strip()
            yield {"name": m.group(1), "index": m.group(2) or "{}", "size": int(m.group(3)),
                   "offset": int(m.group(4)), "shape": shape, "allocation": allocation,
                   "space": _space_of(shape, space), "role": role}
        elif line.startswith("Total bytes used") or line.startswith("Used values"):
            break


def _space_of(shape: str, color: int) -> int:
    """The memory space of a value: its layout's `S(n)` when it has one, else its color."""
    m = re.search(r"S\((\d+)\)\}", shape)
    return int(m.group(1)) if m and not shape.startswith("(") else color


def _order(live_ranges: str) -> tuple[str, ...]:
    names = []
    inside = False
    for line in live_ranges.splitlines():
        if line.strip() == "InstructionSequence:":
            inside = True
        elif inside and (m := re.match(r"^\s+(\d+):(\S+)$", line)):
            names.append(m.group(2))
        elif inside:
            break
    return tuple(names)


def _ranges(live_ranges: str) -> dict[str, tuple[int, int]]:
    ranges = {}
    inside = False
    for line in live_ranges.splitlines():
        if line.strip() == "BufferLiveRange:":
            inside = True
        elif inside and (m := _RANGE.match(line)):
            ranges[m.group(1) + m.group(2)] = (int(m.group(3)), int(m.group(4)))
        elif inside:
            break
    return ranges


def _instructions(module: str) -> dict[str, tuple[str, str | None]]:
    """Each instruction's JAX op name and source (`"#<frame id>"` to resolve later)."""
    found: dict[str, tuple[str, str | None]] = {}
    for line in module.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        op = _OP_NAME.search(line)
        source = None
        if s := _SOURCE.search(line):
            source = f"{s.group(1)}:{s.group(2)}"
        elif f := _FRAME_ID.search(line):
            source = f"#{f.group(1)}"
        found[m.group(1)] = (op.group(1) if op else "", source)
    return found


def _frames(module: str) -> dict[int, tuple[str, ...]]:
    """Stack frame id -> the `file:line`s of its call stack, innermost first."""
    tables = _stack_tables(module)
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    locations = {}
    for k, v in tables.get("FileLocations", {}).items():
        file_id = re.search(r"file_name_id=(\d+)", v)
        line = re.search(r"\bline=(\d+)", v)
        if file_id and line:
            locations[k] = f"{files.get(int(file_id.group(1)), '?')}:{line.group(1)}"
    # A frame's parent is written one past its id; 0 (written 1) is none.
    links = {}
    for k, v in tables.get("StackFrames", {}).items():
        location = re.search(r"file_location_id=(\d+)", v)
        parent = re.search(r"parent_frame_id=(\d+)", v)
        links[k] = (int(location.group(1)) if location else 0,
                    int(parent.group(1)) - 1 if parent else 0)
    return {k: _stack(k, links, locations) for k in links}


def _stack_tables(module: str) -> dict[str, dict[int, str]]:
    """The module's stack tables (`FileNames`, `FileLocations`, `StackFrames`, ...):
    id -> the rest of its line, read from the text before the first computation."""
    tables: dict[str, dict[int, str]] = {}
    section = None
    for line in module.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            tables[section] = {}
        elif section and (m := re.match(r"^(\d+) (.*)$", line)):
            tables[section][int(m.group(1))] = m.group(2)
        elif section and not line.strip():
            section = None
        elif line.startswith("%") or line.startswith("ENTRY"):
            break
    return tables


def _stack(frame: int, links: dict[int, tuple[int, int]], locations: dict[int, str]
           ) -> tuple[str, ...]:
    """The `file:line`s from `frame` out to its outermost caller (64 at most)."""
    stack = []
    while frame in links and len(stack) < 64:
        location, parent = links[frame]
        if location in locations:
            stack.append(locations[location])
        frame = parent if parent != frame else 0
    return tuple(stack)


def _unpadded_bytes(shape: str) -> int:
    """Bytes of an HLO array's elements (0 for tuples and tokens)."""
    m = _ARRAY.match(shape)
    if not m:
        return 0
    dtype, dims = m.groups()
    count = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    digits = re.search(r"\d+", dtype)
    bits = _ITEM_BITS.get(dtype) or (int(digits.group()) if digits else 8)
    return (count * bits + 7) // 8
