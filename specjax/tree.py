"""Static draft-tree topologies: which draft nodes a speculative step proposes and verifies.

A `TreeSpec` is a frozen, hashable dataclass, so it can be a `jit` static argument. It holds
only the topology; every array derived from it is a read-only numpy constant.

Indexing conventions used throughout specjax:

- *node index* `i` in `0..N-1`: the i-th draft node. Nodes are topologically ordered
  (`parents[i] < i`, `-1` = child of the root) and siblings appear in sibling order.
- *verify index* `v` in `0..N`: position in the target's verify pass; `v = 0` is the root (the
  last emitted token) and node `i` is `v = i + 1`.
- *depth*: root 0, children of the root 1, ... (a node's position is `length + depth`).
- *rank*: a node's choice index among its siblings, i.e. "the drafter's rank-th candidate"
  (top-k rank for deterministic drafters, draw order for sampling drafters). Ranks increase
  along sibling order; they equal the sibling position unless a path list skips ranks.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from collections.abc import Sequence
from importlib import resources

import numpy as np
import yaml

from specjax.yamlfile import field_problem, read_yaml_mapping

PRESET_PACKAGE = "specjax.configs"
PRESET_DIR = "trees"
# The most draft nodes (chain length or tree size) a step may verify: one verify pass scores
# 1 + nodes tokens per row, and every node costs a cache slot of margin per row.
MAX_DRAFT_NODES = 64


def _frozen(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """A draft tree: `parents[i]` is node i's parent node index (-1 = the root).

    ranks: each node's candidate rank among its siblings (None = sibling position).
    name: a label for logs; not part of equality or the hash.
    """

    parents: tuple[int, ...]
    ranks: tuple[int, ...] | None = None
    name: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        parents = tuple(int(p) for p in self.parents)
        if not parents:
            raise ValueError("a TreeSpec needs at least one node")
        if len(parents) > MAX_DRAFT_NODES:
            raise ValueError(
                f"a draft tree of {len(parents)} nodes exceeds the cap of {MAX_DRAFT_NODES} "
                f"(one verify pass scores 1 + nodes tokens per row)"
            )
        for i, p in enumerate(parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i}: parent {p} must be in [-1, {i}) (topological order)")
        object.__setattr__(self, "parents", parents)
        sibling_pos = _sibling_positions(parents)
        ranks = sibling_pos if self.ranks is None else tuple(int(r) for r in self.ranks)
        if len(ranks) != len(parents):
            raise ValueError(f"ranks has {len(ranks)} entries for {len(parents)} nodes")
        for i, (p, r) in enumerate(zip(parents, ranks)):
            prev = [ranks[j] for j in range(i) if parents[j] == p]
            if r < 0 or (prev and r <= prev[-1]):
                raise ValueError(f"node {i}: rank {r} must be >= 0 and exceed earlier siblings' {prev}")
        object.__setattr__(self, "ranks", ranks)

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """N, the number of draft nodes (verify rows are 1 + N)."""
        return len(self.parents)

    @functools.cached_property
    def depth(self) -> tuple[int, ...]:
        """`[N]` 1-based depth of each node."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return tuple(out)

    @property
    def max_depth(self) -> int:
        """Dmax: the longest root-to-leaf path in nodes (AcceptResult.path has Dmax + 1 entries)."""
        return max(self.depth)

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, self.num_nodes - 1))

    # ---- structure ---------------------------------------------------------------------------

    @functools.cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """`[1 + N]` (verify layout): children node indices of the root, then of each node,
        in sibling order."""
        out: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for i, p in enumerate(self.parents):
            out[p + 1].append(i)
        return tuple(tuple(c) for c in out)

    @property
    def max_children(self) -> int:
        return max(len(c) for c in self.children)

    @functools.cached_property
    def levels(self) -> tuple[tuple[int, ...], ...]:
        """`[Dmax]`: node indices at depth 1, 2, ..., in node order."""
        return tuple(
            tuple(i for i, d in enumerate(self.depth) if d == level)
            for level in range(1, self.max_depth + 1)
        )

    @functools.cached_property
    def ancestors(self) -> tuple[tuple[int, ...], ...]:
        """`[N]`: node indices from depth 1 down to node i (inclusive)."""
        out: list[tuple[int, ...]] = []
        for i, p in enumerate(self.parents):
            out.append((() if p < 0 else out[p]) + (i,))
        return tuple(out)

    @functools.cached_property
    def leaves(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_nodes) if not self.children[i + 1])

    @functools.cached_property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Root-to-leaf paths as node indices, one per leaf, in leaf order."""
        return tuple(self.ancestors[leaf] for leaf in self.leaves)

    def to_paths(self) -> list[list[int]]:
        """The tree as EAGLE/Medusa "choices": one rank path per node (inverse of from_paths)."""
        return [[self.ranks[j] for j in self.ancestors[i]] for i in range(self.num_nodes)]

    # ---- numpy constants ---------------------------------------------------------------------

    @functools.cached_property
    def node_depth(self) -> np.ndarray:
        """`[N]` int32 depth of each node (1-based)."""
        return _frozen(np.asarray(self.depth, np.int32))

    @functools.cached_property
    def verify_depth(self) -> np.ndarray:
        """`[1 + N]` int32 depth per verify row (root 0): positions are `length + verify_depth`."""
        return _frozen(np.asarray((0,) + self.depth, np.int32))

    @functools.cached_property
    def verify_parents(self) -> np.ndarray:
        """`[N]` int32 verify index of each node's parent (0 = root)."""
        return _frozen(np.asarray(self.parents, np.int32) + 1)

    @functools.cached_property
    def node_ancestor_mask(self) -> np.ndarray:
        """`[N, N]` bool: `[i, j]` is True when node j is node i or one of its ancestors."""
        mask = np.zeros((self.num_nodes, self.num_nodes), bool)
        for i, anc in enumerate(self.ancestors):
            mask[i, list(anc)] = True
        return _frozen(mask)

    def ancestor_mask(self) -> np.ndarray:
        """`[1 + N, 1 + N]` bool, verify layout: row v attends to column u when u is v itself or
        one of its ancestors (the root is everyone's ancestor)."""
        mask = np.zeros((self.num_nodes + 1, self.num_nodes + 1), bool)
        mask[:, 0] = True
        mask[1:, 1:] = self.node_ancestor_mask
        return _frozen(mask)

    @functools.cached_property
    def path_table(self) -> np.ndarray:
        """`[num_leaves, Dmax]` int32 node indices of each root-to-leaf path, -1 padded."""
        table = np.full((len(self.leaves), self.max_depth), -1, np.int32)
        for row, path in enumerate(self.paths):
            table[row, : len(path)] = path
        return _frozen(table)

    @functools.cached_property
    def verify_path_table(self) -> np.ndarray:
        """`[1 + N, Dmax + 1]` int32: row v = verify indices from the root to v, padded by
        repeating v (row 0 is all zeros). `AcceptResult.path = verify_path_table[last]`."""
        table = np.zeros((self.num_nodes + 1, self.max_depth + 1), np.int32)
        for i, anc in enumerate(self.ancestors):
            row = [0] + [j + 1 for j in anc]
            table[i + 1] = row + [i + 1] * (self.max_depth + 1 - len(row))
        return _frozen(table)

    @functools.cached_property
    def children_table(self) -> np.ndarray:
        """`[1 + N, max_children]` int32 (verify-layout rows): node index of the k-th child of
        each verify row, -1 padded."""
        table = np.full((self.num_nodes + 1, self.max_children), -1, np.int32)
        for v, kids in enumerate(self.children):
            table[v, : len(kids)] = kids
        return _frozen(table)

    @functools.cached_property
    def node_ranks(self) -> np.ndarray:
        """`[N]` int32 candidate rank of each node among its siblings."""
        return _frozen(np.asarray(self.ranks, np.int32))

    def __repr__(self) -> str:
        label = f"{self.name!r}, " if self.name else ""
        return f"TreeSpec({label}N={self.num_nodes}, Dmax={self.max_depth}, parents={self.parents})"


