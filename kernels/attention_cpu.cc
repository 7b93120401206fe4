// Verify / decode attention for XLA CPU over the KV cache read in place (kernels/attention_cpu.py).
//
// q       f32 [B, T, Hq, Dh]        the T new tokens' queries (RoPE applied)
// k_new   f32 [B, T, KVH, Dh]       their keys and values
// v_new   f32 [B, T, KVH, Dh]
// k       f32 [L, B, KVH, Dh, S]    the whole cache stack, keys transposed (models/cache.py),
// v       f32 [L, B, KVH, S, Dh]    read at `layer` in place: no slice copy
// layer   s32 []
// lengths s32 [B]                   row b's cached prefix is [0, lengths[b]) (clamped to S)
// mask    s8  [B, T, T]             new token i may see new token j (the draft tree)
// attr scale f32
// out     f32 [B, T, Hq, Dh]
//
// One softmax over the row's prefix and the visible new tokens (what
// kernels/reference.py:verify_attention_reference computes). Only the prefix is read, not the
// whole buffer: a step costs what the rows hold. The prefix is cut in chunks of kChunk keys;
// every (row, KV head, chunk) is one work item that leaves a partial softmax (max, sum, the
// weighted values) for the G query heads x T tokens it serves; a second round merges the
// partials of each (row, KV head) with the new tokens. The chunks depend only on the row's own
// length, so a row's result is the same bit for bit whatever the other rows are.
//
// Non-finite input (as the reference): a query that sees a NaN / Inf in its own q, or a visible
// new token whose key or value is not finite, gets NaN; a new token's bad value never reaches a
// query that cannot see it. Cached entries are trusted finite (models/cache.py stores them so).
// A query that sees nothing gets zeros.
//
// A new token the mask does not let see itself (mask[b, t, t] == 0) is dead: its output is
// zeros and nothing is computed for it (a verify's rows for draft nodes deeper than the step's
// draft, specjax.verify). The live queries' results are the same whatever the dead ones.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "cpu_crew.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kChunk = 128;  // prefix keys per work item (a multiple of 16)
constexpr int kRowTile = 6;      // query rows per pass over a block of 16 keys

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }

inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }

