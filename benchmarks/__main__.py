"""Run the benchmark suite: `python -m benchmarks [--quick] [--workloads a,b]`.

Prints markdown tables (median of interleaved repeats after warm-up, threads
fixed) with ratios against float32 and the relevant baseline, the targets
with met / not met, and writes JSON and markdown to `benchmarks/results/`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from benchmarks import harness, workloads

RESULTS = Path(__file__).resolve().parent / "results"

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
        "mlp_inference",
        "dtype_policies mixed_bfloat16, weight_cache",
        "float32",
        "speedup",
        4.0,
        "mixed_bfloat16 + weight_cache inference >= 4x float32",
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

# Workloads whose variants are whole LLMs: fewer repeats, and a first-call column.
LLM_WORKLOADS = {"llm_decode": "decode", "llm_prefill": "prefill"}

BASELINES = {
    "mlp_train": "torch.autocast bfloat16",
    "mlp_inference": "whole model bfloat16",
    "mlp_decode": "whole model bfloat16",
    "transformer_train": "torch.autocast bfloat16",
    "overhead_no_grad": "nn.Linear float32",
    "overhead_grad": "nn.Linear float32",
    "llm_decode": "whole model bfloat16",
    "llm_prefill": "whole model bfloat16",
}


def _table(title: str, results: list[harness.Result], samples: dict, baseline: str) -> str:
    reference = "float32" if "float32" in samples else "nn.Linear float32"
    lines = [
        f"**{title}**",
        "",
        f"| variant | median ms | IQR ms | x float32 | x {baseline} |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = harness.paired_ratio(samples, reference, r.variant)
        versus = (
            harness.paired_ratio(samples, baseline, r.variant)
            if baseline in samples
            else float("nan")
        )
        note = f" ({r.note})" if r.note else ""
        lines.append(
            f"| {r.variant}{note} | {r.median_ms:.2f} | {r.spread_ms:.2f} | {ratio:.2f} | "
            f"{versus:.2f} |"
        )
    return "\n".join(lines)


def _first_calls(kind: str, names: list[str]) -> dict[str, tuple[float, float] | str]:
    """Per variant, its first call and a later call (seconds), each in a fresh process."""
    calls = {}
    for name in names:
        code = (
            "import torch\n"
            "torch.set_num_threads(torch.get_num_threads())\n"
            "from benchmarks.workloads import llm_factories\n"
            f"run = llm_factories({kind!r})[{name!r}]()\n"
        )
        env = {"DTYPE_POLICIES_COMPILE": "0"} if "COMPILE=0" in name else None
        calls[name] = harness.first_call_of(code, env)
        print(f"  first call of {name}: {calls[name]}", flush=True)
    return calls


def _llm_table(
    title: str,
    results: list[harness.Result],
    samples: dict,
    notes: dict[str, str],
    calls: dict,
    unit: str,
) -> str:
    baseline = BASELINES["llm_decode"]
    lines = [
        f"**{title}**",
        "",
        f"| variant | median {unit} | IQR | x float32 | x {baseline} | first call s | "
        "later call s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    measured = {r.variant: r for r in results}
    failed = [n for n, note in notes.items() if n not in measured and note.startswith("failed")]
    order = [n for n in workloads.LLM_VARIANTS if n in measured or n in failed]
    for name in order:
        r = measured.get(name)
        note = notes.get(name, "")
        note = f" ({note})" if note else ""
        if r is None:
            lines.append(f"| {name}{note} | - | - | - | - | - | - |")
            continue
        ratio = harness.paired_ratio(samples, "float32", name) if "float32" in samples else 0
        versus = harness.paired_ratio(samples, baseline, name) if baseline in samples else 0
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


def _memory_rows(names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        code = (
            "import torch\n"
            "torch.set_num_threads(2)\n"
            "from benchmarks.workloads import mlp_train_factories\n"
            f"step = mlp_train_factories()[{name!r}]()\n"
            "for _ in range(4):\n    step()\n"
        )
        peak = harness.peak_rss_mb_of(code)
        rows.append({"variant": name, "peak_rss_mb": peak})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workloads",
        default=",".join(workloads.WORKLOADS),
        help="comma-separated subset of: " + ", ".join(workloads.WORKLOADS),
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS runs")
    parser.add_argument(
        "--no-first-call", action="store_true", help="skip the LLM first-call processes"
    )
    parser.add_argument("--output", default=str(RESULTS), help="directory for JSON/markdown")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    selected = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(selected) - set(workloads.WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {sorted(workloads.WORKLOADS)}")
    info = harness.machine_info()
    print("Machine: " + ", ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    repeats, rounds = (6, 2) if args.quick else (21, 7)

    all_results: list[harness.Result] = []
    all_samples: dict[str, dict] = {}
    sections = []
    for key in selected:
        title, build = workloads.WORKLOADS[key]
        print(f"\n== {title}", flush=True)
        variants, notes = build()
        if key in LLM_WORKLOADS:
            # Each variant was called once when built; two more warm-up calls
            # cover the shapes torch.compile specializes on.
            llm_repeats, llm_rounds = (4, 2) if args.quick else (12, 4)
            samples = harness.measure_interleaved(
                variants, warmup=2, repeats=llm_repeats, rounds=llm_rounds
            )
        else:
            samples = harness.measure_interleaved(variants, repeats=repeats, rounds=rounds)
        results = harness.summarize(key, samples, notes)
        all_results.extend(results)
        all_samples[key] = samples
        if key in LLM_WORKLOADS:
            del variants
            calls = {} if args.no_first_call else _first_calls(LLM_WORKLOADS[key], list(samples))
            for r in results:
                if isinstance(calls.get(r.variant), tuple):
                    r.extra["first_call_s"], r.extra["later_call_s"] = calls[r.variant]
            for name, note in notes.items():
                if note.startswith("failed"):
                    all_results.append(harness.Result(key, name, float("nan"), 0, 0, note))
            unit = "ms/token" if key == "llm_decode" else "ms"
            section = _llm_table(title, results, samples, notes, calls, unit)
        else:
            section = _table(title, results, samples, BASELINES[key])
        sections.append(section)
        print(section, flush=True)
        variants = None

    accuracy = []
    if "mlp_inference" in selected or "mlp_decode" in selected:
        accuracy = workloads.quantization_accuracy()
        lines = [
            "**Quantized MLP: output error vs float32, stored weight bytes**",
            "",
            "| policy | relative error | weight bytes vs float32 |",
            "|---|---:|---:|",
        ]
        lines += [
            f"| {row['policy']} | {row['relative_error']:.4f} | "
            f"{row['weight_bytes_vs_float32']:.3f} |"
            for row in accuracy
        ]
        sections.append("\n".join(lines))
        print("\n" + sections[-1], flush=True)

    memory = []
    if "mlp_train" in selected and not args.no_memory:
        names = list(workloads.mlp_train_factories())
        memory = _memory_rows([n for n in names if "Keras" not in n])
        lines = [
            "**MLP train step: peak resident memory of a process running it**",
            "",
            "| variant | peak RSS MiB |",
            "|---|---:|",
        ]
        lines += [
            f"| {row['variant']} | {row['peak_rss_mb']:.0f} |"
            for row in memory
            if row["peak_rss_mb"] is not None
        ]
        sections.append("\n".join(lines))
        print("\n" + sections[-1], flush=True)

    target_rows = []
    for workload, variant, baseline, kind, bound, label in TARGETS:
        samples = all_samples.get(workload, {})
        if workload in all_samples and baseline in samples and variant not in samples:
            target_rows.append({"target": label, "measured": "failed", "met": False})
            continue
        if variant not in samples or baseline not in samples:
            continue
        if kind == "speedup":
            value = harness.paired_ratio(samples, baseline, variant)
            met = value >= bound
        else:
            value = 1.0 / harness.paired_ratio(samples, baseline, variant)
            met = value <= bound
        target_rows.append({"target": label, "measured": f"{value:.2f}x", "met": met})
    lines = ["**Targets**", "", "| target | measured | met |", "|---|---:|:---:|"]
    lines += [
        f"| {row['target']} | {row['measured']} | {'yes' if row['met'] else 'no'} |"
        for row in target_rows
    ]
    sections.append("\n".join(lines))
    print("\n" + sections[-1], flush=True)

    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    harness.write_json(str(output / "latest.json"), info, all_results, target_rows)
    with open(output / "latest.json") as f:
        data = json.load(f)
    data["accuracy"], data["memory"] = accuracy, memory
    with open(output / "latest.json", "w") as f:
        json.dump(data, f, indent=2)
    header = (
        f"Measured {info['date']} on {info['cpu']} ({info['cpu_flags']}), "
        f"{info['threads']} threads, torch {info['torch']}."
    )
    (output / "latest.md").write_text(header + "\n\n" + "\n\n".join(sections) + "\n")
    print(f"\nWrote {output / 'latest.json'} and {output / 'latest.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
