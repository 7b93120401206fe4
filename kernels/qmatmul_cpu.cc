// Matmuls over a stack of layer kernels read in place, for XLA CPU through the XLA FFI
// (kernels/qmatmul_cpu.py). A call multiplies one x by a group of kernels of one kind (the
// operands x, layer, then each kernel's; a result each): their column blocks are shared out
// over the helper threads together, one hand-off for q / k / v or gate / up. Two kinds:
//
// Weight-only int8 (SpecjaxQMatmulInt8):
//   y[m, n] = sum_k x[m, k] * w[layer, k, n] * s[layer, k / (K / G), n]
// x    f32 [M, K]                 (any leading shape; M = elements / K)
// w    s8  [L, N / 16, K, 16]     the int8 kernel packed in column blocks of 16: block j holds
//                                 columns [16 j, 16 j + 16) row after row, so one block is one
//                                 contiguous stream of K * 16 bytes
//   or w u8 [L, N / 16, K / 2, 16] int4 values two a byte (python: qmatmul_cpu.pack_int4): in
//                                 each block, 64 bytes hold 8 rows of its 16 columns, byte
//                                 16 i + j row 8 c + i (low nibble) and row 8 c + 4 + i (high
//                                 nibble) of column j, as w + 8 (0..15); K a multiple of 8
// s    f32 [L, G, N]              scales: one per output channel (G = 1) or per K / G inputs
// layer s32 []                    which of the L stacked kernels (read in place: no slice copy)
// y    f32 [M, N]
//
// Float (SpecjaxMatmulF32, SpecjaxMatmulBF16):
//   y[m, n] = sum_k x[m, k] * w[layer, k, n]
// x    f32 [M, K]
// w    f32 or bf16 [L, K, N]      the stacked params as stored (N a multiple of 16): a column
//                                 block is read row after row with a stride of N; a call of 4
//                                 rows or more first copies 4 blocks at a time to a contiguous
//                                 scratch stripe (the strided rows would alias in the caches)
// layer s32 []
// y    f32 [M, N]
//
// Float, packed (SpecjaxMatmulBlocksF32, SpecjaxMatmulBlocksBF16): the same product
// w    f32 or bf16 [L, N / 16, K, 16]  packed as the int8 kernel (python: qmatmul_cpu.pack),
//                                 each column block one contiguous stream; the same tiles and
//                                 sums as the stored layout's, without the restriping
//
// Float, rows as stored (SpecjaxMatmulRowsF32, SpecjaxMatmulRowsBF16): an LM head tied to the
// embedding, whose weights are one row of K per output
//   y[m, n] = sum_k x[m, k] * w[layer, n, k]
// x    f32 [M, K]
// w    f32 or bf16 [L, N, K]      as stored (K a multiple of 8): each output's weights are one
//                                 contiguous row, read once per tile of up to 6 rows of x
// layer s32 []
// y    f32 [M, N]
// Each output is 8 f32 partial sums over k = i mod 8, in order, then summed in a fixed order.
//
// Every kind takes a third operand after layer, live s32 [M] or [0]: where it holds a flag per
// row of x, the rows flagged 0 are dead: their outputs are zeros and their inputs are not read
// (the verify rows of a draft shorter than its program's widest, specjax.verify). [0]: every
// row is live. A live row's outputs are the same whatever the other rows (below).
//
// Each output of the column kinds is one f32 sum over k in order (an FMA chain), whatever M, the row tile or the
// thread that computes it: a row's result does not depend on the other rows (batch-invariant).
// The weights are read once per tile of up to 6 rows of x (a tile of 1-3 rows takes 2-4 column
// blocks at once); the tiles of one column block re-read it from L1 / L2. Column blocks are
// shared out over the calling thread and the kernels' crew of helper threads (cpu_crew.h).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>
#include <thread>

#include "cpu_crew.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 16;  // columns per packed block (two 8-float vectors)
// Cache lines fetched ahead in each packed block's stream (both paths): the hardware
// prefetchers stop at each 4 KB page of a block (SmolLM2's int8 blocks: 9 KB); 16 lines (1 KB)
// ahead read its int8 layers from DRAM at ~23 GB/s against ~20 without (integer path,
// benchmarks/cpu_kernel_stream.py matmul int8, 2026-12-07).
constexpr int64_t kPrefetchLines = 16;
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

inline v8f load_bf16(const uint16_t* p) {  // bf16 is the top half of an f32
#if defined(__AVX2__)
  __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (v8f)_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16);
#else
  float out[8];
  for (int i = 0; i < 8; ++i) {
    const uint32_t bits = uint32_t(p[i]) << 16;
    std::memcpy(&out[i], &bits, sizeof bits);
  }
  return load_f32(out);
#endif
}

inline v8f load_weights(const int8_t* p) { return load_int8(p); }
inline v8f load_weights(const float* p) { return load_f32(p); }
inline v8f load_weights(const uint16_t* p) { return load_bf16(p); }

// Row k of a block of int4 values held two a byte (`Problem::nibbles`): its 16 weights, w[0]
// columns 0-7 and w[1] 8-15. Row k's bytes are the 16 at byte row (k / 8) 4 + k mod 4, in the
// low nibble for k mod 8 < 4, else the high one; each nibble is the value + 8.
inline void load_nibble_row(const int8_t* block, int64_t k, v8f (&w)[2]) {
  const int8_t* bytes = block + ((k >> 3) * 4 + (k & 3)) * kBlock;
  const int shift = (k & 4) ? 4 : 0;
#if defined(__AVX2__)
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  if (shift) v = _mm_srli_epi16(v, 4);
  v = _mm_sub_epi8(_mm_and_si128(v, _mm_set1_epi8(0x0F)), _mm_set1_epi8(8));
  w[0] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
  w[1] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
#else
  for (int half = 0; half < 2; ++half)
    for (int i = 0; i < 8; ++i)
      w[half][i] = float(((uint8_t(bytes[8 * half + i]) >> shift) & 0x0F) - 8);
#endif
}

