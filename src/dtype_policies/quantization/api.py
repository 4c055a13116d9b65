"""`quantize(model, mode, config, filters)`: quantize every module that can be,
all or nothing."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import torch

from dtype_policies._core.compose import original_class
from dtype_policies._core.listeners import model_changed
from dtype_policies._core.module_state import state_of
from dtype_policies._paths import named_module_paths, root_path_of
from dtype_policies.quantization.attach import commit, is_quantized, plan
from dtype_policies.quantization.kinds import kind_of
from dtype_policies.quantization.report import (
    SKIP_ALREADY_QUANTIZED,
    SKIP_FILTERED,
    SKIP_NO_SUPPORT,
    QuantizationReport,
)
from dtype_policies.quantizers.config import validate_and_resolve_config

Filters = str | list | tuple | Callable[[str, torch.nn.Module], bool] | None

# Parents whose forward reads these children's weights directly (so a
# quantized child would not be used through its own forward).
_PARENT_READS: dict[type, tuple[str, ...]] = {
    torch.nn.MultiheadAttention: ("out_proj",),
    torch.nn.TransformerEncoderLayer: ("linear1", "linear2"),
}


def _compile(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"Invalid regex in `filters`: {pattern!r} ({e}).") from None


def _filter_function(filters: Filters) -> Callable[[str, torch.nn.Module], bool]:
    if filters is None:
        return lambda path, module: True
    if isinstance(filters, str):
        pattern = _compile(filters)
        return lambda path, module: pattern.search(path) is not None
    if isinstance(filters, (list, tuple)):
        if not all(isinstance(item, str) for item in filters):
            raise ValueError(f"A `filters` list must hold regex strings. Received: {filters!r}")
        patterns = [_compile(item) for item in filters]
        return lambda path, module: any(p.search(path) for p in patterns)
    if callable(filters):
        return filters
    raise ValueError(
        "The `filters` argument must be a regex string, a list of regex strings, or a "
        f"callable (path, module) -> bool. Received: {type(filters)}"
    )


def _owns_weights(module: torch.nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values())


def _not_ready(module: torch.nn.Module) -> str | None:
    """Why a module has no weights to quantize yet, if it has none (`layer.quantize()`
    on such a layer raises instead, as Keras's does)."""
    if getattr(module, "built", True) is False:
        return "not built yet (call or build it first)"
    if any(torch.nn.parameter.is_lazy(p) for p in module._parameters.values() if p is not None):
        return "its parameters are not initialized yet (a lazy module: call it once first)"
    return None


def read_by_parent(path: str, module: torch.nn.Module, modules: dict[str, Any]) -> str | None:
    """Why `module`'s weight is read directly by its parent (so that it cannot
    change how it computes on its own), or `None`; `modules` maps paths to
    modules (the advisor keeps such weights as they are too)."""
    if isinstance(module, torch.nn.modules.linear.NonDynamicallyQuantizableLinear):
        return "weight read by its parent (NonDynamicallyQuantizableLinear)"
    parent_path, _, name = path.rpartition("/")
    parent = modules.get(parent_path)
    if parent is None:
        return None
    for cls, children in _PARENT_READS.items():
        if issubclass(original_class(parent), cls) and name in children:
            return f"weight read by its parent ({cls.__name__})"
    return None


def quantize(
    model: torch.nn.Module,
    mode: str | None = None,
    config: Any = None,
    filters: Filters = None,
    *,
    type_check: bool = True,
    verbose: bool = False,
) -> QuantizationReport:
    """Quantizes every module of `model` that supports `mode`, in place: all of
    them or, if any raises, none (the error names the module's path).

    Supported: this library's `Dense`, `EinsumDense` (int8, int4, float8) and
    `Embedding` (int8, int4); `torch.nn.Linear`, transformers' `Conv1D` and any
    class registered with `register_linear_kind` (int8, int4, float8); and
    `torch.nn.Embedding` (int8, int4). Skipped and reported, with one summary
    warning: modules that own weights but cannot be quantized, weights that a
    parent module reads directly (`nn.MultiheadAttention.out_proj`, the
    linears of `nn.TransformerEncoderLayer`), parametrized weights. A weight
    shared by several modules (an embedding tied to an LM head) is quantized
    once and its stored tensors are shared.

    A module's policy becomes `"<mode>_from_<its float policy>"`; under
    `apply_policy(model, "mixed_bfloat16")` that is e.g.
    `int8_from_mixed_bfloat16`, which computes in bfloat16.

    Args:
        model: Any module (built, for this library's layers).
        mode: `"int8"`, `"int4"` or `"float8"` (optional when `config` is given).
        config: A quantization config (`Int8QuantizationConfig(activation_quantizer=None)`
            for weight-only int8, `Int4QuantizationConfig(block_size=-1)` for
            per-channel int4, ...).
        filters: Which modules to quantize: a regex searched in the module path,
            a list of them (any matches), or a callable `(path, module) -> bool`.
        type_check: Refuse subclasses of this library's layers (whose `call`
            may not dispatch to the quantized product) unless `False`.
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
    >>> model[0].weight_int8.dtype, model(torch.randn(2, 64)).dtype
    (torch.int8, torch.float32)
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"quantize() expects a torch.nn.Module. Received: {type(model).__name__}")
    config = validate_and_resolve_config(mode, config)
    mode = config.mode
    keep = _filter_function(filters)
    report = QuantizationReport(mode)
    modules = dict(named_module_paths(model, root_path_of(model)))
    plans = []
    planned_weights: dict[int, Any] = {}
    for path, module in modules.items():
        label = path or "(root)"
        kind = kind_of(module)
        if kind is None:
            if _owns_weights(module):
                reason = SKIP_NO_SUPPORT if keep(path, module) else SKIP_FILTERED
                report.skipped.append((label, reason))
            continue
        if is_quantized(module):
            report.skipped.append((label, SKIP_ALREADY_QUANTIZED))
            continue
        if not keep(path, module):
            report.skipped.append((label, SKIP_FILTERED))
            continue
        reason = _not_ready(module) or read_by_parent(path, module, modules)
        if reason is not None:
            report.skipped.append((label, reason))
            continue
        try:
            shared = _shared_tensors(module, kind, mode, planned_weights)
            module_plan = plan(
                module, config, path=path, type_check=type_check, kind=kind, tensors=shared
            )
        except NotImplementedError as e:
            report.skipped.append((label, f"{SKIP_NO_SUPPORT}: {e}"))
            continue
        except Exception as e:
            raise type(e)(f"quantize(): module '{label}': {e}") from e
        weight = module._parameters[module_plan.spec.weight]
        planned_weights.setdefault(id(weight), module_plan)
        plans.append(module_plan)
    for module_plan in plans:  # nothing above changed the model
        commit(module_plan)
        label = module_plan.path or "(root)"
        report.quantized.append((label, mode, state_of(module_plan.module).call.policy.name))
    if plans:
        model_changed(model)
    message = report.summary_warning()
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=2)
    if verbose:
        print(report.render())
    return report


def _shared_tensors(module, kind, mode, planned_weights) -> dict | None:
    """The stored tensors of an already planned module holding the same weight
    Parameter with the same orientation (tied weights), if any."""
    try:
        spec = kind.spec(module, mode)
    except NotImplementedError:
        return None  # `plan` says why
    weight = module._parameters.get(spec.weight)
    earlier = planned_weights.get(id(weight)) if weight is not None else None
    if earlier is None:
        return None
    same = (
        earlier.spec.layout == spec.layout
        and earlier.spec.float_shape == spec.float_shape
        and earlier.spec.weight == spec.weight
        and not earlier.scheme.keeps_float_weight
    )
    return earlier.tensors if same else None
