"""`summary`: a per-module table of policies, dtypes, parameter counts and bytes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtype_policies._paths import named_module_paths, root_path_of


@dataclass(frozen=True)
class ModuleSummary:
    """One row of `summary`: a module's own (not its children's) parameters."""

    path: str
    class_name: str
    policy: str
    compute_dtype: str
    variable_dtype: str
    parameters: int
    bytes: int


def _dtype_names(tensors: list[torch.Tensor]) -> str:
    names = sorted({str(t.dtype).removeprefix("torch.") for t in tensors})
    return ",".join(names) if names else "-"


def module_summaries(model: torch.nn.Module) -> list[ModuleSummary]:
    """The rows of `summary(model)`, one per module, depth first."""
    root_path = root_path_of(model)
    rows = []
    for path, module in named_module_paths(model, root_path):
        own = [p for p in module._parameters.values() if p is not None]
        buffers = [b for b in module._buffers.values() if b is not None]
        state = module.__dict__.get("_dp_state")
        if state is not None:
            resolved = state.policy
            policy, compute = resolved.name, resolved.compute_dtype
        else:
            policy, compute = "-", _dtype_names(own)
        rows.append(
            ModuleSummary(
                path=path or "(root)",
                class_name=type(module).__name__,
                policy=policy,
                compute_dtype=compute,
                variable_dtype=_dtype_names(own),
                parameters=sum(p.numel() for p in own),
                bytes=sum(t.numel() * t.element_size() for t in own + buffers),
            )
        )
    return rows


def summary(model: torch.nn.Module) -> str:
    """A table of every module's path, class, policy, compute and variable
    dtypes, own parameter count and own parameter-and-buffer bytes.

    >>> import torch
    >>> import dtype_policies
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> _ = dtype_policies.apply_policy(model, "mixed_bfloat16")
    >>> print(dtype_policies.summary(model))  # doctest: +NORMALIZE_WHITESPACE
    path    class      policy          compute   variable  params  bytes
    (root)  Sequential mixed_bfloat16  bfloat16  -              0      0
    0       Linear     mixed_bfloat16  bfloat16  float32       20     80
    1       LayerNorm  float32         float32   float32        8     32
    Total: 28 parameters, 112 bytes
    """
    rows = module_summaries(model)
    header = ("path", "class", "policy", "compute", "variable", "params", "bytes")
    table = [header] + [
        (
            r.path,
            r.class_name,
            r.policy,
            r.compute_dtype,
            r.variable_dtype,
            str(r.parameters),
            str(r.bytes),
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = []
    for row in table:
        cells = [
            cell.rjust(width) if i >= 5 else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    total_params = sum(r.parameters for r in rows)
    total_bytes = sum(r.bytes for r in rows)
    lines.append(f"Total: {total_params} parameters, {total_bytes} bytes")
    return "\n".join(lines)
