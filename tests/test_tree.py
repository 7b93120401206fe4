"""TreeSpec: constructors, derived tables in verify layout, presets, hashability."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.tree import (
    TreeSpec,
    available_trees,
    chain,
    from_paths,
    k_ary,
    load_tree,
    tree_from_config,
)


def brute_ancestors(parents, i):
    """Node indices on the root path of node i, root side first (i included)."""
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


@st.composite
def random_parents(draw, max_nodes=12):
    n = draw(st.integers(1, max_nodes))
    return tuple(draw(st.integers(-1, i - 1)) for i in range(n))


def test_chain_layout():
    t = chain(3)
    assert t.parents == (-1, 0, 1) and t.depth == (1, 2, 3) and t.max_depth == 3 and t.is_chain
    assert t.paths == ((0, 1, 2),) and t.leaves == (2,)
    np.testing.assert_array_equal(t.ancestor_mask(), np.tril(np.ones((4, 4), bool)))
    np.testing.assert_array_equal(t.verify_depth, [0, 1, 2, 3])
    np.testing.assert_array_equal(
        t.verify_path_table, [[0, 0, 0, 0], [0, 1, 1, 1], [0, 1, 2, 2], [0, 1, 2, 3]])
    np.testing.assert_array_equal(t.path_table, [[0, 1, 2]])
    with pytest.raises(ValueError):
        chain(0)


def test_from_paths_choices_format():
    t = from_paths([[0, 1], [1], [0], [0, 0]])  # unsorted on purpose
    assert t.parents == (-1, -1, 0, 0)
    assert t.ranks == (0, 1, 0, 1)
    assert t.children == ((0, 1), (2, 3), (), (), ())
    assert t.to_paths() == [[0], [1], [0, 0], [0, 1]]
    assert t.leaves == (1, 2, 3) and t.paths == ((1,), (0, 2), (0, 3))
    np.testing.assert_array_equal(t.path_table, [[1, -1], [0, 2], [0, 3]])
    np.testing.assert_array_equal(t.children_table, [[0, 1], [2, 3], [-1, -1], [-1, -1], [-1, -1]])
    mask = t.ancestor_mask()
    assert mask[3].tolist() == [True, True, False, True, False]  # node 2: root, node 0, itself
    assert mask[0].tolist() == [True, False, False, False, False]


def test_from_paths_keeps_rank_gaps_and_rejects_bad_lists():
    t = from_paths([[0], [2], [2, 1]])
    assert t.parents == (-1, -1, 1) and t.ranks == (0, 2, 1)
    assert t.to_paths() == [[0], [2], [2, 1]]
    with pytest.raises(ValueError, match="prefix"):
        from_paths([[0], [1, 0]])
    with pytest.raises(ValueError, match="duplicate"):
        from_paths([[0], [0]])
    with pytest.raises(ValueError):
        from_paths([[]])


def test_k_ary_full_and_budget():
    full = k_ary((4, 2, 1))
    assert full.num_nodes == 4 + 8 + 8 and full.max_depth == 3
    assert [len(lv) for lv in full.levels] == [4, 8, 8]
    small = k_ary((4, 2, 1), max_nodes=8)
    assert small.to_paths() == [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [1, 0, 0]]
    assert k_ary((1, 1, 1)) == chain(3)


def test_bad_parents_and_ranks_raise():
    for parents in [(), (0,), (-1, 1), (-2,)]:
        with pytest.raises(ValueError):
            TreeSpec(parents)
    with pytest.raises(ValueError):
        TreeSpec((-1, -1), ranks=(1, 0))  # ranks must increase in sibling order


def test_hashable_static_arg_and_name_not_compared():
    a, b = chain(3), TreeSpec((-1, 0, 1), name="other")
    assert a == b and hash(a) == hash(b)
    assert a != from_paths([[0], [1], [0, 0]])
    traces = []

    def depth_sum(x, tree):
        traces.append(tree)
        return x + jnp.asarray(tree.verify_depth).sum()

    depth_sum = jax.jit(depth_sum, static_argnums=1)
    assert int(depth_sum(jnp.int32(0), a)) == 6
    assert int(depth_sum(jnp.int32(1), b)) == 7
    assert len(traces) == 1  # the equal tree hit the cache


def test_tables_are_read_only():
    t = chain(2)
    with pytest.raises(ValueError):
        t.verify_path_table[0, 0] = 5
    with pytest.raises(ValueError):
        t.ancestor_mask()[0, 1] = True


def test_presets_load_by_name_and_path(tmp_path):
    names = available_trees()
    assert {"chain4", "chain8", "eagle_small", "kary_2x2x2"} <= set(names)
    assert load_tree("chain4") == chain(4) and load_tree("chain8") == chain(8)
    assert load_tree("kary_2x2x2") == k_ary((2, 2, 2))
    eagle = load_tree("eagle_small")
    assert eagle.num_nodes == 17 and eagle.max_depth == 5 and eagle.name == "eagle_small"
    path = tmp_path / "mine.yaml"
    path.write_text("paths: [[0], [1], [0, 0]]\n")
    assert load_tree(str(path)) == from_paths([[0], [1], [0, 0]])
    assert load_tree(path) == load_tree(str(path))
    assert load_tree(eagle) is eagle
    with pytest.raises(ValueError, match="presets"):
        load_tree("no_such_tree")
    with pytest.raises(ValueError):
        tree_from_config({"chain": 2, "paths": [[0]]})
    assert tree_from_config({"parents": [-1, 0, 0]}).children == ((0,), (1, 2), (), ())


@settings(max_examples=60, deadline=None)
@given(random_parents())
def test_derived_tables_agree_with_parents(parents):
    t = TreeSpec(parents)
    n = t.num_nodes
    mask = t.ancestor_mask()
    for i in range(n):
        anc = brute_ancestors(parents, i)
        assert t.depth[i] == len(anc)
        assert mask[i + 1].tolist() == [True] + [j in anc for j in range(n)]
        row = t.verify_path_table[i + 1]
        assert row[: len(anc) + 1].tolist() == [0] + [j + 1 for j in anc]
        assert set(row[len(anc) + 1:].tolist()) <= {i + 1}
    assert mask[0].tolist() == [True] + [False] * n
    # every node lies on exactly the root-to-leaf paths through it, leaves end paths
    assert sorted({j for p in t.paths for j in p}) == list(range(n))
    for path, leaf in zip(t.paths, t.leaves):
        assert list(path) == brute_ancestors(parents, leaf) and not t.children[leaf + 1]
    # the path-list round trip reproduces the topology
    assert from_paths(t.to_paths()).to_paths() == sorted(t.to_paths(), key=lambda p: (len(p), p))
