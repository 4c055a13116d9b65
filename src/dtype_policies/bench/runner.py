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
import traceback
from pathlib import Path
from typing import Any

import torch

from dtype_policies._json import strict
from dtype_policies.bench import harness, workloads
from dtype_policies.bench.registry import RunContext
from dtype_policies.bench.report import (
    TARGETS,
    first_calls,
    llm_table,
    markdown_table,
    memory_rows,
)
from dtype_policies.bench.workloads import mlp

DEFAULT_OUTPUT = "benchmark-results"


def main(argv: list[str] | None = None, prog: str = "dtype-policies bench") -> int:
    """Run the suite; `prog` is the command that ran it, for usage and errors."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workloads",
        default=",".join(workloads.WORKLOADS),
        help="comma-separated subset of: " + ", ".join(workloads.WORKLOADS),
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument(
        "--threads",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="threads of every engine: torch, llama.cpp, ONNX Runtime, OpenVINO (default 2)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS runs")
    parser.add_argument(
        "--no-first-call", action="store_true", help="skip the LLM first-call processes"
    )
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="directory for JSON/markdown")
    parser.add_argument(
        "--variants",
        default=None,
        help="real-model workloads: comma-separated variant names (default: all)",
    )
    parser.add_argument(
        "--speed-only",
        action="store_true",
        help="real-model workloads: time the variants without scoring their quality",
    )
    parser.add_argument(
        "--skip",
        default=None,
        help='real-model workloads: variants left out, comma-separated patterns ("gptq/*,awq/*")',
    )
    parser.add_argument(
        "--charts",
        default=None,
        help="real-model workloads: directory for the charts (default: the output directory)",
    )
    parser.add_argument(
        "--contended-retries",
        type=int,
        default=None,
        help="times a round is timed again, after waiting for a quiet machine, when other "
        "processes took more than 5%% of the CPU during it (default 2, 0 with --quick; "
        "0: only report it)",
    )
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, not {args.threads}")
    if args.contended_retries is None:
        args.contended_retries = 0 if args.quick else 2
    if args.contended_retries < 0:
        parser.error(f"--contended-retries must be at least 0, not {args.contended_retries}")
    with harness.retiming_contended_rounds(args.contended_retries) as load_log:
        return _run(args, parser, load_log)


def _run(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    load_log: list[tuple[str, harness.Samples]],
) -> int:
    charts = Path(args.charts) if args.charts else Path(args.output)

    # Every engine (torch, llama.cpp, ONNX Runtime, OpenVINO) reads the run's
    # thread count from here (`realmodels.engines.run_threads`).
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
    real_models: dict[str, dict] = {}
    self_timed_targets: list[dict] = []
    context = RunContext(
        args.quick, Path(args.output), info, args.variants, args.speed_only, charts, args.skip
    )
    crashed: list[str] = []
    for key in selected:
        workload = workloads.WORKLOADS[key]
        print(f"\n== {workload.title}", flush=True)
        try:
            if workload.run is not None:
                section = workload.run(context)
                real_models[key] = section.data
                self_timed_targets += section.data.get("targets", [])
                sections.append(section.markdown)
                print(section.markdown, flush=True)
                continue
            _time_workload(key, workload, args, repeats, rounds, all_results, all_samples, sections)
        except Exception as error:  # one workload's failure is a line of the report
            crashed.append(key)
            sections.append(f"**{workload.title}**: failed: {type(error).__name__}: {error}")
            print(sections[-1], flush=True)
            traceback.print_exc()

    accuracy: list[dict] = []
    memory: list[dict] = []
    wants_accuracy = "mlp_inference" in selected or "mlp_decode" in selected
    extras = (
        (wants_accuracy, "MLP accuracy", _accuracy_section),
        ("mlp_train" in selected and not args.no_memory, "MLP memory", _memory_section),
    )
    for wanted, title, section_of in extras:
        if not wanted:
            continue
        try:
            rows, markdown = section_of(args.threads)
        except Exception as error:  # as a workload's: a line of the report
            crashed.append(title)
            markdown = f"**{title}**: failed: {type(error).__name__}: {error}"
            rows = []
            traceback.print_exc()
        if title == "MLP accuracy":
            accuracy = rows
        else:
            memory = rows
        sections.append(markdown)
        print("\n" + sections[-1], flush=True)

    target_rows = list(self_timed_targets)
    for timed_workload, variant, baseline, kind, bound, label in TARGETS:
        if timed_workload in crashed:
            measured = f"not measured: the workload {timed_workload} failed"
            target_rows.append({"target": label, "measured": measured, "met": False})
            continue
        if timed_workload not in all_samples:
            continue
        samples = all_samples[timed_workload]
        missing = [name for name in (variant, baseline) if name not in samples]
        if missing:  # both are built by the workload: one failed
            measured = "not measured: " + ", ".join(f"{name} failed" for name in missing)
            target_rows.append({"target": label, "measured": measured, "met": False})
            continue
        at_least = kind == "speedup"
        value = harness.paired_ratio(samples, baseline, variant)
        value = value if at_least else 1.0 / value
        met = value >= bound if at_least else value <= bound
        measured = harness.judged(value, bound, at_least)
        target_rows.append({"target": label, "measured": measured, "met": met})
    lines = ["**Targets**", "", "| target | measured | met |", "|---|---:|:---:|"]
    lines += [
        f"| {row['target']} | {row['measured']} | {'yes' if row['met'] else 'no'} |"
        for row in target_rows
    ]
    sections.append("\n".join(lines))
    print("\n" + sections[-1], flush=True)

    load = load_section(load_log)
    sections.append(load)
    print("\n" + load, flush=True)

    for result in all_results:
        result.machine = result.machine or harness.row_machine(info)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    harness.write_json(str(output / "latest.json"), info, all_results, target_rows)
    with open(output / "latest.json") as f:
        data = json.load(f)
    data["accuracy"], data["memory"], data["real_models"] = accuracy, memory, real_models
    data["machine_load"] = [
        {
            "table": label,
            "others_share": samples.others_share,
            "table_share": samples.table_share,
            "retimed": samples.retimed,
        }
        for label, samples in load_log
    ]
    with open(output / "latest.json", "w") as f:
        json.dump(strict(data), f, indent=2, allow_nan=False)
    header = (
        f"Measured {info['date']} on {info['cpu']} (class {info['cpu_class']}: "
        f"{info['cpu_flags']}), "
        f"{info['threads']} threads, torch {info['torch']}."
    )
    (output / "latest.md").write_text(header + "\n\n" + "\n\n".join(sections) + "\n")
    print(f"\nWrote {output / 'latest.json'} and {output / 'latest.md'}")
    timed = any(all_samples.values()) or any(
        data.get("samples", {}).get(name)
        for data in real_models.values()
        for name in data.get("workloads", [])
    )
    if crashed or not timed:
        print("Failed: " + (f"workloads {', '.join(crashed)}" if crashed else "nothing was timed"))
        return 1
    return 0


def _accuracy_section(threads: int) -> tuple[list[dict], str]:
    """The quantized MLP's output error and weight bytes: `(rows, markdown)`."""
    accuracy = mlp.quantization_accuracy()
    lines = [
        "**Quantized MLP: output error vs float32, stored weight bytes**",
        "",
        "| policy | relative error | weight bytes vs float32 |",
        "|---|---:|---:|",
    ]
    lines += [
        f"| {row['policy']} | {row['relative_error']:.4f} | {row['weight_bytes_vs_float32']:.3f} |"
        for row in accuracy
    ]
    return accuracy, "\n".join(lines)