def _sibling_positions(parents: Sequence[int]) -> tuple[int, ...]:
    seen: dict[int, int] = {}
    out = []
    for p in parents:
        out.append(seen.get(p, 0))
        seen[p] = out[-1] + 1
    return tuple(out)


# ---- constructors ----------------------------------------------------------------------------


def check_num_draft(depth, what: str = "num_draft") -> int:
    """`depth` as an int in [1, MAX_DRAFT_NODES], else a ValueError naming `what`."""
    if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)):
        raise ValueError(f"{what} must be an integer in [1, {MAX_DRAFT_NODES}], got {depth!r}")
    if not 1 <= depth <= MAX_DRAFT_NODES:
        raise ValueError(f"{what} must be in [1, {MAX_DRAFT_NODES}], got {depth}")
    return int(depth)


def chain(depth: int, name: str = "") -> TreeSpec:
    """A chain of `depth` draft tokens, 1 <= depth <= MAX_DRAFT_NODES: parents = (-1, 0, 1, ...)."""
    depth = check_num_draft(depth, "chain depth")
    return TreeSpec(tuple(range(-1, depth - 1)), name=name or f"chain{depth}")


def from_paths(paths: Sequence[Sequence[int]], name: str = "") -> TreeSpec:
    """A tree from EAGLE/Medusa "choices": each path lists child ranks from the root, e.g.
    `[[0], [1], [0, 0], [0, 1]]` = top-1 and top-2 at depth 1, then top-1/top-2 after the
    top-1. Every prefix of a path must be listed too. Nodes come out sorted by (depth, path)."""
    keys = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
    if len(keys) != len(paths):
        raise ValueError("duplicate paths in the path list")
    if any(len(p) == 0 or min(p) < 0 for p in keys):
        raise ValueError("paths must be non-empty lists of ranks >= 0")
    index = {p: i for i, p in enumerate(keys)}
    missing = [p for p in keys if len(p) > 1 and p[:-1] not in index]
    if missing:
        raise ValueError(f"paths are missing their prefixes: {[list(p) for p in missing]}")
    parents = tuple(index[p[:-1]] if len(p) > 1 else -1 for p in keys)
    return TreeSpec(parents, ranks=tuple(p[-1] for p in keys), name=name)