// exp(x) for x <= 0 (softmax weights), Cephes' expf polynomial: relative error ~2 ulp; below
// -87 it returns ~1e-38 instead of 0 (a weight that small changes no sum).
inline v8f exp8(v8f x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  x = x > splat(88.0f) ? splat(88.0f) : x;
  v8f fx = x * splat(1.44269504088896341f) + splat(0.5f);
  v8i n = __builtin_convertvector(fx, v8i);
  v8f fn = __builtin_convertvector(n, v8f);
  fn = fn > fx ? fn - splat(1.0f) : fn;  // floor
  n = __builtin_convertvector(fn, v8i);
  x = x - fn * splat(0.693359375f) - fn * splat(-2.12194440e-4f);
  v8f y = splat(1.9875691500e-4f);
  y = y * x + splat(1.3981999507e-3f);
  y = y * x + splat(8.3334519073e-3f);
  y = y * x + splat(4.1665795894e-2f);
  y = y * x + splat(1.6666665459e-1f);
  y = y * x + splat(5.0000001201e-1f);
  y = y * x * x + x + splat(1.0f);
  v8i bits = (n + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

inline float exp1(float x) {
  v8f v = exp8(splat(x));
  return v[0];
}

struct Shapes {
  int64_t B, T, Hq, KVH, Dh, S, G, R;  // R = G * T query rows per (row, KV head)
};

// One (row b, KV head h) problem's pointers.
struct Head {
  const float* k;  // [Dh, S]
  const float* v;  // [S, Dh]
  int64_t length;
};

// The live tokens of each row: row b's count and its tokens' indices, in order.
struct Live {
  int64_t T;
  std::vector<int64_t> count, tokens;  // [B], [B, T] (row b's first count[b])

  Live(const Shapes& sh, const int8_t* mask) : T(sh.T), count(sh.B, 0), tokens(sh.B * sh.T) {
    for (int64_t b = 0; b < sh.B; ++b)
      for (int64_t t = 0; t < sh.T; ++t)
        if (mask[(b * sh.T + t) * sh.T + t] != 0) tokens[b * sh.T + count[b]++] = t;
  }
  const int64_t* of(int64_t b) const { return tokens.data() + b * T; }
};

// The G query heads x the n live tokens ts of (b, h) as G n rows of Dh, scaled: row g * n + i
// is token ts[i].
void gather_queries(const Shapes& sh, const float* q, int64_t b, int64_t h, float scale,
                    const int64_t* ts, int64_t n, float* rows) {
  for (int64_t g = 0; g < sh.G; ++g)
    for (int64_t i = 0; i < n; ++i) {
      const float* src = q + ((b * sh.T + ts[i]) * sh.Hq + h * sh.G + g) * sh.Dh;
      float* dst = rows + (g * n + i) * sh.Dh;
      for (int64_t d = 0; d < sh.Dh; ++d) dst[d] = src[d] * scale;
    }
}

// scores[r, j] = rows[r] . k[:, s0 + j] for j in [0, n), computed 16 keys at a time from the
// chunk's keys packed [n16 / 16][Dh][16] (n16: n rounded up to 16, the pad keys zero): the
// copy reads each of the Dh key rows' n contiguous floats in one sweep (the rows are S floats
// apart: read 16 keys at a time in place, each row's line would wait on its own miss), and
// the row tiles then read the packed blocks from L1 / L2. scores has a row stride of n16.
template <int RT>
void score_tile(const Shapes& sh, const float* rows, const float* block, float* scores, int64_t stride) {
  v8f acc[RT][2];
  for (int r = 0; r < RT; ++r) acc[r][0] = acc[r][1] = v8f{};
  for (int64_t d = 0; d < sh.Dh; ++d) {
    const v8f k0 = load8(block + 16 * d), k1 = load8(block + 16 * d + 8);
    for (int r = 0; r < RT; ++r) {
      const v8f qv = splat(rows[r * sh.Dh + d]);
      acc[r][0] += qv * k0;
      acc[r][1] += qv * k1;
    }
  }
  for (int r = 0; r < RT; ++r) {
    store8(scores + r * stride, acc[r][0]);
    store8(scores + r * stride + 8, acc[r][1]);
  }
}

void score_rows(const Shapes& sh, const float* rows, const float* block, float* scores,
                int64_t stride, int64_t count) {
  switch (count) {
    case 1: return score_tile<1>(sh, rows, block, scores, stride);
    case 2: return score_tile<2>(sh, rows, block, scores, stride);
    case 3: return score_tile<3>(sh, rows, block, scores, stride);
    case 4: return score_tile<4>(sh, rows, block, scores, stride);
    case 5: return score_tile<5>(sh, rows, block, scores, stride);
    default: return score_tile<6>(sh, rows, block, scores, stride);
  }
}

thread_local std::vector<float> scratch_keys;

// The key rows are short runs on separate pages, which the hardware prefetchers do not follow:
// they are fetched kAheadRows rows ahead into L2, and the chunk's values ([n, Dh], contiguous,
// read after the scores) are fetched into L2 along the way, a share each key row. From DRAM
// (SmolLM2's B = 1 decode, 752 keys cached) that reads ~14.7 GB/s against ~13.5 at 4 rows
// ahead into L1 without the values (benchmarks/cpu_kernel_stream.py attention, 2026-12-07).
constexpr int64_t kAheadRows = 16;

void chunk_scores(const Shapes& sh, const float* rows, const float* k, const float* v, int64_t s0,
                  int64_t n, float* scores, int64_t stride) {
  const int64_t blocks = stride / 16, full = n / 8 * 8;
  scratch_keys.resize(blocks * sh.Dh * 16);
  float* packed = scratch_keys.data();
  constexpr int kL2 = 2;  // __builtin_prefetch locality: prefetcht1
  for (int64_t d = 0; d < std::min(kAheadRows, sh.Dh); ++d)
    for (int64_t j = 0; j < n; j += 16) __builtin_prefetch(k + d * sh.S + s0 + j, 0, kL2);
  const char* values = reinterpret_cast<const char*>(v + s0 * sh.Dh);
  const int64_t value_lines = (n * sh.Dh * int64_t(sizeof(float)) + 63) / 64;
  const int64_t lines_per_row = (value_lines + sh.Dh - 1) / sh.Dh;
  for (int64_t d = 0; d < sh.Dh; ++d) {
    const float* row = k + d * sh.S + s0;
    if (d + kAheadRows < sh.Dh)
      for (int64_t j = 0; j < n; j += 16) __builtin_prefetch(row + kAheadRows * sh.S + j, 0, kL2);
    for (int64_t i = d * lines_per_row; i < std::min(value_lines, (d + 1) * lines_per_row); ++i)
      __builtin_prefetch(values + 64 * i, 0, kL2);
    for (int64_t j = 0; j < full; j += 8) store8(packed + (j / 16 * sh.Dh + d) * 16 + j % 16, load8(row + j));
    for (int64_t j = full; j < stride; ++j) packed[(j / 16 * sh.Dh + d) * 16 + j % 16] = j < n ? row[j] : 0.0f;
  }
  const int64_t tiles = (sh.R + kRowTile - 1) / kRowTile;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t r0 = sh.R * t / tiles, r1 = sh.R * (t + 1) / tiles;
      score_rows(sh, rows + r0 * sh.Dh, packed + b * sh.Dh * 16, scores + r0 * stride + 16 * b,
                 stride, r1 - r0);
    }
}

// out[0:Dh] = sum_j p[j] * v[(s0 + j) * Dh : ...]; DV = Dh / 8 vectors (0: any Dh, scalar).
template <int DV>
void weighted_values(const float* p, const float* v, int64_t s0, int64_t n, int64_t dh, float* out) {
  if constexpr (DV > 0) {
    v8f acc[DV];
    for (int i = 0; i < DV; ++i) acc[i] = v8f{};
    for (int64_t j = 0; j < n; ++j) {
      const v8f pj = splat(p[j]);
      const float* row = v + (s0 + j) * dh;
      for (int i = 0; i < DV; ++i) acc[i] += pj * load8(row + 8 * i);
    }
    for (int i = 0; i < DV; ++i) store8(out + 8 * i, acc[i]);
  } else {
    for (int64_t d = 0; d < dh; ++d) out[d] = 0.0f;
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < dh; ++d) out[d] += p[j] * v[(s0 + j) * dh + d];
  }
}

