// Exact int8 x int8 products on AVX2, without VNNI: the W8A8 product's integer
// accumulators on CPUs whose u8 x s8 instructions saturate.
//
//   dtype_policies::int8_mm_avx2(xq, packed, n) -> (M, n) int32
//
// xq: (M, K) int8 in [-127, 127] (checked), rows contiguous; packed: the
// weight laid out by int8_native.pack, (P, Kp * 16) int8 with P = ceil(N / 16)
// panels of 16 output columns and Kp = K rounded up to a multiple of 4: panel p
// holds, for each group of 4 inputs j, 32 bytes for columns 16p..16p+7 then 32
// for 16p+8..16p+15, each column's 4 inputs in order: byte [p][j][h][c][t] =
// w[16p + 8h + c][4j + t]. Padded columns and inputs are zeros. Any int8
// weight (-128 included).
//
// One vpmaddubsw multiplies 4 inputs of a row by 4 inputs of 8 columns: each
// weight's sign moves onto the input (vpsignb), the weights' magnitudes are the
// unsigned operand, so each pair sum |w0| a0' + |w1| a1' is at most
// 2 * 128 * 127 = 32512 < 32767 (no saturation); vpmaddwd widens to int32.
// The sums are the exact integer products, in any order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kPanel = 16;        // output columns per panel
constexpr int64_t kRowBlock = 4;      // rows per micro-kernel call
// Rows per unit of parallel work: 16 (in L1 up to K = 1536, while the units of
// a chunk go through the weight's panels) for weights that stay in L2, 64 for
// larger ones (each panel read from memory once per 64 rows).
constexpr int64_t kSmallWeightChunk = 16, kLargeWeightChunk = 64;
constexpr int64_t kLargeWeightBytes = int64_t{1} << 20;
constexpr int64_t kParallelMinMacs = int64_t{1} << 17;

// `rows` (1..4) rows of x times one panel: 16 int32 sums per row into y.
template <int rows>
inline void panel_product(const int8_t* x, int64_t ldx, const int8_t* panel, int64_t quads,
                          int32_t* y, int64_t ldy, int64_t columns) {
  __m256i acc[rows][2];
  for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t j = 0; j < quads; ++j) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + 64 * j));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + 64 * j + 32));
    const __m256i m0 = _mm256_abs_epi8(w0), m1 = _mm256_abs_epi8(w1);  // 128 for -128: unsigned
    for (int r = 0; r < rows; ++r) {
      int32_t four;
      std::memcpy(&four, x + r * ldx + 4 * j, 4);
      const __m256i a = _mm256_set1_epi32(four);
      acc[r][0] = _mm256_add_epi32(
          acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(m0, _mm256_sign_epi8(a, w0)), ones));
      acc[r][1] = _mm256_add_epi32(
          acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(m1, _mm256_sign_epi8(a, w1)), ones));
    }
  }
  for (int r = 0; r < rows; ++r) {
    // vpmaddwd left each column's 4 products in one lane: lanes are columns.
    if (columns == kPanel) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), acc[r][0]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + 8), acc[r][1]);
    } else {
      alignas(32) int32_t out[kPanel];
      _mm256_store_si256(reinterpret_cast<__m256i*>(out), acc[r][0]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(out + 8), acc[r][1]);
      std::memcpy(y + r * ldy, out, static_cast<size_t>(columns) * sizeof(int32_t));
    }
  }
}

// Whether any of `count` bytes is -128 (the only input the kernel cannot take).
bool contains_minus_128(const int8_t* x, int64_t count) {
  const __m256i minimum = _mm256_set1_epi8(-128);
  __m256i found = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= count; i += 32)
    found = _mm256_or_si256(found, _mm256_cmpeq_epi8(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), minimum));
  bool any = _mm256_movemask_epi8(found) != 0;
  for (; i < count; ++i) any = any || x[i] == -128;
  return any;
}

void rows_times_panel(const int8_t* x, int64_t ldx, int64_t rows, const int8_t* panel,
                      int64_t quads, int32_t* y, int64_t ldy, int64_t columns) {
  int64_t r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock)
    panel_product<4>(x + r * ldx, ldx, panel, quads, y + r * ldy, ldy, columns);
  switch (rows - r) {
    case 3: panel_product<3>(x + r * ldx, ldx, panel, quads, y + r * ldy, ldy, columns); break;
    case 2: panel_product<2>(x + r * ldx, ldx, panel, quads, y + r * ldy, ldy, columns); break;
    case 1: panel_product<1>(x + r * ldx, ldx, panel, quads, y + r * ldy, ldy, columns); break;
    default: break;
  }
}

at::Tensor int8_mm_avx2(const at::Tensor& xq_in, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(xq_in.dim() == 2 && xq_in.scalar_type() == at::kChar,
              "int8_mm_avx2: xq must be a 2-D int8 tensor, got ", xq_in.scalar_type(),
              " of shape ", xq_in.sizes());
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(1) % 64 == 0 && n > 0 && packed.size(0) == (n + kPanel - 1) / kPanel,
              "int8_mm_avx2: packed must be a contiguous (ceil(n / 16), Kp * 16) int8 tensor "
              "with Kp a multiple of 4, for n=", n, "; got ", packed.scalar_type(), " of shape ",
              packed.sizes());
  const int64_t kp = packed.size(1) / kPanel, quads = kp / 4;
  const int64_t m = xq_in.size(0), k = xq_in.size(1);
  TORCH_CHECK(k <= kp && kp - k < 4, "int8_mm_avx2: xq has K=", k,
              " inputs; the packed weight holds Kp=", kp);
  at::Tensor y = at::empty({m, n}, xq_in.options().dtype(at::kInt));
  if (m == 0) return y;
  at::Tensor xq = xq_in.contiguous();
  TORCH_CHECK(!contains_minus_128(xq.data_ptr<int8_t>(), m * k),
              "int8_mm_avx2: xq holds -128; the kernel takes inputs in [-127, 127]");
  if (k != kp) {  // the last group of 4 inputs, zero-padded
    at::Tensor padded = at::zeros({m, kp}, xq.options());
    padded.narrow(1, 0, k).copy_(xq);
    xq = padded;
  }
  const int8_t* x = xq.data_ptr<int8_t>();
  const int8_t* w = packed.data_ptr<int8_t>();
  int32_t* out = y.data_ptr<int32_t>();
  const int64_t chunk_rows = packed.numel() > kLargeWeightBytes ? kLargeWeightChunk : kSmallWeightChunk;
  const int64_t panels = packed.size(0), chunks = (m + chunk_rows - 1) / chunk_rows;
  const int64_t units = chunks * panels;
  const int threads = m * n * kp >= kParallelMinMacs ? at::get_num_threads() : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t unit = 0; unit < units; ++unit) {
    // Panels vary fastest: a thread's consecutive units share their rows.
    const int64_t chunk = unit / panels, p = unit % panels;
    const int64_t row = chunk * chunk_rows;
    const int64_t rows = m - row < chunk_rows ? m - row : chunk_rows;
    const int64_t columns = n - p * kPanel < kPanel ? n - p * kPanel : kPanel;
    rows_times_panel(x + row * kp, kp, rows, w + p * kp * kPanel, quads, out + row * n + p * kPanel,
                     n, columns);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dtype_policies, m) {
  m.def("int8_mm_avx2(Tensor xq, Tensor packed, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(dtype_policies, CPU, m) { m.impl("int8_mm_avx2", &int8_mm_avx2); }
