// Scaled dot-product attention on bfloat16 queries, keys and values for CPUs
// with AVX-512 bfloat16 dot products (vdpbf16ps): scores summed in float32,
// softmax in float32, the unnormalised probabilities rounded to bfloat16 for
// the product with the values (as torch's own CPU flash kernel does), that
// product summed in float32 and divided by the row's float32 sum once.
//
// Each task is QUERY_ROWS query rows of one head: their scores against every
// key they may see are kept (float32, in cache) instead of being recomputed
// block by block with running maxima, which is what the key lengths of the
// models this serves (<= a few thousand) allow. Keys are packed once per
// (batch, key head) in pairs of feature columns, values in pairs of rows: the
// operand layouts of vdpbf16ps. Grouped-query attention reads a key head for
// every query head of its group.
//
// Semantics are torch's F.scaled_dot_product_attention (dropout 0): an
// additive float32 mask broadcast to (B, Hq, Lq, Lk) or top-left causal; a row
// whose keys are all masked gives zeros; a row with a NaN score gives NaN.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "bf16_target.h"

namespace {

constexpr int64_t QUERY_ROWS = 16;  // rows per task (a multiple of ROWS)
constexpr int64_t ROWS = 4;         // rows per micro-kernel

inline int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

DTYPE_POLICIES_BF16_BEGIN

// exp(x) for float32 lanes: 2^n * p(r), r = x - n ln2, |r| <= ln2 / 2, a
// degree-7 Taylor polynomial (relative error < 2e-7); lanes below -87 (and
// -inf, and NaN) give 0.
inline __m512 exp_ps(__m512 x) {
  const __m512 lowest = _mm512_set1_ps(-87.0f);
  const __mmask16 keep = _mm512_cmp_ps_mask(x, lowest, _CMP_GE_OQ);
  x = _mm512_max_ps(x, lowest);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// keys (Lk rows `stride` elements apart, D) -> packed[D/2][columns]: lane j
// of row p holds features 2p, 2p+1 of key j.
void pack_keys(const uint16_t* keys, int64_t stride, int64_t length, int64_t pairs,
               int64_t columns, uint32_t* packed) {
  for (int64_t p = 0; p < pairs; ++p) {
    uint32_t* row = packed + p * columns;
    for (int64_t j = 0; j < length; ++j) {
      uint32_t pair;
      std::memcpy(&pair, keys + j * stride + 2 * p, sizeof(pair));
      row[j] = pair;
    }
    std::fill(row + length, row + columns, 0u);
  }
}

// values (Lk rows `stride` elements apart, D) -> packed[columns/2][D][2]:
// rows 2t and 2t+1 interleaved.
void pack_values(const uint16_t* values, int64_t stride, int64_t length, int64_t depth,
                 int64_t columns, uint16_t* packed) {
  for (int64_t t = 0; t < columns / 2; ++t) {
    uint16_t* out = packed + t * depth * 2;
    for (int e = 0; e < 2; ++e) {
      const int64_t j = 2 * t + e;
      if (j < length) {
        const uint16_t* row = values + j * stride;
        for (int64_t d = 0; d < depth; ++d) out[d * 2 + e] = row[d];
      } else {
        for (int64_t d = 0; d < depth; ++d) out[d * 2 + e] = 0;
      }
    }
  }
}

// scores[r][j] = sum_p query[r][p] . keys[p][j] for ROWS rows and 16 * tiles columns.
template <int TILES>
inline void score_tile(const uint32_t* query, int64_t pairs, const uint32_t* keys, int64_t columns,
                       float* scores, int64_t score_stride) {
  __m512 acc[ROWS][TILES];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < TILES; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i k[TILES];
    for (int c = 0; c < TILES; ++c) k[c] = _mm512_loadu_si512(keys + p * columns + 16 * c);
    for (int r = 0; r < ROWS; ++r) {
      const __m512i q = _mm512_set1_epi32(static_cast<int>(query[r * pairs + p]));
      for (int c = 0; c < TILES; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], as_bh(q), as_bh(k[c]));
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < TILES; ++c) _mm512_storeu_ps(scores + r * score_stride + 16 * c, acc[r][c]);
}

// out[r][d] += sum_t probabilities[r][t] . values[t][d] for ROWS rows and 16 * tiles features.
template <int TILES>
inline void value_tile(const uint32_t* probabilities, int64_t probability_stride, int64_t pairs,
                       const uint16_t* values, int64_t depth, float* out, int64_t out_stride) {
  __m512 acc[ROWS][TILES];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < TILES; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < pairs; ++t) {
    __m512i v[TILES];
    for (int c = 0; c < TILES; ++c) v[c] = _mm512_loadu_si512(values + (t * depth + 16 * c) * 2);
    for (int r = 0; r < ROWS; ++r) {
      const __m512i p = _mm512_set1_epi32(static_cast<int>(probabilities[r * probability_stride + t]));
      for (int c = 0; c < TILES; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], as_bh(p), as_bh(v[c]));
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < TILES; ++c) _mm512_storeu_ps(out + r * out_stride + 16 * c, acc[r][c]);
}

