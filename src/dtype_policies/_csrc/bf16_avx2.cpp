// bfloat16 products at a few rows on x86 CPUs with AVX2 and FMA but no native
// bfloat16 instructions, where torch's bfloat16 product converts element by
// element and runs at a third to a half of the speed of reading the weight:
//
//   dtype_policies::bf16_mm_avx2(x, weight, bias) -> y
//   y[m, n] = bf16( sum_k x[m, k] * weight[n, k] + bias[n] )
//
// x: (M, K) bfloat16; weight: (N, K) bfloat16, rows contiguous (the layout of
// nn.Linear's weight: no packing, the kept weight itself); bias: (N,) float32
// or bfloat16, or none; y: (M, N) bfloat16. Products of two bfloat16 values
// are exact in float32, the sums are float32 (in this kernel's order), and
// each output is rounded once to bfloat16 (nearest even), after the bias: the
// values of a native bfloat16 product up to the order of the float32 sums.
//
// Each 32-bit lane of a 256-bit load of the weight holds two consecutive
// bfloat16 values: shifted left by 16 the lane is the first as a float32,
// masked to its high half the second. The input row is split the same way once
// per call (its even and odd elements as float32), so that the loop over the
// weight is a load, a shift, an and and two fused multiply-adds per 16 weights
// and row, with no shuffles. A tile of R rows by C columns keeps R * C
// accumulators in registers; the columns are shared among torch's threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int64_t kChunk = 16;  // weights per 256-bit load
// Below this many multiply-adds one thread does the whole product: the
// parallel region's fixed cost is larger than what a second thread saves.
constexpr int64_t kParallelMinMacs = int64_t{1} << 17;

inline float to_float(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// x split per row: for chunk j, 8 even-indexed inputs then 8 odd-indexed ones,
// as float32; then the K % 16 tail inputs in order.
struct SplitRows {
  const float* data;
  int64_t stride;  // floats per row
  int64_t chunks;
  int64_t tail;
};

template <int R, int C>
inline void tile(const SplitRows& x, int64_t r0, const uint16_t* w, int64_t k, int64_t c0,
                 const float* bias, c10::BFloat16* y, int64_t n) {
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const uint16_t* col[C];
  for (int c = 0; c < C; ++c) col[c] = w + (c0 + c) * k;
  const float* row[R];
  for (int r = 0; r < R; ++r) row[r] = x.data + (r0 + r) * x.stride;
  // The next tile's columns follow these in memory: fetched while these are
  // multiplied, C / 2 lines per step (the hardware prefetcher alone leaves
  // short rows read from memory at a third of its bandwidth).
  const char* next = reinterpret_cast<const char*>(w + (c0 + C) * k);
  const char* last = reinterpret_cast<const char*>(w + n * k);
  for (int64_t j = 0; j < x.chunks; ++j) {
    for (int l = 0; l < C * 32; l += 64) {
      const char* line = next + j * C * 32 + l;
      if (line < last) _mm_prefetch(line, _MM_HINT_T0);
    }
    for (int c = 0; c < C; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(col[c] + j * kChunk));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      for (int r = 0; r < R; ++r) {
        acc[r][c] = _mm256_fmadd_ps(even, _mm256_loadu_ps(row[r] + j * kChunk), acc[r][c]);
        acc[r][c] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(row[r] + j * kChunk + 8), acc[r][c]);
      }
    }
  }
  const int64_t k_tail = x.chunks * kChunk;
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      const __m128 lo = _mm256_castps256_ps128(acc[r][c]);
      const __m128 hi = _mm256_extractf128_ps(acc[r][c], 1);
      __m128 s = _mm_add_ps(lo, hi);
      s = _mm_add_ps(s, _mm_movehl_ps(s, s));
      s = _mm_add_ss(s, _mm_movehdup_ps(s));
      float sum = _mm_cvtss_f32(s);
      const float* tail = row[r] + k_tail;
      for (int64_t t = 0; t < x.tail; ++t) sum += tail[t] * to_float(col[c][k_tail + t]);
      if (bias != nullptr) sum += bias[c0 + c];
      y[(r0 + r) * n + c0 + c] = c10::BFloat16(sum);
    }
  }
}

