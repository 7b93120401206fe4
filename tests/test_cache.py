"""KV cache writes and path compaction against a token-major numpy reference, ragged rows."""
import jax.numpy as jnp
import numpy as np

from specjax.api import batch_bucket, bucket
from specjax.models.cache import compact, empty_cache, write


def random_cache(rng, lengths, capacity=12):
    """A cache with random contents and the given lengths, plus its token-major numpy copy."""
    cache = empty_cache(2, len(lengths), capacity, 3, 4, jnp.float32)
    k = rng.standard_normal(cache.k.shape).astype(np.float32)
    v = rng.standard_normal(cache.v.shape).astype(np.float32)
    cache = cache.replace(k=jnp.asarray(k), v=jnp.asarray(v), lengths=jnp.asarray(lengths, jnp.int32))
    k_ref, v_ref = (np.array(x) for x in cache.token_major())  # [L, B, S, KVH, Dh], writable
    return cache, k_ref, v_ref


def test_write_at_ragged_offsets_matches_reference():
    rng = np.random.default_rng(0)
    lengths = [0, 5, 9]
    cache, k_ref, v_ref = random_cache(rng, lengths)
    new_k = rng.standard_normal((2, 3, 3, 3, 4)).astype(np.float32)  # [L, B, T, KVH, Dh]
    new_v = rng.standard_normal((2, 3, 3, 3, 4)).astype(np.float32)
    for b, n in enumerate(lengths):
        k_ref[:, b, n:n + 3], v_ref[:, b, n:n + 3] = new_k[:, b], new_v[:, b]
    k, v = write(cache, jnp.asarray(new_k), jnp.asarray(new_v)).token_major()
    np.testing.assert_array_equal(np.asarray(k), k_ref)
    np.testing.assert_array_equal(np.asarray(v), v_ref)
    layer_k, layer_v = cache.layer_kv(1)
    np.testing.assert_array_equal(np.asarray(layer_k), np.asarray(cache.token_major()[0][1]))
    np.testing.assert_array_equal(np.asarray(layer_v), np.asarray(cache.token_major()[1][1]))


def test_compact_moves_the_path_to_the_front_per_row():
    rng = np.random.default_rng(1)
    lengths = [2, 0, 6]
    cache, k_ref, v_ref = random_cache(rng, lengths)
    path = np.array([[0, 2, 3], [0, 1, 4], [0, 3, 3]])  # indices into 5 provisional entries
    for b, n in enumerate(lengths):
        k_ref[:, b, n:n + 3] = k_ref[:, b, n + path[b]]
        v_ref[:, b, n:n + 3] = v_ref[:, b, n + path[b]]
    out = compact(cache, cache.lengths, jnp.asarray(path), 5)
    k, v = out.token_major()
    np.testing.assert_array_equal(np.asarray(k), k_ref)
    np.testing.assert_array_equal(np.asarray(v), v_ref)
    np.testing.assert_array_equal(np.asarray(out.lengths), lengths)


def test_length_buckets_are_powers_of_two_and_half_way_points():
    assert [bucket(n) for n in (1, 16, 17, 24, 25, 33, 87, 97, 129)] == [16, 16, 24, 24, 32, 48, 96, 128, 192]
    for n in range(1, 3000):
        b = bucket(n)
        assert n <= b and (b - n) < b / 3 + 16  # under a third of padding (above the minimum)
        assert bucket(b) == b
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