// a * b + c in one rounding where the CPU has FMA: explicit, so that every tile shape computes
// the same sums (left to the compiler, a contraction can differ between template instances).
inline v8f fma8(v8f a, v8f b, v8f c) {
#if defined(__FMA__)
  return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

inline void store_f32(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }

enum class Scale { kNone, kChannel, kBlock };

struct Digits;  // x as integer digits (the int8 integer path, below)
inline int64_t blocks_per_tile(int64_t rows);

// One call's operands. Column block j of the chosen layer's kernel starts at w + j * block_stride,
// and its row k (16 weights) at + k * row_stride.
template <typename W>
struct Problem {
  const float* x;       // [M, K]
  const W* w;           // the chosen layer's kernel
  const float* s;       // [G, N] of the chosen layer (Scale::kNone: unused)
  float* y;             // [M, N]
  int64_t m, k, n, groups;
  int64_t row_stride, block_stride;
  bool nibbles = false;  // int4 values two a byte (w: the bytes; row_stride 16, K / 2 byte rows)
  const Digits* digits = nullptr;  // int8, integer path: x as digits (`digits_of`)
  const int32_t* digit_sums = nullptr;  // and their sums over this kernel's scale blocks
  const int64_t* y_rows = nullptr;  // x's row m is y's row y_rows[m] (live rows: `compact`); null: m
};

// The row of y that x's row m writes.
template <typename P>
inline int64_t y_row(const P& p, int64_t m) { return p.y_rows ? p.y_rows[m] : m; }

// Rows [m0, m0 + MT) x the NB column blocks at `block` (columns [n0, n0 + 16 NB)); `row_stride`
// from one row of a block to the next. A tile of few rows takes several blocks at once: each
// output is one FMA chain over k (4 cycles a step), and one row over one block (2 chains)
// would wait on that latency, not on memory (standalone, 53 MB of int8 at M = 1: 10.5 -> 11.7
// GB/s on one core, 19 -> 22 on two).
// kNibbles: int4 values two a byte (`load_nibble_row`).
template <typename W, int MT, int NB, Scale kScale, bool kNibbles = false>
void tile_at(const Problem<W>& p, const W* block, int64_t row_stride, int64_t block_stride,
             int64_t n0, int64_t m0) {
  v8f acc[MT][NB][2];
  for (int r = 0; r < MT; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b][0] = acc[r][b][1] = v8f{};
  const float* x = p.x + m0 * p.k;
  const int64_t groups = kScale == Scale::kBlock ? p.groups : 1, per_group = p.k / groups;
  // Strided rows (a float kernel as stored) are fetched ahead: one cache line a block a row.
  const bool strided = row_stride != kBlock;
  constexpr int64_t kRowsPerLine = kNibbles ? 8 : std::max<int64_t>(1, 64 / (kBlock * sizeof(W)));
  for (int64_t g = 0; g < groups; ++g) {
    const float* scale = kScale == Scale::kBlock ? p.s + g * p.n + n0 : nullptr;
    for (int64_t k = g * per_group; k < (g + 1) * per_group; ++k) {
      if (strided && k + 8 < p.k)
        for (int b = 0; b < NB; ++b) __builtin_prefetch(block + b * block_stride + (k + 8) * row_stride);
      // Packed blocks: each block's stream kPrefetchLines ahead, once a cache line.
      if (!strided && k % kRowsPerLine == 0)
        for (int b = 0; b < NB; ++b) {
          const int64_t ahead = k + kRowsPerLine * kPrefetchLines;  // (nibbles: 2 rows a byte row)
          __builtin_prefetch(block + b * block_stride + (kNibbles ? ahead / 2 : ahead) * row_stride);
        }
      v8f w[NB][2];
      for (int b = 0; b < NB; ++b) {
        if constexpr (kNibbles) {
          load_nibble_row(block + b * block_stride, k, w[b]);
        } else {
          const W* row = block + b * block_stride + k * row_stride;
          w[b][0] = load_weights(row);
          w[b][1] = load_weights(row + 8);
        }
        if constexpr (kScale == Scale::kBlock) {  // block scales multiply the weights
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
      if constexpr (kScale == Scale::kChannel) {  // one scale a channel multiplies the sums
        acc[r][b][0] *= load_f32(p.s + n0 + b * kBlock);
        acc[r][b][1] *= load_f32(p.s + n0 + b * kBlock + 8);
      }
      store_f32(p.y + y_row(p, m0 + r) * p.n + n0 + b * kBlock, acc[r][b][0]);
      store_f32(p.y + y_row(p, m0 + r) * p.n + n0 + b * kBlock + 8, acc[r][b][1]);
    }
}

// ---- int8 weights x integer digits of x (AVX-512 VNNI) ---------------------------------------
//
// Where the CPU has AVX-512 VNNI and VBMI, an int8 call multiplies in integers: each row of x
// becomes three int8 digits,
//   x[m, k] ~= s0[m] * (d0 + (d1 + d2 / 254) / 254),  s0 = max|x[m, :]| / 127,
// (each digit the rounded remainder of the one before, so the error is ~2^-24 of the row's
// largest |x|, f32's own), and y[m, n] = s[n] * s0[m] * (A0 + (A1 + A2 / 254) / 254) with
// A_i = sum_k d_i[m, k] * w[k, n] summed EXACTLY in int32 (vpdpbusd: 64 products an
// instruction, against 16 for a float FMA after two converts). The sums do not depend on their
// order, so a row's result is the same whatever the rows, the tiles or the threads (batch
// invariance) and on any CPU with these instructions. One digit plane of a row: K bytes; the
// weights are read as stored (4 rows of a block, 64 bytes, permuted to 16 x 4 in a register).
// With a scale a block of K / G inputs (int4: 32), each block's sums are exact integers too,
// combined in f32 and scaled block by block in order (`digits_tile_grouped`).
// A row holding a NaN or an infinity yields NaN in every output (never a finite number); the
// other rows are untouched.
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define SPECJAX_INT8_DIGITS 1
#endif

constexpr int kDigits = 3;  // (the epilogue of `digits_tile` combines three)
constexpr float kDigitBase = 254.0f;
constexpr int64_t kMaxDigitsK = 65536;  // int32 sums: K / 4 x 4 x 255 x 127 < 2^31

struct Digits {
  int64_t m = 0, k = 0;
  std::vector<int8_t> d;  // [3, M, K]
  std::vector<float> s0;  // [M]
  // Per count of scale blocks G (1: a scale a channel): each plane's digit sums [3, M, G] over
  // each row's blocks of K / G inputs (vpdpbusd reads w + 128: the sums take the 128 back out).
  std::deque<std::pair<int64_t, std::vector<int32_t>>> sums;

  const int32_t* sums_for(int64_t groups) {
    for (const auto& [g, values] : sums)
      if (g == groups) return values.data();
    std::vector<int32_t> values(kDigits * m * groups);
    const int64_t per_group = k / groups;
    for (int64_t plane = 0; plane < kDigits * m; ++plane)
      for (int64_t g = 0; g < groups; ++g) {
        int32_t total = 0;
        for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) total += d[plane * k + e];
        values[plane * groups + g] = total;
      }
    return sums.emplace_back(groups, std::move(values)).second.data();
  }
};

inline float digit(float v) { return std::max(-127.0f, std::min(127.0f, std::nearbyint(v))); }

// x [M, K] as digits (a row that is not finite: zero digits, s0 NaN). Each
// element's digits come from the same operations in any build (16 at a time where AVX-512 is,
// one by one for the last K mod 16), so they depend on the element and its row's maximum only.
std::shared_ptr<Digits> digits_of(const float* x, int64_t m, int64_t k) {
  auto out = std::make_shared<Digits>();
  out->m = m, out->k = k;
  out->d.resize(kDigits * m * k);
  out->s0.resize(m);
  for (int64_t r = 0; r < m; ++r) {
    const float* row = x + r * k;
    float amax = 0.0f, probe = 0.0f;  // probe: NaN iff the row holds a NaN or an infinity
    int64_t i = 0;
#if defined(SPECJAX_INT8_DIGITS)
    {  // the maximum and the probe do not depend on the order: 16 lanes at a time
      __m512 vmax = _mm512_setzero_ps(), vprobe = _mm512_setzero_ps();
      for (; i + 16 <= k; i += 16) {
        const __m512 v = _mm512_loadu_ps(row + i);
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
        vprobe = _mm512_add_ps(vprobe, _mm512_mul_ps(v, _mm512_setzero_ps()));
      }
      amax = _mm512_reduce_max_ps(vmax);
      probe = _mm512_reduce_add_ps(vprobe);
    }
#endif
    for (; i < k; ++i) {
      amax = std::max(amax, std::fabs(row[i]));
      probe += row[i] * 0.0f;
    }
    // A row that is not finite: digits 0 and s0 NaN, so each of its outputs is NaN (as the
    // float path gives), and the other rows are untouched.
    const bool finite = probe == 0.0f;
    const float inv = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
    out->s0[r] = finite ? amax / 127.0f : std::nanf("");
    int8_t* plane[kDigits];
    for (int j = 0; j < kDigits; ++j) plane[j] = out->d.data() + (j * m + r) * k;
    i = 0;
#if defined(SPECJAX_INT8_DIGITS)
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (; i + 16 <= k; i += 16) {
      __m512 v = _mm512_mul_ps(_mm512_loadu_ps(row + i), _mm512_set1_ps(inv));
      for (int j = 0; j < kDigits; ++j) {
        const __m512 d = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(
            v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
        const __m512i di = _mm512_cvtps_epi32(d);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(plane[j] + i), _mm512_cvtsepi32_epi8(di));
        v = _mm512_mul_ps(_mm512_sub_ps(v, d), _mm512_set1_ps(kDigitBase));
      }
    }
#endif
    for (; i < k; ++i) {
      float v = row[i] * inv;
      for (int j = 0; j < kDigits; ++j) {
        const float d = digit(v);
        plane[j][i] = int8_t(d);
        v = (v - d) * kDigitBase;
      }
    }
  }
  return out;
}

#if defined(SPECJAX_INT8_DIGITS)
// acc[r][b][i] = sum over k in [k0, k1) of d_i[m0 + r, k] * (w[k, column] + offset) for the 16
// columns of block jb + b, exact in int32 (offset: 128 for int8 values, read with their sign bit
// flipped; 8 for int4 held two a byte, as stored). The weights are read as stored (64 bytes: 4
// rows of a block, or 8 of nibbles; permuted to 16 columns x 4 rows, vpdpbusd's lanes) and
// fetched kPrefetchLines ahead.
template <int MT, int NB, bool kNibbles>
inline void digit_products(const Problem<int8_t>& p, int64_t jb, int64_t m0, int64_t k0, int64_t k1,
                           __m512i (&acc)[MT][NB][kDigits]) {
  alignas(64) static const int8_t kPerm[64] = {  // out byte 4 j + i <- row i, column j
      0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51,
      4, 20, 36, 52, 5, 21, 37, 53, 6, 22, 38, 54, 7, 23, 39, 55,
      8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
      12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
  const __m512i perm = _mm512_load_si512(kPerm);
  const __m512i flip = _mm512_set1_epi8(char(0x80)), low = _mm512_set1_epi8(0x0F);
  constexpr int kPlanes = kNibbles ? 2 : 1;  // sets of 4 rows in 64 bytes
  const Digits& dg = *p.digits;
  for (int r = 0; r < MT; ++r)
    for (int b = 0; b < NB; ++b)
      for (int i = 0; i < kDigits; ++i) acc[r][b][i] = _mm512_setzero_si512();
  const int8_t* w = p.w + jb * p.block_stride;
  const int8_t* planes[MT][kDigits];
  for (int r = 0; r < MT; ++r)
    for (int i = 0; i < kDigits; ++i) planes[r][i] = dg.d.data() + (i * dg.m + m0 + r) * dg.k;
  for (int64_t k = k0; k < k1; k += 4 * kPlanes) {
    const int64_t at = (k / kPlanes) * kBlock;  // the 64 bytes of rows [k, k + 4 kPlanes)
    __m512i wv[NB][kPlanes];
    for (int b = 0; b < NB; ++b)
      _mm_prefetch(reinterpret_cast<const char*>(w + b * p.block_stride + at + 64 * kPrefetchLines),
                   _MM_HINT_T0);
    for (int b = 0; b < NB; ++b) {
      const __m512i bytes = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(w + b * p.block_stride + at));
      if constexpr (kNibbles) {
        wv[b][0] = _mm512_and_si512(bytes, low);
        wv[b][kPlanes - 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
      } else {
        wv[b][0] = _mm512_xor_si512(bytes, flip);
      }
    }
    for (int r = 0; r < MT; ++r)
      for (int i = 0; i < kDigits; ++i)
        for (int h = 0; h < kPlanes; ++h) {
          int32_t four;
          std::memcpy(&four, planes[r][i] + k + 4 * h, sizeof four);
          const __m512i xb = _mm512_set1_epi32(four);
          for (int b = 0; b < NB; ++b) acc[r][b][i] = _mm512_dpbusd_epi32(acc[r][b][i], wv[b][h], xb);
        }
  }
}

// Rows [m0, m0 + MT) x the NB column blocks from block jb (w: block jb's row 0).
template <int MT, int NB, bool kNibbles>
void digits_tile(const Problem<int8_t>& p, int64_t jb, int64_t m0) {
  const Digits& dg = *p.digits;
  __m512i acc[MT][NB][kDigits];
  digit_products<MT, NB, kNibbles>(p, jb, m0, 0, p.k, acc);
  constexpr int32_t kOffset = kNibbles ? 8 : 128;
  // y = s * s0 * (A0 + (A1 + A2 / 254) / 254) in double, 8 columns a vector, where
  // A_i = acc_i - offset sum_k d_i (the weights were read as w + offset: `digit_products`).
  const __m512d base = _mm512_set1_pd(kDigitBase);
  for (int r = 0; r < MT; ++r) {
    const int64_t row = m0 + r;
    const __m512d s0 = _mm512_set1_pd(dg.s0[row]);
    __m512i shift[kDigits];
    for (int i = 0; i < kDigits; ++i) shift[i] = _mm512_set1_epi32(kOffset * p.digit_sums[i * dg.m + row]);
    for (int b = 0; b < NB; ++b) {
      const int64_t n0 = (jb + b) * kBlock;
      __m512i exact[kDigits];
      for (int i = 0; i < kDigits; ++i) exact[i] = _mm512_sub_epi32(acc[r][b][i], shift[i]);
      for (int half = 0; half < 2; ++half) {
        __m512d v[kDigits];
        for (int i = 0; i < kDigits; ++i)
          v[i] = _mm512_cvtepi32_pd(half ? _mm512_extracti64x4_epi64(exact[i], 1)
                                         : _mm512_castsi512_si256(exact[i]));
        const __m512d sum = _mm512_add_pd(
            v[0], _mm512_div_pd(_mm512_add_pd(v[1], _mm512_div_pd(v[2], base)), base));
        const __m512d scale = _mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(p.s + n0 + 8 * half)), s0);
        _mm256_storeu_ps(p.y + y_row(p, row) * p.n + n0 + 8 * half, _mm512_cvtpd_ps(_mm512_mul_pd(scale, sum)));
      }
    }
  }
}

// The same with a scale a block of K / G inputs (int4: 32): each block's three sums are exact
// integers, combined in f32 (A0 + A1 / 254 + A2 / 254^2: A0 is exact while |A0| < 2^24, as
// for int4's blocks of 32, |A0| <= 32 x 127 x 8; f32-rounded beyond),
// scaled and summed over the blocks in order (an FMA a block: f32's precision, as the float
// path's FMA chain over k); y = s0 * that.
template <int MT, int NB, bool kNibbles>
void digits_tile_grouped(const Problem<int8_t>& p, int64_t jb, int64_t m0) {
  const Digits& dg = *p.digits;
  const __m512 inv1 = _mm512_set1_ps(1.0f / kDigitBase), inv2 = _mm512_set1_ps(1.0f / (kDigitBase * kDigitBase));
  constexpr int32_t kOffset = kNibbles ? 8 : 128;  // what `digit_products` added to each weight
  const int64_t per_group = p.k / p.groups;
  __m512 total[MT][NB];
  for (int r = 0; r < MT; ++r)
    for (int b = 0; b < NB; ++b) total[r][b] = _mm512_setzero_ps();
  // The scales of a block are one line a group, N floats apart: fetched kScaleAhead groups ahead.
  constexpr int64_t kScaleAhead = 4;
  for (int64_t g = 0; g < std::min(kScaleAhead, p.groups); ++g)
    for (int b = 0; b < NB; ++b) _mm_prefetch(reinterpret_cast<const char*>(p.s + g * p.n + (jb + b) * kBlock), _MM_HINT_T0);
  for (int64_t g = 0; g < p.groups; ++g) {
    if (g + kScaleAhead < p.groups)
      for (int b = 0; b < NB; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(p.s + (g + kScaleAhead) * p.n + (jb + b) * kBlock), _MM_HINT_T0);
    __m512i acc[MT][NB][kDigits];
    digit_products<MT, NB, kNibbles>(p, jb, m0, g * per_group, (g + 1) * per_group, acc);
    for (int r = 0; r < MT; ++r) {
      __m512i shift[kDigits];
      for (int i = 0; i < kDigits; ++i) shift[i] = _mm512_set1_epi32(kOffset * p.digit_sums[(i * dg.m + m0 + r) * p.groups + g]);
      for (int b = 0; b < NB; ++b) {
        __m512 v[kDigits];
        for (int i = 0; i < kDigits; ++i) v[i] = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][b][i], shift[i]));
        const __m512 block = _mm512_fmadd_ps(v[2], inv2, _mm512_fmadd_ps(v[1], inv1, v[0]));
        total[r][b] = _mm512_fmadd_ps(_mm512_loadu_ps(p.s + g * p.n + (jb + b) * kBlock), block, total[r][b]);
      }
    }
  }
  for (int r = 0; r < MT; ++r) {
    const __m512 s0 = _mm512_set1_ps(dg.s0[m0 + r]);
    for (int b = 0; b < NB; ++b)
      _mm512_storeu_ps(p.y + y_row(p, m0 + r) * p.n + (jb + b) * kBlock, _mm512_mul_ps(total[r][b], s0));
  }
}