// Columns [c0, c1) for every row: tiles of up to 3 rows by 4 columns (8
// columns for a single row), the last columns one at a time.
void columns(const SplitRows& x, int64_t m, const uint16_t* w, int64_t k, int64_t c0, int64_t c1,
             const float* bias, c10::BFloat16* y, int64_t n) {
  int64_t c = c0;
  if (m == 1) {
    for (; c + 8 <= c1; c += 8) tile<1, 8>(x, 0, w, k, c, bias, y, n);
    for (; c < c1; ++c) tile<1, 1>(x, 0, w, k, c, bias, y, n);
    return;
  }
  for (; c + 4 <= c1; c += 4) {
    int64_t r = 0;
    for (; r + 3 <= m; r += 3) tile<3, 4>(x, r, w, k, c, bias, y, n);
    if (m - r == 2) tile<2, 4>(x, r, w, k, c, bias, y, n);
    if (m - r == 1) tile<1, 4>(x, r, w, k, c, bias, y, n);
  }
  for (; c < c1; ++c)
    for (int64_t r = 0; r < m; ++r) tile<1, 1>(x, r, w, k, c, bias, y, n);
}

at::Tensor bf16_mm_avx2(const at::Tensor& x_in, const at::Tensor& weight_in,
                        const std::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16,
              "bf16_mm_avx2: x must be a 2-D bfloat16 tensor, got ", x_in.scalar_type(),
              " of shape ", x_in.sizes());
  TORCH_CHECK(weight_in.dim() == 2 && weight_in.scalar_type() == at::kBFloat16 &&
                  weight_in.size(1) == x_in.size(1),
              "bf16_mm_avx2: weight must be a 2-D bfloat16 tensor with K=", x_in.size(1),
              " columns, got ", weight_in.scalar_type(), " of shape ", weight_in.sizes());
  const int64_t m = x_in.size(0), k = x_in.size(1), n = weight_in.size(0);
  at::Tensor bias32;  // float32, contiguous: the caller's own when it already is
  if (bias_in.has_value() && bias_in->defined()) {
    const at::Tensor& b = *bias_in;
    TORCH_CHECK(b.dim() == 1 && b.size(0) == n &&
                    (b.scalar_type() == at::kFloat || b.scalar_type() == at::kBFloat16),
                "bf16_mm_avx2: bias must be a (", n, ",) float32 or bfloat16 tensor, got ",
                b.scalar_type(), " of shape ", b.sizes());
    bias32 = b.to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({m, n}, x_in.options());
  if (m == 0 || n == 0) return y;
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();

  const int64_t chunks = k / kChunk, tail = k - chunks * kChunk;
  const int64_t stride = chunks * kChunk + tail;
  std::vector<float> split(static_cast<size_t>(m * stride));
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < m; ++r) {
    const uint16_t* src = xs + r * k;
    float* dst = split.data() + r * stride;
    for (int64_t j = 0; j < chunks; ++j)
      for (int64_t l = 0; l < 8; ++l) {
        dst[j * kChunk + l] = to_float(src[j * kChunk + 2 * l]);
        dst[j * kChunk + 8 + l] = to_float(src[j * kChunk + 2 * l + 1]);
      }
    for (int64_t t = 0; t < tail; ++t) dst[chunks * kChunk + t] = to_float(src[chunks * kChunk + t]);
  }
  const SplitRows rows{split.data(), stride, chunks, tail};
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const float* bias = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  c10::BFloat16* out = reinterpret_cast<c10::BFloat16*>(y.data_ptr<at::BFloat16>());

  // Units of 8 columns, so that each thread's tiles are whole.
  const int64_t units = (n + 7) / 8;
  const int threads = m * n * k >= kParallelMinMacs ? at::get_num_threads() : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#ifdef _OPENMP
    const int64_t team = omp_get_num_threads(), id = omp_get_thread_num();
#else
    const int64_t team = 1, id = 0;
#endif
    const int64_t begin = units * id / team * 8, end = std::min(n, units * (id + 1) / team * 8);
    if (begin < end) columns(rows, m, w, k, begin, end, bias, out, n);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dtype_policies, m) {
  m.def("bf16_mm_avx2(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(dtype_policies, CPU, m) { m.impl("bf16_mm_avx2", &bf16_mm_avx2); }
