"""The CPU-class workload: a 2048 -> 5632 -> 2048 MLP (GELU) under every
policy and mode, from every source policy, at 1 and at 64 rows, each variant
against float32 in one interleaved run (the targets of "Right and fast on
every CPU"). The notes name the kernel each variant's first layer runs by on
this CPU (`apply.kernel_report`).
"""

from __future__ import annotations

import copy
import functools
import warnings

import torch
import torch.nn as nn

from dtype_policies.apply.kernel_report import kernel_of
from dtype_policies.bench.registry import Variants, register
from dtype_policies.bench.workloads.common import policied_copy
from dtype_policies.quantization import Int4QuantizationConfig, Int8QuantizationConfig

WIDTHS = (2048, 5632)
SOURCES = ("float32", "mixed_bfloat16", "mixed_float16")
MODES = (
    ("int8", "int8", None),  # the default int8: inputs and weights rounded to int8 per 32
    ("int8 W8A8/32", "int8", Int8QuantizationConfig(activation_block_size=32)),  # per-channel w
    ("int8 weight-only", "int8", Int8QuantizationConfig(activation_quantizer=None)),
    ("int8 W8A8", "int8", Int8QuantizationConfig()),  # Keras's: per-row activations
    ("int4/128", "int4", None),
    ("int4/-1", "int4", Int4QuantizationConfig(block_size=-1)),
    # this library's W4A8: inputs rounded to int8 per 32, integer products
    ("int4/128 W4A8", "int4", Int4QuantizationConfig(block_size=128, activation_block_size=32)),
    ("float8", "float8", None),
)


def mlp(hidden: int = WIDTHS[0], inner: int = WIDTHS[1]) -> nn.Sequential:
    return nn.Sequential(nn.Linear(hidden, inner), nn.GELU(), nn.Linear(inner, hidden))


def _inference(model: nn.Module, x: torch.Tensor):
    def run():
        with torch.inference_mode():
            return model(x)

    return run


def cpu_mlp(rows: int) -> tuple[Variants, dict[str, str]]:
    """Every variant of the MLP at `rows` rows (sources that a mode refuses,
    such as int8 from float16, are skipped)."""
    torch.manual_seed(0)
    base = mlp().eval()
    x = torch.randn(rows, WIDTHS[0])
    variants: Variants = {"float32": _inference(copy.deepcopy(base), x)}
    variants["whole model bfloat16"] = _inference(copy.deepcopy(base).bfloat16(), x.bfloat16())
    notes: dict[str, str] = {}
    for source in SOURCES:
        candidates: list[tuple[str, str | None, object]] = (
            [(source, None, None)] if source != "float32" else []
        )
        candidates += [(f"{label}_from_{source}", mode, config) for label, mode, config in MODES]
        for name, mode, config in candidates:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = policied_copy(base, source, mode, config)
            except ValueError:
                continue  # e.g. int8 from a float16 source (Keras refuses it)
            variants[name] = _inference(model, x)
            notes[name] = kernel_of(model[0])
    return variants, notes


# The targets, measured on the AVX2 class (and no worse elsewhere):
# (workload, variant, bound, label); speed = float32 time / variant time.
_TARGETS = [
    ("cpu_mlp_1", "mixed_bfloat16", 1.6, "mixed_bfloat16 >= 1.6x float32 at 1 row"),
    ("cpu_mlp_64", "mixed_bfloat16", 0.95, "mixed_bfloat16 >= 0.95x float32 at 64 rows"),
    ("cpu_mlp_1", "int8_from_mixed_bfloat16", 1.2, "int8 >= 1.2x float32 at 1 row"),
    ("cpu_mlp_1", "int8_from_float32", 1.2, "int8 from float32 >= 1.2x float32 at 1 row"),
    ("cpu_mlp_64", "int8_from_mixed_bfloat16", 1.5, "int8 >= 1.5x float32 at 64 rows"),
    ("cpu_mlp_64", "int8_from_float32", 1.5, "int8 from float32 >= 1.5x float32 at 64 rows"),
]
for _source in SOURCES:
    _TARGETS.append(
        ("cpu_mlp_1", f"int4/128_from_{_source}", 2.5, f"int4 from {_source} >= 2.5x at 1 row")
    )
    for _rows in (1, 64):
        for _label, _mode, _ in MODES:
            if _mode == "int8" and _source == "mixed_float16":
                continue  # Keras refuses int8 from float16
            _TARGETS.append(
                (
                    f"cpu_mlp_{_rows}",
                    f"{_label}_from_{_source}",
                    0.75,
                    f"{_label} from {_source} >= 0.75x float32 at {_rows} rows",
                )
            )
TARGETS = [
    (workload, variant, "float32", "speedup", bound, label)
    for workload, variant, bound, label in _TARGETS
]

for _rows in (1, 64):
    register(
        f"cpu_mlp_{_rows}",
        f"MLP {WIDTHS[0]}->{WIDTHS[1]}->{WIDTHS[0]} at {_rows} row{'s' if _rows > 1 else ''}, "
        "every policy, mode and source (kernels of this CPU class in the notes)",
        functools.partial(cpu_mlp, _rows),
        baseline="whole model bfloat16",
    )
