// int4 weight-only product for x86 CPUs with AVX2 and FMA (no AVX-512):
//   y[m, n] = bf16( sum_k x[m, k] * (q[n, k] * s[n, g(k)] + z[n, g(k)]) )
// with bfloat16 activations x, signed 4-bit q in [-8, 7], bfloat16 scales s and
// offsets z per group of `group` inputs, float32 products and sums. These are the
// values of torch's `_weight_int4pack_mm_for_cpu` for the same scales and offsets
// (its `(u - 8) * s + z` with u = q + 8), up to the order of the float32 sums.
//
// Layout (built by int4_native.pack):
//   packed [N, Kp / 2] bytes, Kp a multiple of 64: each 64 inputs of a row are 8
//     little-endian 32-bit words, word j holding q[8 i + j] in bits 4 i .. 4 i + 3;
//     one shift pair per i gives 8 consecutive inputs in the 8 lanes.
//   sz [N, ceil(Kp / group), 2] bfloat16: (s, z) per row and group; group a power of
//     two, at least 32.
// Inputs x [M, K] (K <= Kp; the rest reads as zeros), output y [M, N], both bfloat16.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

namespace {

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN kept quiet
  uint32_t bits;
  memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float horizontal_sum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// The 8 signed nibbles i of the 8 words of v, as floats.
template <int i>
inline __m256 nibbles(__m256i v) {
  if (i == 7) return _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 28));
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 28 - 4 * i), 28));
}

// The weights q * s + z of nibbles first .. first + 3 of v (32 inputs).
template <int first>
inline void decode_half(__m256i v, __m256 s, __m256 z, __m256 w[4]) {
  w[0] = _mm256_fmadd_ps(nibbles<first>(v), s, z);
  w[1] = _mm256_fmadd_ps(nibbles<first + 1>(v), s, z);
  w[2] = _mm256_fmadd_ps(nibbles<first + 2>(v), s, z);
  w[3] = _mm256_fmadd_ps(nibbles<first + 3>(v), s, z);
}

// Inputs 32 half .. 32 half + 31 of the 64 in v: nibbles 4 half .. 4 half + 3.
inline void decode_half(int half, __m256i v, __m256 s, __m256 z, __m256 w[4]) {
  if (half)
    decode_half<4>(v, s, z, w);
  else
    decode_half<0>(v, s, z, w);
}

constexpr int64_t kRowsPerTile = 4;
constexpr int64_t kColumnsPerBlock = 16;

// The scale (s) and offset (z) of one group, broadcast: one 32-bit load of the
// bfloat16 pair, its halves moved into float32 positions.
inline void group_pair(const uint16_t* pair, __m256& s, __m256& z) {
  uint32_t bits;
  memcpy(&bits, pair, 4);
  const __m256i both = _mm256_set1_epi32(static_cast<int>(bits));
  s = _mm256_castsi256_ps(_mm256_slli_epi32(both, 16));
  z = _mm256_castsi256_ps(_mm256_and_si256(both, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// Rows [m0, m0 + rows) times columns [n0, n1): each 32 weights are decoded once
// for the `rows` rows. `group_shift`: log2 of the 32-input halves per group.
template <int rows>
void tile(const float* xf, int64_t kp, const uint8_t* packed, const uint16_t* sz, int64_t groups,
          int group_shift, uint16_t* y, int64_t n_total, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t words = kp / 64;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = packed + n * (kp / 2);
    const uint16_t* pairs = sz + n * groups * 2;
    __m256 even[rows], odd[rows];
    for (int r = 0; r < rows; ++r) even[r] = odd[r] = _mm256_setzero_ps();
    __m256 s = _mm256_setzero_ps(), z = _mm256_setzero_ps();
    int64_t loaded = -1;
    for (int64_t c = 0; c < words; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c));
      for (int half = 0; half < 2; ++half) {
        const int64_t h = 2 * c + half, g = h >> group_shift;
        if (g != loaded) {
          group_pair(pairs + 2 * g, s, z);
          loaded = g;
        }
        __m256 w[4];
        decode_half(half, v, s, z, w);
        for (int r = 0; r < rows; ++r) {
          const float* x = xf + (m0 + r) * kp + 32 * h;
          even[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x), w[0], even[r]);
          odd[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), w[1], odd[r]);
          even[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), w[2], even[r]);
          odd[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), w[3], odd[r]);
        }
      }
    }
    for (int r = 0; r < rows; ++r)
      y[(m0 + r) * n_total + n] = float_to_bf16(horizontal_sum(_mm256_add_ps(even[r], odd[r])));
  }
}