// Rows [m0, m0 + MT) x NB column blocks on the integer path, one scale a channel or a block.
template <int MT, int NB>
void digits_tile_any(const Problem<int8_t>& p, int64_t jb, int64_t m0) {
  if (p.nibbles) {
    if (p.groups == 1) return digits_tile<MT, NB, true>(p, jb, m0);
    return digits_tile_grouped<MT, NB, true>(p, jb, m0);
  }
  if (p.groups == 1) return digits_tile<MT, NB, false>(p, jb, m0);
  return digits_tile_grouped<MT, NB, false>(p, jb, m0);
}

template <int MT>
void digits_tile_blocks(const Problem<int8_t>& p, int64_t jb, int64_t m0, int64_t nb) {
  if constexpr (MT == 1) {
    switch (nb) {
      case 4: return digits_tile_any<1, 4>(p, jb, m0);
      case 3: return digits_tile_any<1, 3>(p, jb, m0);
      case 2: return digits_tile_any<1, 2>(p, jb, m0);
      default: return digits_tile_any<1, 1>(p, jb, m0);
    }
  } else {
    if (nb == 2) return digits_tile_any<MT, 2>(p, jb, m0);
    return digits_tile_any<MT, 1>(p, jb, m0);
  }
}

// Column blocks [lo, hi) of an int8 call on the integer path, every row (as `blocks`).
void digits_blocks(const Problem<int8_t>& p, int64_t lo, int64_t hi) {
  const int64_t tiles = (p.m + kMaxTile - 1) / kMaxTile;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t m0 = p.m * t / tiles, rows = p.m * (t + 1) / tiles - m0;
    const int64_t step = blocks_per_tile(rows);
    for (int64_t jb = lo; jb < hi; jb += step) {
      const int64_t nb = std::min(step, hi - jb);
      switch (rows) {
        case 1: digits_tile_blocks<1>(p, jb, m0, nb); break;
        case 2: digits_tile_blocks<2>(p, jb, m0, nb); break;
        case 3: digits_tile_blocks<3>(p, jb, m0, nb); break;
        case 4: digits_tile_any<4, 1>(p, jb, m0); break;
        case 5: digits_tile_any<5, 1>(p, jb, m0); break;
        default: digits_tile_any<6, 1>(p, jb, m0); break;
      }
    }
  }
}
#endif

