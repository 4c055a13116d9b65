// float8 (e4m3fn) rounding of a float8 layer's inputs, in one call:
//   dtype_policies::float8_e4m3_qdq(x, scale) -> Tensor
//     `x / scale`, clamped to +-448, rounded to float8_e4m3fn (nearest,
//     ties to even), times `scale`, in x's dtype; `scale` None: the per-tensor
//     dynamic scale max|x| / 448 over x's finite values (1 when there are
//     none or all are zero; at least float32's smallest normal). NaN stays NaN.
// The same values as quantizers.math's compute_float8_dynamic_scale and
// quantize_and_dequantize bit for bit; in torch's ops that is 16 small
// kernels, about 60 us per call at one row of 576, this a few.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
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
          if (std::isfinite(v) && v > found) found = v;
        }
        return found;
      },
      [](float a, float b) { return std::max(a, b); });
}

template <typename T>
void round_e4m3(const T* x, T* out, int64_t n, float scale) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float v = static_cast<float>(x[i]) / scale;
      if (v > kE4m3Max) {
        v = kE4m3Max;
      } else if (v < -kE4m3Max) {
        v = -kE4m3Max;
      }  // NaN passes both tests, as torch.clamp keeps it
      out[i] = static_cast<T>(static_cast<float>(c10::Float8_e4m3fn(v)) * scale);
    }
  });
}

template <typename T>
at::Tensor qdq(const at::Tensor& x, const c10::optional<at::Tensor>& scale) {
  const at::Tensor input = x.contiguous();
  at::Tensor out = at::empty_like(input);
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
  round_e4m3(data, out.data_ptr<T>(), n, s);
  return out;
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
