// The int4 AVX2 kernels (int4_avx2.cpp) as torch operators, so that eager
// calls and compiled graphs reach them through the dispatcher without a
// Python frame per product:
//   dtype_policies::int4_mm_avx2(x, packed, pairs, group, n)     weight-only
//   dtype_policies::int4_mm_q8_avx2(x, packed, pairs, group, n)  W4A8, blocks of 32
//   dtype_policies::int4_mm_q8_vnni(...)  the same values, for CPUs with AVX-512 VNNI
//   dtype_policies::int4_mm_q8_amx(..., min_rows)  the same values on AMX tiles from
//     min_rows rows (the VNNI copy below them, or where the tiles do not run)
//   dtype_policies::int4_decode_avx2(packed, pairs, group, out)  float32 weight into out
//   dtype_policies::int4_decode_q8_avx2(packed, pairs, group, out)  the same, W4A8 layout
//   dtype_policies::int4_packed_decoded_mm(x, packed, pairs, group, block_n)  torch's
//     packed int4 weight decoded chunk by chunk into bfloat16, each chunk one GEMM
// x: (M, K) bfloat16; weight-only: packed (N, Kp / 2) uint8, pairs (N, G, 2)
// float32; W4A8: packed (ceil(N / 8), Kp * 4) uint8, pairs (ceil(N / 8), G, 16)
// float32 or float16 (the AMX copy and the decoder take float16 pairs as their
// float32 values) (int4_avx2.cpp has the layouts); int4_packed_decoded_mm reads torch's
// packing and its bfloat16 pairs. The decoders write (N, Kp) float32
// (W4A8: out's rows give N).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

extern "C" int dtype_policies_int4_mm_bf16(const uint16_t*, int64_t, int64_t, const uint8_t*,
                                           const float*, int64_t, int64_t, uint16_t*, int64_t, int);
extern "C" int dtype_policies_int4_mm_q8(const uint16_t*, int64_t, int64_t, const uint8_t*,
                                         const float*, int64_t, int64_t, uint16_t*, int64_t, int);
extern "C" int dtype_policies_int4_mm_q8_vnni(const uint16_t*, int64_t, int64_t, const uint8_t*,
                                              const float*, int64_t, int64_t, uint16_t*, int64_t,
                                              int);
extern "C" int dtype_policies_int4_mm_q8_h(const uint16_t*, int64_t, int64_t, const uint8_t*,
                                           const uint16_t*, int64_t, int64_t, uint16_t*, int64_t,
                                           int);
extern "C" int dtype_policies_int4_mm_q8_vnni_h(const uint16_t*, int64_t, int64_t, const uint8_t*,
                                                const uint16_t*, int64_t, int64_t, uint16_t*,
                                                int64_t, int);
extern "C" int dtype_policies_int4_mm_q8_amx(const uint16_t*, int64_t, int64_t, const uint8_t*,
                                             const float*, int64_t, int64_t, uint16_t*, int64_t,
                                             int);
extern "C" int dtype_policies_int4_dequantize(const uint8_t*, const float*, int64_t, int64_t,
                                              int64_t, float*, int);
extern "C" int dtype_policies_int4_torch_pairs(const uint16_t*, int64_t, int64_t, int64_t, int64_t,
                                               float*, float*);
extern "C" int dtype_policies_int4_decode_torch_packed(const uint8_t*, const float*, const float*,
                                                       int64_t, int64_t, int64_t, int64_t, int64_t,
                                                       int64_t, int64_t, int64_t, uint16_t*,
                                                       int64_t);
extern "C" int dtype_policies_int4_q8_dequantize(const uint8_t*, const float*, int64_t, int64_t,
                                                 int64_t, float*, int);

