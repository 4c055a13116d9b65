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

With `--w4a8`, the same for the opt-in int4 W4A8 product
(`Int4QuantizationConfig(activation_block_size=32)`, group 32): its AMX copy
(`int4_mm_q8_amx`) against its VNNI copy (`int4_mm_q8_vnni`) and the same
bfloat16 GEMM. It is how `int4_native.Q8_AMX_MIN_ROWS` was chosen.

    python -m benchmarks.amx_int8 --w4a8 [--rows 8,32,128,512] [--shapes 576x1536,...]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from dtype_policies.quantization.kernels import int4_native, int8_native
from dtype_policies.quantizers.math import abs_max_quantize_blocks

SHAPES = "384x1536,1536x384,576x1536,1536x576,576x192,2048x8192"
ROWS = "1,8,32,128,512,4096"
W4A8_SHAPES = "576x1536,1536x576,576x192,2048x8192"
W4A8_ROWS = "8,16,32,128,512"
W4A8_GROUP = 32
TILES_AT_ANY_ROWS = 0  # the AMX operators' last argument: the rows from which tiles run


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
    parser.add_argument("--rows", default=None, help=f"default {ROWS} ({W4A8_ROWS} with --w4a8)")
    parser.add_argument(
        "--shapes", default=None, help=f"KxN,... (default {SHAPES}; {W4A8_SHAPES} with --w4a8)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--w4a8", action="store_true", help="the int4 W4A8 product's copies")
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    if not int8_native.available():
        raise SystemExit("the int8 and int4 kernels are not built here")
    if arguments.w4a8:
        w4a8(arguments.shapes or W4A8_SHAPES, arguments.rows or W4A8_ROWS)
    else:
        int8(arguments.shapes or SHAPES, arguments.rows or ROWS)


def int8(shapes: str, rows_list: str) -> None:
    ops = torch.ops.dtype_policies
    for shape in shapes.split(","):
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
            ops.int8_mm_q8b_amx(check, packed, block_step, None, n, True, TILES_AT_ANY_ROWS),
        )
        print(f"K={k} N={n}: the AMX copy gives the VNNI copy's values bit for bit: {same}")
        for rows in (int(r) for r in rows_list.split(",")):
            x = torch.randn(rows, k).bfloat16()
            operands = (x, packed, block_step, None, n, True)
            calls = {
                "VNNI": functools.partial(ops.int8_mm_q8b_vnni, *operands),
                "AMX": functools.partial(ops.int8_mm_q8b_amx, *operands, TILES_AT_ANY_ROWS),
                "bf16 GEMM": functools.partial(
                    torch.ops.mkldnn._linear_pointwise, x, prepacked, None, "none", [], ""
                ),
            }
            print(f"  M={rows:5d}  " + interleaved(calls), flush=True)


def w4a8(shapes: str, rows_list: str) -> None:
    ops = torch.ops.dtype_policies
    group = W4A8_GROUP
    for shape in shapes.split(","):
        k, n = (int(size) for size in shape.split("x"))
        torch.manual_seed(0)
        q = torch.randint(-8, 8, (n, k))
        scale, offset = torch.rand(k // group, n) * 0.01, torch.randn(k // group, n) * 0.001
        packed, pairs = int4_native.pack_q8(q, scale, offset, group)
        decoded = int4_native.decode(packed, pairs, group, q8=True)[:n, :k]
        prepacked = torch.ops.mkldnn._reorder_linear_weight(decoded.bfloat16().contiguous(), 1)
        check = torch.randn(67, k).bfloat16()
        same = torch.equal(
            ops.int4_mm_q8_vnni(check, packed, pairs, group, n).view(torch.int16),
            ops.int4_mm_q8_amx(check, packed, pairs, group, n, TILES_AT_ANY_ROWS).view(torch.int16),
        )
        print(f"K={k} N={n} W4A8: the AMX copy gives the VNNI copy's values bit for bit: {same}")
        for rows in (int(r) for r in rows_list.split(",")):
            x = torch.randn(rows, k).bfloat16()
            operands = (x, packed, pairs, group, n)
            calls = {
                "VNNI": functools.partial(ops.int4_mm_q8_vnni, *operands),
                "AMX": functools.partial(ops.int4_mm_q8_amx, *operands, TILES_AT_ANY_ROWS),
                "bf16 GEMM": functools.partial(
                    torch.ops.mkldnn._linear_pointwise, x, prepacked, None, "none", [], ""
                ),
            }
            print(f"  M={rows:5d}  " + interleaved(calls), flush=True)


if __name__ == "__main__":
    main()
