"""Quantization accuracy (issue 10, item 7): int4 with searched scales against
min/max, and float8 dynamic against delayed scaling.

    PYTHONPATH=src python -m benchmarks.accuracy_research [--part mlp,layers,llama,timing,float8]

Each part prints a markdown table. The MLP is exactly the benchmark's
(`bench.workloads.mlp.quantization_accuracy`: seed 0, `mlp()`, a batch of 64
from `torch.randn` right after, `apply_policy(model, "mixed_bfloat16")`, then
`quantize`); a second, independent batch of 256 (seed 1) is reported too.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import warnings

import torch
import torch.nn as nn

from dtype_policies import apply_policy, quantize
from dtype_policies.bench import harness
from dtype_policies.bench.workloads.llm import llama
from dtype_policies.bench.workloads.mlp import mlp
from dtype_policies.quantization import Float8QuantizationConfig, Int4QuantizationConfig
from dtype_policies.quantizers import (
    abs_max_quantize,
    dequantize_grouped,
    grouped_quantize_with_zero_point,
    search_grouped_int4,
    search_per_channel_int4,
)
from dtype_policies.quantizers.math import INT4_RANGE


def benchmark_mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    base = mlp().eval()
    x = torch.randn(64, 1024)
    x256 = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1))
    return base, x, x256


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.float() - reference.float()).norm() / reference.float().norm()).item()


def int4_model(base: nn.Module, block_size: int, search: bool, policy="mixed_bfloat16"):
    model = copy.deepcopy(base)
    if policy:
        apply_policy(model, policy)
    quantize(model, "int4", Int4QuantizationConfig(block_size=block_size, scale_search=search))
    return model


def part_mlp() -> None:
    base, x, x256 = benchmark_mlp()
    with torch.no_grad():
        references = (base(x), base(x256))
    print("**Benchmark MLP output relative error vs float32, int4 from mixed_bfloat16**\n")
    print("| int4 block | min/max (64) | searched (64) | min/max (256) | searched (256) |")
    print("|---|---|---|---|---|")
    for block_size in (128, 64, 32, -1):
        cells = []
        for batch, reference in zip((x, x256), references):
            for search in (False, True):
                model = int4_model(base, block_size, search)
                with torch.no_grad():
                    cells.append(relative_error(model(batch), reference))
        name = "per-channel (-1)" if block_size == -1 else str(block_size)
        print(f"| {name} | " + " | ".join(f"{100 * c:.2f}%" for c in cells) + " |")
    print()


def _grouped_error(w_kn: torch.Tensor, block_size: int, search: bool) -> float:
    fn = search_grouped_int4 if search else grouped_quantize_with_zero_point
    q, scale, zero = fn(w_kn, block_size)
    return ((dequantize_grouped(q, scale, zero, block_size) - w_kn).norm() / w_kn.norm()).item()


def _channel_error(w_kn: torch.Tensor, search: bool) -> float:
    if search:
        q, scale = search_per_channel_int4(w_kn)
    else:
        q, scale = abs_max_quantize(w_kn, 0, INT4_RANGE)
    return ((q / scale - w_kn).norm() / w_kn.norm()).item()


def part_layers() -> None:
    base, _, _ = benchmark_mlp()
    print("**Weight reconstruction relative error ||W_q - W|| / ||W||**\n")
    print("| weight | int4/128 min/max | searched | per-channel abs-max | searched |")
    print("|---|---|---|---|---|")
    kernels = [
        (f"MLP {i} ({m.in_features}->{m.out_features}, uniform)", m.weight.detach().t())
        for i, m in enumerate(base)
        if isinstance(m, nn.Linear)
    ]
    generator = torch.Generator().manual_seed(0)
    kernels.append(("4096x4096 normal", torch.randn(4096, 4096, generator=generator)))
    for name, w in kernels:
        cells = [
            _grouped_error(w, 128, False),
            _grouped_error(w, 128, True),
            _channel_error(w, False),
            _channel_error(w, True),
        ]
        print(f"| {name} | " + " | ".join(f"{100 * c:.2f}%" for c in cells) + " |")
    print()


def part_llama() -> None:
    base = llama()
    ids = torch.randint(0, 32000, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = base(ids).logits
    print("**The llm_decode Llama (hidden 1024, 8 layers, vocab 32000, random init): logits")
    print("relative error vs float32 on 64 random tokens, int4 from mixed_bfloat16**\n")
    print("| int4 block | min/max | searched |")
    print("|---|---|---|")
    for block_size in (128, -1):
        cells = []
        for search in (False, True):
            model = int4_model(base, block_size, search)
            with torch.no_grad():
                cells.append(relative_error(model(ids).logits, reference))
        print(f"| {block_size} | " + " | ".join(f"{100 * c:.2f}%" for c in cells) + " |")
    print()


def part_timing(repeats: int = 5) -> None:
    w = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0)) * 0.02
    methods = {
        "int4/128 min/max": lambda: grouped_quantize_with_zero_point(w, 128),
        "int4/128 searched": lambda: search_grouped_int4(w, 128),
        "per-channel abs-max": lambda: abs_max_quantize(w, 0, INT4_RANGE),
        "per-channel searched": lambda: search_per_channel_int4(w),
    }
    samples = harness.measure_interleaved(methods, warmup=0, repeats=repeats, rounds=repeats)
    medians = {
        name: statistics.median(t for r in per_round for t in r)
        for name, per_round in samples.items()
    }
    print(f"**Quantize time of a 4096x4096 weight, {torch.get_num_threads()} threads, ")
    print(f"interleaved median of {repeats}**\n")
    print("| method | seconds | x min/max |")
    print("|---|---|---|")
    for name, median in medians.items():
        base = medians["int4/128 min/max" if "128" in name else "per-channel abs-max"]
        print(f"| {name} | {median:.3f} | {median / base:.1f} |")
    print()


def part_float8() -> None:
    base, x, _ = benchmark_mlp()
    with torch.no_grad():
        reference = base(x)
    print("**Benchmark MLP, float8 from mixed_bfloat16: output relative error vs float32**\n")
    print("| scaling | first call, uncalibrated | after 2 training steps |")
    print("|---|---|---|")
    for scaling in ("delayed", "dynamic"):
        model = copy.deepcopy(base)
        apply_policy(model, "mixed_bfloat16")
        quantize(model, "float8", Float8QuantizationConfig(scaling=scaling))
        with torch.no_grad():
            first = relative_error(model(x), reference)
        model.train()
        for _ in range(2):
            model(x).float().sum().backward()
        model.eval()
        with torch.no_grad():
            trained = relative_error(model(x), reference)
        print(f"| {scaling} | {100 * first:.2f}% | {100 * trained:.2f}% |")
    print()


PARTS = {
    "mlp": part_mlp,
    "layers": part_layers,
    "llama": part_llama,
    "timing": part_timing,
    "float8": part_float8,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default=",".join(PARTS), help=f"comma list of {list(PARTS)}")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    for part in args.part.split(","):
        PARTS[part]()


if __name__ == "__main__":
    main()