namespace {

// Below this many weights one thread does the whole product: a parallel
// region costs more than it saves.
constexpr int64_t kParallelMinWeights = int64_t{1} << 16;

int threads_for(int64_t weights) {
  return weights >= kParallelMinWeights ? at::get_num_threads() : 1;
}

// The weight's Kp, after checking the tensors against the layout: weight-only
// (packed (N, Kp / 2), pairs (N, G, 2)) or W4A8 (`q8`: packed (ceil(N / 8),
// Kp * 4), pairs (ceil(N / 8), G, 16)).
int64_t checked_kp(const char* name, const at::Tensor& packed, const at::Tensor& pairs,
                   int64_t group, int64_t n, bool q8) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              name, ": packed must be a contiguous 2-D uint8 tensor, got ", packed.scalar_type(),
              " of shape ", packed.sizes());
  const int64_t kp = q8 ? packed.size(1) / 4 : packed.size(1) * 2;
  const int64_t rows = q8 ? (n + 7) / 8 : packed.size(0);
  const int64_t per_group = q8 ? 16 : 2;
  const int64_t multiple = q8 ? 32 : 64;
  TORCH_CHECK(kp % multiple == 0 && group >= 32 && (group & (group - 1)) == 0 &&
                  (n <= packed.size(0) || q8) && packed.size(0) == rows,
              name, ": expected Kp a multiple of ", multiple, ", a group that is a power of two ",
              "from 32, and a packed weight for n=", n, "; got Kp=", kp, ", group=", group,
              ", packed ", packed.sizes());
  const bool dtype_ok =
      pairs.scalar_type() == at::kFloat || (q8 && pairs.scalar_type() == at::kHalf);
  TORCH_CHECK(pairs.dim() == 3 && dtype_ok && pairs.is_contiguous() &&
                  pairs.size(0) == rows && pairs.size(1) == (kp + group - 1) / group &&
                  pairs.size(2) == per_group,
              name, ": pairs must be a contiguous (", rows, ", ", (kp + group - 1) / group, ", ",
              per_group, ") float32", q8 ? " or float16" : "", " tensor, got ",
              pairs.scalar_type(), " of shape ", pairs.sizes());
  return kp;
}

using Product = int (*)(const uint16_t*, int64_t, int64_t, const uint8_t*, const float*,
                        int64_t, int64_t, uint16_t*, int64_t, int);
using HalfProduct = int (*)(const uint16_t*, int64_t, int64_t, const uint8_t*, const uint16_t*,
                            int64_t, int64_t, uint16_t*, int64_t, int);

// `product` on float32 pairs, `half_product` on float16 ones; without it,
// float16 pairs go to `product` as their float32 values (the same results).
at::Tensor run_product(Product product, const char* name, bool q8, const at::Tensor& x_in,
                       const at::Tensor& packed, const at::Tensor& pairs, int64_t group, int64_t n,
                       HalfProduct half_product = nullptr) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16,
              name, ": x must be a 2-D bfloat16 tensor, got ", x_in.scalar_type(), " of shape ",
              x_in.sizes());
  const int64_t kp = checked_kp(name, packed, pairs, group, n, q8);
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k <= kp, name, ": x has K=", k, " inputs, more than the weight's Kp=", kp);
  at::Tensor y = at::empty({m, n}, x.options());
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* ys = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int threads = threads_for(n * kp);
  int status;
  if (pairs.scalar_type() == at::kHalf && half_product != nullptr) {
    status = half_product(xs, m, k, packed.data_ptr<uint8_t>(),
                          reinterpret_cast<const uint16_t*>(pairs.data_ptr()), kp, group, ys, n,
                          threads);
  } else {
    const at::Tensor wide = pairs.to(at::kFloat);
    status = product(xs, m, k, packed.data_ptr<uint8_t>(), wide.data_ptr<float>(), kp, group, ys,
                     n, threads);
  }
  TORCH_CHECK(status == 0, name, " failed (status ", status, ": ",
              status == 2 ? "out of memory" : "rejected its arguments", ")");
  return y;
}

at::Tensor int4_mm_avx2(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& pairs,
                        int64_t group, int64_t n) {
  return run_product(dtype_policies_int4_mm_bf16, "int4_mm_avx2", false, x, packed, pairs, group, n);
}

at::Tensor int4_mm_q8_avx2(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& pairs,
                           int64_t group, int64_t n) {
  return run_product(dtype_policies_int4_mm_q8, "int4_mm_q8_avx2", true, x, packed, pairs, group, n,
                     dtype_policies_int4_mm_q8_h);
}

at::Tensor int4_mm_q8_vnni(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& pairs,
                           int64_t group, int64_t n) {
  return run_product(dtype_policies_int4_mm_q8_vnni, "int4_mm_q8_vnni", true, x, packed, pairs,
                     group, n, dtype_policies_int4_mm_q8_vnni_h);
}

// From `min_rows` rows on AMX tiles, below them the VNNI copy: the choice by
// rows made at run time, so that a compiled graph holds no guard on the rows.
at::Tensor int4_mm_q8_amx(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& pairs,
                          int64_t group, int64_t n, int64_t min_rows) {
  if (x.dim() == 2 && x.size(0) < min_rows)
    return run_product(dtype_policies_int4_mm_q8_vnni, "int4_mm_q8_amx", true, x, packed, pairs,
                       group, n, dtype_policies_int4_mm_q8_vnni_h);
  return run_product(dtype_policies_int4_mm_q8_amx, "int4_mm_q8_amx", true, x, packed, pairs,
                     group, n);
}

using Decode = int (*)(const uint8_t*, const float*, int64_t, int64_t, int64_t, float*, int);

