"""The open issues' targets on the real models, judged from one run's table.

Speed targets compare two variants timed in the same interleaved rounds
(`harness.paired_ratio`: the median over rounds of the ratio of their
medians); quality targets compare a variant's score with float32's (the
table's reference row). A target whose variants were not in the run is left
out; one whose variant, or peer, failed is reported as not met, with why.
A figure is shown with as many decimals as keep it on its side of the bound
(`harness.judged`).

>>> table = {
...     "model": "minilm",
...     "rows": [{"variant": "float32", "status": "ok", "cosine_mean": 1.0},
...              {"variant": "int8", "status": "ok", "cosine_mean": 0.9996}],
...     "samples": {},
... }
>>> [(row["target"], row["measured"], row["met"]) for row in evaluate(table)]
[('MiniLM int8 cosine >= 0.999', '0.9996', True)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtype_policies.bench import harness

REFERENCE = "float32"


@dataclass(frozen=True)
class SpeedTarget:
    """`ours` at least `bound` times as fast as `peer` on `workload`."""

    model: str
    workload: str
    ours: str
    peer: str
    bound: float
    label: str


@dataclass(frozen=True)
class QualityTarget:
    """`variant`'s `column`: at most `bound` times float32's (`relative`,
    perplexity), or at least `bound` (`relative=False`: agreement, cosine)."""

    model: str
    variant: str
    column: str
    bound: float
    relative: bool
    label: str


LM, ENCODER = "smollm2", "minilm"

SPEED_TARGETS = (
    SpeedTarget(
        LM,
        "decode",
        "mixed_bfloat16 compiled",
        "llama.cpp BF16",
        0.8,
        "SmolLM2 decode, mixed_bfloat16 compiled >= 0.8x llama.cpp BF16",
    ),
    SpeedTarget(
        LM,
        "decode",
        "int8 compiled",
        "llama.cpp Q8_0",
        0.8,
        "SmolLM2 decode, int8 compiled >= 0.8x llama.cpp Q8_0",
    ),
    SpeedTarget(
        LM,
        "decode",
        "int4/32 W4A8 compiled",
        "llama.cpp Q4_0",
        0.8,
        "SmolLM2 decode, int4/32 W4A8 compiled >= 0.8x llama.cpp Q4_0",
    ),
    SpeedTarget(
        LM,
        "prefill",
        "mixed_bfloat16 compiled",
        "llama.cpp BF16",
        1.0,
        "SmolLM2 prefill, mixed_bfloat16 compiled >= 1x llama.cpp BF16",
    ),
    SpeedTarget(
        LM,
        "prefill",
        "int8 compiled",
        "llama.cpp Q8_0",
        1.0,
        "SmolLM2 prefill, int8 compiled >= 1x llama.cpp Q8_0",
    ),
    SpeedTarget(
        LM,
        "prefill",
        "int4/32 W4A8 compiled",
        "llama.cpp Q4_0",
        1.0,
        "SmolLM2 prefill, int4/32 W4A8 compiled >= 1x llama.cpp Q4_0",
    ),
    SpeedTarget(LM, "decode", "int4/128", "int4/64", 1.0, "SmolLM2 decode, int4/128 >= 1x int4/64"),
    SpeedTarget(
        ENCODER,
        "b1x32",
        "int8 compiled",
        "onnxruntime int8 (quantize_dynamic)",
        0.8,
        "MiniLM 1 x 32, int8 compiled >= 0.8x ONNX Runtime int8",
    ),
    SpeedTarget(
        ENCODER,
        "b1x32",
        "mixed_bfloat16 compiled",
        "openvino (CPU default precision)",
        0.8,
        "MiniLM 1 x 32, mixed_bfloat16 compiled >= 0.8x OpenVINO",
    ),
    SpeedTarget(
        ENCODER,
        "b32x128",
        "int8 compiled",
        "onnxruntime int8 (quantize_dynamic)",
        1.0,
        "MiniLM 32 x 128, int8 compiled >= 1x ONNX Runtime int8",
    ),
    SpeedTarget(
        ENCODER,
        "b32x128",
        "mixed_bfloat16 compiled",
        "openvino (CPU default precision)",
        0.95,
        "MiniLM 32 x 128, mixed_bfloat16 compiled >= 0.95x OpenVINO",
    ),
)

QUALITY_TARGETS = (
    QualityTarget(LM, "int4/32", "perplexity", 1.01, True, "SmolLM2 int4/32 perplexity <= +1%"),
    QualityTarget(LM, "int4/128", "perplexity", 1.06, True, "SmolLM2 int4/128 perplexity <= +6%"),
    QualityTarget(
        LM, "int4/-1", "perplexity", 1.25, True, "SmolLM2 int4 per channel perplexity <= +25%"
    ),
    QualityTarget(LM, "int8", "perplexity", 1.01, True, "SmolLM2 int8 perplexity <= +1%"),
    QualityTarget(LM, "int8", "top1", 0.95, False, "SmolLM2 int8 top-1 >= 0.95"),
    QualityTarget(
        LM,
        "float8 weight-only",
        "perplexity",
        1.02,
        True,
        "SmolLM2 float8 weight-only perplexity <= +2%",
    ),
    QualityTarget(
        LM, "gptq/4/128", "perplexity", 1.03, True, "SmolLM2 gptq/4/128 perplexity <= +3%"
    ),
    QualityTarget(LM, "awq/4/128", "perplexity", 1.04, True, "SmolLM2 awq/4/128 perplexity <= +4%"),
    QualityTarget(LM, "gptq/8/-1", "perplexity", 1.003, True, "SmolLM2 gptq/8 perplexity <= +0.3%"),
    QualityTarget(ENCODER, "int8", "cosine_mean", 0.999, False, "MiniLM int8 cosine >= 0.999"),
    QualityTarget(
        ENCODER, "int4/128", "cosine_mean", 0.985, False, "MiniLM int4/128 cosine >= 0.985"
    ),
    QualityTarget(ENCODER, "int4/32", "cosine_mean", 0.99, False, "MiniLM int4/32 cosine >= 0.99"),
)


def _why_untimed(row: dict, workload: str) -> str:
    """Why a variant of the run has no time for `workload`."""
    for reason in (row.get(f"{workload}_status"), row.get("status")):
        if isinstance(reason, str) and reason != "ok":
            return reason
    return "not timed"


def _speed(target: SpeedTarget, rows: dict[str, dict], samples: dict) -> dict | None:
    if target.ours not in rows or target.peer not in rows or target.workload not in samples:
        return None  # not both in the run, or the run did not time this workload
    timed = samples[target.workload]
    if target.ours in timed and target.peer in timed:
        value = harness.paired_ratio(timed, target.peer, target.ours)  # peer time / ours
        measured = harness.judged(value, target.bound, at_least=True)
        return {"target": target.label, "measured": measured, "met": value >= target.bound}
    times = {name: rows[name].get(f"{target.workload}_ms") for name in (target.ours, target.peer)}
    untimed = [
        f"{name} {_why_untimed(rows[name], target.workload)}"
        for name, ms in times.items()
        if ms is None
    ]
    if untimed:
        return {
            "target": target.label,
            "measured": "not measured: " + "; ".join(untimed),
            "met": False,
        }
    # one of them timed once, too slow to time in every round
    ours_ms, peer_ms = times[target.ours], times[target.peer]
    assert ours_ms is not None and peer_ms is not None  # `untimed` is empty
    value = peer_ms / ours_ms
    once = next(name for name in times if name not in timed)
    note = rows[once].get(f"{target.workload}_status", "one call")
    return {
        "target": target.label,
        "measured": f"{harness.judged(value, target.bound, at_least=True)} ({once}: {note})",
        "met": value >= target.bound,
    }


def _quality(target: QualityTarget, rows: dict[str, dict]) -> dict | None:
    row = rows.get(target.variant)
    if row is None:
        return None
    if target.column not in row:
        if row.get("status", "ok") == "ok":
            return None  # a speed-only run
        return {"target": target.label, "measured": f"failed ({row['status']})", "met": False}
    value = float(row[target.column])
    if target.relative:
        reference = rows.get(REFERENCE, {}).get(target.column)
        if reference is None:
            return None
        change = value / float(reference)
        return {
            "target": target.label,
            "measured": harness.judged(change, target.bound, False, digits=1, percent=True),
            "met": change <= target.bound,
        }
    measured = harness.judged(value, target.bound, at_least=True, digits=4).removesuffix("x")
    return {"target": target.label, "measured": measured, "met": value >= target.bound}


def evaluate(table: dict[str, Any]) -> list[dict]:
    """The targets of `table`'s model that its run measured:
    `{"target", "measured", "met"}` each."""
    rows = {row["variant"]: row for row in table["rows"]}
    samples = table.get("samples", {})
    judged = [
        _speed(target, rows, samples) for target in SPEED_TARGETS if target.model == table["model"]
    ] + [_quality(target, rows) for target in QUALITY_TARGETS if target.model == table["model"]]
    return [row for row in judged if row is not None]