// Whether the int8 calls of this build multiply in integer digits (`digits_of`).
constexpr bool kInt8Digits =
#if defined(SPECJAX_INT8_DIGITS)
    true;
#else
    false;
#endif

// A tile read where the call's layout holds the blocks (Stripe: the copy `stripe_of` made).
template <typename W>
struct Stripe {
  const W* w;  // block jb's row 0
  int64_t row_stride, block_stride;
};

template <typename W, int MT, int NB>
void tile(const Problem<W>& p, const Stripe<W>& at, int64_t jb, int64_t m0) {
  const int64_t n0 = jb * kBlock;
  if constexpr (std::is_same_v<W, int8_t>) {
    if (p.nibbles) {
      if (p.groups == 1)
        return tile_at<W, MT, NB, Scale::kChannel, true>(p, at.w, at.row_stride, at.block_stride, n0, m0);
      return tile_at<W, MT, NB, Scale::kBlock, true>(p, at.w, at.row_stride, at.block_stride, n0, m0);
    }
    if (p.groups == 1)
      return tile_at<W, MT, NB, Scale::kChannel>(p, at.w, at.row_stride, at.block_stride, n0, m0);
    return tile_at<W, MT, NB, Scale::kBlock>(p, at.w, at.row_stride, at.block_stride, n0, m0);
  } else {
    return tile_at<W, MT, NB, Scale::kNone>(p, at.w, at.row_stride, at.block_stride, n0, m0);
  }
}

