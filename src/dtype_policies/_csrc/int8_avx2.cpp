// Exact int8 x int8 products on AVX2: the W8A8 product's integer accumulators
// on CPUs whose u8 x s8 instructions saturate (no VNNI), and the products with
// inputs rounded per block of 32 on any x86 CPU with AVX2, with VNNI's vpdpbusd
// where the caller chooses the `_vnni` operators (AVX-512 VNNI; int8_native).
// The loops are in int8_panels.inc, compiled once per instruction set.
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
#include <ATen/record_function.h>
#include <immintrin.h>
#include <omp.h>
#include <torch/library.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>

#include "amx_target.h"
#include "vnni_target.h"

// int4_avx2.cpp: the W4A8 rounding of bfloat16 rows (blocks of 32, Q8_0's rule).
extern "C" int dtype_policies_round_rows_q8(const uint16_t* x, int64_t m, int64_t k, int64_t kp,
                                            int8_t* q, float* d, char* finite, int threads);

namespace {

constexpr int64_t kPanel = 16;        // output columns per panel
constexpr int64_t kRowBlock = 4;      // rows per micro-kernel call
// Rows per unit of parallel work: 16 (in L1 up to K = 1536, while the units of
// a chunk go through the weight's panels) for weights that stay in L2, 64 for
// larger ones (each panel read from memory once per 64 rows).
constexpr int64_t kSmallWeightChunk = 16, kLargeWeightChunk = 64;
constexpr int64_t kLargeWeightBytes = int64_t{1} << 20;
constexpr int64_t kParallelMinMacs = int64_t{1} << 17;

// ---------------------------------------------------------------------------
// W8A8 with the activations rounded per block of 32 inputs (the W4A8 rule of
// int4_avx2.cpp: bfloat16 inputs, d = max|x| / 127, xq = round-half-even(x / d)):
//
//   dtype_policies::int8_mm_q8_avx2(x, packed, column_step, bias, n, bf16_out)
//   y[m, c] = (sum_b d[m, b] * sum_{k in b} xq[m, k] w[c, k]) * column_step[c] + bias[c]
//
// x: (M, K) bfloat16; packed: as int8_mm_avx2's; column_step, bias: (n,) float32;
// y float32, or bfloat16 with bf16_out. Each block's integer sum is exact (at most
// 32 * 128 * 127 in int32); the blocks are added in float32 in order, one FMA each.
// A row holding a NaN or an infinity gives a row of NaN.
//
// With weights that have a step per block of 32 inputs too (llama.cpp's Q8_0 x Q8_0):
//
//   dtype_policies::int8_mm_q8b_avx2(x, packed, block_step, bias, n, bf16_out)
//   y[m, c] = sum_b d[m, b] * block_step[b, c] * sum_{k in b} xq[m, k] w[c, k] + bias[c]
//
// block_step: (ceil(n / 16), ceil(K / 32) * 16) float32: for each panel of 16 columns,
// each block's 16 steps (read in step with the panel's weights), padded columns zeros.
//
// int8_mm_q8_vnni and int8_mm_q8b_vnni are the same products, arguments and
// values, bit for bit, with vpdpbusd (AVX-512 VNNI) in place of the pair sums;
// int8_mm_q8_amx and int8_mm_q8b_amx too, with AMX tiles (int8_amx.inc), on
// AMX CPUs, from the row count their last argument gives: they run the VNNI
// copy below it and where the compiler had no AMX or Linux refuses the tiles.

constexpr int64_t kBlock = 32, kBlockQuads = kBlock / 4;

struct BlockedRows {
  const int8_t* q;  // [m, kq]: rounded inputs, kq a multiple of 32, zeros past K
  const float* d;   // [m, kq / 32]: each block's step
  int64_t kq;
};

// One product's weight for the blocked loops: `step` per column (int8_mm_q8) or
// per panel and block (`weight_blocks`, int8_mm_q8b); `shift` the bias or null;
// the last panel's steps and bias zero-padded to 16 columns in `tail_*`.
struct BlockedWeight {
  const int8_t* w;
  int64_t n, panels, kp;
  bool weight_blocks;
  const float* step;
  const float* shift;
  const float* tail_step;
  const float* tail_shift;
};

namespace madd {
constexpr bool kOffsetInputs = false;
inline __m256i dot4(__m256i acc, __m256i unsigned_bytes, __m256i signed_bytes) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned_bytes, signed_bytes),
                                                 _mm256_set1_epi16(1)));
}
#include "int8_panels.inc"

