"""The one cost model of a draft shape: what `specjax tune` ranks shapes by and what
`num_draft="auto"` picks a shape with, every step, inside the compiled program.

For B rows and a chain of D draft tokens (D = 0: a plain decoding step):

    tokens/s(D) = E[tokens per step](D) x B / T(D)
    E(D)        = 1 + sum_{j < D} joint_j,      joint_j = prod_{k <= j} conditional_k

For a draft tree, each node is on the accepted path with the product over its path of
g(depth, rank) = q(depth, rank) x prod_{r < rank} (1 - q(depth, r)): the candidate of that rank is
the target's token, those ranked above it were not (q(k, 0) = conditional_k, q(k, r >= 1) the
conditional acceptance of the rank-r candidate once the higher ranks missed):

    E(tree) = 1 + sum_nodes prod_{a on the node's path} g(depth_a, rank_a)

T(D) is the step's cost in seconds: T_target(B, 1 + D) + T_draft(B, D), or the measured
whole step. `conditional_k` is P(draft token k + 1 accepted | the first k were).

Every function takes Python floats, NumPy arrays or JAX arrays (traced inside a program).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def throughput(tokens_per_step, batch_size, t_target, t_draft=0.0):
    """E[tokens per step] x B / (T_target(B, 1 + D) + T_draft(B, D)), tokens/s."""
    return tokens_per_step * batch_size / (t_target + t_draft)


def chain_tokens_per_step(joint, num_draft: int):
    """1 + sum of the first D joint acceptances: E[tokens per step] of a chain of D."""
    head = joint[:num_draft]
    return 1.0 + (head.sum() if hasattr(head, "sum") else float(sum(head)))


def joint_acceptance(conditional):
    """`[Dmax]` P(the first j + 1 draft tokens accepted) from the conditional acceptances `[Dmax]`."""
    xp = np if isinstance(conditional, (list, tuple, np.ndarray)) else jnp
    return xp.cumprod(xp.asarray(conditional), axis=-1)


def chain_tokens_per_steps(conditional, lengths: tuple[int, ...]):
    """`[S]` E[tokens per step] of each chain length in `lengths` (0: a plain step, E = 1)
    from the conditional acceptances `[Dmax]` (Dmax >= max(lengths))."""
    joint = joint_acceptance(conditional)
    xp = np if isinstance(joint, np.ndarray) else jnp
    return xp.stack([xp.asarray(chain_tokens_per_step(joint, d)) for d in lengths])


def tree_tokens_per_step(conditional, siblings, tree):
    """E[tokens per step] of a draft tree (`specjax.tree.TreeSpec`, depth <= Dmax) from the
    conditional acceptances `[Dmax]` of the top candidate and `siblings` `[Dmax, R - 1]` of the
    candidates of rank 1..R-1 (R > the tree's largest rank; see the module docstring)."""
    xp = np if isinstance(conditional, (list, tuple, np.ndarray)) else jnp
    q = xp.concatenate([xp.asarray(conditional)[:, None], xp.asarray(siblings)], axis=1)  # [Dmax, R]
    missed = xp.cumprod(1.0 - q, axis=1)
    before = xp.concatenate([xp.ones_like(missed[:, :1]), missed[:, :-1]], axis=1)
    g = q * before  # [Dmax, R] P(the rank-r candidate is the accepted one | parent accepted)
    node_g = g[np.asarray(tree.node_depth) - 1, np.asarray(tree.node_ranks)]  # [N]
    log_g = xp.log(xp.maximum(node_g, 1e-30))
    on_path = xp.exp(xp.asarray(tree.node_ancestor_mask, log_g.dtype) @ log_g)  # [N]
    return 1.0 + on_path.sum()
