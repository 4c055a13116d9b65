// int4 products for x86 CPUs with AVX2 and FMA: weight-only (this part) and
// W4A8 (below, `dtype_policies_int4_mm_q8`).
//
// Weight-only:
//   y[m, n] = bf16( sum_k x[m, k] * (q[n, k] * s[n, g(k)] + z[n, g(k)]) )
// with bfloat16 activations x, signed 4-bit q in [-8, 7], float32 scales s and
// offsets z per group of `group` inputs (z = -zero * s: a group's weights are
// Keras's (q - zero) * s up to float32 rounding, however far from 0 the group
// lies), float32 products and sums. torch's `_weight_int4pack_mm_for_cpu`
// computes the same formula (its `(u - 8) * s + z` with u = q + 8) with its
// scales and offsets rounded to bfloat16.
//
// Layout (built by int4_native.pack):
//   packed [N, Kp / 2] bytes, Kp a multiple of 64: each 64 inputs of a row are 8
//     little-endian 32-bit words, word j holding q[8 i + j] in bits 4 i .. 4 i + 3;
//     one shift pair per i gives 8 consecutive inputs in the 8 lanes.
//   sz [N, ceil(Kp / group), 2] float32: (s, z) per row and group; group a power of
//     two, at least 32.
// Inputs x [M, K] (K <= Kp; the rest reads as zeros), output y [M, N], both bfloat16.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "vnni_target.h"

// int8_avx2.cpp: the W4A8 product on AMX tiles (int4_amx.inc); 1 where the tiles
// do not run.
extern "C" int dtype_policies_int4_mm_q8_tiles(const int8_t* q, const float* d, const float* sums,
                                               int64_t m, int64_t kp, const uint8_t* packed,
                                               const float* pairs, int64_t groups, int group_shift,
                                               uint16_t* y, int64_t n, int threads);

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

// The scale (s) and offset (z) of one group, broadcast.
inline void group_pair(const float* pair, __m256& s, __m256& z) {
  s = _mm256_broadcast_ss(pair);
  z = _mm256_broadcast_ss(pair + 1);
}

