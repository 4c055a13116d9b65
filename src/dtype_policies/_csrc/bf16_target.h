// The instruction set of the bfloat16 attention kernel, in one place: the
// functions between DTYPE_POLICIES_BF16_BEGIN and DTYPE_POLICIES_BF16_END are
// compiled for AVX-512 with bfloat16 dot products (vdpbf16ps, vcvtne2ps2bf16).
// Use them after every #include, so that no inline function of a header is
// compiled with these instructions. The callers run those functions only on
// CPUs that have them (attention.available() in Python).
#pragma once

#if defined(__clang__)
#define DTYPE_POLICIES_BF16_BEGIN                                                                  \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512vl,avx512dq,avx512bf16\"))), apply_to = function)")
#define DTYPE_POLICIES_BF16_END _Pragma("clang attribute pop")
#else
#define DTYPE_POLICIES_BF16_BEGIN                                                                  \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512dq,avx512bf16\")")
#define DTYPE_POLICIES_BF16_END _Pragma("GCC pop_options")
#endif
