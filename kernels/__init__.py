"""Attention kernels (Pallas) with their jnp references and dispatch."""