// `rows` (1..4) rows of x times one panel: 16 int32 sums per row into y.
template <int rows>
inline void panel_product(const int8_t* x, int64_t ldx, const int8_t* panel, int64_t quads,
                          int32_t* y, int64_t ldy, int64_t columns) {
  __m256i acc[rows][2], unused[2];
  for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  for (int64_t j = 0; j < quads; ++j) add_quad<rows>(acc, unused, x, ldx, panel, j);
  for (int r = 0; r < rows; ++r) {
    // Each column's 4-product sums landed in one lane: lanes are columns.
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

inline void rows_times_panel(const int8_t* x, int64_t ldx, int64_t rows, const int8_t* panel,
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

// The exact (m, n) int32 products of int8_mm_avx2 (CPUs without VNNI): x (m, kp)
// int8 in [-127, 127], zero-padded.
void exact_product(const int8_t* x, int64_t m, int64_t kp, const int8_t* w, int64_t panels,
                   int32_t* out, int64_t n, int64_t chunk_rows, int threads) {
  const int64_t quads = kp / 4, chunks = (m + chunk_rows - 1) / chunk_rows;
  const int64_t units = chunks * panels;
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
}
}  // namespace madd

// The VNNI copy: only the functions of int8_panels.inc are compiled for AVX-512
// VNNI (every header is included above), and they run only where the caller
// chose a `_vnni` operator from the processor's features.
DTYPE_POLICIES_VNNI_BEGIN
namespace vnni {
constexpr bool kOffsetInputs = true;
inline __m256i dot4(__m256i acc, __m256i unsigned_bytes, __m256i signed_bytes) {
  return _mm256_dpbusd_epi32(acc, unsigned_bytes, signed_bytes);
}
#include "int8_panels.inc"
}  // namespace vnni
DTYPE_POLICIES_VNNI_END

#if DTYPE_POLICIES_HAS_AMX
DTYPE_POLICIES_AMX_BEGIN
namespace amx {
constexpr bool kOffsetInputs = true;
inline __m256i dot4(__m256i acc, __m256i unsigned_bytes, __m256i signed_bytes) {
  return _mm256_dpbusd_epi32(acc, unsigned_bytes, signed_bytes);
}
#include "int8_panels.inc"
#include "int8_amx.inc"
#include "int4_amx.inc"
}  // namespace amx
DTYPE_POLICIES_AMX_END
#endif

// Whether the AMX copy runs in this process: compiled, an AMX CPU (CPUID leaf 7:
// AMX-TILE and AMX-INT8), and Linux grants the tile data (asked once).
bool tiles_usable() {
#if DTYPE_POLICIES_HAS_AMX && defined(__linux__)
  static const bool usable = [] {
    unsigned int eax = 7, ebx = 0, ecx = 0, edx = 0;
    asm volatile("cpuid" : "+a"(eax), "=b"(ebx), "+c"(ecx), "=d"(edx));
    const bool amx_int8 = (edx >> 24 & 1u) && (edx >> 25 & 1u);
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XTILEDATA
    return amx_int8 && syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return usable;
#else
  return false;
#endif
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

// The packed weight's Kp, after checking it against n output columns and
// the `input`'s K inputs (K <= Kp < K + 4).
int64_t checked_kp(const char* name, const char* input, const at::Tensor& packed, int64_t n,
                   int64_t k) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(1) % 64 == 0 && n > 0 && packed.size(0) == (n + kPanel - 1) / kPanel,
              name, ": packed must be a contiguous (ceil(n / 16), Kp * 16) int8 tensor "
              "with Kp a multiple of 4, for n=", n, "; got ", packed.scalar_type(), " of shape ",
              packed.sizes());
  const int64_t kp = packed.size(1) / kPanel;
  TORCH_CHECK(k <= kp && kp - k < 4, name, ": ", input, " has K=", k,
              " inputs; the packed weight holds Kp=", kp);
  return kp;
}

at::Tensor int8_mm_avx2(const at::Tensor& xq_in, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(xq_in.dim() == 2 && xq_in.scalar_type() == at::kChar,
              "int8_mm_avx2: xq must be a 2-D int8 tensor, got ", xq_in.scalar_type(),
              " of shape ", xq_in.sizes());
  const int64_t m = xq_in.size(0), k = xq_in.size(1);
  const int64_t kp = checked_kp("int8_mm_avx2", "xq", packed, n, k);
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
  const int threads = m * n * kp >= kParallelMinMacs ? at::get_num_threads() : 1;
  madd::exact_product(x, m, kp, w, packed.size(0), out, n, chunk_rows, threads);
  return y;
}

enum class Copy { avx2, vnni, amx };  // which copy of the loops an operator runs

// The shared body of int8_mm_q8_* (`block_step` undefined: `column_step` per
// column) and int8_mm_q8b_* (`block_step` per block and column).
at::Tensor q8_product(const char* name, const at::Tensor& x_in, const at::Tensor& packed,
                      const at::Tensor& column_step, const at::Tensor& block_step,
                      const std::optional<at::Tensor>& bias, int64_t n, bool bf16_out,
                      Copy copy) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, name,
              ": x must be a 2-D bfloat16 tensor, got ", x_in.scalar_type(), " of shape ",
              x_in.sizes());
  const bool weight_blocks = block_step.defined();
  const int64_t m = x_in.size(0), k = x_in.size(1);
  const int64_t kp = checked_kp(name, "x", packed, n, k);
  const int64_t kq = (k + kBlock - 1) / kBlock * kBlock, blocks = kq / kBlock;
  const int64_t panels = packed.size(0);
  if (weight_blocks) {
    TORCH_CHECK(block_step.dim() == 2 && block_step.size(0) == panels &&
                    block_step.size(1) == blocks * kPanel &&
                    block_step.scalar_type() == at::kFloat && block_step.is_contiguous(),
                name, ": block_step must be a contiguous (", panels, ", ", blocks * kPanel,
                ") float32 tensor (panels of 16 of n=", n, ", 16 steps per block of 32 of K=",
                k, "), got ", block_step.scalar_type(), " of shape ", block_step.sizes());
  } else {
    TORCH_CHECK(column_step.dim() == 1 && column_step.size(0) == n &&
                    column_step.scalar_type() == at::kFloat,
                name, ": column_step must be a (", n, ",) float32 tensor, got ",
                column_step.scalar_type(), " of shape ", column_step.sizes());
  }
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat,
                name, ": bias must be a (", n, ",) float32 tensor, got ", bias->scalar_type(),
                " of shape ", bias->sizes());
  at::Tensor y = at::empty({m, n}, x_in.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (m == 0) return y;
  const at::Tensor x = x_in.contiguous();
  const bool tiles = copy == Copy::amx && tiles_usable();
  if (copy == Copy::amx && !tiles) copy = Copy::vnni;  // the same values
  // the AMX copy reads whole tiles of 16 rows: rows and steps zero-padded
  const int64_t mp = tiles ? (m + 15) / 16 * 16 : m;
  const int64_t macs = m * n * kp;
  const int threads = macs >= kParallelMinMacs ? at::get_num_threads() : 1;
  // rounded rows: steps, bytes, finiteness; then each thread's column sums (int8_panels.inc)
  at::Tensor scratch = at::empty({mp * blocks + mp * kq / 4 + mp + threads * blocks * kPanel},
                                 x.options().dtype(at::kFloat));
  float* d = scratch.data_ptr<float>();
  int8_t* q = reinterpret_cast<int8_t*>(d + mp * blocks);
  char* finite = reinterpret_cast<char*>(q + mp * kq);
  int32_t* offsets = reinterpret_cast<int32_t*>(d + mp * blocks + mp * kq / 4 + mp);
  if (mp > m) {
    std::memset(d + m * blocks, 0, static_cast<size_t>((mp - m) * blocks) * sizeof(float));
    std::memset(q + m * kq, 0, static_cast<size_t>((mp - m) * kq));
  }
  const at::Tensor steps = weight_blocks ? block_step : column_step.contiguous();
  const at::Tensor shifts = has_bias ? bias->contiguous() : at::Tensor();
  const float* step = steps.data_ptr<float>();
  const float* shift = has_bias ? shifts.data_ptr<float>() : nullptr;
  // the last panel's steps and bias, zero-padded to 16 columns (block_step is padded)
  alignas(32) float tail_step[kPanel] = {}, tail_shift[kPanel] = {};
  const int64_t tail = n - (panels - 1) * kPanel;
  if (!weight_blocks)
    std::memcpy(tail_step, step + (panels - 1) * kPanel, static_cast<size_t>(tail) * sizeof(float));
  if (has_bias)
    std::memcpy(tail_shift, shift + (panels - 1) * kPanel, static_cast<size_t>(tail) * sizeof(float));
  const int status = dtype_policies_round_rows_q8(reinterpret_cast<const uint16_t*>(x.data_ptr()),
                                                  m, k, kq, q, d, finite,
                                                  m >= 64 ? threads : 1);
  TORCH_CHECK(status == 0, name, ": rounding rejected K=", k);
  const BlockedRows in{q, d, kq};
  const BlockedWeight weight{packed.data_ptr<int8_t>(), n, panels, kp, weight_blocks, step, shift,
                             tail_step, tail_shift};
  char* out = static_cast<char*>(y.data_ptr());
  const int64_t chunk_rows = packed.numel() > kLargeWeightBytes ? kLargeWeightChunk : kSmallWeightChunk;
  if (copy == Copy::vnni) {
    for (int64_t i = 0; i < m * kq; ++i) q[i] = static_cast<int8_t>(q[i] ^ 0x80);  // xq + 128, unsigned
    vnni::blocked_product(in, m, weight, out, bf16_out, chunk_rows, threads, offsets);
  } else if (copy == Copy::amx) {
#if DTYPE_POLICIES_HAS_AMX
    RECORD_FUNCTION("dtype_policies::amx_tiles", std::vector<c10::IValue>());
    amx::tiled_product(in, m, weight, out, bf16_out, threads);
#endif
  } else {
    madd::blocked_product(in, m, weight, out, bf16_out, chunk_rows, threads, offsets);
  }
  for (int64_t r = 0; r < m; ++r)
    if (!finite[r]) y.select(0, r).fill_(std::numeric_limits<float>::quiet_NaN());
  return y;
}