// The blocks a tile of `rows` rows takes at once (at most 12 accumulators).
inline int64_t blocks_per_tile(int64_t rows) { return rows == 1 ? 4 : rows <= 3 ? 2 : 1; }

template <typename W, int MT>
void tile_blocks(const Problem<W>& p, const Stripe<W>& at, int64_t jb, int64_t m0, int64_t nb) {
  if constexpr (MT == 1) {
    switch (nb) {
      case 4: return tile<W, 1, 4>(p, at, jb, m0);
      case 3: return tile<W, 1, 3>(p, at, jb, m0);
      case 2: return tile<W, 1, 2>(p, at, jb, m0);
      default: return tile<W, 1, 1>(p, at, jb, m0);
    }
  } else {
    if (nb == 2) return tile<W, MT, 2>(p, at, jb, m0);
    return tile<W, MT, 1>(p, at, jb, m0);
  }
}

template <typename W>
void tile_rows(const Problem<W>& p, const Stripe<W>& at, int64_t jb, int64_t m0, int64_t rows,
               int64_t nb) {
  switch (rows) {
    case 1: return tile_blocks<W, 1>(p, at, jb, m0, nb);
    case 2: return tile_blocks<W, 2>(p, at, jb, m0, nb);
    case 3: return tile_blocks<W, 3>(p, at, jb, m0, nb);
    case 4: return tile<W, 4, 1>(p, at, jb, m0);
    case 5: return tile<W, 5, 1>(p, at, jb, m0);
    default: return tile<W, 6, 1>(p, at, jb, m0);
  }
}

constexpr int64_t kStripeBlocks = 4;  // column blocks copied to a stripe at once

// Column blocks [lo, hi), every row: the rows in ceil(M / 6) tiles of balanced size. Where the
// blocks are strided (a float kernel as stored) and a tile takes one block at a time (4 rows or
// more: one 64-byte piece of each strided row, a new page every row) or several tiles re-read
// them, up to 4 blocks are first copied to a contiguous stripe (thread-local scratch), reading
// 256 contiguous bytes of each row: the same weights in the same order, so the same sums.
template <typename W>
void blocks(const Problem<W>& p, int64_t lo, int64_t hi) {
#if defined(SPECJAX_INT8_DIGITS)
  if constexpr (std::is_same_v<W, int8_t>)
    if (p.digits != nullptr) return digits_blocks(p, lo, hi);
#endif
  const int64_t tiles = (p.m + kMaxTile - 1) / kMaxTile;
  const bool restripe = p.row_stride != kBlock && (tiles > 1 || blocks_per_tile(p.m) == 1);
  thread_local std::vector<W> scratch;
  if (restripe) scratch.resize(p.k * kBlock * kStripeBlocks);
  W* const stripe = scratch.data();  // read once: a thread_local's address is a call away (-fPIC)
  for (int64_t jb0 = lo; jb0 < hi;) {
    // blocks handled per pass over the rows
    const int64_t span = restripe ? std::min(kStripeBlocks, hi - jb0) : hi - jb0;
    Stripe<W> at{p.w + jb0 * p.block_stride, p.row_stride, p.block_stride};
    if (restripe) {
      for (int64_t k = 0; k < p.k; ++k) {
        if (k + 8 < p.k)
          for (int64_t b = 0; b < span; ++b) __builtin_prefetch(at.w + b * p.block_stride + (k + 8) * p.row_stride);
        for (int64_t b = 0; b < span; ++b)
          std::memcpy(stripe + (b * p.k + k) * kBlock, at.w + b * p.block_stride + k * p.row_stride,
                      kBlock * sizeof(W));
      }
      at = Stripe<W>{stripe, kBlock, p.k * kBlock};
    }
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t m0 = p.m * t / tiles, m1 = p.m * (t + 1) / tiles;
      const int64_t step = blocks_per_tile(m1 - m0);
      for (int64_t j = 0; j < span; j += step) {
        Stripe<W> from = at;
        from.w = at.w + j * at.block_stride;
        tile_rows(p, from, jb0 + j, m0, m1 - m0, std::min(step, span - j));
      }
    }
    jb0 += span;
  }
}

// One rows-layout call: y = x @ w.T, w the chosen layer's [N, K].
template <typename W>
struct RowsProblem {
  const float* x;  // [M, K]
  const W* w;      // [N, K]
  float* y;        // [M, N]
  int64_t m, k, n;
  const int64_t* y_rows = nullptr;  // as Problem's
};

constexpr int64_t kRowsUnit = 16;  // outputs per unit of work handed out