// Rows [m0, m0 + rows) times columns [n0, n1): each 32 weights are decoded once
// for the `rows` rows. `group_shift`: log2 of the 32-input halves per group.
template <int rows>
void tile(const float* xf, int64_t kp, const uint8_t* packed, const float* sz, int64_t groups,
          int group_shift, uint16_t* y, int64_t n_total, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t words = kp / 64;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = packed + n * (kp / 2);
    const float* pairs = sz + n * groups * 2;
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
void row_two_columns(const float* xf, int64_t kp, const uint8_t* packed, const float* sz,
                     int64_t groups, int group_shift, uint16_t* y, int64_t n_total, int64_t m0,
                     int64_t n0, int64_t n1) {
  const int64_t words = kp / 64;
  const float* x = xf + m0 * kp;
  int64_t n = n0;
  for (; n + 1 < n1; n += 2) {
    const uint8_t* row_a = packed + n * (kp / 2);
    const uint8_t* row_b = row_a + kp / 2;
    const float* pairs_a = sz + n * groups * 2;
    const float* pairs_b = pairs_a + groups * 2;
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
                                           const float* sz, int64_t kp, int64_t group, uint16_t* y,
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

// ---------------------------------------------------------------------------
// W4A8: the activations rounded to int8 in blocks of 32 inputs (llama.cpp's
// Q8_0 rule: d = max|x| / 127, xq = round-half-even(x / d)), integer products
// (vpmaddubsw of unsigned nibbles u = q + 8 and int8 inputs: pair sums at most
// 2 * 15 * 127, eight of them at most 30,480, no saturation; vpmaddwd to int32),
// then
//   y[m, n] = bf16( sum_g s_g * sum_{k in g} xh_k * u_k + (z_g - 8 s_g) * sum_{k in g} xh_k )
// with xh_k = xq_k * d_b: the weight-only product of the rounded inputs xh.
//
// Layout (int4_native.pack_q8), 8 output columns interleaved, so that one
// instruction multiplies 4 inputs by 8 columns and the sums of 8 columns land in
// the 8 lanes of one register (no horizontal sums):
//   packed [ceil(N / 8), Kp / 32, 4, 8, 4] bytes, Kp a multiple of 32: for
//     column block c8, input block b, byte [j, c, t] holds u[8 c8 + c][32 b + 4 j + t]
//     in its low nibble and u[8 c8 + c][32 b + 4 (j + 4) + t] in its high one;
//   pairs [ceil(N / 8), G, 2, 8] float32 or float16 (`Pair`: int4_native.pack_q8
//     takes float16 where it moves no weight by more than 1/64 of its group's step,
//     reading a sixth fewer bytes per weight): the 8 columns' scales s, then
//     offsets z, per group; group a power of two, at least 32.

namespace {

// 8 lanes of a W4A8 layout's pairs, as float32 (float16 converts exactly).
inline __m256 load_pairs8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_pairs8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

struct RoundedInputs {
  int8_t* q;      // [m, kp]
  float* d;       // [m, kp / 32]: each block's step
  float* sums;    // [m, groups]: sum of xh over each group
};

// One block of 32 inputs (all present), vectorized: its step, its int8 values
// in order, and the sum of those; false on a NaN or an infinity.
inline bool round_block(const uint16_t* x, int8_t* q, float& step, int& total) {
  const __m256i raw0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i raw1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
  const __m256i exponent = _mm256_set1_epi16(0x7f80);
  const __m256i special = _mm256_or_si256(
      _mm256_cmpeq_epi16(_mm256_and_si256(raw0, exponent), exponent),
      _mm256_cmpeq_epi16(_mm256_and_si256(raw1, exponent), exponent));
  if (_mm256_movemask_epi8(special) != 0) return false;
  __m256 v[4];
  v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw0)), 16));
  v[1] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw0, 1)), 16));
  v[2] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw1)), 16));
  v[3] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw1, 1)), 16));
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                              _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  step = _mm_cvtss_f32(m) / 127.0f;
  if (step == 0.0f) {
    memset(q, 0, 32);
    total = 0;
    return true;
  }
  const __m256 divisor = _mm256_set1_ps(step), limit = _mm256_set1_ps(127.0f);
  __m256i ints[4];
  __m256 rounded_sum = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    __m256 r = _mm256_round_ps(_mm256_div_ps(v[i], divisor), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm256_max_ps(_mm256_min_ps(r, limit), _mm256_sub_ps(_mm256_setzero_ps(), limit));
    rounded_sum = _mm256_add_ps(rounded_sum, r);
    ints[i] = _mm256_cvtps_epi32(r);
  }
  // packs interleave 128-bit lanes: 4-byte groups come out as a0 b0 c0 d0 a1 b1 c1 d1
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]),
                                           _mm256_packs_epi32(ints[2], ints[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
  total = static_cast<int>(horizontal_sum(rounded_sum));  // exact: integers below 2**24
  return true;
}

// The rounded inputs of one row (k inputs, the rest of kp zeros) and, unless
// `sums` is null, the sums of each group's rounded inputs; false when the row
// holds a NaN or an infinity (its rounding, and so every output, is NaN).
bool round_row(const uint16_t* x, int64_t k, int64_t kp, int64_t groups, int group_shift,
               int8_t* q, float* d, float* sums) {
  const int64_t blocks = kp / 32;
  if (sums != nullptr)
    for (int64_t g = 0; g < groups; ++g) sums[g] = 0.0f;
  float values[32];
  for (int64_t b = 0; b < blocks; ++b) {
    float step;
    int total = 0;
    if (32 * b + 32 <= k) {
      if (!round_block(x + 32 * b, q + 32 * b, step, total)) return false;
    } else {  // the last, partial block (the rest reads as zeros)
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) {
        const int64_t at = 32 * b + i;
        values[i] = at < k ? bf16_to_float(x[at]) : 0.0f;
        if ((at < k) && (x[at] & 0x7f80u) == 0x7f80u) return false;  // NaN or infinity
        const float a = values[i] < 0 ? -values[i] : values[i];
        amax = a > amax ? a : amax;
      }
      step = amax / 127.0f;
      for (int i = 0; i < 32; ++i) {
        float r = step > 0.0f ? __builtin_nearbyintf(values[i] / step) : 0.0f;
        r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
        q[32 * b + i] = static_cast<int8_t>(r);
        total += static_cast<int>(r);
      }
    }
    d[b] = step;
    if (sums != nullptr) sums[b >> group_shift] += step * static_cast<float>(total);
  }
  return true;
}

