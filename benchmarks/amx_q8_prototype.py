"""A prototype AMX kernel for the default int8 (Q8_0 x Q8_0), measured
against this library's AVX-512 VNNI kernel and a bfloat16 GEMM (research,
not part of the package: issue 21's "int8 never slower than mixed_bfloat16").

On an `amx` CPU the default int8 runs the VNNI copy of `int8_mm_q8b`: at
MiniLM's 32 x 128 it was 0.29x mixed_bfloat16 compiled (2026-12-02). This
kernel computes the same values bit for bit (an exact int32 sum per 32-deep
block with `_tile_dpbssd`, then the kernel's epilogue: factor = d[m, b] *
w_step[b, n], fmadd into float32 in block order), 2.2-3.7x the VNNI kernel at
128-4096 rows, 2 threads (measured under a CI run's load: ratios within one
run). A bfloat16 GEMM on the same shapes is 3.4-6.8x the kernel, so the
per-block store/convert/fmadd bounds this one; a 32 x 64 register block
(more reuse of each weight tile) is the next step. Plain-torch routes (a
batched bmm per block, `torch._int_mm` per block) were 0.07-0.22x the kernel:
the (blocks, M, N) intermediate.

Traps: fill the tile configuration and add a compiler barrier before
`_tile_loadconfig` (GCC dropped the stores: SIGSEGV); load it in every
parallel work item (oneDNN releases the tiles of the shared OpenMP threads:
SIGILL otherwise); request XTILEDATA once (`arch_prctl`). M and N must be
multiples of 32 here; K a multiple of 32. The C++ source:
`benchmarks/amx_q8_prototype.cpp`.

    python benchmarks/amx_q8_prototype.py   # an AMX CPU and a C++ compiler
"""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_suffix(".cpp")


def build() -> Any:
    """The prototype, compiled with torch's `load_inline`."""
    from torch.utils.cpp_extension import load_inline

    directory = os.path.join(tempfile.gettempdir(), "dtype_policies_amx_q8_prototype")
    os.makedirs(directory, exist_ok=True)
    return load_inline(
        "q8b_amx_prototype",
        cpp_sources=SOURCE.read_text(),
        functions=["q8b_amx"],
        extra_cflags=["-O3", "-mavx512f", "-mavx512dq", "-mamx-tile", "-mamx-int8", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=directory,
    )


def pack(q: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 -> (N/16, K/32, 8, 64): row r, byte 4c+i = w[c, 32b+4r+i]."""
    n, k = q.shape
    panels = q.view(n // 16, 16, k // 32, 8, 4).permute(0, 2, 3, 1, 4)
    return panels.reshape(n // 16, k // 32, 8, 64).contiguous()


def pack_steps(steps: torch.Tensor) -> torch.Tensor:
    """(N, K/32) float32 -> (N/16, K/32, 16)."""
    n, blocks = steps.shape
    return steps.view(n // 16, 16, blocks).transpose(1, 2).contiguous()


def round_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rounding of (M, K) activations: int8 values and a step per block."""
    m, k = x.shape
    blocks = x.float().view(m, k // 32, 32)
    step = blocks.abs().amax(-1) / 127.0
    q = torch.where(step[..., None] > 0, torch.round(blocks / step[..., None]), 0.0)
    return q.clamp_(-127, 127).view(m, k).to(torch.int8), step.contiguous()


def main() -> None:
    from dtype_policies.quantization.kernels import int8 as int8_kernels
    from dtype_policies.quantizers.math import abs_max_quantize_blocks

    torch.set_num_threads(2)
    module = build()
    for k, n in [(384, 1536), (1536, 384), (576, 1536), (1536, 576), (2048, 8192)]:
        torch.manual_seed(0)
        q, scale = abs_max_quantize_blocks(torch.randn(n, k) * 0.05, 32)
        runtime = int8_kernels.Int8Runtime()
        runtime.refresh(q, scale, lambda data: data, False, True, 32)
        steps = 1.0 / scale.float()
        packed, packed_steps = pack(q), pack_steps(steps)
        dequantized = (q.float() * steps.repeat_interleave(32, 1)).bfloat16().contiguous()
        prepacked = torch.ops.mkldnn._reorder_linear_weight(dequantized, 1)
        x = torch.randn(256, k).bfloat16()
        kernel = int8_kernels.int8_blocked_linear(x, runtime, None, torch.float32)
        amx = module.q8b_amx(*round_blocks(x), packed, packed_steps)
        print(f"K={k} N={n}: bit-identical to the kernel: {torch.equal(kernel, amx)}")
        for m in (128, 512, 4096):
            x = torch.randn(m, k).bfloat16()
            xq, step = round_blocks(x)
            calls = {
                "kernel": functools.partial(
                    int8_kernels.int8_blocked_linear, x, runtime, None, torch.bfloat16
                ),
                "bf16 GEMM": functools.partial(
                    torch.ops.mkldnn._linear_pointwise, x, prepacked, None, "none", [], ""
                ),
                "AMX": functools.partial(module.q8b_amx, xq, step, packed, packed_steps),
            }
            print(f"  M={m:5d}  " + interleaved(calls))


def interleaved(calls: dict[str, Any], rounds: int = 21) -> str:
    """Each call timed round after round; medians and median ratios to the first."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    first = next(iter(times.values()))
    parts = []
    for name, seconds in times.items():
        ratio = statistics.median(a / b for a, b in zip(first, seconds))
        parts.append(f"{name} {statistics.median(seconds) * 1e3:.2f} ms ({ratio:.2f}x)")
    return "  ".join(parts)


if __name__ == "__main__":
    main()
