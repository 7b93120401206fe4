// The argmax of each row, for XLA CPU through the XLA FFI (kernels/argmax_cpu.py).
//
// x    f32 [M, V]    (any leading shape; M = elements / V)
// out  s32 [M]       the first index of the row's largest value; where the row holds a NaN,
//                    the first NaN's index (jnp.argmax's)
//
// Why a kernel: greedy decoding takes the argmax of every verified token's logits, and XLA
// CPU's variadic reduce runs it at ~0.5 GB/s (SmolLM2's 49152 logits: ~0.09 ms a row; a
// verify of 9 tokens at B = 8, 72 rows, ~5 ms of a ~25 ms step). Here a row is read twice
// (its maximum, then where it first occurs, from the caches), 8 lanes at a time; rows are
// shared out over the kernels' crew of helper threads (cpu_crew.h).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_crew.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Whether any lane of a comparison's result is set.
inline bool any(v8i mask) {
  int32_t lanes[8];
  std::memcpy(lanes, &mask, sizeof lanes);
  int32_t acc = 0;
  for (int i = 0; i < 8; ++i) acc |= lanes[i];
  return acc != 0;
}

int32_t row_argmax(const float* x, int64_t n) {
  const float lowest = -std::numeric_limits<float>::infinity();
  v8f top = v8f{lowest, lowest, lowest, lowest, lowest, lowest, lowest, lowest};
  v8i nan = v8i{};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8f v = load8(x + i);
    nan |= v != v;
    top = v > top ? v : top;
  }
  bool has_nan = any(nan);
  float best = lowest;
  for (int k = 0; k < 8; ++k) best = std::max(best, top[k]);
  for (; i < n; ++i) {
    has_nan |= x[i] != x[i];
    best = std::max(best, x[i]);
  }
  // Where it first occurs: 8 lanes at a time until a lane hits, then that block one by one.
  const v8f want = v8f{best, best, best, best, best, best, best, best};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const v8f v = load8(x + j);
    if (any(has_nan ? v != v : v == want)) break;
  }
  for (; j < n; ++j)
    if (has_nan ? x[j] != x[j] : x[j] == best) return int32_t(j);
  return 0;  // an empty row
}

// Rows handed out this many at a time (a SmolLM2 row is 192 KB).
constexpr int64_t kRowsPerItem = 2;

ffi::Error ArgmaxRows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  const auto dims = x.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("argmax: x must have a last axis");
  const int64_t V = dims[dims.size() - 1];
  const int64_t M = out->element_count();
  if (M * V != x.element_count()) return ffi::Error::InvalidArgument("argmax: out must be x's leading shape");
  if (V >= (int64_t(1) << 31)) return ffi::Error::InvalidArgument("argmax: rows longer than 2^31 - 1");
  const float* xs = x.typed_data();
  int32_t* ys = out->typed_data();
  const auto rows = [&](int64_t item) {
    for (int64_t m = item * kRowsPerItem; m < std::min(M, (item + 1) * kRowsPerItem); ++m)
      ys[m] = row_argmax(xs + m * V, V);
  };
  const int64_t items = (M + kRowsPerItem - 1) / kRowsPerItem;
  // below ~64K numbers handing rows out costs more than it saves
  specjax_crew::parallel_for(pool, items, rows, M * V >= (int64_t(1) << 16));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxArgmaxRows, ArgmaxRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