def _memory_section(threads: int) -> tuple[list[dict], str]:
    """The MLP train step's peak RSS per variant, each in its own process."""
    names = list(mlp.mlp_train_factories())
    memory = memory_rows([n for n in names if "Keras" not in n], threads)
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
    return memory, "\n".join(lines)


def _time_workload(
    key: str,
    workload: Any,
    args: argparse.Namespace,
    repeats: int,
    rounds: int,
    all_results: list[harness.Result],
    all_samples: dict[str, dict],
    sections: list[str],
) -> None:
    """Builds and times one of the suite's own workloads, adding its results,
    samples and table to the run's."""
    variants, notes = workload.build()
    if workload.heavy:
        # Each variant was called once when built; two more warm-up calls
        # cover the shapes torch.compile specializes on.
        heavy_repeats, heavy_rounds = (4, 2) if args.quick else (12, 4)
        samples = harness.measure_interleaved(
            variants, warmup=2, repeats=heavy_repeats, rounds=heavy_rounds, label=key
        )
    else:
        samples = harness.measure_interleaved(variants, repeats=repeats, rounds=rounds, label=key)
    results = harness.summarize(key, samples, notes)
    all_results.extend(results)
    all_samples[key] = samples
    if workload.first_call is not None:
        del variants
        calls = (
            {}
            if args.no_first_call
            else first_calls(workload.first_call, list(samples), args.threads)
        )
        for r in results:
            call = calls.get(r.variant)
            if isinstance(call, tuple):
                r.extra["first_call_s"], r.extra["later_call_s"] = call
        for name, note in notes.items():
            if note.startswith("failed"):
                all_results.append(harness.Result(key, name, float("nan"), 0, 0, note))
        unit = "ms/token" if workload.first_call == "decode" else "ms"
        section = llm_table(workload, results, samples, notes, calls, unit)
    else:
        section = markdown_table(workload, results, samples)
    sections.append(section)
    print(section, flush=True)


def load_section(log: list[tuple[str, harness.Samples]]) -> str:
    """What other processes took of the machine while each table was timed.

    >>> quiet, busy = harness.Samples(a=[[1.0]]), harness.Samples(a=[[1.0]])
    >>> quiet.others_share, quiet.retimed, busy.others_share, busy.retimed = [0.0], 0, [0.4], 2
    >>> first, second = load_section([("mlp", quiet), ("smollm2 decode", busy)]).splitlines()
    >>> first
    '**Machine load**: other processes took under 5% of the CPU while 1 of 2 timed tables ran.'
    >>> second.split(" (contended")[0]
    'Not quiet, so their figures are unreliable: smollm2 decode'
    >>> load_section([("minilm b1x32", harness.Samples())]).splitlines()[1]
    'Nothing timed (every variant failed): minilm b1x32'
    """
    empty = [label or "a table" for label, samples in log if not samples]
    notes = [(label or "a table", samples.contention_note()) for label, samples in log if samples]
    unknown = [label for label, note in notes if note.startswith("load unknown")]
    busy = [f"{label} ({note})" for label, note in notes if note and label not in unknown]
    quiet = len(notes) - len(busy) - len(unknown)
    line = (
        f"**Machine load**: other processes took under 5% of the CPU while "
        f"{quiet} of {len(notes)} timed tables ran."
    )
    if busy:
        line += "\nNot quiet, so their figures are unreliable: " + "; ".join(busy) + "."
    if unknown:
        line += "\nLoad not measured (no /proc/stat, or rounds too short): " + ", ".join(unknown)
    if empty:
        line += "\nNothing timed (every variant failed): " + ", ".join(empty)
    return line