// One row times columns [n0, n1), two columns per pass: their sums are
// independent chains, which one column alone leaves idle (decoding, one row).
void row_two_columns(const float* xf, int64_t kp, const uint8_t* packed, const uint16_t* sz,
                     int64_t groups, int group_shift, uint16_t* y, int64_t n_total, int64_t m0,
                     int64_t n0, int64_t n1) {
  const int64_t words = kp / 64;
  const float* x = xf + m0 * kp;
  int64_t n = n0;
  for (; n + 1 < n1; n += 2) {
    const uint8_t* row_a = packed + n * (kp / 2);
    const uint8_t* row_b = row_a + kp / 2;
    const uint16_t* pairs_a = sz + n * groups * 2;
    const uint16_t* pairs_b = pairs_a + groups * 2;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    __m256 sa = _mm256_setzero_ps(), za = _mm256_setzero_ps();
    __m256 sb = _mm256_setzero_ps(), zb = _mm256_setzero_ps();
    int64_t loaded = -1;
    for (int64_t c = 0; c < words; ++c) {
      const __m256i va = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row_a + 32 * c));
      const __m256i vb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row_b + 32 * c));
      const float* xc = x + 64 * c;
      for (int half = 0; half < 2; ++half) {
        const int64_t g = (2 * c + half) >> group_shift;
        if (g != loaded) {
          group_pair(pairs_a + 2 * g, sa, za);
          group_pair(pairs_b + 2 * g, sb, zb);
          loaded = g;
        }
        const float* xh = xc + 32 * half;
        __m256 wa[4], wb[4];
        decode_half(half, va, sa, za, wa);
        decode_half(half, vb, sb, zb, wb);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xh), wa[0], a0);
        b0 = _mm256_fmadd_ps(_mm256_loadu_ps(xh), wb[0], b0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xh + 8), wa[1], a1);
        b1 = _mm256_fmadd_ps(_mm256_loadu_ps(xh + 8), wb[1], b1);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xh + 16), wa[2], a0);
        b0 = _mm256_fmadd_ps(_mm256_loadu_ps(xh + 16), wb[2], b0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xh + 24), wa[3], a1);
        b1 = _mm256_fmadd_ps(_mm256_loadu_ps(xh + 24), wb[3], b1);
      }
    }
    y[m0 * n_total + n] = float_to_bf16(horizontal_sum(_mm256_add_ps(a0, a1)));
    y[m0 * n_total + n + 1] = float_to_bf16(horizontal_sum(_mm256_add_ps(b0, b1)));
  }
  if (n < n1) tile<1>(xf, kp, packed, sz, groups, group_shift, y, n_total, m0, n, n1);
}

inline int log2_of(int64_t v) {
  int shift = 0;
  while ((int64_t{1} << shift) < v) ++shift;
  return shift;
}

}  // namespace

extern "C" int dtype_policies_int4_mm_bf16(const uint16_t* x, int64_t m, int64_t k, const uint8_t* packed,
                                           const uint16_t* sz, int64_t kp, int64_t group, uint16_t* y,
                                           int64_t n, int threads) {
  if (m <= 0 || n <= 0) return 0;
  if (kp % 64 != 0 || group < 32 || (group & (group - 1)) != 0 || k > kp) return 1;
  const int64_t groups = (kp + group - 1) / group;
  const int group_shift = log2_of(group / 32);
  float* xf = static_cast<float*>(malloc(static_cast<size_t>(m * kp) * sizeof(float)));
  if (xf == nullptr) return 2;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t i = 0; i < k; ++i) xf[r * kp + i] = bf16_to_float(x[r * k + i]);
    for (int64_t i = k; i < kp; ++i) xf[r * kp + i] = 0.0f;
  }
  const int64_t row_tiles = (m + kRowsPerTile - 1) / kRowsPerTile;
  const int64_t blocks = (n + kColumnsPerBlock - 1) / kColumnsPerBlock;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2) if (threads > 1)
  for (int64_t t = 0; t < row_tiles; ++t) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t m0 = t * kRowsPerTile, n0 = b * kColumnsPerBlock;
      const int64_t n1 = n0 + kColumnsPerBlock < n ? n0 + kColumnsPerBlock : n;
      switch (m - m0 < kRowsPerTile ? m - m0 : kRowsPerTile) {
        case 1: row_two_columns(xf, kp, packed, sz, groups, group_shift, y, n, m0, n0, n1); break;
        case 2: tile<2>(xf, kp, packed, sz, groups, group_shift, y, n, m0, n0, n1); break;
        case 3: tile<3>(xf, kp, packed, sz, groups, group_shift, y, n, m0, n0, n1); break;
        default: tile<4>(xf, kp, packed, sz, groups, group_shift, y, n, m0, n0, n1); break;
      }
    }
  }
  free(xf);
  return 0;
}

// The float32 weight [N, Kp] of the same layout (`q * s + z` per weight), for
// many rows, where one float32 GEMM on it costs far more than this pass.
extern "C" int dtype_policies_int4_dequantize(const uint8_t* packed, const uint16_t* sz, int64_t kp,
                                              int64_t group, int64_t n, float* out, int threads) {
  if (n <= 0) return 0;
  if (kp % 64 != 0 || group < 32 || (group & (group - 1)) != 0) return 1;
  const int64_t groups = (kp + group - 1) / group, halves = kp / 32, halves_per_group = group / 32;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t row = 0; row < n; ++row) {
    const uint8_t* words = packed + row * (kp / 2);
    const uint16_t* pairs = sz + row * groups * 2;
    float* w = out + row * kp;
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 s = _mm256_set1_ps(bf16_to_float(pairs[2 * g]));
      const __m256 z = _mm256_set1_ps(bf16_to_float(pairs[2 * g + 1]));
      const int64_t h_end = (g + 1) * halves_per_group < halves ? (g + 1) * halves_per_group : halves;
      for (int64_t h = g * halves_per_group; h < h_end; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + 32 * (h >> 1)));
        __m256 decoded[4];
        decode_half(static_cast<int>(h & 1), v, s, z, decoded);
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(w + 32 * h + 8 * j, decoded[j]);
      }
    }
  }
  return 0;
}
