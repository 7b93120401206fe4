"""Chooses the attention implementation: the Pallas kernel of the backend (Triton on GPU,
Mosaic on TPU), the CPU kernel (`attention_cpu`, where `models.llama.attention_impl` finds it
can run), the XLA reference elsewhere."""
from __future__ import annotations

import jax

from specjax.kernels.attention_cpu import cache_attention
from specjax.kernels.reference import verify_attention_reference

#: the names `attention_impl` accepts; 'pallas' is the Pallas kernel of the running backend,
#: 'cpu' the C++ kernel of the CPU backend
IMPLS = ("auto", "pallas", "pallas_tpu", "cpu", "xla")


def native_head_dim(backend: str, head_dim: int) -> bool:
    """Whether the backend's kernel runs head_dim without zero-padding the cache: a power of
    two ≥ 16 on GPU (Triton), a multiple of 128 or 64 on TPU (Mosaic lanes)."""
    if backend == "tpu":
        return head_dim % 128 == 0 or head_dim == 64
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def resolve_impl(impl: str, head_dim: int | None = None) -> str:
    """The implementation that runs: 'pallas' (Triton GPU kernel), 'pallas_tpu' (Mosaic TPU
    kernel) or 'xla'.

    'auto' -> 'pallas' on GPU, 'pallas_tpu' on TPU, 'xla' on CPU; given head_dim, 'auto' also
    keeps the XLA path where the kernel would have to zero-pad the cache (`native_head_dim`).
    'pallas' -> the kernel of the backend ('pallas_tpu' on TPU, else the Triton kernel, which
    runs in interpret mode off a GPU); 'pallas_tpu' / 'xla' pass through (the TPU kernel runs
    in interpret mode off a TPU). Explicit kernels pad any head_dim. 'cpu' passes through on
    the CPU backend (an error elsewhere).
    """
    if impl not in IMPLS:
        raise ValueError(f"attention_impl must be one of {', '.join(IMPLS)}, not {impl!r}")
    backend = jax.default_backend()
    if impl == "cpu" and backend != "cpu":
        raise ValueError(f"attention_impl='cpu' is the CPU backend's kernel; this backend is {backend}")
    if impl == "auto":
        if backend not in ("gpu", "tpu") or not (head_dim is None or native_head_dim(backend, head_dim)):
            return "xla"
        impl = "pallas"
    if impl == "pallas" and backend == "tpu":
        return "pallas_tpu"
    return impl


def verify_attention(q, k_new, v_new, k_cache, v_cache, lengths, tree_mask, *, impl: str = "auto",
                     layer=None):
    """Verify attention (see `verify_attention_reference` for shapes), by the chosen implementation.

    With `layer` (int32 `[]`), k_cache / v_cache are the whole stacks `[L, ...]` of `KVCache`:
    the CPU kernel reads layer `layer` in place, the others its slice."""
    chosen = resolve_impl(impl, q.shape[-1])
    if chosen == "cpu":
        if layer is None:
            k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
        return cache_attention(q, k_new, v_new, k_cache, v_cache, layer, lengths, tree_mask)
    if layer is not None:
        k_cache, v_cache = (jax.lax.dynamic_index_in_dim(c, layer, keepdims=False) for c in (k_cache, v_cache))
    # the kernels are imported on their path only: neither backend's module is needed elsewhere
    if chosen == "pallas":
        from specjax.kernels.verify_attention import verify_attention as kernel
    elif chosen == "pallas_tpu":
        from specjax.kernels.verify_attention_tpu import verify_attention as kernel
    else:
        kernel = verify_attention_reference
    return kernel(q, k_new, v_new, k_cache, v_cache, lengths, tree_mask)
