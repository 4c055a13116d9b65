"""One table per real model: every variant's quality beside its speed,
measured in the same run, and a chart of the trade-off.

`model_table(model)` prepares each variant once (`quality_table`), scores it,
then times every speed workload of the model (`speed`) over all variants
that prepared, interleaved, with ratios against float32. Failing variants
are rows that say why. `chart.draw` plots time against quality.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from dtype_policies.bench import harness
from dtype_policies.bench.realmodels import catalogue, quality_table, speed, targets
from dtype_policies.bench.realmodels.variants import Calibration

REFERENCE = "float32"


# A sample of a one-call workload lasts at least this long (MiniLM's 1 x 32
# calls take 3-6 ms: one call per sample gave round-to-round ratios 0.64-0.97x
# apart in one table); decode and prefill calls are one call a sample.
MIN_SAMPLE_S = 0.05


def _timed_calls(
    engines: dict[str, Any], workload: str, rows: dict[str, dict], quick: bool
) -> dict[str, Callable[[], object]]:
    """Each engine's call, probed once (the warm-up); failures go to the rows.

    A variant whose probe is more than `speed.SLOW` times float32's is
    probed once more (its first call may have compiled: the compiled
    variants); if the second is too, it is a cliff: it decodes
    `speed.SLOW_TOKENS` tokens, or, for one-call workloads, its probe is its
    figure and it is not timed again (so that a cliff costs two calls, not
    minutes); its row says so."""
    tokens = 16 if quick else speed.DECODE_TOKENS
    calls, probes = {}, {}
    for name, engine in engines.items():
        try:
            call = speed.call_of(engine, workload, tokens)
            probes[name] = harness.time_call(call)[0]
            calls[name] = call
        except Exception as error:  # reported, not fatal
            rows[name][f"{workload}_status"] = quality_table.failure(error)
    if REFERENCE not in probes:
        return calls
    for name, seconds in probes.items():
        if seconds <= speed.SLOW * probes[REFERENCE]:
            continue
        seconds = harness.time_call(calls[name])[0]  # after a compiling first call
        if seconds <= speed.SLOW * probes[REFERENCE]:
            continue
        if workload == "decode":
            calls[name] = speed.call_of(engines[name], workload, speed.SLOW_TOKENS)
            rows[name][f"{workload}_status"] = f"{speed.SLOW_TOKENS} tokens (slow)"
        else:
            del calls[name]
            rows[name][f"{workload}_ms"] = seconds * 1e3
            rows[name][f"{workload}_x_float32"] = probes[REFERENCE] / seconds
            rows[name][f"{workload}_status"] = "one call (slow)"
    return calls


def time_workload(
    engines: dict[str, Any],
    workload: str,
    rows: dict[str, dict],
    quick: bool,
    echo,
    label: str = "",
    timings: dict[str, dict[str, list[list[float]]]] | None = None,
) -> str:
    """Times `workload` on every engine; writes ms and x float32 into the
    rows, and the samples of each round into `timings[workload]` (for the
    targets, `targets.evaluate`). Returns what other processes took of the
    machine meanwhile ("" if it was quiet; `harness.Samples.contention_note`)."""
    calls = _timed_calls(engines, workload, rows, quick)
    rounds = 2 if quick else 5
    samples = harness.measure_interleaved(
        calls,
        warmup=1,
        repeats=rounds,
        rounds=rounds,
        min_sample_s=MIN_SAMPLE_S,
        label=label or workload,
    )
    for name, per_round in samples.items():
        rows[name][f"{workload}_ms"] = statistics.median(t for r in per_round for t in r) * 1e3
        if REFERENCE in samples:
            rows[name][f"{workload}_x_float32"] = harness.paired_ratio(samples, REFERENCE, name)
    if timings is not None:
        timings[workload] = dict(samples)
    note = samples.contention_note()
    echo(f"  timed {workload}: {len(samples)} variants" + (f"; {note}" if note else ""), flush=True)
    return note


def model_table(
    model: str,
    names: str | None = None,
    quick: bool = False,
    echo=print,
    quality: bool = True,
    machine: dict[str, str] | None = None,
    skip: str | None = None,
) -> dict:
    """`{"model", "rows", "workloads"}`: quality (unless `quality=False`) and
    speed of every variant; each row records `harness.row_machine(machine)`
    (default: this machine now)."""
    where = harness.row_machine(machine or harness.machine_info())
    base, tokenizer = quality_table.load(model)
    calibration = Calibration(model, tokenizer)
    rows: dict[str, dict] = {}
    engines: dict[str, Any] = {}
    for variant in catalogue.select(names, model, skip):
        row, engine = quality_table.prepare_and_score(variant, base, calibration, quality)
        row.update(where)
        if "engine_threads" in row and str(row["engine_threads"]) != where["threads"]:
            row["note"] = "; ".join(
                filter(None, [row["note"], f"runs {row['engine_threads']} threads"])
            )
        rows[variant.name] = row
        if engine is not None:
            engines[variant.name] = engine
        echo("  " + quality_table.markdown_row(model, row), flush=True)
    del base
    contended: dict[str, str] = {}
    timings: dict[str, dict[str, list[list[float]]]] = {}
    for workload in speed.WORKLOADS[model]:
        note = time_workload(engines, workload, rows, quick, echo, f"{model} {workload}", timings)
        if note:
            contended[workload] = note
    measured = {
        "model": model,
        "rows": list(rows.values()),
        "workloads": speed.WORKLOADS[model],
        "contended": contended,
        "samples": timings,
    }
    measured["targets"] = targets.evaluate(measured)
    return measured


def builds(table: dict) -> dict[str, str]:
    """Per engine family, what its build uses (llama.cpp's CPU features)."""
    return {row["family"]: row["engine_build"] for row in table["rows"] if row.get("engine_build")}


def markdown(table: dict, title: str) -> str:
    model, workloads = table["model"], table["workloads"]
    quality_columns = quality_table.COLUMNS[model]
    header = ["variant", *(name for name, _ in quality_columns)]
    for workload, unit in workloads.items():
        header += [f"{workload} {unit}", f"{workload} x float32"]
    lines = [f"**{title}**", "", "| " + " | ".join(header) + " |"]
    lines.append("|---|" + "---:|" * (len(header) - 1))
    for row in table["rows"]:
        label = row["variant"] + (f" ({row['note']})" if row.get("note") else "")
        if row["status"] != "ok":
            lines.append(f"| {label}: {row['status']} |" + " - |" * (len(header) - 1))
            continue
        cells = quality_table.quality_cells(model, row)
        for workload in workloads:
            status = row.get(f"{workload}_status", "")
            if f"{workload}_ms" not in row:
                cells += [status or "-", "-"]
                continue
            flag = f" ({status})" if status else ""
            ratio = row.get(f"{workload}_x_float32", float("nan"))
            cells += [f"{row[f'{workload}_ms']:.1f}{flag}", f"{ratio:.2f}"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    ok = [row for row in table["rows"] if "cpu_class" in row]
    if ok:
        first = ok[0]
        lines += [
            "",
            f"CPU class {first['cpu_class']} ({first['cpu_flags']}), {first['threads']} threads "
            "for every engine.",
        ]
    lines += [f"{family} build: {features}." for family, features in builds(table).items()]
    lines += [
        f"**{workload}: machine load not measured**: {note}."
        if note.startswith("load unknown")
        else f"**{workload} timed on a busy machine, unreliable**: {note}."
        for workload, note in table.get("contended", {}).items()
    ]
    return "\n".join(lines)