def k_ary(branching: Sequence[int], max_nodes: int | None = None, name: str = "") -> TreeSpec:
    """A full top-k tree: `branching[d]` children per node at depth d, e.g. (4, 2, 1).

    With a node budget, keeps the `max_nodes` paths with the smallest rank sum (ties: shallower,
    then lexicographic), which always keeps every kept node's ancestors.
    """
    if not branching or min(branching) < 1:
        raise ValueError(f"branching must be a non-empty list of ints >= 1, got {branching}")
    paths = [
        p for d in range(1, len(branching) + 1)
        for p in itertools.product(*(range(k) for k in branching[:d]))
    ]
    if max_nodes is not None:
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        paths = sorted(paths, key=lambda p: (sum(p), len(p), p))[:max_nodes]
    label = "x".join(map(str, branching)) + (f"_n{max_nodes}" if max_nodes else "")
    return from_paths(paths, name=name or f"kary_{label}")


# ---- YAML presets ----------------------------------------------------------------------------


def tree_from_config(config: dict, name: str = "") -> TreeSpec:
    """Builds a tree from a parsed YAML mapping with exactly one of the keys
    `chain: D`, `k_ary: {branching: [...], max_nodes: M}`, `paths: [[...], ...]`,
    `parents: [...]` (optional `ranks`), plus an optional `name`."""
    kinds = [k for k in ("chain", "k_ary", "paths", "parents") if k in config]
    if len(kinds) != 1:
        raise ValueError(f"a tree config needs exactly one of chain/k_ary/paths/parents, got {kinds}")
    name = str(config.get("name", name))
    kind = kinds[0]
    if kind == "chain":
        return chain(config["chain"], name=name)
    if kind == "k_ary":
        spec = config["k_ary"]
        return k_ary(spec["branching"], spec.get("max_nodes"), name=name)
    if kind == "paths":
        return from_paths(config["paths"], name=name)
    ranks = config.get("ranks")
    return TreeSpec(tuple(config["parents"]), None if ranks is None else tuple(ranks), name=name)


def available_trees() -> list[str]:
    """Names of the tree presets shipped in `specjax.configs/trees`."""
    root = resources.files(PRESET_PACKAGE) / PRESET_DIR
    return sorted(f.name.rsplit(".", 1)[0] for f in root.iterdir() if f.name.endswith(".yaml"))


def load_tree(name_or_yaml: str | os.PathLike | TreeSpec) -> TreeSpec:
    """A TreeSpec from a preset name (`chain4`, `kary_2x2x2`, ...) or a path to a YAML file."""
    if isinstance(name_or_yaml, TreeSpec):
        return name_or_yaml
    text = str(name_or_yaml)
    if text.endswith((".yaml", ".yml")) or os.path.sep in text or os.path.exists(text):
        config = read_yaml_mapping(text, "tree file")
        try:
            return tree_from_config(config, name=os.path.basename(text).split(".")[0])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"tree file {text}: {field_problem(e)}") from None
    preset = resources.files(PRESET_PACKAGE) / PRESET_DIR / f"{text}.yaml"
    if not preset.is_file():
        raise ValueError(f"unknown tree {text!r}: not a YAML path; presets: {available_trees()}")
    return tree_from_config(yaml.safe_load(preset.read_text()), name=text)
