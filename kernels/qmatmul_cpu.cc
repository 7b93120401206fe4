// Weight-only int8 matmul for XLA CPU, called through the XLA FFI (kernels/qmatmul_cpu.py).
//
//   y[m, n] = sum_k x[m, k] * w[layer, k, n] * s[layer, k / (K / G), n]
//
// x    f32 [M, K]                 (any leading shape; M = elements / K)
// w    s8  [L, N / 16, K, 16]     the int8 kernel packed in column blocks of 16: block j holds
//                                 columns [16 j, 16 j + 16) row after row, so one block is one
//                                 contiguous stream of K * 16 bytes
// s    f32 [L, G, N]              scales: one per output channel (G = 1) or per K / G inputs
// layer s32 []                    which of the L stacked kernels (read in place: no slice copy)
// y    f32 [M, N]
//
// Each output is one f32 sum over k in order (an FMA chain), whatever M, the row tile or the
// thread that computes it: a row's result does not depend on the other rows (batch-invariant).
// The weights are read once per tile of up to 6 rows of x (a tile of 1-3 rows takes 2-4 column
// blocks at once); the tiles of one column block re-read it from L1 / L2. Column blocks are
// shared out over the intra-op thread pool XLA hands to the call.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 16;  // columns per packed block (two 8-float vectors)
constexpr int kMaxTile = 6;     // rows of x per pass: 2 x 6 accumulators + 2 weights + 1 x

typedef float v8f __attribute__((vector_size(32)));
typedef int8_t v8b __attribute__((vector_size(8)));

inline v8f load_int8(const int8_t* p) {
#if defined(__AVX2__)
  __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
#else
  v8b bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  return __builtin_convertvector(bytes, v8f);
#endif
}

inline v8f load_f32(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store_f32(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }

struct Problem {
  const float* x;      // [M, K]
  const int8_t* w;     // [N / 16, K, 16] of the chosen layer
  const float* s;      // [G, N] of the chosen layer
  float* y;            // [M, N]
  int64_t m, k, n, groups;
};

// Rows [m0, m0 + MT) x the NB column blocks from jb (columns [16 jb, 16 (jb + NB))). A tile
// of few rows takes several blocks at once: each output is one FMA chain over k (4 cycles a
// step), and one row over one block (2 chains) would wait on that latency, not on memory
// (standalone, 53 MB of int8 at M = 1: 10.5 -> 11.7 GB/s on one core, 19 -> 22 on two).
template <int MT, int NB, bool kBlockScales>
void tile_scaled(const Problem& p, int64_t jb, int64_t m0) {
  v8f acc[MT][NB][2];
  for (int r = 0; r < MT; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b][0] = acc[r][b][1] = v8f{};
  const int8_t* block = p.w + jb * p.k * kBlock;
  const int64_t stride = p.k * kBlock;  // one block to the next
  const int64_t n0 = jb * kBlock;
  const float* x = p.x + m0 * p.k;
  const int64_t groups = kBlockScales ? p.groups : 1, per_group = p.k / groups;
  for (int64_t g = 0; g < groups; ++g) {
    const float* scale = p.s + g * p.n + n0;
    for (int64_t k = g * per_group; k < (g + 1) * per_group; ++k) {
      v8f w[NB][2];
      for (int b = 0; b < NB; ++b) {
        w[b][0] = load_int8(block + b * stride + k * kBlock);
        w[b][1] = load_int8(block + b * stride + k * kBlock + 8);
        if constexpr (kBlockScales) {  // block scales multiply the weights
          w[b][0] *= load_f32(scale + b * kBlock);
          w[b][1] *= load_f32(scale + b * kBlock + 8);
        }
      }
      for (int r = 0; r < MT; ++r) {
        const float xv = x[r * p.k + k];
        for (int b = 0; b < NB; ++b) {
          acc[r][b][0] += xv * w[b][0];
          acc[r][b][1] += xv * w[b][1];
        }
      }
    }
  }
  for (int r = 0; r < MT; ++r)
    for (int b = 0; b < NB; ++b) {
      if constexpr (!kBlockScales) {  // one scale a channel multiplies the sums
        acc[r][b][0] *= load_f32(p.s + n0 + b * kBlock);
        acc[r][b][1] *= load_f32(p.s + n0 + b * kBlock + 8);
      }
      store_f32(p.y + (m0 + r) * p.n + n0 + b * kBlock, acc[r][b][0]);
      store_f32(p.y + (m0 + r) * p.n + n0 + b * kBlock + 8, acc[r][b][1]);
    }
}

template <int MT, int NB>
void tile(const Problem& p, int64_t jb, int64_t m0) {
  if (p.groups == 1) return tile_scaled<MT, NB, false>(p, jb, m0);
  return tile_scaled<MT, NB, true>(p, jb, m0);
}

// The blocks a tile of `rows` rows takes at once (at most 12 accumulators).
inline int64_t blocks_per_tile(int64_t rows) { return rows == 1 ? 4 : rows <= 3 ? 2 : 1; }

template <int MT>
void tile_blocks(const Problem& p, int64_t jb, int64_t m0, int64_t nb) {
  if constexpr (MT == 1) {
    switch (nb) {
      case 4: return tile<1, 4>(p, jb, m0);
      case 3: return tile<1, 3>(p, jb, m0);
      case 2: return tile<1, 2>(p, jb, m0);
      default: return tile<1, 1>(p, jb, m0);
    }
  } else {
    if (nb == 2) return tile<MT, 2>(p, jb, m0);
    return tile<MT, 1>(p, jb, m0);
  }
}

void tile_rows(const Problem& p, int64_t jb, int64_t m0, int64_t rows, int64_t nb) {
  switch (rows) {
    case 1: return tile_blocks<1>(p, jb, m0, nb);
    case 2: return tile_blocks<2>(p, jb, m0, nb);
    case 3: return tile_blocks<3>(p, jb, m0, nb);
    case 4: return tile<4, 1>(p, jb, m0);
    case 5: return tile<5, 1>(p, jb, m0);
    default: return tile<6, 1>(p, jb, m0);
  }
}

// Column blocks [lo, hi), every row: the rows in ceil(M / 6) tiles of balanced size.
void blocks(const Problem& p, int64_t lo, int64_t hi) {
  const int64_t tiles = (p.m + kMaxTile - 1) / kMaxTile;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t m0 = p.m * t / tiles, m1 = p.m * (t + 1) / tiles;
    const int64_t step = blocks_per_tile(m1 - m0);
    for (int64_t jb = lo; jb < hi; jb += step)
      tile_rows(p, jb, m0, m1 - m0, std::min(step, hi - jb));
  }
}

