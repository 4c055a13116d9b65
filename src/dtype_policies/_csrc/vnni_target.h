// The instruction set of the kernels' VNNI copies, in one place: the functions
// between DTYPE_POLICIES_VNNI_BEGIN and DTYPE_POLICIES_VNNI_END are compiled for
// AVX-512 VNNI (ymm vpdpbusd needs AVX512VL). Use them after every #include, so
// that no inline function of a header (shared with the AVX2 code by the linker)
// is compiled with these instructions. The callers run those functions only on
// CPUs that have them (native.operator_suffix() in Python).
#pragma once

#if defined(__clang__)
#define DTYPE_POLICIES_VNNI_BEGIN                                                                  \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512vl,avx512vnni\"))), apply_to = function)")
#define DTYPE_POLICIES_VNNI_END _Pragma("clang attribute pop")
#else
#define DTYPE_POLICIES_VNNI_BEGIN                                                                  \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512vnni\")")
#define DTYPE_POLICIES_VNNI_END _Pragma("GCC pop_options")
#endif
