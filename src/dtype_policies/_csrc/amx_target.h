// The instruction set of the int8 kernel's AMX copy (int8_amx.inc), as
// vnni_target.h for the VNNI copy: the functions between
// DTYPE_POLICIES_AMX_BEGIN and DTYPE_POLICIES_AMX_END are compiled for AMX
// (tiles, int8) and AVX-512, after every #include. DTYPE_POLICIES_HAS_AMX is 0
// where the compiler has no AMX intrinsics (GCC before 11, clang before 12):
// the `_amx` operators then run the VNNI copy (the same values).
#pragma once

#ifndef DTYPE_POLICIES_HAS_AMX  // -DDTYPE_POLICIES_HAS_AMX=0 builds without it
#if (defined(__clang__) && __clang_major__ >= 12) || \
    (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define DTYPE_POLICIES_HAS_AMX 1
#else
#define DTYPE_POLICIES_HAS_AMX 0
#endif
#endif

#if defined(__clang__)
#define DTYPE_POLICIES_AMX_BEGIN                                                                   \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8\"))), apply_to = function)")
#define DTYPE_POLICIES_AMX_END _Pragma("clang attribute pop")
#else
#define DTYPE_POLICIES_AMX_BEGIN                                                                   \
  _Pragma("GCC push_options")                                                                      \
  _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8\")")
#define DTYPE_POLICIES_AMX_END _Pragma("GCC pop_options")
#endif