// Rows [m0, m0 + MT) x outputs [n0, n0 + NR): MT x NR vector accumulators over k, 8 at a time;
// each weight row is read once for the MT rows of x.
template <typename W, int MT, int NR>
void rows_tile(const RowsProblem<W>& p, int64_t n0, int64_t m0) {
  v8f acc[MT][NR];
  for (int r = 0; r < MT; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = v8f{};
  const float* x = p.x + m0 * p.k;
  const W* w = p.w + n0 * p.k;
  for (int64_t k = 0; k < p.k; k += 8) {
    v8f xv[MT];
    for (int r = 0; r < MT; ++r) xv[r] = load_f32(x + r * p.k + k);
    for (int c = 0; c < NR; ++c) {
      const v8f wv = load_weights(w + c * p.k + k);
      for (int r = 0; r < MT; ++r) acc[r][c] = fma8(xv[r], wv, acc[r][c]);
    }
  }
  for (int r = 0; r < MT; ++r)
    for (int c = 0; c < NR; ++c) {
      const v8f a = acc[r][c];
      p.y[y_row(p, m0 + r) * p.n + n0 + c] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    }
}

// Outputs [n0, n1) for a tile of MT rows: NR at a time (NR divides kRowsUnit; at most 12
// accumulators), a short unit's last ones one by one.
template <typename W, int MT>
void rows_span(const RowsProblem<W>& p, int64_t n0, int64_t n1, int64_t m0) {
  constexpr int NR = MT == 1 ? 8 : MT <= 3 ? 4 : 2;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) rows_tile<W, MT, NR>(p, n, m0);
  for (; n < n1; ++n) rows_tile<W, MT, 1>(p, n, m0);
}

// Units [lo, hi) (kRowsUnit outputs each, the last one short), every row: a unit's weights
// (16 rows of K) are read from memory once, then from the caches by each tile of up to 6 rows.
template <typename W>
void blocks(const RowsProblem<W>& p, int64_t lo, int64_t hi) {
  const int64_t tiles = (p.m + kMaxTile - 1) / kMaxTile;
  for (int64_t u = lo; u < hi; ++u) {
    const int64_t n0 = u * kRowsUnit, n1 = std::min(n0 + kRowsUnit, p.n);
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t m0 = p.m * t / tiles, rows = p.m * (t + 1) / tiles - m0;
      switch (rows) {
        case 1: rows_span<W, 1>(p, n0, n1, m0); break;
        case 2: rows_span<W, 2>(p, n0, n1, m0); break;
        case 3: rows_span<W, 3>(p, n0, n1, m0); break;
        case 4: rows_span<W, 4>(p, n0, n1, m0); break;
        case 5: rows_span<W, 5>(p, n0, n1, m0); break;
        default: rows_span<W, 6>(p, n0, n1, m0); break;
      }
    }
  }
}

// Units of work of a problem: column blocks, or kRowsUnit outputs of a rows problem.
template <typename W>
int64_t units(const Problem<W>& p) { return p.m == 0 ? 0 : p.n / kBlock; }
template <typename W>
int64_t units(const RowsProblem<W>& p) { return p.m == 0 ? 0 : (p.n + kRowsUnit - 1) / kRowsUnit; }

// The units of one call (the column blocks of every kernel of its group, one after the other;
// or a rows problem's outputs), handed out in chunks to whichever thread asks next: the calling
// thread and the crew's helpers (cpu_crew.h). Shared (heap) state, so a helper that comes after
// the call has returned finds no chunk left and leaves.
template <typename P>
struct Work {
  std::vector<P> problems;
  std::vector<int64_t> first;  // problems[i]'s blocks are [first[i], first[i + 1])
  int64_t nblocks = 0, chunk = 1;
  std::atomic<int64_t> next{0}, done{0};
  std::shared_ptr<const void> keep;  // what the problems point into (the int8 digits, the live rows)
};

template <typename P>
void run_chunks(Work<P>& work) {
  for (;;) {
    const int64_t lo = work.next.fetch_add(work.chunk, std::memory_order_relaxed);
    if (lo >= work.nblocks) return;
    const int64_t hi = std::min(lo + work.chunk, work.nblocks);
    for (size_t i = 0; i < work.problems.size(); ++i) {
      const int64_t from = std::max(lo, work.first[i]), to = std::min(hi, work.first[i + 1]);
      if (from < to) blocks(work.problems[i], from - work.first[i], to - work.first[i]);
    }
    work.done.fetch_add(hi - lo, std::memory_order_release);
  }
}

int64_t product(ffi::Span<const int64_t> dims, size_t from, size_t to) {
  int64_t out = 1;
  for (size_t i = from; i < to; ++i) out *= dims[i];
  return out;
}

// Runs the call: the column blocks of all its kernels shared out over the calling thread and
// the crew (one hand-off for the group: kernels of one input, e.g. q / k / v, go together).
template <typename P>
ffi::Error run(ffi::ThreadPool& pool, std::vector<P> problems,
               std::shared_ptr<const void> keep = nullptr) {
  auto work = std::make_shared<Work<P>>();
  work->keep = std::move(keep);
  work->first.push_back(0);
  for (const auto& p : problems) work->first.push_back(work->first.back() + units(p));
  work->problems = std::move(problems);
  const int64_t nblocks = work->nblocks = work->first.back();
  if (nblocks == 0) return ffi::Error::Success();
  const int64_t threads = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), nblocks);
  work->chunk = std::max<int64_t>(1, nblocks / (4 * threads));
  // Only chunks other threads took are left when the caller's loop ends, and those threads are
  // running them: waiting for them cannot deadlock (a helper that comes later finds nothing
  // left and touches nothing).
  specjax_crew::share(pool, threads - 1, [work] { run_chunks(*work); },
                      [&] { return work->done.load(std::memory_order_acquire) >= nblocks; });
  return ffi::Error::Success();
}

ffi::Error invalid(const std::string& message) { return ffi::Error::InvalidArgument(message); }

// The checks every kind shares: x's rows, y's size and the layer index. Sets M and l.
ffi::Error check_rows(const char* name, int64_t x_count, int64_t y_count, int64_t K, int64_t N,
                      int64_t layer, int64_t L, int64_t& M) {
  const std::string kernel(name);
  if (K == 0 || x_count % K != 0) return invalid(kernel + ": x's last axis is not the kernel's input size");
  M = x_count / K;
  if (y_count != M * N) return invalid(kernel + ": output size is not M x N");
  if (layer < 0 || layer >= L) return invalid(kernel + ": layer index out of range");
  return ffi::Error::Success();
}

// The live rows of a call's x (one copy, [M', K]) and the rows of y they write.
struct Compact {
  std::vector<float> x;
  std::vector<int64_t> rows;
};

