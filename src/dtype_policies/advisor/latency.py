"""Per-call latency of a module's variants at the shapes the inputs produce,
on this machine: warm-up, then interleaved rounds (every variant once per
round, the order rotating; a sample averages several calls), the fastest
sample per variant.

The fastest, not the median: the noise of a shared machine (other processes
taking a core while torch's threads wait for each other) only ever adds
time, and on a loaded 2-core machine it made medians 10-100x the
undisturbed time and reorder the variants, while the fastest samples
stayed within ~10% from run to run."""

from __future__ import annotations

import time
from typing import Any

import torch

SAMPLE_SECONDS = 2e-3  # a sample calls the module until this much time has passed
MAX_CALLS_PER_SAMPLE = 50


def time_variants(
    variants: dict[Any, torch.nn.Module], args: tuple, kwargs: dict, repeats: int = 7
) -> dict[Any, float]:
    """Seconds per call of each variant called with `args, kwargs`.

    Each variant is called twice to warm up (kernel layouts, kept casts),
    then `repeats` rounds take one sample of each: calls until
    `SAMPLE_SECONDS` have passed (at least one, at most
    `MAX_CALLS_PER_SAMPLE`), so a slow machine costs samples, not time."""
    keys = list(variants)
    samples: dict[Any, list[float]] = {key: [] for key in keys}
    clock = time.perf_counter
    with torch.inference_mode():
        for key in keys:
            for _ in range(2):
                variants[key](*args, **kwargs)
        for round_index in range(repeats):
            shift = round_index % len(keys)
            for key in keys[shift:] + keys[:shift]:
                module, calls, start = variants[key], 0, clock()
                while True:
                    module(*args, **kwargs)
                    calls += 1
                    elapsed = clock() - start
                    if elapsed >= SAMPLE_SECONDS or calls >= MAX_CALLS_PER_SAMPLE:
                        break
                samples[key].append(elapsed / calls)
    return {key: min(values) for key, values in samples.items()}
