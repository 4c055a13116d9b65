"""The default int8 (Q8_0 x Q8_0) on an AMX CPU: the blocked kernel's AMX
copy (`int8_mm_q8b_amx`) against its AVX-512 VNNI copy (`int8_mm_q8b_vnni`)
and a bfloat16 oneDNN GEMM on a prepacked weight (the library's bfloat16
path there), by rows. It is how `int8_native.AMX_MIN_ROWS` was chosen.

    python -m benchmarks.amx_int8 [--rows 1,8,32,128,512,4096] [--shapes 384x1536,...]

The three are called in turn, round after round (a machine shared with other
work slows all three alike), each after a warm-up; printed: the median
milliseconds and, per call, the median of the ratios of the VNNI copy's time
to each one's (above 1: faster than the VNNI copy). Both copies are checked
to give the same values bit for bit first.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from dtype_policies.quantization.kernels import int8_native
from dtype_policies.quantizers.math import abs_max_quantize_blocks

SHAPES = "384x1536,1536x384,576x1536,1536x576,576x192,2048x8192"
ROWS = "1,8,32,128,512,4096"


def interleaved(calls: dict[str, Callable[[], object]], budget: float = 2.0) -> str:
    """Each call timed round after round (5 to 21 rounds, about `budget`
    seconds); the medians, and the median ratio of the first's time to each."""
    for call in calls.values():
        call()
    start = time.perf_counter()
    for call in calls.values():
        call()
    rounds = max(5, min(21, int(budget / max(time.perf_counter() - start, 1e-6))))
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
        parts.append(f"{name} {statistics.median(seconds) * 1e3:8.3f} ms ({ratio:5.2f}x)")
    return "  ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=ROWS)
    parser.add_argument("--shapes", default=SHAPES, help="KxN,...")
    parser.add_argument("--threads", type=int, default=2)
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    if not int8_native.available():
        raise SystemExit("the int8 kernel is not built here")
    ops = torch.ops.dtype_policies
    for shape in arguments.shapes.split(","):
        k, n = (int(size) for size in shape.split("x"))
        torch.manual_seed(0)
        q, scale = abs_max_quantize_blocks(torch.randn(n, k) * 0.05, 32)
        steps = 1.0 / scale.float()
        packed, block_step = int8_native.pack(q), int8_native.pack_block_steps(steps, 32, k)
        dequantized = (q.float() * steps.repeat_interleave(32, 1)).bfloat16().contiguous()
        prepacked = torch.ops.mkldnn._reorder_linear_weight(dequantized, 1)
        check = torch.randn(67, k).bfloat16()
        same = torch.equal(
            ops.int8_mm_q8b_vnni(check, packed, block_step, None, n, True),
            ops.int8_mm_q8b_amx(check, packed, block_step, None, n, True),
        )
        print(f"K={k} N={n}: the AMX copy gives the VNNI copy's values bit for bit: {same}")
        for rows in (int(r) for r in arguments.rows.split(",")):
            x = torch.randn(rows, k).bfloat16()
            operands = (x, packed, block_step, None, n, True)
            calls = {
                "VNNI": functools.partial(ops.int8_mm_q8b_vnni, *operands),
                "AMX": functools.partial(ops.int8_mm_q8b_amx, *operands),
                "bf16 GEMM": functools.partial(
                    torch.ops.mkldnn._linear_pointwise, x, prepacked, None, "none", [], ""
                ),
            }
            print(f"  M={rows:5d}  " + interleaved(calls), flush=True)


if __name__ == "__main__":
    main()