// Points every problem of a call (one x) at the live rows of x (`live` s32 [M] or [0]: every row
// live) and zeroes the dead rows of each y -> what the problems point into (null when every
// row is live: the problems are untouched).
template <typename P>
ffi::ErrorOr<std::shared_ptr<Compact>> compact(const ffi::Buffer<ffi::S32>& live, std::vector<P>& problems) {
  if (live.element_count() == 0 || problems.empty()) return std::shared_ptr<Compact>();
  const int64_t M = problems[0].m, K = problems[0].k;
  if (live.element_count() != M)
    return ffi::Unexpected(ffi::Error::InvalidArgument("matmul: live must hold a flag per row of x"));
  const int32_t* flags = live.typed_data();
  auto out = std::make_shared<Compact>();
  for (int64_t m = 0; m < M; ++m)
    if (flags[m] != 0) out->rows.push_back(m);
  const int64_t kept = out->rows.size();
  if (kept == M) return std::shared_ptr<Compact>();
  out->x.resize(kept * K);
  for (int64_t i = 0; i < kept; ++i)
    std::memcpy(out->x.data() + i * K, problems[0].x + out->rows[i] * K, K * sizeof(float));
  for (auto& p : problems) {
    for (int64_t m = 0; m < M; ++m)
      if (flags[m] == 0) std::memset(p.y + m * p.n, 0, p.n * sizeof(float));
    p.x = out->x.data(), p.m = kept, p.y_rows = out->rows.data();
  }
  return out;
}

ffi::ErrorOr<int64_t> layer_of(ffi::Buffer<ffi::S32>& layer) {
  if (layer.element_count() != 1) return ffi::Unexpected(invalid("qmatmul: layer must be a scalar"));
  return int64_t(layer.typed_data()[0]);
}

// One int8 kernel of a group: w [L, N/16, K, 16] (int8 values) or u8 [L, N/16, K/2, 16] (int4
// values two a byte) and s [L, G, N] at the layer.
ffi::ErrorOr<Problem<int8_t>> int8_problem(const float* x, int64_t x_count, ffi::AnyBuffer w,
                                           ffi::AnyBuffer s, ffi::Result<ffi::AnyBuffer> y,
                                           int64_t l) {
  const auto wd = w.dimensions();
  const auto sd = s.dimensions();
  const bool nibbles = w.element_type() == ffi::U8;
  if ((w.element_type() != ffi::S8 && !nibbles) || s.element_type() != ffi::F32 ||
      y->element_type() != ffi::F32)
    return ffi::Unexpected(invalid("qmatmul: w must be int8 (or uint8: int4 two a byte), s and y f32"));
  if (wd.size() < 4 || sd.size() < 3)
    return ffi::Unexpected(invalid("qmatmul: w must be [L, N/16, K, 16] (uint8: [L, N/16, K/2, 16]), s [L, G, N]"));
  const size_t wr = wd.size(), sr = sd.size();
  if (wd[wr - 1] != kBlock || product(wd, 0, wr - 4) != 1 || product(sd, 0, sr - 3) != 1)
    return ffi::Unexpected(invalid("qmatmul: w must be [L, N/16, K, 16] (uint8: [L, N/16, K/2, 16]), s [L, G, N]"));
  const int64_t L = wd[wr - 4], nblocks = wd[wr - 3], rows = wd[wr - 2], N = nblocks * kBlock;
  const int64_t K = nibbles ? 2 * rows : rows;
  if (nibbles && K % 8 != 0)
    return ffi::Unexpected(invalid("qmatmul: int4 two a byte needs K a multiple of 8"));
  const int64_t G = sd[sr - 2];
  if (sd[sr - 3] != L || sd[sr - 1] != N || G < 1 || K % G != 0)
    return ffi::Unexpected(invalid("qmatmul: scale shape does not match the kernel"));
  int64_t M = 0;
  if (auto error = check_rows("qmatmul", x_count, y->element_count(), K, N, l, L, M); error.failure())
    return ffi::Unexpected(error);
  Problem<int8_t> p{x, static_cast<const int8_t*>(w.untyped_data()) + l * nblocks * rows * kBlock,
                    static_cast<const float*>(s.untyped_data()) + l * G * N,
                    static_cast<float*>(y->untyped_data()), M, K, N, G, kBlock, rows * kBlock};
  p.nibbles = nibbles;
  return p;
}

// One float kernel of a group: w [L, K, N] as stored (W: float, or uint16_t holding bf16).
template <typename W>
ffi::ErrorOr<Problem<W>> float_problem(const float* x, int64_t x_count, ffi::AnyBuffer w,
                                       ffi::Result<ffi::AnyBuffer> y, int64_t l) {
  const ffi::DataType want = std::is_same_v<W, float> ? ffi::F32 : ffi::BF16;
  if (w.element_type() != want || y->element_type() != ffi::F32)
    return ffi::Unexpected(invalid("matmul: the kernels of a call must share one dtype, y f32"));
  const auto wd = w.dimensions();
  const size_t wr = wd.size();
  if (wr < 3 || product(wd, 0, wr - 3) != 1) return ffi::Unexpected(invalid("matmul: w must be [L, K, N]"));
  const int64_t L = wd[wr - 3], K = wd[wr - 2], N = wd[wr - 1];
  if (N % kBlock != 0) return ffi::Unexpected(invalid("matmul: N must be a multiple of 16"));
  int64_t M = 0;
  if (auto error = check_rows("matmul", x_count, y->element_count(), K, N, l, L, M); error.failure())
    return ffi::Unexpected(error);
  return Problem<W>{x, static_cast<const W*>(w.untyped_data()) + l * K * N, nullptr,
                    static_cast<float*>(y->untyped_data()), M, K, N, 1, N, kBlock};
}

// One float kernel of a group packed in column blocks: w [L, N/16, K, 16] (W: float, or
// uint16_t holding bf16), each block one contiguous stream as the int8 kernel's.
template <typename W>
ffi::ErrorOr<Problem<W>> blocks_problem(const float* x, int64_t x_count, ffi::AnyBuffer w,
                                        ffi::Result<ffi::AnyBuffer> y, int64_t l) {
  const ffi::DataType want = std::is_same_v<W, float> ? ffi::F32 : ffi::BF16;
  if (w.element_type() != want || y->element_type() != ffi::F32)
    return ffi::Unexpected(invalid("matmul_blocks: the kernels of a call must share one dtype, y f32"));
  const auto wd = w.dimensions();
  const size_t wr = wd.size();
  if (wr < 4 || wd[wr - 1] != kBlock || product(wd, 0, wr - 4) != 1)
    return ffi::Unexpected(invalid("matmul_blocks: w must be [L, N/16, K, 16]"));
  const int64_t L = wd[wr - 4], nblocks = wd[wr - 3], K = wd[wr - 2], N = nblocks * kBlock;
  int64_t M = 0;
  if (auto error = check_rows("matmul_blocks", x_count, y->element_count(), K, N, l, L, M); error.failure())
    return ffi::Unexpected(error);
  return Problem<W>{x, static_cast<const W*>(w.untyped_data()) + l * nblocks * K * kBlock, nullptr,
                    static_cast<float*>(y->untyped_data()), M, K, N, 1, kBlock, K * kBlock};
}

