"""The benchmark report: speed targets, and markdown tables of ratios."""

from __future__ import annotations

from typing import cast

from dtype_policies.bench import harness
from dtype_policies.bench.registry import Workload
from dtype_policies.bench.workloads import cpu_mlp, llm

# (workload, our variant, baseline, kind, bound, label). "speedup": baseline time /
# our time >= bound. "overhead": our time / baseline time <= bound.
TARGETS = [
    (
        "mlp_train",
        "dtype_policies mixed_bfloat16",
        "float32",
        "speedup",
        3.5,
        "mixed_bfloat16 train >= 3.5x float32",
    ),
    (
        "mlp_train",
        "dtype_policies mixed_bfloat16",
        "torch.autocast bfloat16",
        "speedup",
        1.2,
        "mixed_bfloat16 train >= 1.2x torch.autocast",
    ),
    (
        "mlp_inference",
        "dtype_policies mixed_bfloat16",
        "float32",
        "speedup",
        4.0,
        "mixed_bfloat16 inference >= 4x float32",
    ),
    (
        "overhead_no_grad",
        "nn.Linear + apply_policy mixed_bfloat16",
        "nn.Linear float32",
        "overhead",
        2.0,
        "apply_policy 64x64 call <= 2x nn.Linear (no_grad)",
    ),
    (
        "overhead_no_grad",
        "dtype_policies.layers.Dense mixed_bfloat16",
        "nn.Linear float32",
        "overhead",
        2.0,
        "layers.Dense 64x64 call <= 2x nn.Linear (no_grad)",
    ),
    (
        "overhead_grad",
        "nn.Linear + apply_policy mixed_bfloat16",
        "nn.Linear float32",
        "overhead",
        2.0,
        "apply_policy 64x64 call <= 2x nn.Linear (grad)",
    ),
    (
        "overhead_grad",
        "dtype_policies.layers.Dense mixed_bfloat16",
        "nn.Linear float32",
        "overhead",
        2.0,
        "layers.Dense 64x64 call <= 2x nn.Linear (grad)",
    ),
    (
        "mlp_inference",
        "dtype_policies int8_from_mixed_bfloat16",
        "float32",
        "speedup",
        4.0,
        "int8 inference >= 4x float32",
    ),
    (
        "mlp_inference",
        "dtype_policies int8_from_mixed_bfloat16",
        "torchao Int8DynamicActivationInt8Weight",
        "speedup",
        2.0,
        "int8 inference >= 2x torchao (eager)",
    ),
    (
        "mlp_inference",
        "dtype_policies int8_from_mixed_bfloat16",
        "torchao Int8DynamicActivationInt8Weight, compiled",
        "speedup",
        2.0,
        "int8 inference >= 2x torchao (compiled)",
    ),
    (
        "mlp_decode",
        "dtype_policies int4/128_from_mixed_bfloat16",
        "whole model bfloat16",
        "speedup",
        3.0,
        "int4 batch-1 >= 3x bfloat16 batch-1",
    ),
]

for _workload, _variant, _bound, _label in [
    (
        "llm_decode",
        "dtype_policies mixed_bfloat16",
        0.95,
        "LLM decode mixed_bfloat16 >= 0.95x bf16",
    ),
    ("llm_decode", "dtype_policies int8_from_mixed_bfloat16", 1.6, "LLM decode int8 >= 1.6x bf16"),
    (
        "llm_decode",
        "dtype_policies int4/128_from_mixed_bfloat16",
        3.0,
        "LLM decode int4 >= 3x bf16",
    ),
    (
        "llm_prefill",
        "dtype_policies int8_from_mixed_bfloat16",
        1.3,
        "LLM prefill int8 >= 1.3x bf16",
    ),
    (
        "llm_prefill",
        "dtype_policies int4/128_from_mixed_bfloat16",
        0.9,
        "LLM prefill int4 >= 0.9x bf16",
    ),
]:
    TARGETS.append((_workload, _variant, "whole model bfloat16", "speedup", _bound, _label))

TARGETS += cpu_mlp.TARGETS


def markdown_table(workload: Workload, results: list[harness.Result], samples: dict) -> str:
    reference, baseline = workload.reference, workload.baseline
    lines = [
        f"**{workload.title}**",
        "",
        f"| variant | median ms | IQR ms | x {reference} | x {baseline} |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = harness.paired_ratio(samples, reference, r.variant)
        versus = (
            harness.paired_ratio(samples, cast(str, baseline), r.variant)
            if baseline in samples
            else float("nan")
        )
        note = f" ({r.note})" if r.note else ""
        lines.append(
            f"| {r.variant}{note} | {r.median_ms:.2f} | {r.spread_ms:.2f} | {ratio:.2f} | "
            f"{versus:.2f} |"
        )
    return "\n".join(lines)


def first_calls(kind: str, names: list[str], threads: int) -> dict[str, tuple[float, float] | str]:
    """Per variant, its first call and a later call (seconds), each in a fresh
    process on `threads` threads."""
    calls = {}
    for name in names:
        code = (
            "import torch\n"
            f"torch.set_num_threads({threads})\n"
            "from dtype_policies.bench.workloads.llm import llm_factories\n"
            f"run = llm_factories({kind!r})[{name!r}]()\n"
        )
        calls[name] = harness.first_call_of(code)
        print(f"  first call of {name}: {calls[name]}", flush=True)
    return calls


def llm_table(
    workload: Workload,
    results: list[harness.Result],
    samples: dict,
    notes: dict[str, str],
    calls: dict,
    unit: str,
) -> str:
    baseline = workload.baseline
    lines = [
        f"**{workload.title}**",
        "",
        f"| variant | median {unit} | IQR | x float32 | x {baseline} | first call s | "
        "later call s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    measured = {r.variant: r for r in results}
    failed = [n for n, note in notes.items() if n not in measured and note.startswith("failed")]
    order = [n for n in llm.LLM_VARIANTS if n in measured or n in failed]
    for name in order:
        r = measured.get(name)
        note = notes.get(name, "")
        note = f" ({note})" if note else ""
        if r is None:
            lines.append(f"| {name}{note} | - | - | - | - | - | - |")
            continue
        reference = workload.reference
        ratio = harness.paired_ratio(samples, reference, name) if reference in samples else 0
        versus = (
            harness.paired_ratio(samples, cast(str, baseline), name) if baseline in samples else 0
        )
        call = calls.get(name)
        first = (
            f"{call[0]:.2f} | {call[1]:.2f}"
            if isinstance(call, tuple)
            else (f"failed: {call} | -" if call else "- | -")
        )
        lines.append(
            f"| {name}{note} | {r.median_ms:.2f} | {r.spread_ms:.2f} | {ratio:.2f} | "
            f"{versus:.2f} | {first} |"
        )
    return "\n".join(lines)


def memory_rows(names: list[str], threads: int) -> list[dict]:
    rows = []
    for name in names:
        code = (
            "import torch\n"
            f"torch.set_num_threads({threads})\n"
            "from dtype_policies.bench.workloads.mlp import mlp_train_factories\n"
            f"step = mlp_train_factories()[{name!r}]()\n"
            "for _ in range(4):\n    step()\n"
        )
        peak = harness.peak_rss_mb_of(code)
        rows.append({"variant": name, "peak_rss_mb": peak})
    return rows
