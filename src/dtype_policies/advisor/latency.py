"""Per-call latency of a module's variants at the shapes the inputs produce,
on this machine: warm-up, then interleaved rounds (every variant once per
round, the order rotating), the median per variant."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch

TARGET_SAMPLE_SECONDS = 2e-3
MAX_CALLS_PER_SAMPLE = 50


def time_variants(
    variants: dict[Any, torch.nn.Module], args: tuple, kwargs: dict, repeats: int = 7
) -> dict[Any, float]:
    """Seconds per call of each variant called with `args, kwargs`."""
    keys = list(variants)
    calls: dict[Any, int] = {}
    samples: dict[Any, list[float]] = {key: [] for key in keys}
    clock = time.perf_counter
    with torch.inference_mode():
        for key in keys:  # warm-up (kernel layouts, kept casts), and calls per sample
            module = variants[key]
            module(*args, **kwargs)
            once = math.inf
            for _ in range(3):
                start = clock()
                module(*args, **kwargs)
                once = min(once, max(clock() - start, 1e-7))
            calls[key] = max(1, min(MAX_CALLS_PER_SAMPLE, int(TARGET_SAMPLE_SECONDS / once)))
        for round_index in range(repeats):
            shift = round_index % len(keys)
            for key in keys[shift:] + keys[:shift]:
                module, n = variants[key], calls[key]
                start = clock()
                for _ in range(n):
                    module(*args, **kwargs)
                samples[key].append((clock() - start) / n)
    return {key: statistics.median(values) for key, values in samples.items()}