// Asks for the 128 bytes `kPrefetchDistance` past `w` (a block of 32 inputs
// of 8 columns): a thread's tiles are consecutive in memory, and a decoding row
// reads each weight once, from memory, in calls too short for the hardware
// prefetcher to run far enough ahead (1.02-1.09x SmolLM2's decode products on
// AMD Zen 4, measured; the same values).
constexpr int64_t kPrefetchDistance = 4096;

inline void prefetch_ahead(const uint8_t* w) {
  _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchDistance), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchDistance + 64), _MM_HINT_T0);
}

// One row times the 8 columns of block c8: their 8 sums, in the lanes of one register.
template <typename Pair>
inline __m256 q8_columns8(const RoundedInputs& in, int64_t row, int64_t kp, const uint8_t* tile,
                          const Pair* pairs, int64_t groups, int group_shift) {
  const int64_t blocks = kp / 32;
  const int8_t* xq = in.q + row * kp;
  const float* d = in.d + row * blocks;
  const __m256i mask = _mm256_set1_epi8(0x0f);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* w = tile + 128 * b;
    prefetch_ahead(w);
    const int8_t* x = xq + 32 * b;
    __m256i sum16 = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
      int32_t lo_inputs, hi_inputs;
      memcpy(&lo_inputs, x + 4 * j, 4);
      memcpy(&hi_inputs, x + 4 * (j + 4), 4);
      const __m256i lo = _mm256_and_si256(v, mask);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      sum16 = _mm256_add_epi16(sum16, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(lo_inputs)));
      sum16 = _mm256_add_epi16(sum16, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(hi_inputs)));
    }
    const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16, _mm256_set1_epi16(1)));
    const __m256 s = load_pairs8(pairs + 16 * (b >> group_shift));
    acc = _mm256_fmadd_ps(dot, _mm256_mul_ps(s, _mm256_broadcast_ss(d + b)), acc);
  }
  const float* sums = in.sums + row * groups;
  const __m256 eight = _mm256_set1_ps(8.0f);
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 s = load_pairs8(pairs + 16 * g), z = load_pairs8(pairs + 16 * g + 8);
    acc = _mm256_fmadd_ps(_mm256_fnmadd_ps(eight, s, z), _mm256_broadcast_ss(sums + g), acc);
  }
  return acc;
}

// The VNNI copy of q8_columns8 for `rows` (1..4) rows at once: vpdpbusd multiplies
// the unsigned nibbles by the int8 inputs into int32 lanes directly (4 products
// of at most 15 * 127 each), and each 32-byte load of weights serves the rows.
// The same integer sums and the same float operations in the same order as
// q8_columns8, so the same values bit for bit. Compiled for AVX-512 VNNI after
// every header; called only from dtype_policies_int4_mm_q8_vnni.
DTYPE_POLICIES_VNNI_BEGIN
template <int rows, typename Pair>
void q8_columns8_vnni(const RoundedInputs& in, int64_t row, int64_t kp, const uint8_t* tile,
                      const Pair* pairs, int64_t groups, int group_shift, float (*out)[8]) {
  const int64_t blocks = kp / 32;
  const __m256i mask = _mm256_set1_epi8(0x0f);
  __m256 acc[rows];
  for (int r = 0; r < rows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* w = tile + 128 * b;
    prefetch_ahead(w);
    __m256i dot[rows];
    for (int r = 0; r < rows; ++r) dot[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
      const __m256i lo = _mm256_and_si256(v, mask);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      for (int r = 0; r < rows; ++r) {
        const int8_t* x = in.q + (row + r) * kp + 32 * b;
        int32_t lo_inputs, hi_inputs;
        memcpy(&lo_inputs, x + 4 * j, 4);
        memcpy(&hi_inputs, x + 4 * (j + 4), 4);
        dot[r] = _mm256_dpbusd_epi32(dot[r], lo, _mm256_set1_epi32(lo_inputs));
        dot[r] = _mm256_dpbusd_epi32(dot[r], hi, _mm256_set1_epi32(hi_inputs));
      }
    }
    const __m256 s = load_pairs8(pairs + 16 * (b >> group_shift));
    for (int r = 0; r < rows; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]),
                               _mm256_mul_ps(s, _mm256_broadcast_ss(in.d + (row + r) * blocks + b)),
                               acc[r]);
  }
  const __m256 eight = _mm256_set1_ps(8.0f);
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 s = load_pairs8(pairs + 16 * g), z = load_pairs8(pairs + 16 * g + 8);
    const __m256 shift = _mm256_fnmadd_ps(eight, s, z);
    for (int r = 0; r < rows; ++r)
      acc[r] = _mm256_fmadd_ps(shift, _mm256_broadcast_ss(in.sums + (row + r) * groups + g), acc[r]);
  }
  for (int r = 0; r < rows; ++r) _mm256_storeu_ps(out[r], acc[r]);
}
DTYPE_POLICIES_VNNI_END

