"""This library's bfloat16 attention kernel (`_csrc/attention_bf16.cpp`)
against torch's `F.scaled_dot_product_attention`, by shape: how the kernel's
CPU classes were chosen (`_native.KernelSource.supports`: AVX-512 bfloat16
without AMX; with AMX torch's flash kernel multiplies on the bfloat16 tiles
and is faster).

    python -m benchmarks.attention_kernel [--threads 2]

The kernel's operator is called directly (built here even where the library
does not choose it); the two are called in turn, round after round, and the
median of the per-round ratios is printed (above 1: torch's faster).
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dtype_policies import _native as native
from dtype_policies.quantization.kernels import attention

# name: (batch, query heads, queries, depth), key heads, keys, additive mask, causal
SHAPES: dict[str, tuple[tuple[int, int, int, int], int, int, bool, bool]] = {
    "MiniLM 1 x 32": ((1, 12, 32, 32), 12, 32, True, False),
    "MiniLM 32 x 128": ((32, 12, 128, 32), 12, 128, True, False),
    "BERT-base 8 x 256": ((8, 12, 256, 64), 12, 256, True, False),
    "SmolLM2 prefill 512": ((1, 9, 512, 64), 3, 512, False, True),
    "SmolLM2 decode, 544 cached": ((1, 9, 1, 64), 3, 544, True, False),
    "Llama-3.2-1B prefill 1024": ((1, 32, 1024, 64), 8, 1024, False, True),
}


def median_ratio(first: Callable[[], object], second: Callable[[], object], rounds: int = 15):
    """Median times of both, and the median per-round ratio first / second."""
    for call in (first, second, first, second):
        call()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for call, seconds in zip((first, second), times):
            start = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - start)
    ratio = statistics.median(a / b for a, b in zip(*times))
    return statistics.median(times[0]), statistics.median(times[1]), ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if native.library(attention.KERNEL) is None:
        raise SystemExit("the attention kernel cannot be built here (AVX-512 bfloat16 compiler)")
    torch.manual_seed(0)
    print(f"this library chooses its kernel here: {native.available(attention.KERNEL)}")
    with torch.inference_mode():
        for name, (shape, key_heads, keys, masked, causal) in SHAPES.items():
            batch, heads, queries, depth = shape
            q = torch.randn(shape).bfloat16()
            k = torch.randn(batch, key_heads, keys, depth).bfloat16()
            v = torch.randn(batch, key_heads, keys, depth).bfloat16()
            mask = torch.zeros(batch, 1, queries, keys) if masked else None
            scale = 1.0 / math.sqrt(depth)
            kernel = functools.partial(
                torch.ops.dtype_policies.attention_bf16, q, k, v, mask, scale, causal
            )
            torchs = functools.partial(
                F.scaled_dot_product_attention,
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=causal,
                enable_gqa=key_heads != heads,
            )
            ours, theirs, ratio = median_ratio(kernel, torchs)
            print(
                f"{name:28s} kernel {ours * 1e3:7.3f} ms  torch {theirs * 1e3:7.3f} ms  "
                f"torch's speed / kernel's {ratio:.2f}x"
            )


if __name__ == "__main__":
    main()