struct Shapes {
  int64_t batch, heads, key_heads, queries, keys, depth;
  int64_t pairs, columns;  // depth / 2; keys rounded up to 32
};

// One task: rows [first, first + rows) of query head `head` of batch `b`
// (query rows `query_stride` elements apart; output rows `out_stride`).
void attend_rows(const Shapes& s, const uint16_t* query_rows, int64_t query_stride,
                 const uint32_t* packed_keys,
                 const uint16_t* packed_values, const float* mask, const int64_t* mask_strides,
                 int64_t b, int64_t head, int64_t first, int64_t rows, bool causal, float scale,
                 uint16_t* out, int64_t out_stride, std::vector<uint32_t>& query, std::vector<float>& scores,
                 std::vector<uint16_t>& probabilities, std::vector<float>& sums,
                 std::vector<float>& accumulated) {
  const int64_t pairs = s.pairs, columns = s.columns;
  // the columns any of these rows may see (causal: top-left aligned, as torch)
  const int64_t visible = causal ? std::min<int64_t>(s.keys, first + rows) : s.keys;
  const int64_t width = round_up(std::max<int64_t>(visible, 1), 32);
  std::fill(query.begin(), query.end(), 0u);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(query.data() + r * pairs, query_rows + r * query_stride, s.depth * sizeof(uint16_t));
  for (int64_t r0 = 0; r0 < QUERY_ROWS; r0 += ROWS) {
    if (r0 >= rows) break;
    for (int64_t j = 0; j < width; j += 32)
      score_tile<2>(query.data() + r0 * pairs, pairs, packed_keys + j, columns,
                    scores.data() + r0 * columns + j, columns);
  }
  const float negative_infinity = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = first + r;
    float* row = scores.data() + r * columns;
    const int64_t limit = causal ? std::min<int64_t>(i + 1, s.keys) : s.keys;
    const float* mask_row = mask == nullptr
                                ? nullptr
                                : mask + b * mask_strides[0] + head * mask_strides[1] + i * mask_strides[2];
    // scaled, masked (columns at or beyond `limit`: -inf), the row's maximum
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 scales = _mm512_set1_ps(scale);
    const __m512 hidden = _mm512_set1_ps(negative_infinity);
    __m512 maxima = hidden;
    __mmask16 nans = 0;
    alignas(64) float gathered[16];
    for (int64_t j = 0; j < width; j += 16) {
      const __mmask16 valid =
          _mm512_cmplt_epi32_mask(_mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(j))),
                                  _mm512_set1_epi32(static_cast<int>(limit)));
      __m512 x = _mm512_mul_ps(_mm512_loadu_ps(row + j), scales);
      if (mask_row != nullptr && mask_strides[3] == 1) {
        x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(valid, mask_row + j));
      } else if (mask_row != nullptr) {
        for (int e = 0; e < 16; ++e)
          gathered[e] = j + e < limit ? mask_row[(j + e) * mask_strides[3]] : 0.0f;
        x = _mm512_add_ps(x, _mm512_load_ps(gathered));
      }
      nans |= _mm512_mask_cmp_ps_mask(valid, x, x, _CMP_UNORD_Q);
      x = _mm512_mask_blend_ps(valid, hidden, x);
      maxima = _mm512_max_ps(maxima, x);
      _mm512_storeu_ps(row + j, x);
    }
    const bool nan = nans != 0;
    const float maximum = _mm512_reduce_max_ps(maxima);
    uint16_t* probability_row = probabilities.data() + r * columns;
    if (nan || maximum == negative_infinity) {
      std::fill(probability_row, probability_row + width, 0);
      sums[r] = nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
      continue;
    }
    const __m512 shift = _mm512_set1_ps(maximum);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < width; j += 32) {
      const __m512 low = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(row + j), shift));
      const __m512 high = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(row + j + 16), shift));
      total = _mm512_add_ps(total, _mm512_add_ps(low, high));
      // (high, low): lanes 0-15 from low, 16-31 from high
      _mm512_storeu_si512(probability_row + j, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
    sums[r] = _mm512_reduce_add_ps(total);
  }
  for (int64_t r = rows; r < round_up(rows, ROWS); ++r)
    std::fill(probabilities.data() + r * columns, probabilities.data() + r * columns + width, 0);
  const auto* probability_pairs = reinterpret_cast<const uint32_t*>(probabilities.data());
  const int64_t probability_stride = columns / 2;
  for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
    const uint32_t* pairs_of_rows = probability_pairs + r0 * probability_stride;
    float* sums_of_rows = accumulated.data() + r0 * s.depth;
    int64_t d = 0;
    for (; d + 64 <= s.depth; d += 64)
      value_tile<4>(pairs_of_rows, probability_stride, width / 2, packed_values + d * 2, s.depth,
                    sums_of_rows + d, s.depth);
    for (; d + 32 <= s.depth; d += 32)
      value_tile<2>(pairs_of_rows, probability_stride, width / 2, packed_values + d * 2, s.depth,
                    sums_of_rows + d, s.depth);
    for (; d < s.depth; d += 16)
      value_tile<1>(pairs_of_rows, probability_stride, width / 2, packed_values + d * 2, s.depth,
                    sums_of_rows + d, s.depth);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inverse = _mm512_set1_ps(sums[r] == 0.0f ? 0.0f : 1.0f / sums[r]);
    const float* source = accumulated.data() + r * s.depth;
    uint16_t* target = out + r * out_stride;
    for (int64_t d = 0; d < s.depth; d += 16) {
      const __m512 value = _mm512_mul_ps(_mm512_loadu_ps(source + d), inverse);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(target + d), (__m256i)_mm512_cvtneps_pbh(value));
    }
  }
}

