"""What a compiled program communicates: the collectives of its decode loop, read from the HLO
text of a compiled XLA program (`jitted.lower(...).compile().as_text()`).

`loop_collectives(text)` counts each collective kind (all-gather, all-reduce, reduce-scatter,
all-to-all, collective-permute) in the condition and body of the program's outermost `while`
loops (one decode step each) and
every computation they call (nested loops such as the layer scan count once: the count is per
loop body, not per executed instance). `collective_shapes` lists the result shapes, so a test
can refuse a gather of a whole weight matrix or KV cache.
"""
from __future__ import annotations

import re
from collections import Counter

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_CALLED = re.compile(
    r"\b(?:body|condition|calls|to_apply|branch_computations|true_computation|false_computation)"
    r"=\{?(%?[\w.\-]+(?:, ?%[\w.\-]+)*)\}?"
)
_WHILE = re.compile(r"\bwhile\(")
#: `%name = f32[2,8]{1,0} all-gather(...)` (or `(f32[..], ..) all-reduce-start(...)`)
_INSTRUCTION = re.compile(r"=\s*(\S+)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_SHAPE = re.compile(r"[a-z]+\d*\[([\d,]*)\]")


def computations(text: str) -> dict[str, list[str]]:
    """{computation name: its instruction lines} of an HLO module's text; the entry computation
    is also under "ENTRY"."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head and not line.startswith(" "):
            current = head.group(1)
            out[current] = []
            if line.startswith("ENTRY"):
                out["ENTRY"] = out[current]
        elif line.strip() == "}":
            current = None
        elif current is not None:
            out[current].append(line)
    return out


def called(lines: list[str]) -> set[str]:
    """Names of the computations these instructions call (loop bodies, fusions, reducers...)."""
    names = set()
    for line in lines:
        for group in _CALLED.findall(line):
            names.update(name.strip().lstrip("%") for name in group.split(","))
    return names


def reachable(comps: dict[str, list[str]], roots: set[str]) -> set[str]:
    """The computations `roots` call, transitively, roots included."""
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        todo.extend(called(comps[name]))
    return seen


def loop_computations(text: str) -> set[str]:
    """The condition and body of each `while` loop of the entry computation (the decode loop)."""
    comps = computations(text)
    return called([line for line in comps.get("ENTRY", []) if _WHILE.search(line)])


def collective_shapes(text: str, inside_loop: bool = True) -> list[tuple[str, tuple[int, ...]]]:
    """(kind, result shape) of every collective inside the entry's while loops (or anywhere)."""
    comps = computations(text)
    names = reachable(comps, loop_computations(text)) if inside_loop else set(comps) - {"ENTRY"}
    out = []
    for name in sorted(names):
        for line in comps[name]:
            m = _INSTRUCTION.search(line)
            if m:
                shape = _SHAPE.search(m.group(1))
                dims = tuple(int(d) for d in shape.group(1).split(",") if d) if shape else ()
                out.append((m.group(2), dims))
    return out


def loop_collectives(text: str) -> dict[str, int]:
    """{collective kind: count} in the decode loop's body (every kind listed, 0 included)."""
    counts = Counter(kind for kind, _ in collective_shapes(text))
    return {kind: counts[kind] for kind in COLLECTIVES}


def dims_key(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape's dimensions without the 1s, sorted: equal for transposes and reshapes that only
    add or drop unit axes."""
    return tuple(sorted(d for d in shape if d != 1))


def whole_gathers(text: str, whole_shapes: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Result shapes of the loop's all-gathers that are one of `whole_shapes` (a whole split
    weight matrix, KV cache layer or stack; up to transposes and unit axes): gathers a sharded
    program must never do."""
    whole = {dims_key(shape) for shape in whole_shapes}
    return [shape for kind, shape in collective_shapes(text)
            if kind == "all-gather" and dims_key(shape) in whole]