void weighted(const float* p, const float* v, int64_t s0, int64_t n, int64_t dh, float* out) {
  switch (dh) {
    case 32: return weighted_values<4>(p, v, s0, n, dh, out);
    case 64: return weighted_values<8>(p, v, s0, n, dh, out);
    case 128: return weighted_values<16>(p, v, s0, n, dh, out);
    default: return weighted_values<0>(p, v, s0, n, dh, out);
  }
}

// Scratch of the thread running a work item.
struct Scratch {
  std::vector<float> rows, scores;
};

thread_local Scratch scratch;

// A partial softmax over one chunk: per query row of the live tokens (`gather_queries`' rows,
// the first G x live.count[b] of R) its max, its sum of exp(score - max) and the values
// weighted by those; laid out [R] max, [R] sum, [R, Dh] values.
void chunk_partial(const Shapes& sh, const float* q, float scale, int64_t b, int64_t h,
                   const Head& head, int64_t s0, const Live& live, float* partial) {
  const int64_t n = std::min(kChunk, head.length - s0);
  const int64_t stride = (n + 15) / 16 * 16;
  Shapes rows_of = sh;  // the live rows only
  rows_of.R = sh.G * live.count[b];
  if (rows_of.R == 0) return;
  scratch.rows.resize(rows_of.R * sh.Dh);
  scratch.scores.resize(rows_of.R * stride);
  gather_queries(sh, q, b, h, scale, live.of(b), live.count[b], scratch.rows.data());
  float* scores = scratch.scores.data();
  chunk_scores(rows_of, scratch.rows.data(), head.k, head.v, s0, n, scores, stride);
  float* maxes = partial;
  float* sums = partial + sh.R;
  float* values = partial + 2 * sh.R;
  for (int64_t r = 0; r < rows_of.R; ++r) {
    float* row = scores + r * stride;
    float m = -std::numeric_limits<float>::infinity();
    bool nan = false;
    for (int64_t j = 0; j < n; ++j) {
      nan |= std::isnan(row[j]);
      m = std::max(m, row[j]);
    }
    if (nan) m = std::numeric_limits<float>::quiet_NaN();
    for (int64_t j = n; j < stride; ++j) row[j] = m;
    v8f total = v8f{};
    for (int64_t j = 0; j < stride; j += 8) {
      v8f e = exp8(load8(row + j) - splat(m));
      if (j + 8 > n)
        for (int64_t i = std::max<int64_t>(n - j, 0); i < 8; ++i) e[i] = 0.0f;
      store8(row + j, e);
      total += e;
    }
    float sum = 0.0f;
    for (int i = 0; i < 8; ++i) sum += total[i];
    maxes[r] = m;
    sums[r] = sum;
    weighted(row, head.v, s0, n, sh.Dh, values + r * sh.Dh);
  }
}