void run_decode(Decode decode, const char* name, bool q8, const at::Tensor& packed,
                const at::Tensor& pairs, int64_t group, const at::Tensor& out) {
  const int64_t n = q8 ? out.size(0) : packed.size(0);
  const int64_t kp = checked_kp(name, packed, pairs, group, n, q8);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == n && out.size(1) == kp,
              name, ": out must be a contiguous float32 (", n, ", ", kp,
              ") tensor, got ", out.scalar_type(), " of shape ", out.sizes());
  const at::Tensor wide = pairs.to(at::kFloat);  // float16 pairs: their float32 values
  const int status = decode(packed.data_ptr<uint8_t>(), wide.data_ptr<float>(), kp, group, n,
                            out.data_ptr<float>(), threads_for(n * kp));
  TORCH_CHECK(status == 0, name, " rejected its arguments (status ", status, ")");
}

void int4_decode_avx2(const at::Tensor& packed, const at::Tensor& pairs, int64_t group,
                      const at::Tensor& out) {
  run_decode(dtype_policies_int4_dequantize, "int4_decode_avx2", false, packed, pairs, group, out);
}

void int4_decode_q8_avx2(const at::Tensor& packed, const at::Tensor& pairs, int64_t group,
                         const at::Tensor& out) {
  run_decode(dtype_policies_int4_q8_dequantize, "int4_decode_q8_avx2", true, packed, pairs, group,
             out);
}

// Values of the float32 weight decoded per chunk of output rows: 1 MiB, multiplied while it
// is still in cache.
constexpr int64_t kFloatDecodedChunkValues = int64_t{1} << 18;

// x [M, K] float32 times a weight packed by `pack` (or `pack_q8`, q8): [M, N] float32 (W4A8:
// N rounded up to a multiple of 8), from one float32 GEMM per chunk of output rows of the
// weight decoded into one cache-sized buffer. One operator, so that a compiled graph calls the
// same chunks and GEMMs as eager (the same values).
at::Tensor int4_decoded_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& pairs,
                           int64_t group, bool q8) {
  const char* name = q8 ? "int4_decoded_mm (q8)" : "int4_decoded_mm";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, name,
              ": x must be a 2-D float32 tensor, got ", x.scalar_type(), " of shape ", x.sizes());
  TORCH_CHECK(packed.dim() == 2, name, ": packed must be 2-D, got shape ", packed.sizes());
  const int64_t n = q8 ? packed.size(0) * 8 : packed.size(0);
  const int64_t kp = q8 ? packed.size(1) / 4 : packed.size(1) * 2;
  const int64_t k = x.size(1);
  TORCH_CHECK(k <= kp, name, ": x has ", k, " inputs, the weight ", kp);
  const int64_t per_row = q8 ? 8 : 1;  // output rows per packed row
  const int64_t rows = std::max<int64_t>(16, kFloatDecodedChunkValues / kp) / per_row * per_row;
  const Decode decode = q8 ? dtype_policies_int4_q8_dequantize : dtype_policies_int4_dequantize;
  if (rows >= n) {
    at::Tensor weight = at::empty({n, kp}, x.options());
    run_decode(decode, name, q8, packed, pairs, group, weight);
    return at::mm(x, weight.narrow(1, 0, k).t());
  }
  at::Tensor buffer = at::empty({rows, kp}, x.options());
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  for (int64_t start = 0; start < n; start += rows) {
    const int64_t stop = std::min(start + rows, n);
    const int64_t p0 = start / per_row, p1 = stop / per_row;
    at::Tensor weight = buffer.narrow(0, 0, stop - start);
    run_decode(decode, name, q8, packed.narrow(0, p0, p1 - p0), pairs.narrow(0, p0, p1 - p0),
               group, weight);
    y.narrow(1, start, stop - start).copy_(at::mm(x, weight.narrow(1, 0, k).t()));
  }
  return y;
}

// Values of the bfloat16 weight decoded per chunk: 8 MiB. With 1 MiB chunks (multiplied
// while in cache) the alternation of parallel decoding and GEMMs made the time bimodal
// (896 x 4864 at 128 rows, 2 threads: 3.7 or 6.4-7.0 ms from one run to the next); with
// 8 MiB it is 3.5-4.0 ms every run.
constexpr int64_t kDecodedChunkValues = int64_t{1} << 22;

