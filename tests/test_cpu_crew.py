"""The CPU kernels' crew of helper threads (kernels/cpu_crew.h): what it computes is what the
kernels computed with XLA's pool as helpers, bit for bit; one crew serves both kernel
libraries; callers on several threads at once each get their own results."""
from __future__ import annotations

import ctypes
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax.models.quant as quant
from specjax.kernels import attention_cpu, cpu_ffi, qmatmul_cpu
from specjax.models.paths import cache_dir

REASONS = (quant.cpu_kernel_reason(), attention_cpu.available(cache_dir() / "kernels"))
pytestmark = pytest.mark.skipif(any(REASONS), reason=f"CPU kernels unavailable: {REASONS}")


@pytest.fixture
def crew_restored():
    yield
    cpu_ffi.use_crew(True)


def normal(seed: int, shape) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def kernel_outputs(m: int) -> list[jax.Array]:
    """Every kind of kernel call on `m` rows: int8 / int4 (a group), f32, bf16 rows, attention
    (ragged lengths, a padded row of length 0)."""
    k = 96
    quantized = [quant.quantize_kernel(normal(i, (2, k, n)), quant.SPECS[mode])
                 for i, (n, mode) in enumerate([(80, "int8"), (48, "int4")])]
    pairs = [(qmatmul_cpu.pack(quantized[0].qvalue), quantized[0].scale),
             (qmatmul_cpu.pack_int4(quantized[1].qvalue), quantized[1].scale)]
    x = normal(100 + m, (m, k))
    out = list(jax.jit(qmatmul_cpu.qmatmul_group)(x, pairs, 1))
    out.append(jax.jit(qmatmul_cpu.matmul)(x, normal(3, (2, k, 64)), 0))
    out.append(jax.jit(qmatmul_cpu.matmul_rows)(x, normal(4, (2, 40, k)).astype(jnp.bfloat16), 1))
    batch, new, kv_heads, heads, dim, capacity = 3, max(m, 1), 2, 6, 32, 200
    lengths = jnp.asarray([0, 77, 200 - new][:batch], jnp.int32)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((new, new), bool)), (batch, new, new))
    out.append(jax.jit(attention_cpu.cache_attention)(
        normal(5, (batch, new, heads, dim)), normal(6, (batch, new, kv_heads, dim)),
        normal(7, (batch, new, kv_heads, dim)), normal(8, (1, batch, kv_heads, dim, capacity)),
        normal(9, (1, batch, kv_heads, capacity, dim)), 0, lengths, mask))
    return [np.asarray(y) for y in out]


@pytest.mark.parametrize("m", [0, 1, 3, 8, 13])
def test_the_crew_computes_what_xlas_pool_computed(m, crew_restored):
    cpu_ffi.use_crew(False)
    pool = kernel_outputs(m)
    cpu_ffi.use_crew(True)
    for _ in range(5):  # calls in a row: a crew thread asleep at the first may miss its units
        for a, b in zip(pool, kernel_outputs(m)):
            np.testing.assert_array_equal(a, b)


def test_both_kernel_libraries_share_one_crew():
    """A crew each would keep two helper threads spinning beside each other's work."""
    libraries = cpu_ffi._libraries
    assert len(libraries) >= 2
    crews = set()
    for library in libraries:
        library.specjax_crew_with.restype = ctypes.c_void_p
        crews.add(library.specjax_crew_with(ctypes.c_int64(1)))
    assert len(crews) == 1 and None not in crews


def test_callers_on_several_threads_each_get_their_own_results():
    """Jobs published at once: a helper takes the newest, each caller finishes its own."""
    expected = {m: kernel_outputs(m) for m in (1, 5, 13)}
    failures: list = []

    def caller(m: int) -> None:
        try:
            for _ in range(15):
                for got, want in zip(kernel_outputs(m), expected[m]):
                    np.testing.assert_array_equal(got, want)
        except Exception as error:  # reported below, in the test's thread
            failures.append(error)

    threads = [threading.Thread(target=caller, args=(m,)) for m in (1, 5, 13, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[0]


def test_crew_threads_compute_in_the_callers_floating_point_environment(crew_restored):
    """XLA's threads flush subnormals to zero; a crew thread computes its units the same way
    (it takes the caller's environment with each job), so a row's result does not depend on
    the thread that computed it. Subnormal inputs whose sums would be normal numbers."""
    x = jnp.full((8, 96), 1e-39, jnp.float32)
    stack = jnp.ones((2, 96, 8192), jnp.float32)  # 512 column blocks: the crew takes some
    want = np.asarray(jax.jit(lambda a, w: a @ w[0])(x, stack))
    run = jax.jit(qmatmul_cpu.matmul)
    for on in (False, True):
        cpu_ffi.use_crew(on)
        for _ in range(20):  # calls in a row: the crew is awake and takes units
            np.testing.assert_array_equal(np.asarray(run(x, stack, 0)), want)