bool finite(const float* x, int64_t n) {
  float acc = 0.0f;
  for (int64_t i = 0; i < n; ++i) acc += x[i] * 0.0f;
  return acc == 0.0f;
}

// Query rows of (b, h): the chunks' partials and the visible new tokens under one softmax (a
// dead token's rows: zeros).
void merge(const Shapes& sh, const float* q, const float* k_new, const float* v_new,
           const int8_t* mask, float scale, int64_t b, int64_t h, const float* partials,
           int64_t chunks, const Live& live, float* out) {
  const int64_t Dh = sh.Dh;
  std::vector<float> query(Dh), acc(Dh), scores(sh.T);
  std::vector<char> visible(sh.T), good(sh.T);
  for (int64_t j = 0; j < sh.T; ++j) {
    const float* kj = k_new + ((b * sh.T + j) * sh.KVH + h) * Dh;
    const float* vj = v_new + ((b * sh.T + j) * sh.KVH + h) * Dh;
    good[j] = finite(kj, Dh) && finite(vj, Dh);
  }
  const int64_t alive = live.count[b];
  std::vector<int64_t> index(sh.T, -1);  // token t's place among the live ones (-1: dead)
  for (int64_t i = 0; i < alive; ++i) index[live.of(b)[i]] = i;
  for (int64_t g = 0; g < sh.G; ++g)
    for (int64_t t = 0; t < sh.T; ++t) {
      const int64_t r = g * alive + index[t];
      const float* qr = q + ((b * sh.T + t) * sh.Hq + h * sh.G + g) * Dh;
      float* dst = out + ((b * sh.T + t) * sh.Hq + h * sh.G + g) * Dh;
      if (index[t] < 0) {
        std::fill(dst, dst + Dh, 0.0f);
        continue;
      }
      for (int64_t d = 0; d < Dh; ++d) query[d] = qr[d] * scale;
      bool nan = false, any = chunks > 0;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunks; ++c) {
        const float mc = partials[c * sh.R * (2 + Dh) + r];
        nan |= std::isnan(mc);
        m = std::max(m, mc);
      }
      for (int64_t j = 0; j < sh.T; ++j) {
        visible[j] = mask[(b * sh.T + t) * sh.T + j] != 0;
        if (!visible[j]) continue;
        any = true;
        const float* kj = k_new + ((b * sh.T + j) * sh.KVH + h) * Dh;
        float s = 0.0f;
        for (int64_t d = 0; d < Dh; ++d) s += query[d] * kj[d];
        if (!good[j]) s = std::numeric_limits<float>::quiet_NaN();
        scores[j] = s;
        nan |= std::isnan(s);
        m = std::max(m, s);
      }
      if (!any) {
        std::fill(dst, dst + Dh, 0.0f);
        continue;
      }
      if (nan) {
        std::fill(dst, dst + Dh, std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      float denom = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t c = 0; c < chunks; ++c) {
        const float* part = partials + c * sh.R * (2 + Dh);
        const float w = exp1(part[r] - m);
        denom += w * part[sh.R + r];
        const float* values = part + 2 * sh.R + r * Dh;
        for (int64_t d = 0; d < Dh; ++d) acc[d] += w * values[d];
      }
      for (int64_t j = 0; j < sh.T; ++j) {
        if (!visible[j]) continue;
        const float w = exp1(scores[j] - m);
        denom += w;
        const float* vj = v_new + ((b * sh.T + j) * sh.KVH + h) * Dh;
        for (int64_t d = 0; d < Dh; ++d) acc[d] += w * vj[d];
      }
      const float inv = 1.0f / (denom > 0.0f ? denom : 1.0f);
      for (int64_t d = 0; d < Dh; ++d) dst[d] = acc[d] * inv;
    }
}