DTYPE_POLICIES_BF16_END

at::Tensor attention_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& mask, double scale, bool causal) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "attention_bf16: queries, keys and values must be (B, H, L, D); got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16,
              "attention_bf16: bfloat16 tensors expected");
  Shapes s{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), 0, 0};
  TORCH_CHECK(k.size(0) == s.batch && v.size(0) == s.batch && v.size(1) == s.key_heads &&
                  v.size(2) == s.keys && k.size(3) == s.depth && v.size(3) == s.depth,
              "attention_bf16: mismatched shapes ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(s.key_heads > 0 && s.heads % s.key_heads == 0,
              "attention_bf16: query heads (", s.heads, ") must be a multiple of key heads (",
              s.key_heads, ")");
  TORCH_CHECK(s.depth % 16 == 0 && s.depth > 0, "attention_bf16: head size ", s.depth,
              " must be a positive multiple of 16");
  // (B, Lq, H, D) memory returned as (B, H, Lq, D), as torch's flash kernel:
  // transformers' transpose back to (B, Lq, H, D) is then free
  auto out = at::empty({s.batch, s.queries, s.heads, s.depth}, q.options()).transpose(1, 2);
  if (out.numel() == 0) return out;
  if (s.keys == 0) return out.zero_();
  s.pairs = s.depth / 2;
  s.columns = round_up(s.keys, 32);
  // any layout whose rows are contiguous is read in place
  const auto queries = q.stride(3) == 1 ? q : q.contiguous();
  const auto keys = k.stride(3) == 1 ? k : k.contiguous();
  const auto values = v.stride(3) == 1 ? v : v.contiguous();
  at::Tensor expanded;
  int64_t mask_strides[4] = {0, 0, 0, 0};
  const float* mask_data = nullptr;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->scalar_type() == at::kFloat, "attention_bf16: the mask must be float32");
    expanded = mask->expand({s.batch, s.heads, s.queries, s.keys});
    for (int i = 0; i < 4; ++i) mask_strides[i] = expanded.stride(i);
    mask_data = expanded.data_ptr<float>();
  }
  const int64_t kv_groups = s.batch * s.key_heads;
  auto packed_keys = at::empty({kv_groups, s.pairs * s.columns}, q.options().dtype(at::kInt));
  auto packed_values = at::empty({kv_groups, s.columns * s.depth}, q.options().dtype(at::kShort));
  const auto* key_data = reinterpret_cast<const uint16_t*>(keys.data_ptr<at::BFloat16>());
  const auto* value_data = reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>());
  auto* packed_key_data = reinterpret_cast<uint32_t*>(packed_keys.data_ptr<int32_t>());
  auto* packed_value_data = reinterpret_cast<uint16_t*>(packed_values.data_ptr<int16_t>());
  at::parallel_for(0, kv_groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t b = g / s.key_heads, h = g % s.key_heads;
      pack_keys(key_data + b * keys.stride(0) + h * keys.stride(1), keys.stride(2), s.keys, s.pairs,
                s.columns, packed_key_data + g * s.pairs * s.columns);
      pack_values(value_data + b * values.stride(0) + h * values.stride(1), values.stride(2),
                  s.keys, s.depth, s.columns, packed_value_data + g * s.columns * s.depth);
    }
  });
  const int64_t blocks = (s.queries + QUERY_ROWS - 1) / QUERY_ROWS;
  const int64_t group = s.heads / s.key_heads;
  const auto* query_data = reinterpret_cast<const uint16_t*>(queries.data_ptr<at::BFloat16>());
  auto* out_data = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float scale_f = static_cast<float>(scale);
  at::parallel_for(0, s.batch * s.heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> query(QUERY_ROWS * s.pairs);
    std::vector<float> scores(QUERY_ROWS * s.columns);
    std::vector<uint16_t> probabilities(QUERY_ROWS * s.columns);
    std::vector<float> sums(QUERY_ROWS);
    std::vector<float> accumulated(QUERY_ROWS * s.depth);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task % blocks;
      const int64_t head = (task / blocks) % s.heads;
      const int64_t b = task / (blocks * s.heads);
      const int64_t g = b * s.key_heads + head / group;
      const int64_t first = block * QUERY_ROWS;
      const int64_t rows = std::min<int64_t>(QUERY_ROWS, s.queries - first);
      const int64_t in = b * queries.stride(0) + head * queries.stride(1) + first * queries.stride(2);
      const int64_t at = b * out.stride(0) + head * out.stride(1) + first * out.stride(2);
      attend_rows(s, query_data + in, queries.stride(2), packed_key_data + g * s.pairs * s.columns,
                  packed_value_data + g * s.columns * s.depth, mask_data, mask_strides, b, head,
                  first, rows, causal, scale_f, out_data + at, out.stride(2), query, scores,
                  probabilities, sums, accumulated);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dtype_policies, m) {
  m.def("attention_bf16(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool causal) -> Tensor");
}

TORCH_LIBRARY_IMPL(dtype_policies, CPU, m) { m.impl("attention_bf16", &attention_bf16); }
