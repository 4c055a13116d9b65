// float8 (e4m3fn) rounding of a float8 layer's inputs, in one call:
//   dtype_policies::float8_e4m3_qdq(x, scale) -> Tensor
//     `x / scale`, clamped to +-448, rounded to float8_e4m3fn (nearest,
//     ties to even), times `scale`, in x's dtype; `scale` None: the per-tensor
//     dynamic scale max|x| / 448 over x's finite values (1 when there are
//     none or all are zero; at least float32's smallest normal). NaN stays NaN.
// The same values as quantizers.math's compute_float8_dynamic_scale and
// quantize_and_dequantize bit for bit; in torch's ops that is 16 small
// kernels, about 40-60 us per call at one row of 576, this about 6.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr float kE4m3Max = 448.0f;
constexpr int64_t kGrain = 32768;

template <typename T>
float finite_abs_max(const T* x, int64_t n) {
  return at::parallel_reduce(
      0, n, kGrain, 0.0f,
      [&](int64_t begin, int64_t end, float found) {
        for (int64_t i = begin; i < end; ++i) {
          const float v = std::fabs(static_cast<float>(x[i]));
          // NaN and inf fail the first test
          found = (v <= std::numeric_limits<float>::max() && v > found) ? v : found;
        }
        return found;
      },
      [](float a, float b) { return std::max(a, b); });
}

// `v` (within +-448, or NaN) rounded to e4m3fn's grid, nearest even: adding
// and subtracting 1.5 * 2**(e + 20), `e` v's exponent (at least -6), lands the
// sum in a binade whose last bit is the grid step (as the Python
// kernels.float8.quantize_dequantize_e4m3, which torch's conversion matches).
inline float e4m3_grid(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  uint32_t exponent = bits & 0x7F800000u;
  exponent = exponent < (121u << 23) ? (121u << 23) : exponent;
  const uint32_t magic_bits = exponent + ((20u << 23) | 0x400000u);
  float magic;
  std::memcpy(&magic, &magic_bits, sizeof magic);
  return (v + magic) - magic;
}

template <typename T>
void round_e4m3(const T* x, float* out, int64_t n, float scale) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float v = static_cast<float>(x[i]) / scale;
      // NaN passes both, as torch.clamp keeps it
      v = std::min(v, kE4m3Max);
      v = std::max(v, -kE4m3Max);
      out[i] = e4m3_grid(v) * scale;
    }
  });
}

template <typename T>
at::Tensor qdq(const at::Tensor& x, const c10::optional<at::Tensor>& scale) {
  const at::Tensor input = x.contiguous();
  at::Tensor out = at::empty(input.sizes(), input.options().dtype(at::kFloat));
  const int64_t n = input.numel();
  const T* data = input.data_ptr<T>();
  float s;
  if (scale.has_value()) {
    s = scale->item<float>();
  } else {
    const float amax = finite_abs_max(data, n);
    s = amax > 0.0f ? amax / kE4m3Max : 1.0f;
    s = std::max(s, std::numeric_limits<float>::min());
  }
  round_e4m3(data, out.data_ptr<float>(), n, s);
  // torch's conversion (vectorized, nearest even)
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

at::Tensor float8_e4m3_qdq(const at::Tensor& x, const c10::optional<at::Tensor>& scale) {
  TORCH_CHECK(x.device().is_cpu(), "float8_e4m3_qdq: a CPU tensor; got one on ", x.device());
  TORCH_CHECK(!scale.has_value() || scale->numel() == 1,
              "float8_e4m3_qdq: a scale of one element; got ", scale->numel());
  switch (x.scalar_type()) {
    case at::kFloat:
      return qdq<float>(x, scale);
    case at::kBFloat16:
      return qdq<c10::BFloat16>(x, scale);
    case at::kHalf:
      return qdq<c10::Half>(x, scale);
    default:
      TORCH_CHECK(false, "float8_e4m3_qdq: float32, bfloat16 or float16 inputs; got ",
                  x.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dtype_policies, m) {
  m.def("float8_e4m3_qdq(Tensor x, Tensor? scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(dtype_policies, CPU, m) { m.impl("float8_e4m3_qdq", &float8_e4m3_qdq); }
