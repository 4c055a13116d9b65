"""The shape sweep: over the layer widths of real models, at 1 and 128 rows,
for every policy, mode and block size, the product path the library chooses
against every other path it has for the same values, and against whole-model
bfloat16 and float32, each case in one interleaved run.

A cell where the chosen path is more than `CLIFF` times slower than the best
path the library has is a cliff: it fails the sweep's target (a check of the
benchmark, never of the test suite). Paths are timed at the kernel level (the
library's own functions, the chosen one with its default choice), so module
call overhead does not blur small shapes.
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtype_policies._core import products
from dtype_policies._core.module_state import state_of
from dtype_policies._cpu import processor
from dtype_policies.bench import harness
from dtype_policies.bench.registry import RunContext, Section, register
from dtype_policies.bench.workloads.common import policied_copy
from dtype_policies.quantization import Int4QuantizationConfig, Int8QuantizationConfig
from dtype_policies.quantization.attach import quantization_of
from dtype_policies.quantization.kernels import float8 as float8_kernels
from dtype_policies.quantization.kernels import int4 as int4_kernels
from dtype_policies.quantization.kernels import int8 as int8_kernels
from dtype_policies.quantization.schemes.float8 import weight_only_kernel

# (K, N): MiniLM, SmolLM2 (MLP and K/V), Qwen2.5-0.5B, Llama-3.2-1B, 7B-class, BERT-base.
SHAPES = (
    (384, 1536),
    (576, 1536),
    (576, 192),
    (896, 4864),
    (2048, 8192),
    (4096, 14336),
    (768, 3072),
)
QUICK_SHAPES = ((576, 1536), (576, 192), (896, 4864))
ROWS = (1, 128)
CLIFF = 1.3


def _int4(block: int, activation_block_size: int | None = None) -> Int4QuantizationConfig:
    return Int4QuantizationConfig(block_size=block, activation_block_size=activation_block_size)


# (label, source policy, mode, config)
CASES = (
    ("mixed_bfloat16", "mixed_bfloat16", None, None),
    ("mixed_float16", "mixed_float16", None, None),
    ("int8 from float32", "float32", "int8", None),
    ("int8 from mixed_bfloat16", "mixed_bfloat16", "int8", None),
    (
        "int8 weight-only from mixed_bfloat16",
        "mixed_bfloat16",
        "int8",
        Int8QuantizationConfig(activation_quantizer=None),
    ),
    *(
        (f"int4/{block} from mixed_bfloat16", "mixed_bfloat16", "int4", _int4(block))
        for block in (32, 64, 128, 256, -1)
    ),
    ("int4/128 from float32", "float32", "int4", _int4(128)),
    *(
        (f"int4/{block} W4A8 from mixed_bfloat16", "mixed_bfloat16", "int4", _int4(block, 32))
        for block in (32, 128)
    ),
    ("float8 from float32", "float32", "float8", None),
    ("float8 from mixed_bfloat16", "mixed_bfloat16", "float8", None),
)


def _float_paths(layer: nn.Linear, x: torch.Tensor, dtype: torch.dtype):
    weight = layer.weight.detach().to(dtype)
    bias = layer.bias.detach().to(dtype)
    xd = x.to(dtype)
    weight32, bias32 = weight.float(), bias.float()
    paths = {
        f"F.linear {str(dtype).removeprefix('torch.')}": lambda: F.linear(xd, weight, bias),
        "float32 products": lambda: F.linear(xd.float(), weight32, bias32).to(dtype),
    }
    if dtype is torch.bfloat16 and products.bf16_kernel(processor()):
        x2 = xd.reshape(-1, xd.shape[-1])
        paths["AVX2 bfloat16 kernel"] = lambda: torch.ops.dtype_policies.bf16_mm_avx2(
            x2, weight, bias
        )
    if products.kind_for(dtype, weight.device, weight.numel()) == "onednn_prepacked":
        packed = products.linear_product(weight, kept=True)
        if packed is None:  # a graph-free weight of this kind is prepacked
            raise RuntimeError("linear_product gave no oneDNN prepacked product")
        paths["oneDNN prepacked"] = lambda: packed(xd, bias)
    chosen = products.linear_product(weight, kept=True)
    if chosen is None:
        return paths, next(iter(paths)), None
    return paths, None, lambda: chosen(xd, bias)


def _quantized_paths(layer: nn.Linear, x: torch.Tensor, compute: torch.dtype):
    """`(paths, chosen name or None, chosen callable or None)` for a quantized linear."""
    qw = quantization_of(layer)
    scheme, config = qw.scheme, qw.config
    xd = x.to(compute)
    bias = layer.bias.detach().to(compute) if layer.bias is not None else None
    with torch.inference_mode():
        layer(x)  # builds the runtime
    runtime = qw.runtime
    paths: dict[str, Callable[..., torch.Tensor]]  # lambdas bind their path by default
    if qw.mode == "int8" and config.activation_block_size is not None:
        paths = {
            name: (lambda name=name: int8_kernels.int8_blocked_linear(
                xd, runtime, bias, compute, name))
            for name in int8_kernels.blocked_paths(runtime)
        }  # fmt: skip
        return paths, int8_kernels.blocked_paths(runtime)[0], None
    if qw.mode == "int8" and config.weight_only:
        paths = {
            name: (lambda name=name: int8_kernels.int8_weight_only_linear(
                xd, runtime, bias, compute, name))
            for name in int8_kernels.weight_only_paths(xd, runtime)
        }  # fmt: skip
        return paths, int8_kernels.weight_only_path(xd, runtime), None
    if qw.mode == "int8":
        paths = {
            name: (lambda name=name: int8_kernels.int8_linear(xd, runtime, bias, compute, name))
            for name in runtime.w8a8_paths()
        }
        return paths, runtime.w8a8_path(xd.shape[0]), None
    if qw.mode == "int4":
        _, scale, zero = scheme._stored(layer, qw)
        block = config.group_size
        # the integer values are unpacked inside the timed call, as the
        # scheme does on every call of a path other than a kernel
        int4_paths: dict[str, Callable[..., torch.Tensor]] = {
            name: (lambda name=name: int4_kernels.int4_linear(
                xd, None if name in int4_kernels.KERNELS else scheme.integer_values(layer, qw),
                scale, zero, block, bias, compute, runtime, name, None,
                config.activation_block_size))
            for name in int4_kernels.paths(runtime)
        }  # fmt: skip
        plan = runtime.plan
        if plan is not None and plan.kernel == "native" and int4_kernels._KERNEL_AVAILABLE:
            # torch's kernel on the same weight, for comparison: never chosen here
            torchs = int4_kernels.Int4Runtime()
            q_nk = scheme.integer_values(layer, qw)
            torchs.refresh(q_nk, scale, zero, block, (q_nk,), kernel="packed")

            def torchs_kernel() -> torch.Tensor:
                return int4_kernels.int4_linear(
                    xd, None, scale, zero, block, bias, compute, torchs, "packed"
                )

            int4_paths["packed"] = torchs_kernel
        return int4_paths, int4_kernels.int4_path(runtime, xd.shape[0], block), None
    # float8, by its config's scaling: the kernel quantize-dequantized once
    # and kept with its product (the scheme's calls without gradients), or
    # quantize-dequantized at each call (the work of a call with gradients)
    spec, scaling = qw.spec, config.scaling
    weight = layer.weight.detach()
    kernel_scale = layer._buffers["kernel_scale"] if scaling == "delayed" else None
    input_scale = layer._buffers["inputs_scale"] if scaling == "delayed" else None
    quantize_kernel = (lambda k: weight_only_kernel(spec, k)) if scaling == "weight_only" else None
    quantize_inputs = scaling != "weight_only"

    def to_nk(kernel: torch.Tensor) -> torch.Tensor:
        return spec.nk(spec.matrix(kernel))

    def float8_kernel(nk: Callable[[torch.Tensor], torch.Tensor] | None):
        return float8_kernels.float8_kernel(
            None, "shape sweep", weight, kernel_scale, compute, nk, quantize_kernel
        )

    def contract(a: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
        return F.linear(a, to_nk(kernel))

    kept, product = float8_kernel(to_nk)
    paths = {
        "kept float8 weight": lambda: float8_kernels.float8_linear(
            xd, input_scale, kept, product, contract, bias, quantize_inputs
        ),
        "quantize-dequantize per call": lambda: float8_kernels.float8_linear(
            xd, input_scale, float8_kernel(None)[0], None, contract, bias, quantize_inputs
        ),
    }
    return paths, "kept float8 weight", None


def _measure(calls: dict[str, Callable[[], object]], quick: bool) -> dict[str, float]:
    rounds, repeats = (2, 4) if quick else (5, 15)
    with torch.inference_mode():
        samples = harness.measure_interleaved(
            calls, warmup=2, repeats=repeats, rounds=rounds, label="shape sweep"
        )
    return {name: statistics.median(min(r) for r in per) for name, per in samples.items()}


def sweep(quick: bool = False) -> tuple[str, list[dict], list[harness.Result]]:
    """Runs the sweep: `(markdown section, target rows, results)`."""
    cpu = processor()
    lines = [
        f"**Shape sweep on CPU class {cpu.describe()}: chosen path against the best the "
        f"library has (cliff: > {CLIFF}x), ratios of times in one interleaved run per case**",
        "",
        "| K -> N | rows | case | chosen | best | chosen / best | x float32 | x whole bf16 |",
        "|---|---:|---|---|---|---:|---:|---:|",
    ]
    cliffs, results = [], []
    for k, n in QUICK_SHAPES if quick else SHAPES:
        torch.manual_seed(k + n)
        base = nn.Linear(k, n).eval()
        for rows in ROWS:
            x = torch.randn(rows, k)
            w32, b32 = base.weight.detach(), base.bias.detach()
            wb, bb, xb = w32.bfloat16(), b32.bfloat16(), x.bfloat16()
            references: dict[str, Callable[..., torch.Tensor]] = {
                "float32": lambda x=x, w=w32, b=b32: F.linear(x, w, b),
                "whole bf16": lambda x=xb, w=wb, b=bb: F.linear(x, w, b),
            }
            for label, source, mode, config in CASES:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    layer = policied_copy(base, source, mode, config)
                state = state_of(layer)
                compute = None if state is None or state.call is None else state.call.compute
                if compute is None:  # `policied_copy` applied a float policy
                    raise RuntimeError(f"{label}: the layer has no floating compute dtype")
                if mode is None:
                    paths, chosen_name, chosen = _float_paths(base, x, compute)
                else:
                    paths, chosen_name, chosen = _quantized_paths(layer, x, compute)
                calls: dict[str, Callable[[], object]] = dict(references)
                calls.update({f"path: {name}": fn for name, fn in paths.items()})
                if chosen is not None:
                    calls["chosen"] = chosen
                    chosen_label = "chosen"
                else:
                    chosen_label = f"path: {chosen_name}"
                times = _measure(calls, quick)
                path_times = {name: times[f"path: {name}"] for name in paths}
                best_name = min(path_times, key=path_times.__getitem__)
                chosen_time = times[chosen_label]
                if chosen_label == "chosen":
                    # the chosen product is one of the paths, by its rows rule
                    chosen_name = products.describe(
                        products.kind_for(compute, x.device, k * n), compute, k * n
                    )
                ratio = chosen_time / path_times[best_name]
                if ratio > CLIFF:  # confirm on a second pass: shared machines spike
                    again = _measure(
                        {"chosen": calls[chosen_label], "best": calls[f"path: {best_name}"]},
                        quick,
                    )
                    ratio = min(ratio, again["chosen"] / again["best"])
                cliff = ratio > CLIFF
                if cliff:
                    cliffs.append(f"{k}->{n} x{rows} {label}: {ratio:.2f}x")
                lines.append(
                    f"| {k} -> {n} | {rows} | {label} | {chosen_name} "
                    f"({chosen_time * 1e6:.0f} µs) | {best_name} "
                    f"({path_times[best_name] * 1e6:.0f} µs) | "
                    f"{ratio:.2f}{' **cliff**' if cliff else ''} | "
                    f"{times['float32'] / chosen_time:.2f} | "
                    f"{times['whole bf16'] / chosen_time:.2f} |"
                )
                results.append(
                    harness.Result(
                        "shape_sweep",
                        f"{k}->{n} x{rows} {label}",
                        chosen_time * 1e3,
                        0.0,
                        0,
                        note=f"chosen {chosen_name}; best {best_name}; {ratio:.2f}x",
                        extra={
                            "paths_ms": {name: t * 1e3 for name, t in path_times.items()},
                            "float32_ms": times["float32"] * 1e3,
                            "whole_bf16_ms": times["whole bf16"] * 1e3,
                            "cpu_class": cpu.name,
                        },
                    )
                )
                print(lines[-1], flush=True)
                del layer, paths, calls
    target = {
        "target": f"shape sweep: no chosen path more than {CLIFF}x slower than the best",
        "measured": f"{len(cliffs)} cliff(s)" + (f": {'; '.join(cliffs)}" if cliffs else ""),
        "met": not cliffs,
    }
    return "\n".join(lines), [target], results


def _run(context: RunContext) -> Section:
    markdown, targets, results = sweep(context.quick)
    return Section(markdown, {"targets": targets, "results": [r.__dict__ for r in results]})


register(
    "shape_sweep", "Shape sweep: the chosen product path against the best the library has", run=_run
)
