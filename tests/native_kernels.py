"""Whether this machine runs this library's C++ kernels, for the tests of
those kernels (one definition, imported by each test file)."""

import pytest
import torch

from dtype_policies import _cpu
from dtype_policies import _native as native
from dtype_policies.quantization.kernels import int4_native, int8_native

KERNEL = int4_native.KERNEL
assert int8_native.KERNEL == KERNEL, "the int4 and int8 kernels share one library"

RUNS_HERE = (
    _cpu.processor().architecture == "x86_64"
    and {"avx2", "fma", "f16c"} <= _cpu.hardware_flags()
    and native.enabled()
    and native.library(KERNEL) is not None
)
"""x86 with AVX2, FMA and F16C, native kernels enabled, and the library built."""

VNNI_HERE = RUNS_HERE and {"avx512_vnni", "avx512vl"} <= _cpu.hardware_flags()
"""The kernels' AVX-512 VNNI copies run here too."""

AMX_HERE = VNNI_HERE and {"amx_tile", "amx_int8"} <= _cpu.hardware_flags()
"""The int8 kernel's AMX copy runs on tiles here (elsewhere it runs the VNNI copy)."""

needs_kernel = pytest.mark.skipif(not RUNS_HERE, reason="needs x86 AVX2+FMA and a C++ compiler")
needs_vnni = pytest.mark.skipif(not VNNI_HERE, reason="needs a CPU with AVX-512 VNNI")
needs_amx = pytest.mark.skipif(not AMX_HERE, reason="needs a CPU with AMX (tiles and int8)")


def on_one_and_several_threads(call):
    """`(call() on one torch thread, call() on at least two)`, the thread count
    restored after: the kernels' parallel splits against their serial loops."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = call()
        torch.set_num_threads(max(2, threads))
        return one, call()
    finally:
        torch.set_num_threads(threads)
