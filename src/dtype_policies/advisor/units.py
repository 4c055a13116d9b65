"""Which modules the advisor chooses a precision for (the "units"), and what
one forward pass on the first batch records about them: their inputs (for
timing), how often they are called, and which of them read the same input."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dtype_policies._core.module_rules import matches_any
from dtype_policies._core.module_state import state_of
from dtype_policies._core.slots import own_parameters
from dtype_policies._paths import named_module_paths, root_path_of
from dtype_policies.advisor.batches import Batch, floating_tensors
from dtype_policies.apply.apply import DEFAULT_FLOAT32_RULES
from dtype_policies.quantization.attach import quantization_of
from dtype_policies.quantization.experts import expert_routers
from dtype_policies.quantization.kinds import read_by_parent


@dataclass
class Unit:
    """A module that owns floating weights and may get a precision of its own.

    Attributes:
        path: Its `/`-joined path (the key of its policy map entry).
        module: The module in the advisor's working copy.
        calls: How many times one forward on the first batch calls it.
        args, kwargs: Its (cloned) arguments in its first call.
        output_dtype: The dtype of its first floating output.
        router: A mixture-of-experts block's router, which computes with a
            quantized policy's float source (`apply_policy` keeps it so).
    """

    path: str
    module: torch.nn.Module
    calls: int = 0
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    output_dtype: torch.dtype | None = None
    router: bool = False

    @property
    def class_name(self) -> str:
        return type(self.module).__name__


@dataclass
class Skipped:
    """A module with weights left as it is (no entry in the map), and why:
    float32, or the quantized policy it already computes by."""

    path: str
    class_name: str
    reason: str
    policy: str = "float32"


def _owns_float_weights(module: torch.nn.Module) -> bool:
    return any(p.is_floating_point() for p in own_parameters(module))


def find_units(model: torch.nn.Module) -> tuple[list[Unit], list[Skipped]]:
    """The modules with floating weights of their own that may change precision,
    and those that may not: normalization layers (float32 islands, as
    `apply_policy` keeps them), weights read directly by their parent,
    modules already quantized."""
    modules = dict(named_module_paths(model, root_path_of(model)))
    routers = expert_routers(modules.values())
    units, skipped = [], []
    for path, module in modules.items():
        if not _owns_float_weights(module) and quantization_of(module) is None:
            continue
        name = type(module).__name__
        if (quantized := quantization_of(module)) is not None:
            call = getattr(state_of(module), "call", None)
            policy = call.policy.name if call is not None else quantized.mode
            skipped.append(Skipped(path, name, "already quantized", policy))
        elif matches_any(path, module, DEFAULT_FLOAT32_RULES):
            skipped.append(Skipped(path, name, "normalization layer (float32 island)"))
        elif (reason := read_by_parent(path, module, modules)) is not None:
            skipped.append(Skipped(path, name, reason))
        else:
            units.append(Unit(path, module, router=id(module) in routers))
    return units, skipped


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    if isinstance(value, list):
        return [_clone(v) for v in value]
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def _first_floating(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
    return None


def record(model: torch.nn.Module, units: list[Unit], batch: Batch) -> tuple[Any, list[list[str]]]:
    """Runs `batch` once with hooks on the units: fills in each unit's calls,
    first arguments and output dtype. Returns the outputs and the lists of
    unit paths that received the very same input tensor object."""
    readers: dict[int, list[str]] = {}
    alive: list[torch.Tensor] = []  # keeps ids unique during the pass
    handles = []

    def pre_hook(unit: Unit):
        def hook(module, args, kwargs):
            unit.calls += 1
            first = _first_floating(args, kwargs)
            if unit.calls == 1:
                unit.args, unit.kwargs = _clone(args), _clone(kwargs)
            if first is not None:
                alive.append(first)
                paths = readers.setdefault(id(first), [])
                if unit.path not in paths:
                    paths.append(unit.path)

        return hook

    def post_hook(unit: Unit):
        def hook(module, args, output):
            if unit.output_dtype is None:
                first = next(floating_tensors(output), None)
                unit.output_dtype = first.dtype if first is not None else None

        return hook

    try:
        for unit in units:
            handles.append(unit.module.register_forward_pre_hook(pre_hook(unit), with_kwargs=True))
            handles.append(unit.module.register_forward_hook(post_hook(unit)))
        with torch.inference_mode():
            outputs = batch(model)
    finally:
        for handle in handles:
            handle.remove()
    shared = [paths for paths in readers.values() if len(paths) > 1]
    return outputs, shared
