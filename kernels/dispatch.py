"""Chooses the attention implementation: Pallas on GPU, the XLA reference elsewhere."""
from __future__ import annotations

import jax

from specjax.kernels.reference import verify_attention_reference


def resolve_impl(impl: str) -> str:
    """'auto' -> 'pallas' on GPU, 'xla' on CPU/TPU; 'pallas' / 'xla' pass through."""
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if impl not in ("pallas", "xla"):
        raise ValueError(f"attention_impl must be auto, pallas or xla, not {impl!r}")
    return impl


def verify_attention(q, k_new, v_new, k_cache, v_cache, lengths, tree_mask, *, impl: str = "auto"):
    """Verify attention (see `verify_attention_reference` for shapes), by the chosen implementation."""
    if resolve_impl(impl) == "pallas":
        from specjax.kernels.verify_attention import verify_attention as pallas_verify_attention

        return pallas_verify_attention(q, k_new, v_new, k_cache, v_cache, lengths, tree_mask)
    return verify_attention_reference(q, k_new, v_new, k_cache, v_cache, lengths, tree_mask)