// x @ each int8 kernel of the group: args (w_0, s_0, w_1, s_1, ...), results (y_0, y_1, ...).
ffi::Error QMatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                       ffi::Buffer<ffi::S32> live, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  auto l = layer_of(layer);
  if (l.has_error()) return l.error();
  if (args.size() != 2 * rets.size() || rets.size() == 0)
    return invalid("qmatmul: a (kernel, scale) pair per result");
  std::vector<Problem<int8_t>> problems;
  for (size_t i = 0; i < rets.size(); ++i) {
    auto w = args.get<ffi::AnyBuffer>(2 * i);
    auto s = args.get<ffi::AnyBuffer>(2 * i + 1);
    auto y = rets.get<ffi::AnyBuffer>(i);
    if (w.has_error() || s.has_error() || y.has_error()) return invalid("qmatmul: bad operands");
    auto p = int8_problem(x.typed_data(), x.element_count(), *w, *s, *y, *l);
    if (p.has_error()) return p.error();
    problems.push_back(*p);
  }
  auto rows = compact(live, problems);
  if (rows.has_error()) return rows.error();
  // The integer path for each kernel whose scale blocks hold a multiple of 4 inputs (8 for int4
  // two a byte; one scale a channel; int4's blocks of 32); x's digits made once for the group.
  std::shared_ptr<Digits> digits;
  for (auto& p : problems) {
    if (!kInt8Digits || p.m == 0 || p.k > kMaxDigitsK || p.groups <= 0 || p.k % p.groups != 0 ||
        (p.k / p.groups) % (p.nibbles ? 8 : 4) != 0)
      continue;
    if (!digits) digits = digits_of(p.x, p.m, p.k);
    p.digits = digits.get();
    p.digit_sums = digits->sums_for(p.groups);
  }
  return run(pool, std::move(problems), std::make_shared<std::pair<std::shared_ptr<Compact>, std::shared_ptr<Digits>>>(
                                            std::move(*rows), std::move(digits)));
}

// One rows-layout kernel: w [L, N, K] as stored (K a multiple of 8).
template <typename W>
ffi::ErrorOr<RowsProblem<W>> rows_problem(const float* x, int64_t x_count, ffi::AnyBuffer w,
                                          ffi::Result<ffi::AnyBuffer> y, int64_t l) {
  const ffi::DataType want = std::is_same_v<W, float> ? ffi::F32 : ffi::BF16;
  if (w.element_type() != want || y->element_type() != ffi::F32)
    return ffi::Unexpected(invalid("matmul_rows: the kernels of a call must share one dtype, y f32"));
  const auto wd = w.dimensions();
  const size_t wr = wd.size();
  if (wr < 3 || product(wd, 0, wr - 3) != 1) return ffi::Unexpected(invalid("matmul_rows: w must be [L, N, K]"));
  const int64_t L = wd[wr - 3], N = wd[wr - 2], K = wd[wr - 1];
  if (K % 8 != 0) return ffi::Unexpected(invalid("matmul_rows: K must be a multiple of 8"));
  int64_t M = 0;
  if (auto error = check_rows("matmul_rows", x_count, y->element_count(), K, N, l, L, M); error.failure())
    return ffi::Unexpected(error);
  return RowsProblem<W>{x, static_cast<const W*>(w.untyped_data()) + l * N * K,
                        static_cast<float*>(y->untyped_data()), M, K, N};
}

// x @ each float kernel of the group: args (w_0, w_1, ...), results (y_0, y_1, ...); Make
// reads one kernel's problem (float_problem, rows_problem).
template <typename P, ffi::ErrorOr<P> (*Make)(const float*, int64_t, ffi::AnyBuffer,
                                               ffi::Result<ffi::AnyBuffer>, int64_t)>
ffi::Error MatmulFloat(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                       ffi::Buffer<ffi::S32> live, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  auto l = layer_of(layer);
  if (l.has_error()) return l.error();
  if (args.size() != rets.size() || rets.size() == 0) return invalid("matmul: a kernel per result");
  std::vector<P> problems;
  for (size_t i = 0; i < rets.size(); ++i) {
    auto w = args.get<ffi::AnyBuffer>(i);
    auto y = rets.get<ffi::AnyBuffer>(i);
    if (w.has_error() || y.has_error()) return invalid("matmul: bad operands");
    auto p = Make(x.typed_data(), x.element_count(), *w, *y, *l);
    if (p.has_error()) return p.error();
    problems.push_back(*p);
  }
  auto rows = compact(live, problems);
  if (rows.has_error()) return rows.error();
  return run(pool, std::move(problems), std::move(*rows));
}

#define SPECJAX_FLOAT_KIND(name, P, Make)                                                      \
  ffi::Error name(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer, \
                  ffi::Buffer<ffi::S32> live, ffi::RemainingArgs args, ffi::RemainingRets rets) { \
    return MatmulFloat<P, Make>(pool, x, layer, live, args, rets);                            \
  }

SPECJAX_FLOAT_KIND(MatmulF32, Problem<float>, float_problem<float>)
SPECJAX_FLOAT_KIND(MatmulBF16, Problem<uint16_t>, float_problem<uint16_t>)
SPECJAX_FLOAT_KIND(MatmulBlocksF32, Problem<float>, blocks_problem<float>)
SPECJAX_FLOAT_KIND(MatmulBlocksBF16, Problem<uint16_t>, blocks_problem<uint16_t>)
SPECJAX_FLOAT_KIND(MatmulRowsF32, RowsProblem<float>, rows_problem<float>)
SPECJAX_FLOAT_KIND(MatmulRowsBF16, RowsProblem<uint16_t>, rows_problem<uint16_t>)

}  // namespace

#define SPECJAX_GROUP_HANDLER(symbol, function)                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, function,                                \
                                ffi::Ffi::Bind()                                 \
                                    .Ctx<ffi::ThreadPool>()                      \
                                    .Arg<ffi::Buffer<ffi::F32>>()                \
                                    .Arg<ffi::Buffer<ffi::S32>>()                \
                                    .Arg<ffi::Buffer<ffi::S32>>()                \
                                    .RemainingArgs()                             \
                                    .RemainingRets());

SPECJAX_GROUP_HANDLER(SpecjaxQMatmulInt8, QMatmulInt8)
SPECJAX_GROUP_HANDLER(SpecjaxMatmulF32, MatmulF32)
SPECJAX_GROUP_HANDLER(SpecjaxMatmulBF16, MatmulBF16)
SPECJAX_GROUP_HANDLER(SpecjaxMatmulBlocksF32, MatmulBlocksF32)
SPECJAX_GROUP_HANDLER(SpecjaxMatmulBlocksBF16, MatmulBlocksBF16)
SPECJAX_GROUP_HANDLER(SpecjaxMatmulRowsF32, MatmulRowsF32)
SPECJAX_GROUP_HANDLER(SpecjaxMatmulRowsBF16, MatmulRowsBF16)