ffi::Error CacheAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                          ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> layer,
                          ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S8> mask, float scale,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5)
    return ffi::Error::InvalidArgument("cache_attention: q must be [B, T, Hq, Dh], k / v [L, B, KVH, ...]");
  Shapes sh{qd[0], qd[1], qd[2], kd[2], qd[3], kd[4], 0, 0};
  const int64_t L = kd[0];
  if (kd[1] != sh.B || kd[3] != sh.Dh || vd[0] != L || vd[1] != sh.B || vd[2] != sh.KVH ||
      vd[3] != sh.S || vd[4] != sh.Dh || sh.KVH == 0 || sh.Hq % sh.KVH != 0)
    return ffi::Error::InvalidArgument("cache_attention: cache shapes do not fit q");
  const int64_t new_kv = sh.B * sh.T * sh.KVH * sh.Dh;
  if (k_new.element_count() != new_kv || v_new.element_count() != new_kv ||
      mask.element_count() != sh.B * sh.T * sh.T || lengths.element_count() != sh.B ||
      layer.element_count() != 1 || out->element_count() != q.element_count())
    return ffi::Error::InvalidArgument("cache_attention: new keys, mask, lengths or layer do not fit");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("cache_attention: layer index out of range");
  sh.G = sh.Hq / sh.KVH;
  sh.R = sh.G * sh.T;
  if (sh.B == 0 || sh.T == 0 || sh.Hq == 0 || sh.Dh == 0) return ffi::Error::Success();

  // The work items: (b, h, chunk), in order; each (b, h)'s first item.
  std::vector<Head> heads(sh.B * sh.KVH);
  std::vector<int64_t> first(sh.B * sh.KVH + 1, 0);
  for (int64_t b = 0; b < sh.B; ++b) {
    const int64_t length = std::clamp<int64_t>(lengths.typed_data()[b], 0, sh.S);
    for (int64_t h = 0; h < sh.KVH; ++h) {
      const int64_t bh = b * sh.KVH + h;
      heads[bh] = Head{k.typed_data() + ((l * sh.B + b) * sh.KVH + h) * sh.Dh * sh.S,
                       v.typed_data() + ((l * sh.B + b) * sh.KVH + h) * sh.S * sh.Dh, length};
      first[bh + 1] = first[bh] + (length + kChunk - 1) / kChunk;
    }
  }
  const int64_t items = first.back(), per_item = sh.R * (2 + sh.Dh);
  thread_local std::vector<float> partials;  // the calling thread's; helpers write into it
  partials.resize(std::max<int64_t>(items * per_item, 1));
  float* parts = partials.data();
  const float* qp = q.typed_data();
  const Live live(sh, mask.typed_data());
  specjax_crew::parallel_for(pool, items, [&](int64_t i) {
    const int64_t bh = std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1;
    chunk_partial(sh, qp, scale, bh / sh.KVH, bh % sh.KVH, heads[bh], (i - first[bh]) * kChunk,
                  live, parts + i * per_item);
  });
  auto merge_one = [&](int64_t bh) {
    merge(sh, qp, k_new.typed_data(), v_new.typed_data(), mask.typed_data(), scale, bh / sh.KVH,
          bh % sh.KVH, parts + first[bh] * per_item, first[bh + 1] - first[bh], live, out->typed_data());
  };
  // The merge reads (chunks + T) x Dh numbers a query row: below ~64K of them for the whole
  // call, handing it out costs more than it saves.
  specjax_crew::parallel_for(pool, sh.B * sh.KVH, merge_one,
                             sh.B * sh.KVH * sh.R * (items / (sh.B * sh.KVH) + 1 + sh.T) * sh.Dh >= (1 << 16));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxCacheAttention, CacheAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