// One row chunk (rows 1..4) of the VNNI copy: the columns' sums into out.
template <typename Pair>
void q8_rows_vnni(const RoundedInputs& in, int64_t row, int64_t rows, int64_t kp, const uint8_t* tile,
                  const Pair* pairs, int64_t groups, int group_shift, float (*out)[8]) {
  switch (rows) {
    case 4: q8_columns8_vnni<4>(in, row, kp, tile, pairs, groups, group_shift, out); break;
    case 3: q8_columns8_vnni<3>(in, row, kp, tile, pairs, groups, group_shift, out); break;
    case 2: q8_columns8_vnni<2>(in, row, kp, tile, pairs, groups, group_shift, out); break;
    default: q8_columns8_vnni<1>(in, row, kp, tile, pairs, groups, group_shift, out); break;
  }
}

enum class Q8Copy { avx2, vnni, amx };

// The body of dtype_policies_int4_mm_q8 and its VNNI and AMX copies (the AMX
// tiles read float32 pairs only).
template <typename Pair>
int int4_mm_q8(const uint16_t* x, int64_t m, int64_t k, const uint8_t* packed, const Pair* sz,
               int64_t kp, int64_t group, uint16_t* y, int64_t n, int threads, Q8Copy copy) {
  if (m <= 0 || n <= 0) return 0;
  if (kp % 32 != 0 || group < 32 || (group & (group - 1)) != 0 || k > kp) return 1;
  const int64_t groups = (kp + group - 1) / group;
  const int group_shift = log2_of(group / 32);
  const int64_t blocks = kp / 32, column_blocks = (n + 7) / 8;
  // the AMX copy reads whole tiles of 16 rows: rows and steps zero-padded
  const int64_t mp = copy == Q8Copy::amx ? (m + 15) / 16 * 16 : m;
  void* memory = malloc(static_cast<size_t>(mp * kp) + static_cast<size_t>(mp * blocks + m * groups) * sizeof(float) +
                        static_cast<size_t>(m));
  if (memory == nullptr) return 2;
  RoundedInputs in;
  in.d = static_cast<float*>(memory);
  in.sums = in.d + mp * blocks;
  in.q = reinterpret_cast<int8_t*>(in.sums + m * groups);
  char* finite = reinterpret_cast<char*>(in.q + mp * kp);
  memset(in.q + m * kp, 0, static_cast<size_t>((mp - m) * kp));
  for (int64_t i = m * blocks; i < mp * blocks; ++i) in.d[i] = 0.0f;
  // rows are rounded independently: in parallel from 64 rows, the same values
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && m >= 64)
  for (int64_t r = 0; r < m; ++r) {
    finite[r] = round_row(x + r * k, k, kp, groups, group_shift, in.q + r * kp, in.d + r * blocks,
                          in.sums + r * groups);
    if (!finite[r]) {  // zeros for the products; the row's outputs are set to NaN after
      memset(in.q + r * kp, 0, static_cast<size_t>(kp));
      for (int64_t b = 0; b < blocks; ++b) in.d[r * blocks + b] = 0.0f;
      for (int64_t g = 0; g < groups; ++g) in.sums[r * groups + g] = 0.0f;
    }
  }
  bool all_finite = true;
  for (int64_t r = 0; r < m; ++r) all_finite = all_finite && finite[r];
  if (copy == Q8Copy::amx) {
    int status = 1;
    if constexpr (std::is_same_v<Pair, float>)
      status = dtype_policies_int4_mm_q8_tiles(in.q, in.d, in.sums, m, kp, packed, sz, groups,
                                               group_shift, y, n, threads);
    if (status == 2) {
      free(memory);
      return 2;
    }
    copy = status == 0 ? Q8Copy::amx : Q8Copy::vnni;  // no tiles here: the same values
  }
  if (copy != Q8Copy::amx) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t c8 = 0; c8 < column_blocks; ++c8) {
      const uint8_t* tile = packed + c8 * blocks * 128;
      const Pair* pairs = sz + c8 * groups * 16;
      const int64_t columns = n - 8 * c8 < 8 ? n - 8 * c8 : 8;
      if (copy == Q8Copy::vnni) {
        for (int64_t r = 0; r < m; r += 4) {
          const int64_t rows = m - r < 4 ? m - r : 4;
          alignas(32) float out[4][8];
          q8_rows_vnni(in, r, rows, kp, tile, pairs, groups, group_shift, out);
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t c = 0; c < columns; ++c) y[(r + i) * n + 8 * c8 + c] = float_to_bf16(out[i][c]);
        }
        continue;
      }
      for (int64_t r = 0; r < m; ++r) {
        alignas(32) float out[8];
        _mm256_store_ps(out, q8_columns8(in, r, kp, tile, pairs, groups, group_shift));
        for (int64_t c = 0; c < columns; ++c) y[r * n + 8 * c8 + c] = float_to_bf16(out[c]);
      }
    }
  }
  if (!all_finite)
    for (int64_t r = 0; r < m; ++r)
      if (!finite[r])
        for (int64_t j = 0; j < n; ++j) y[r * n + j] = 0x7fc0;  // bfloat16 NaN
  free(memory);
  return 0;
}

}  // namespace

