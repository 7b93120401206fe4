"""Chooses the attention implementation: Pallas on GPU, the XLA reference elsewhere."""
from __future__ import annotations

import jax

from specjax.kernels.reference import verify_attention_reference


def resolve_impl(impl: str, head_dim: int | None = None) -> str:
    """'auto' -> 'pallas' on GPU, 'xla' on CPU/TPU; 'pallas' / 'xla' pass through.

    Given head_dim, 'auto' also keeps the XLA path where the kernel would have to zero-pad
    the cache (head_dim not a power of two >= 16); an explicit 'pallas' pads.
    """
    if impl == "auto":
        native = head_dim is None or (head_dim >= 16 and head_dim & (head_dim - 1) == 0)
        return "pallas" if jax.default_backend() == "gpu" and native else "xla"
    if impl not in ("pallas", "xla"):
        raise ValueError(f"attention_impl must be auto, pallas or xla, not {impl!r}")
    return impl


def verify_attention(q, k_new, v_new, k_cache, v_cache, lengths, tree_mask, *, impl: str = "auto"):
    """Verify attention (see `verify_attention_reference` for shapes), by the chosen implementation."""
    if resolve_impl(impl, q.shape[-1]) == "pallas":
        # imported on the GPU path only: the Pallas/Triton module is not needed elsewhere
        from specjax.kernels.verify_attention import verify_attention as pallas_verify_attention

        return pallas_verify_attention(q, k_new, v_new, k_cache, v_cache, lengths, tree_mask)
    return verify_attention_reference(q, k_new, v_new, k_cache, v_cache, lengths, tree_mask)