constexpr const char* kCopyNames[] = {"avx2", "vnni", "amx"};

template <Copy copy>
at::Tensor int8_mm_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& column_step,
                      const std::optional<at::Tensor>& bias, int64_t n, bool bf16_out) {
  const std::string name = std::string("int8_mm_q8_") + kCopyNames[static_cast<int>(copy)];
  return q8_product(name.c_str(), x, packed, column_step, at::Tensor(), bias, n, bf16_out, copy);
}

template <Copy copy>
at::Tensor int8_mm_q8b(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& block_step,
                       const std::optional<at::Tensor>& bias, int64_t n, bool bf16_out) {
  const std::string name = std::string("int8_mm_q8b_") + kCopyNames[static_cast<int>(copy)];
  TORCH_CHECK(block_step.defined(), name, ": block_step is undefined");
  return q8_product(name.c_str(), x, packed, at::Tensor(), block_step, bias, n, bf16_out, copy);
}

// The AMX operators take the row count from which their tiles pay off
// (`min_rows`) and run the VNNI copy below it: the choice by rows is made
// here, at run time, so that a compiled graph with a dynamic number of rows
// holds no guard on it.
Copy amx_copy_for(const at::Tensor& x, int64_t min_rows) {
  return x.dim() == 2 && x.size(0) < min_rows ? Copy::vnni : Copy::amx;
}