extern "C" int dtype_policies_int4_mm_q8(const uint16_t* x, int64_t m, int64_t k, const uint8_t* packed,
                                         const float* sz, int64_t kp, int64_t group, uint16_t* y,
                                         int64_t n, int threads) {
  return int4_mm_q8(x, m, k, packed, sz, kp, group, y, n, threads, Q8Copy::avx2);
}

// The same product on CPUs with AVX-512 VNNI (the caller checks).
extern "C" int dtype_policies_int4_mm_q8_vnni(const uint16_t* x, int64_t m, int64_t k,
                                              const uint8_t* packed, const float* sz, int64_t kp,
                                              int64_t group, uint16_t* y, int64_t n, int threads) {
  return int4_mm_q8(x, m, k, packed, sz, kp, group, y, n, threads, Q8Copy::vnni);
}

// The AVX2 and VNNI products of a layout whose pairs are float16 (`sz`: their bits).
extern "C" int dtype_policies_int4_mm_q8_h(const uint16_t* x, int64_t m, int64_t k, const uint8_t* packed,
                                           const uint16_t* sz, int64_t kp, int64_t group, uint16_t* y,
                                           int64_t n, int threads) {
  return int4_mm_q8(x, m, k, packed, sz, kp, group, y, n, threads, Q8Copy::avx2);
}

extern "C" int dtype_policies_int4_mm_q8_vnni_h(const uint16_t* x, int64_t m, int64_t k,
                                                const uint8_t* packed, const uint16_t* sz, int64_t kp,
                                                int64_t group, uint16_t* y, int64_t n, int threads) {
  return int4_mm_q8(x, m, k, packed, sz, kp, group, y, n, threads, Q8Copy::vnni);
}

// The same product on AMX tiles (int4_amx.inc, the caller checks for AVX-512
// VNNI); the VNNI copy where the tiles do not run.
extern "C" int dtype_policies_int4_mm_q8_amx(const uint16_t* x, int64_t m, int64_t k,
                                             const uint8_t* packed, const float* sz, int64_t kp,
                                             int64_t group, uint16_t* y, int64_t n, int threads) {
  return int4_mm_q8(x, m, k, packed, sz, kp, group, y, n, threads, Q8Copy::amx);
}

