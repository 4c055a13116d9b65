"""`quantize(model, mode, config, filters)`: quantize every module that can be."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import torch

from dtype_policies._paths import named_module_paths
from dtype_policies.layers.layer import Layer
from dtype_policies.quantization import torch_modules
from dtype_policies.quantization.config import validate_and_resolve_config
from dtype_policies.quantization.layer_support import QuantizableLayer
from dtype_policies.quantization.report import (
    SKIP_ALREADY_QUANTIZED,
    SKIP_FILTERED,
    SKIP_NO_SUPPORT,
    QuantizationReport,
)

Filters = str | list | tuple | Callable[[str, torch.nn.Module], bool] | None


def _filter_function(filters: Filters) -> Callable[[str, torch.nn.Module], bool]:
    if filters is None:
        return lambda path, module: True
    if isinstance(filters, str):
        pattern = re.compile(filters)
        return lambda path, module: pattern.search(path) is not None
    if isinstance(filters, (list, tuple)):
        if not all(isinstance(item, str) for item in filters):
            raise ValueError(f"A `filters` list must hold regex strings. Received: {filters!r}")
        patterns = [re.compile(item) for item in filters]
        return lambda path, module: any(p.search(path) for p in patterns)
    if callable(filters):
        return filters
    raise ValueError(
        "The `filters` argument must be a regex string, a list of regex strings, or a "
        f"callable (path, module) -> bool. Received: {type(filters)}"
    )


def _owns_weights(module: torch.nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values())


def quantize(
    model: torch.nn.Module,
    mode: str | None = None,
    config: Any = None,
    filters: Filters = None,
    *,
    type_check: bool = True,
    verbose: bool = False,
) -> QuantizationReport:
    """Quantizes every module of `model` that supports `mode`, in place.

    Supported: this library's `Dense`, `EinsumDense` (int8, int4, float8) and
    `Embedding` (int8, int4), and plain `torch.nn.Linear` (int8, int4, float8)
    and `torch.nn.Embedding` (int8, int4) anywhere in the model. Other modules
    that own weights are skipped and reported, with a single summary warning.
    A module's policy becomes `"<mode>_from_<its policy>"`; under
    `apply_policy(model, "mixed_bfloat16")` that is e.g. `int8_from_mixed_bfloat16`,
    which computes in bfloat16.

    Args:
        model: Any module (built, for this library's layers).
        mode: `"int8"`, `"int4"` or `"float8"` (optional when `config` is given).
        config: A quantization config (`Int8QuantizationConfig(activation_quantizer=None)`
            for weight-only int8, `Int4QuantizationConfig(block_size=-1)` for
            per-channel int4, ...).
        filters: Which modules to quantize: a regex searched in the module path,
            a list of them (any matches), or a callable `(path, module) -> bool`.
        type_check: Passed to `Layer.quantize` (refuses subclasses of the
            quantizable layers unless `False`).
        verbose: Print the report.

    Returns:
        A `QuantizationReport` of the quantized and skipped modules.

    >>> import torch
    >>> import dtype_policies
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64),
    ...                             torch.nn.Linear(64, 8))
    >>> report = dtype_policies.quantize(model, "int8", filters=r"^0$")
    >>> report.quantized, report.skipped
    ([('0', 'int8', 'int8_from_float32')], [('1', 'filtered out'), ('2', 'filtered out')])
    >>> model[0].weight.dtype, model(torch.randn(2, 64)).dtype
    (torch.int8, torch.float32)
    """
    config = validate_and_resolve_config(mode, config)
    mode = config.mode
    keep = _filter_function(filters)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"quantize() expects a torch.nn.Module. Received: {type(model).__name__}")
    report = QuantizationReport(mode)
    root_path = (model.path or model.name) if isinstance(model, Layer) else ""
    for path, module in list(named_module_paths(model, root_path)):
        label = path or "(root)"
        quantizer = _quantizer(module, mode, config, type_check)
        if quantizer is None:
            if _owns_weights(module):
                reason = SKIP_NO_SUPPORT if keep(path, module) else SKIP_FILTERED
                report.skipped.append((label, reason))
            continue
        already_quantized, apply = quantizer
        if already_quantized:
            report.skipped.append((label, SKIP_ALREADY_QUANTIZED))
        elif not keep(path, module):
            report.skipped.append((label, SKIP_FILTERED))
        else:
            try:
                policy_name = apply()
            except NotImplementedError:
                report.skipped.append((label, SKIP_NO_SUPPORT))
            else:
                report.quantized.append((label, mode, policy_name))
    message = report.summary_warning()
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=2)
    if verbose:
        print(report.render())
    return report


def _quantizer(
    module: torch.nn.Module, mode: str, config: Any, type_check: bool
) -> tuple[bool, Callable[[], str]] | None:
    """`(already quantized, quantize it and return its new policy name)` for a
    module that supports quantization, else `None`."""
    if isinstance(module, QuantizableLayer):

        def apply_to_layer() -> str:
            module.quantize(mode, config, type_check=type_check)
            return module._resolve_policy().name

        return module.is_quantized, apply_to_layer
    if torch_modules.supported_modes(module):

        def apply_to_module() -> str:
            length = _history_length(config, module)
            return torch_modules.quantize_module(module, mode, config, length).name

        return torch_modules.is_quantized(module), apply_to_module
    return None


def _history_length(config: Any, module: torch.nn.Module) -> int:
    length = getattr(config, "amax_history_length", None)
    if length:
        return length
    policy = module.__dict__.get("_dp_policy")
    return getattr(policy, "amax_history_length", 1024)
