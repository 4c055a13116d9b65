"""The quality table of chosen variants, quickly:

    python -m benchmarks quality --model smollm2 --variants int4/32,int4/128
    python -m benchmarks quality --model minilm

Each variant is prepared on a fresh copy of the float32 model and scored
against the cached float32 reference (`quality`); a variant that fails or
whose packages are missing becomes a row saying why. Rows print as they are
measured; the table is also written to `<output>/quality-<model>.{json,md}`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import torch

from dtype_policies.bench.realmodels import catalogue, engines, models, quality, variants
from dtype_policies.bench.realmodels.variants import LM, Calibration, Variant

COLUMNS = {
    LM: (("perplexity", "{:.2f}"), ("top1", "{:.3f}"), ("kl", "{:.4f}")),
    variants.ENCODER: (
        ("cosine_mean", "{:.5f}"),
        ("cosine_min", "{:.5f}"),
        ("nn_agreement", "{:.3f}"),
    ),
}


def missing_packages(variant: Variant) -> list[str]:
    return [name for name in variant.requires if importlib.util.find_spec(name) is None]


def load(model: str) -> tuple[torch.nn.Module, Any]:
    return models.load_smollm2() if model == LM else models.load_minilm()


def score(engine: Any, model: str) -> dict[str, float]:
    if model == LM:
        return quality.evaluate_lm(engine.logits)
    return quality.evaluate_encoder(engine.hidden)


def prepare_engine(variant: Variant, base: torch.nn.Module, calibration: Calibration) -> Any:
    return engines.as_engine(variants.prepared(variant, base, calibration), calibration.model)


def failure(error: BaseException) -> str:
    return f"failed: {type(error).__name__}: {error}".splitlines()[0][:200]


def prepare_and_score(
    variant: Variant, base: torch.nn.Module, calibration: Calibration, scored: bool = True
) -> tuple[dict[str, Any], Any]:
    """The variant's quality row and its engine (None when it has no figures:
    the row's status says why); `scored=False` prepares without scoring."""
    row: dict[str, Any] = {"variant": variant.name, "family": variant.family, "note": variant.note}
    missing = missing_packages(variant)
    if missing:
        row["status"] = f"not installed: {', '.join(missing)}"
        return row, None
    start = time.perf_counter()
    engine = None
    try:
        engine = prepare_engine(variant, base, calibration)
        row["prepare_s"] = time.perf_counter() - start
        if getattr(engine, "note", ""):
            row["note"] = "; ".join(filter(None, [row["note"], engine.note]))
        row["engine_threads"] = engine.threads
        if getattr(engine, "build", ""):
            row["engine_build"] = engine.build
        if scored:
            row.update(score(engine, calibration.model))
        row["status"] = "ok"
    except Exception as error:  # a failing variant is a row, not a crash
        row["status"] = failure(error)
        engine = None
    row["seconds"] = time.perf_counter() - start
    return row, engine


def quality_rows(model: str, selected: list[Variant], echo=print) -> list[dict[str, Any]]:
    """One row per variant: its figures, or why it has none."""
    base, tokenizer = load(model)
    calibration = Calibration(model, tokenizer)
    rows = []
    for variant in selected:
        row, _ = prepare_and_score(variant, base, calibration)
        rows.append(row)
        echo(markdown_row(model, row))
    return rows


def markdown_header(model: str) -> str:
    names = [name for name, _ in COLUMNS[model]]
    return "\n".join(["| variant | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)])


def markdown_row(model: str, row: dict[str, Any]) -> str:
    label = row["variant"] + (f" ({row['note']})" if row.get("note") else "")
    if row["status"] != "ok":
        return f"| {label}: {row['status']} |" + " - |" * len(COLUMNS[model])
    return f"| {label} | " + " | ".join(quality_cells(model, row)) + " |"


def quality_cells(model: str, row: dict[str, Any]) -> list[str]:
    """The row's formatted quality figures ("-" where not measured)."""
    return [fmt.format(row[name]) if name in row else "-" for name, fmt in COLUMNS[model]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks quality", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", choices=[LM, variants.ENCODER], default=LM)
    parser.add_argument("--variants", default="", help="comma-separated names (default: all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default="benchmark-results")
    parser.add_argument("--list", action="store_true", help="list the variant names and exit")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.list:
        for variant in catalogue.select(None, args.model):
            print(variant.name)
        return 0
    try:
        selected = catalogue.select(args.variants, args.model)
    except ValueError as e:
        parser.error(str(e))
    print(markdown_header(args.model), flush=True)
    rows = quality_rows(args.model, selected, echo=lambda line: print(line, flush=True))
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    (output / f"quality-{args.model}.json").write_text(json.dumps(rows, indent=2))
    lines = [markdown_header(args.model)]
    lines += [markdown_row(args.model, r) for r in rows]
    (output / f"quality-{args.model}.md").write_text("\n".join(lines) + "\n")
    return 0