// The float32 weight [N, Kp] of the same layout (`q * s + z` per weight), for
// many rows, where one float32 GEMM on it costs far more than this pass.
extern "C" int dtype_policies_int4_dequantize(const uint8_t* packed, const float* sz, int64_t kp,
                                              int64_t group, int64_t n, float* out, int threads) {
  if (n <= 0) return 0;
  if (kp % 64 != 0 || group < 32 || (group & (group - 1)) != 0) return 1;
  const int64_t groups = (kp + group - 1) / group, halves = kp / 32, halves_per_group = group / 32;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t row = 0; row < n; ++row) {
    const uint8_t* words = packed + row * (kp / 2);
    const float* pairs = sz + row * groups * 2;
    float* w = out + row * kp;
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 s = _mm256_set1_ps(pairs[2 * g]);
      const __m256 z = _mm256_set1_ps(pairs[2 * g + 1]);
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

// The float32 weight [N, Kp] of the W4A8 layout: `(u - 8) * s + z` per weight.
extern "C" int dtype_policies_int4_q8_dequantize(const uint8_t* packed, const float* sz, int64_t kp,
                                                 int64_t group, int64_t n, float* out, int threads) {
  if (n <= 0) return 0;
  if (kp % 32 != 0 || group < 32 || (group & (group - 1)) != 0) return 1;
  const int64_t groups = (kp + group - 1) / group, blocks = kp / 32, column_blocks = (n + 7) / 8;
  const int group_shift = log2_of(group / 32);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t c8 = 0; c8 < column_blocks; ++c8) {
    const uint8_t* tile = packed + c8 * blocks * 128;
    const float* pairs = sz + c8 * groups * 16;
    const int64_t columns = n - 8 * c8 < 8 ? n - 8 * c8 : 8;
    for (int64_t c = 0; c < columns; ++c) {
      float* w = out + (8 * c8 + c) * kp;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t g = b >> group_shift;
        const float s = pairs[16 * g + c], offset = pairs[16 * g + 8 + c] - 8.0f * s;
        const uint8_t* bytes = tile + 128 * b;
        for (int j = 0; j < 4; ++j)
          for (int t = 0; t < 4; ++t) {
            const uint8_t byte = bytes[32 * j + 4 * c + t];
            w[32 * b + 4 * j + t] = static_cast<float>(byte & 0x0f) * s + offset;
            w[32 * b + 4 * (j + 4) + t] = static_cast<float>(byte >> 4) * s + offset;
          }
      }
    }
  }
  return 0;
}

// The W4A8 rounding of m bfloat16 rows (k inputs each) for other kernels
// (int8_avx2.cpp): q [m, kp] int8 (kp a multiple of 32, the rest zeros), d [m, kp / 32]
// steps, finite[m] 0 for a row holding a NaN or an infinity (its q and d then zeros).
extern "C" int dtype_policies_round_rows_q8(const uint16_t* x, int64_t m, int64_t k, int64_t kp,
                                            int8_t* q, float* d, char* finite, int threads) {
  if (kp % 32 != 0 || k > kp) return 1;
  const int64_t blocks = kp / 32;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t r = 0; r < m; ++r) {
    finite[r] = round_row(x + r * k, k, kp, blocks, 0, q + r * kp, d + r * blocks, nullptr) ? 1 : 0;
    if (!finite[r]) {
      memset(q + r * kp, 0, static_cast<size_t>(kp));
      for (int64_t b = 0; b < blocks; ++b) d[r * blocks + b] = 0.0f;
    }
  }
  return 0;
}