// The column blocks of one call, handed out in chunks to whichever thread asks next: the
// calling thread and the helpers it scheduled on XLA's pool. Shared (heap) state, so a helper
// the pool starts after the call has returned finds no chunk left and leaves.
struct Work {
  Problem p;
  int64_t nblocks = 0, chunk = 1;
  std::atomic<int64_t> next{0}, done{0};
};

void run_chunks(Work& work) {
  for (;;) {
    const int64_t lo = work.next.fetch_add(work.chunk, std::memory_order_relaxed);
    if (lo >= work.nblocks) return;
    const int64_t hi = std::min(lo + work.chunk, work.nblocks);
    blocks(work.p, lo, hi);
    work.done.fetch_add(hi - lo, std::memory_order_release);
  }
}

int64_t product(ffi::Span<const int64_t> dims, size_t from, size_t to) {
  int64_t out = 1;
  for (size_t i = from; i < to; ++i) out *= dims[i];
  return out;
}

ffi::Error QMatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                       ffi::Buffer<ffi::F32> s, ffi::Buffer<ffi::S32> layer,
                       ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions();
  const auto sd = s.dimensions();
  if (wd.size() < 4 || sd.size() < 3)
    return ffi::Error::InvalidArgument("qmatmul: w must be [L, N/16, K, 16], s [L, G, N]");
  const size_t wr = wd.size(), sr = sd.size();
  if (wd[wr - 1] != kBlock || product(wd, 0, wr - 4) != 1 || product(sd, 0, sr - 3) != 1)
    return ffi::Error::InvalidArgument("qmatmul: w must be [L, N/16, K, 16], s [L, G, N]");
  const int64_t L = wd[wr - 4], nblocks = wd[wr - 3], K = wd[wr - 2], N = nblocks * kBlock;
  const int64_t G = sd[sr - 2];
  if (sd[sr - 3] != L || sd[sr - 1] != N || G < 1 || K % G != 0)
    return ffi::Error::InvalidArgument("qmatmul: scale shape does not match the kernel");
  if (K == 0 || x.element_count() % K != 0)
    return ffi::Error::InvalidArgument("qmatmul: x's last axis is not the kernel's input size");
  const int64_t M = x.element_count() / K;
  if (y->element_count() != M * N)
    return ffi::Error::InvalidArgument("qmatmul: output size is not M x N");
  if (layer.element_count() != 1)
    return ffi::Error::InvalidArgument("qmatmul: layer must be a scalar");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("qmatmul: layer index out of range");

  if (M == 0) return ffi::Error::Success();
  auto work = std::make_shared<Work>();
  work->p = Problem{x.typed_data(), w.typed_data() + l * nblocks * K * kBlock,
                    s.typed_data() + l * G * N, y->typed_data(), M, K, N, G};
  work->nblocks = nblocks;
  const int64_t threads = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), nblocks);
  work->chunk = std::max<int64_t>(1, nblocks / (4 * threads));
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([work] { run_chunks(*work); });
  run_chunks(*work);
  // Only chunks other threads took are left, and those threads are running them: waiting for
  // them cannot deadlock (a helper that starts later finds nothing left and touches nothing).
  while (work->done.load(std::memory_order_acquire) < nblocks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQMatmulInt8, QMatmulInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