at::Tensor int8_mm_q8_amx(const at::Tensor& x, const at::Tensor& packed,
                          const at::Tensor& column_step, const std::optional<at::Tensor>& bias,
                          int64_t n, bool bf16_out, int64_t min_rows) {
  return q8_product("int8_mm_q8_amx", x, packed, column_step, at::Tensor(), bias, n, bf16_out,
                    amx_copy_for(x, min_rows));
}

at::Tensor int8_mm_q8b_amx(const at::Tensor& x, const at::Tensor& packed,
                           const at::Tensor& block_step, const std::optional<at::Tensor>& bias,
                           int64_t n, bool bf16_out, int64_t min_rows) {
  TORCH_CHECK(block_step.defined(), "int8_mm_q8b_amx: block_step is undefined");
  return q8_product("int8_mm_q8b_amx", x, packed, at::Tensor(), block_step, bias, n, bf16_out,
                    amx_copy_for(x, min_rows));
}

}  // namespace

// The W4A8 product of int4_avx2.cpp on AMX tiles (int4_amx.inc), on its rounded
// rows (q, d zero-padded to a multiple of 16 rows; sums per group): 0 when done,
// 1 where the tiles do not run (not compiled, not an AMX CPU, refused by Linux:
// the caller runs the VNNI copy), 2 out of memory.
extern "C" int dtype_policies_int4_mm_q8_tiles(const int8_t* q, const float* d, const float* sums,
                                               int64_t m, int64_t kp, const uint8_t* packed,
                                               const float* pairs, int64_t groups, int group_shift,
                                               uint16_t* y, int64_t n, int threads) {
  if (!tiles_usable()) return 1;
#if DTYPE_POLICIES_HAS_AMX
  RECORD_FUNCTION("dtype_policies::amx_tiles", std::vector<c10::IValue>());
  const amx::Q8Operands operands{q, d, sums, m, kp, groups, group_shift, packed, pairs, n, y};
  return amx::w4a8_tiled_product(operands, threads) ? 0 : 2;
#else
  (void)q, (void)d, (void)sums, (void)m, (void)kp, (void)packed, (void)pairs, (void)groups;
  (void)group_shift, (void)y, (void)n, (void)threads;
  return 1;
#endif
}