// torch's CPU int4 packing (`_convert_weight_to_int4pack_for_cpu`), decoded into
// bfloat16 for GEMMs. Columns come in blocks of `block_n` (64 where torch's
// kernels run AVX-512, 32 under AVX2), block b at byte b * kp * block_n / 2:
//   a whole block: byte j of input k (k * block_n / 2 + j) holds column j in its
//     low nibble and column j + block_n / 2 in its high nibble;
//   a last block of nb < block_n columns: byte j of input k (k * nb / 2 + j) holds
//     columns 2 j and 2 j + 1.
//   sz [G, np, 2] bfloat16: (s, z) per group of `group` inputs and column.
// Writes columns [c0, c0 + cols) (c0 a multiple of block_n, c0 + cols <= np) of
// the weight, transposed: out[k * ldo + c - c0] = bf16((u - 8) * s + z), the float32
// value torch's kernel multiplies by, rounded to nearest even.
namespace {

inline __m256i round_to_bf16_bits(__m256 w) {  // finite inputs: the bits in the high half
  const __m256i bits = _mm256_castps_si256(w);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
}

// 16 nibbles (one per byte of `u`, already masked) of columns c .. c + 15 into out.
inline void decode16(__m128i u, const float* s, const float* z, uint16_t* out) {
  const __m256 eight = _mm256_set1_ps(8.0f);
  const __m256 a = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(u)), eight);
  const __m256 b = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(u, 8))), eight);
  const __m256i wa = round_to_bf16_bits(_mm256_fmadd_ps(a, _mm256_loadu_ps(s), _mm256_loadu_ps(z)));
  const __m256i wb = round_to_bf16_bits(_mm256_fmadd_ps(b, _mm256_loadu_ps(s + 8), _mm256_loadu_ps(z + 8)));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(wa, wb), 0xd8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), packed);
}

}  // namespace

// The chunk's scales and offsets as float32, s and z each [groups, cols].
extern "C" int dtype_policies_int4_torch_pairs(const uint16_t* sz, int64_t groups, int64_t np,
                                               int64_t c0, int64_t cols, float* s, float* z) {
  if (c0 < 0 || cols < 0 || c0 + cols > np) return 1;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = 0; c < cols; ++c) {
      s[g * cols + c] = bf16_to_float(sz[(g * np + c0 + c) * 2]);
      z[g * cols + c] = bf16_to_float(sz[(g * np + c0 + c) * 2 + 1]);
    }
  return 0;
}

// Inputs [k0, k1) of the chunk's columns (the caller runs ranges in parallel);
// s, z from dtype_policies_int4_torch_pairs.
extern "C" int dtype_policies_int4_decode_torch_packed(const uint8_t* packed, const float* s,
                                                       const float* z, int64_t kp, int64_t group,
                                                       int64_t np, int64_t block_n, int64_t c0,
                                                       int64_t cols, int64_t k0, int64_t k1,
                                                       uint16_t* out, int64_t ldo) {
  if (cols <= 0 || k1 <= k0) return 0;
  if ((block_n != 32 && block_n != 64) || c0 % block_n != 0 || c0 + cols > np || np % 16 != 0 ||
      cols % 16 != 0 || ldo < cols || group < 1 || kp % group != 0 || k0 < 0 || k1 > kp)
    return 1;
  const int64_t half = block_n / 2;
  const int64_t first_block = c0 / block_n, blocks = (cols + block_n - 1) / block_n;
  for (int64_t k = k0; k < k1; ++k) {
    const float* sk = s + (k / group) * cols;
    const float* zk = z + (k / group) * cols;
    uint16_t* row = out + k * ldo;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t col = b * block_n;  // in the chunk
      const int64_t nb = np - (c0 + col) < block_n ? np - (c0 + col) : block_n;
      const uint8_t* base = packed + (first_block + b) * kp * half;
      if (nb == block_n) {
        const uint8_t* bytes = base + k * half;
        for (int64_t j = 0; j < half; j += 16) {
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + j));
          const __m128i low = _mm_and_si128(v, _mm_set1_epi8(0x0f));
          const __m128i high = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f));
          decode16(low, sk + col + j, zk + col + j, row + col + j);
          decode16(high, sk + col + half + j, zk + col + half + j, row + col + half + j);
        }
      } else {
        const uint8_t* bytes = base + k * (nb / 2);
        for (int64_t j = 0; j < nb / 2; ++j) {
          const int64_t c = col + 2 * j;
          const float lo = static_cast<float>(bytes[j] & 0x0f) - 8.0f;
          const float hi = static_cast<float>(bytes[j] >> 4) - 8.0f;
          row[c] = float_to_bf16(fmaf(lo, sk[c], zk[c]));
          row[c + 1] = float_to_bf16(fmaf(hi, sk[c + 1], zk[c + 1]));
        }
      }
    }
  }
  return 0;
}