// x [M, Kp] bfloat16 times torch's packed int4 weight (packed: its bytes for
// np = pairs.size(1) columns in blocks of block_n; pairs [Kp / group, np, 2]
// bfloat16): [M, np] bfloat16, from one bfloat16 GEMM per chunk of columns on
// the decoded weight (float32 sums, one rounding of each output). Each chunk is
// decoded in parallel on torch's threads (at::parallel_for), so that they work
// instead of spinning between the GEMMs.
at::Tensor int4_packed_decoded_mm(const at::Tensor& x, const at::Tensor& packed,
                                  const at::Tensor& pairs, int64_t group, int64_t block_n) {
  const char* name = "int4_packed_decoded_mm";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), name,
              ": x must be a contiguous 2-D bfloat16 tensor, got ", x.scalar_type(), " of shape ",
              x.sizes());
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), name,
              ": packed must be a contiguous uint8 tensor, got ", packed.scalar_type());
  const int64_t kp = x.size(1);
  TORCH_CHECK(pairs.dim() == 3 && pairs.scalar_type() == at::kBFloat16 && pairs.is_contiguous() &&
                  pairs.size(2) == 2 && group > 0 && kp % group == 0 &&
                  pairs.size(0) == kp / group,
              name, ": pairs must be a contiguous bfloat16 (Kp / group, np, 2) tensor for Kp=", kp,
              ", group=", group, "; got ", pairs.scalar_type(), " of shape ", pairs.sizes());
  const int64_t np = pairs.size(1);
  TORCH_CHECK((block_n == 32 || block_n == 64) && np % 16 == 0 && packed.numel() == np * kp / 2,
              name, ": expected block_n 32 or 64, np a multiple of 16 and np * Kp / 2 packed "
              "bytes; got block_n=", block_n, ", np=", np, ", ", packed.numel(), " bytes");
  const int64_t m = x.size(0);
  const int64_t chunk = std::max(block_n, kDecodedChunkValues / kp / block_n * block_n);
  const int64_t width = std::min(chunk, np);
  const int64_t groups = kp / group;
  at::Tensor buffer = at::empty({kp, width}, x.options());
  at::Tensor steps = at::empty({2, groups, width}, x.options().dtype(at::kFloat));
  at::Tensor y = width == np ? at::Tensor() : at::empty({m, np}, x.options());
  const uint8_t* bytes = packed.data_ptr<uint8_t>();
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(pairs.data_ptr());
  uint16_t* out = reinterpret_cast<uint16_t*>(buffer.data_ptr());
  float* s = steps.data_ptr<float>();
  // rows of the decoded chunk per task: about 32 KiB of output each
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / width);
  for (int64_t c0 = 0; c0 < np; c0 += chunk) {
    const int64_t cols = std::min(chunk, np - c0);
    float* z = s + groups * cols;
    TORCH_CHECK(dtype_policies_int4_torch_pairs(sz, groups, np, c0, cols, s, z) == 0, name,
                ": a column range outside the weight");
    std::atomic<int> status{0};
    at::parallel_for(0, kp, grain, [&](int64_t k0, int64_t k1) {
      const int code = dtype_policies_int4_decode_torch_packed(bytes, s, z, kp, group, np, block_n,
                                                               c0, cols, k0, k1, out, width);
      if (code != 0) status = code;
    });
    TORCH_CHECK(status == 0, name, " rejected its arguments (status ", status.load(), ")");
    at::Tensor weight = cols == width ? buffer : buffer.narrow(1, 0, cols);
    if (cols == np) return at::mm(x, weight);
    at::Tensor part = y.narrow(1, c0, cols);
    at::mm_out(part, x, weight);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dtype_policies, m) {
  m.def("int4_mm_avx2(Tensor x, Tensor packed, Tensor pairs, int group, int n) -> Tensor");
  m.def("int4_mm_q8_avx2(Tensor x, Tensor packed, Tensor pairs, int group, int n) -> Tensor");
  m.def("int4_mm_q8_vnni(Tensor x, Tensor packed, Tensor pairs, int group, int n) -> Tensor");
  m.def("int4_mm_q8_amx(Tensor x, Tensor packed, Tensor pairs, int group, int n, int min_rows) "
        "-> Tensor");
  m.def("int4_decode_avx2(Tensor packed, Tensor pairs, int group, Tensor(a!) out) -> ()");
  m.def("int4_decode_q8_avx2(Tensor packed, Tensor pairs, int group, Tensor(a!) out) -> ()");
  m.def("int4_decoded_mm(Tensor x, Tensor packed, Tensor pairs, int group, bool q8) -> Tensor");
  m.def(
      "int4_packed_decoded_mm(Tensor x, Tensor packed, Tensor pairs, int group, int block_n) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(dtype_policies, CPU, m) {
  m.impl("int4_mm_avx2", &int4_mm_avx2);
  m.impl("int4_mm_q8_avx2", &int4_mm_q8_avx2);
  m.impl("int4_mm_q8_vnni", &int4_mm_q8_vnni);
  m.impl("int4_mm_q8_amx", &int4_mm_q8_amx);
  m.impl("int4_decode_avx2", &int4_decode_avx2);
  m.impl("int4_decode_q8_avx2", &int4_decode_q8_avx2);
  m.impl("int4_decoded_mm", &int4_decoded_mm);
  m.impl("int4_packed_decoded_mm", &int4_packed_decoded_mm);
}
