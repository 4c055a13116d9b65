"""The real trained models (SmolLM2-135M-Instruct, all-MiniLM-L6-v2, from
PyPI): quality beside speed for every variant and installed peer, and one
chart per model (`dtype_policies.bench.realmodels`). Skipped, with the
reason, when a model package is not installed."""

from __future__ import annotations

import json

from dtype_policies._json import strict
from dtype_policies.bench.realmodels import chart, models, table, text
from dtype_policies.bench.registry import RunContext, Section, register

TITLES = {
    "smollm2": (
        "SmolLM2-135M-Instruct: quality on GPL-3 (8 x 512 tokens) and speed "
        "(batch-1 greedy decode after a 32-token prompt; one 512-token prefill)"
    ),
    "minilm": (
        "all-MiniLM-L6-v2: quality on 200 GPL-3 sentences and speed "
        "(batch 1 x 32 tokens; batch 32 x 128)"
    ),
}


def run_model(model: str, context: RunContext) -> Section:
    title = TITLES[model]
    try:
        measured = table.model_table(
            model,
            context.variants,
            context.quick,
            quality=not context.speed_only,
            machine=context.machine,
            skip=context.skip,
        )
    except (models.ModelUnavailable, text.TextUnavailable) as e:
        return Section(f"**{title}**\n\nskipped: {e}", {"skipped": str(e)})
    machine = context.machine
    threads = f"{machine['threads']} thread{'' if machine['threads'] == '1' else 's'}"
    subtitle = (
        f"{machine['cpu']}, CPU class {machine['cpu_class']} ({machine['cpu_flags']}), "
        f"{threads} per engine, torch {machine['torch']}, {machine['date']}"
    )
    context.output.mkdir(parents=True, exist_ok=True)
    (context.output / f"{model}.json").write_text(
        json.dumps(strict({"machine": machine, **measured}), indent=2, allow_nan=False)
    )
    charts = context.charts or context.output
    drawn = chart.draw(measured, charts / f"{model}.png", subtitle)
    markdown = table.markdown(measured, title)
    if drawn is not None:
        markdown += f"\n\nChart: `{drawn}` (time against quality, frontier dashed)."
    return Section(markdown, measured)


register("smollm2", TITLES["smollm2"], run=lambda context: run_model("smollm2", context))
register("minilm", TITLES["minilm"], run=lambda context: run_model("minilm", context))