TORCH_LIBRARY_FRAGMENT(dtype_policies, m) {
  m.def("int8_mm_avx2(Tensor xq, Tensor packed, int n) -> Tensor");
  for (const char* name : {"int8_mm_q8_avx2", "int8_mm_q8_vnni"})
    m.def((std::string(name) + "(Tensor x, Tensor packed, Tensor column_step, Tensor? bias, "
                               "int n, bool bf16_out) -> Tensor").c_str());
  for (const char* name : {"int8_mm_q8b_avx2", "int8_mm_q8b_vnni"})
    m.def((std::string(name) + "(Tensor x, Tensor packed, Tensor block_step, Tensor? bias, "
                               "int n, bool bf16_out) -> Tensor").c_str());
  m.def("int8_mm_q8_amx(Tensor x, Tensor packed, Tensor column_step, Tensor? bias, int n, "
        "bool bf16_out, int min_rows) -> Tensor");
  m.def("int8_mm_q8b_amx(Tensor x, Tensor packed, Tensor block_step, Tensor? bias, int n, "
        "bool bf16_out, int min_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(dtype_policies, CPU, m) {
  m.impl("int8_mm_avx2", &int8_mm_avx2);
  m.impl("int8_mm_q8_avx2", &int8_mm_q8<Copy::avx2>);
  m.impl("int8_mm_q8_vnni", &int8_mm_q8<Copy::vnni>);
  m.impl("int8_mm_q8_amx", &int8_mm_q8_amx);
  m.impl("int8_mm_q8b_avx2", &int8_mm_q8b<Copy::avx2>);
  m.impl("int8_mm_q8b_vnni", &int8_mm_q8b<Copy::vnni>);
  m.impl("int8_mm_q8b_amx", &int8_mm_q8b_amx);
}
