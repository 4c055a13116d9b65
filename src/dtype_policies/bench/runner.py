"""Run the benchmark suite: `dtype-policies bench [--quick] [--workloads a,b]`
(or `python -m benchmarks` in a source checkout).

Prints markdown tables (median of interleaved repeats after warm-up, threads
fixed) with ratios against float32 and the relevant baseline, the targets
with met / not met, and writes JSON and markdown to the output directory.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from dtype_policies.bench import harness, workloads
from dtype_policies.bench.report import (
    BASELINES,
    LLM_WORKLOADS,
    TARGETS,
    first_calls,
    llm_table,
    markdown_table,
    memory_rows,
)
from dtype_policies.bench.workloads import mlp

DEFAULT_OUTPUT = "benchmark-results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dtype-policies bench", description=__doc__.splitlines()[0]
    )
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
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="directory for JSON/markdown")
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
    self_timed_targets: list[dict] = []
    for key in selected:
        title, build = workloads.WORKLOADS[key]
        print(f"\n== {title}", flush=True)
        if key in workloads.SELF_TIMED:  # it measures and reports itself
            section, rows, results = workloads.SELF_TIMED[key](args.quick)
            sections.append(section)
            self_timed_targets += rows
            all_results.extend(results)
            continue
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
            calls = {} if args.no_first_call else first_calls(LLM_WORKLOADS[key], list(samples))
            for r in results:
                if isinstance(calls.get(r.variant), tuple):
                    r.extra["first_call_s"], r.extra["later_call_s"] = calls[r.variant]
            for name, note in notes.items():
                if note.startswith("failed"):
                    all_results.append(harness.Result(key, name, float("nan"), 0, 0, note))
            unit = "ms/token" if key == "llm_decode" else "ms"
            section = llm_table(title, results, samples, notes, calls, unit)
        else:
            section = markdown_table(title, results, samples, BASELINES[key])
        sections.append(section)
        print(section, flush=True)
        variants = None

    accuracy = []
    if "mlp_inference" in selected or "mlp_decode" in selected:
        accuracy = mlp.quantization_accuracy()
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
        names = list(mlp.mlp_train_factories())
        memory = memory_rows([n for n in names if "Keras" not in n])
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
    target_rows += self_timed_targets
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
        f"Measured {info['date']} on {info['cpu']} ({info['cpu_flags']}; CPU class "
        f"{info['cpu_class']}), "
        f"{info['threads']} threads, torch {info['torch']}."
    )
    (output / "latest.md").write_text(header + "\n\n" + "\n\n".join(sections) + "\n")
    print(f"\nWrote {output / 'latest.json'} and {output / 'latest.md'}")
    return 0
