"""`summary`: a per-module table of policies, dtypes, quantization, parameter
counts and bytes."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, cast

import torch

from dtype_policies._core.module_state import state_of
from dtype_policies._core.sharded import class_under_fsdp, is_sharded_tensor
from dtype_policies._core.tensor_identity import has_strides, sparse_parts
from dtype_policies._modes import mode_record
from dtype_policies._paths import named_module_paths, root_path_of
from dtype_policies.quantization.attach import quantization_of


@dataclass(frozen=True)
class ModuleSummary:
    """One row of `summary`: a module's own (not its children's) tensors.

    `parameters` counts the weights the module holds, a quantized weight's
    values included; `bytes` is what its parameters and buffers occupy.
    """

    path: str
    class_name: str
    policy: str
    compute_dtype: str
    variable_dtype: str
    quantization: str
    parameters: int
    bytes: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


COLUMNS = (
    ("path", "path"),
    ("class", "class_name"),
    ("policy", "policy"),
    ("compute", "compute_dtype"),
    ("variable", "variable_dtype"),
    ("quantization", "quantization"),
    ("params", "parameters"),
    ("bytes", "bytes"),
)


def _dtype_names(tensors: list[torch.Tensor]) -> str:
    names = sorted({str(t.dtype).removeprefix("torch.") for t in tensors})
    return ",".join(names) if names else "-"


def quantization_label(module: torch.nn.Module) -> str:
    """`"int8"`, `"int8 weight-only"`, `"int4/128"`, `"float8"`, or `"-"`."""
    quantized = quantization_of(module)
    return "-" if quantized is None else label_of(quantized.mode, quantized.config)


def label_of(mode: str, config: Any) -> str:
    """The quantization column's text for `mode` with its `config` (its record's label)."""
    return mode_record(mode).label_of(config)


def module_summaries(model: torch.nn.Module) -> list[ModuleSummary]:
    """The rows of `summary(model)`, one per module, depth first."""
    rows = []
    for path, module in named_module_paths(model, root_path_of(model)):
        own: list[torch.Tensor] = [p for p in module._parameters.values() if p is not None]
        buffers = [b for b in module._buffers.values() if b is not None]
        quantized = quantization_of(module)
        parameters = sum(p.numel() for p in own)
        stored: list[torch.Tensor] = []
        if quantized is not None:
            # (a quantized module's stored tensors are present)
            stored = [
                cast(torch.Tensor, module._buffers[n]) for n in sorted(quantized.stored_names)
            ]
            if not quantized.scheme.keeps_float_weight:
                parameters += int(torch.Size(quantized.spec.float_shape).numel())
                stored = [_integer_data(module, quantized)]  # (scales are bookkeeping)
        state = getattr(state_of(module), "call", None)
        if state is not None:
            policy, compute = state.policy.name, state.policy.compute_dtype
        else:
            policy, compute = "-", _dtype_names(own)
        rows.append(
            ModuleSummary(
                path=path or "(root)",
                class_name=class_under_fsdp(type(module)).__name__,
                policy=policy,
                compute_dtype=compute,
                variable_dtype=_dtype_names(own + stored),
                quantization=quantization_label(module),
                parameters=parameters,
                bytes=sum(_stored_bytes(t) for t in own + buffers),
            )
        )
    return rows


def render_table(header: tuple[str, ...], rows: list[tuple[str, ...]], numeric: int) -> str:
    """A plain-text table; the last `numeric` columns are right-aligned."""
    table = [header, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    first_numeric = len(header) - numeric
    lines = []
    for row in table:
        cells = [
            cell.rjust(width) if i >= first_numeric else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def summary(model: torch.nn.Module) -> str:
    """A table of every module's path, class, policy, compute and variable
    dtypes, quantization, own parameter count and own bytes.

    >>> import torch
    >>> import dtype_policies
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> _ = dtype_policies.apply_policy(model, "mixed_bfloat16")
    >>> print(dtype_policies.summary(model))  # doctest: +NORMALIZE_WHITESPACE
    path    class       policy          compute   variable  quantization  params  bytes
    (root)  Sequential  mixed_bfloat16  bfloat16  -         -                  0      0
    0       Linear      mixed_bfloat16  bfloat16  float32   -                 20     80
    1       LayerNorm   float32         float32   float32   -                  8     32
    Total: 28 parameters, 112 bytes
    """
    rows = module_summaries(model)
    cells = [tuple(str(getattr(r, field)) for _, field in COLUMNS) for r in rows]
    text = render_table(tuple(name for name, _ in COLUMNS), cells, numeric=2)
    total_params, total_bytes = model_totals(model)
    return f"{text}\nTotal: {total_params:,} parameters, {total_bytes:,} bytes"


def model_totals(model: torch.nn.Module) -> tuple[int, int]:
    """The model's parameter count and bytes, each tensor once: a table
    shared by an embedding and its tied head is one table (the rows of
    `module_summaries` show it in both modules)."""
    counted: set[int] = set()  # ids of the tensors whose parameters are counted
    stored: set[tuple] = set()  # the tensors whose bytes are counted, by storage
    parameters = size = 0
    for module in model.modules():
        own: list[torch.Tensor] = [p for p in module._parameters.values() if p is not None]
        buffers = [b for b in module._buffers.values() if b is not None]
        quantized = quantization_of(module)
        if quantized is not None and not quantized.scheme.keeps_float_weight:
            data = _integer_data(module, quantized)
            if id(data) not in counted:
                counted.add(id(data))
                parameters += int(torch.Size(quantized.spec.float_shape).numel())
        for tensor in own:
            if id(tensor) not in counted:
                counted.add(id(tensor))
                parameters += tensor.numel()
        for tensor in own + buffers:
            key = _storage_key(tensor)
            if key not in stored:
                stored.add(key)
                size += _stored_bytes(tensor)
    return parameters, size


def _stored_bytes(tensor: torch.Tensor) -> int:
    """The bytes `tensor` holds: a sparse tensor its indices and values
    (its `numel` counts the dense shape)."""
    if tensor.layout is not torch.strided:
        return sum(_stored_bytes(part) for part in sparse_parts(tensor))
    if tensor.is_nested:
        return tensor.values().numel() * tensor.element_size()
    return tensor.numel() * tensor.element_size()


def _integer_data(module: torch.nn.Module, quantized: Any) -> Any:
    """The buffer holding a quantized weight's integer values."""
    return module._buffers[quantized.data_name]


def _storage_key(tensor: torch.Tensor) -> tuple:
    """What tells tensors sharing memory apart; a sharded DTensor (FSDP2's,
    counted at its full size), a meta tensor and a sparse or nested tensor
    have no storage to read."""
    if tensor.device.type == "meta" or is_sharded_tensor(tensor) or not has_strides(tensor):
        return (id(tensor),)
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tensor.numel(),
        tensor.dtype,
    )
