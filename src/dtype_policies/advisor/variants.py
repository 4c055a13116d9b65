"""A unit under one candidate: a deep copy of just that module with the
candidate applied (and quantized), never the model's own module."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch

from dtype_policies._modes import mode_record
from dtype_policies._paths import named_module_paths, root_path_of
from dtype_policies.advisor.candidates import Candidate
from dtype_policies.apply import PolicyHandle, apply_policy
from dtype_policies.policies import DTypePolicyMap
from dtype_policies.quantization import attach
from dtype_policies.quantization.api import quantize
from dtype_policies.quantization.experts import expanded, experts_layout
from dtype_policies.quantization.kinds import kind_of


def build_variant(
    module: torch.nn.Module,
    candidate: Candidate,
    inputs: tuple | None = None,
    router: bool = False,
) -> torch.nn.Module | str:
    """A copy of `module` computing by `candidate` (its children, if any, in
    float32), or the reason it cannot take the candidate. A calibrated mode
    (gptq, awq) calibrates on `inputs`, the module's recorded positional
    arguments. A mixture-of-experts module's experts are quantized one linear
    per expert; a `router` computes with a quantized candidate's float source,
    as `apply_policy` keeps it."""
    mode = candidate.mode
    policy: Any = candidate.policy  # quantized ones have a source_policy
    if mode is not None and router:
        mode, policy = None, policy.source_policy
    layout = None if mode is None else experts_layout(module)
    if mode is not None and layout is not None:
        if mode_record(mode).calibrated:
            return (
                f"{candidate.label}: experts calibrate on their block's routing; "
                "quantize(model, config=...) calibrates them"
            )
        if "linear" not in mode_record(mode).roles:
            return f"{type(module).__name__}'s experts cannot be quantized by {mode}"
    elif mode is not None and mode_record(mode).calibrated:
        return _calibrated_variant(module, candidate, inputs)
    elif mode is not None:
        kind = kind_of(module)
        if kind is None:
            return f"{type(module).__name__} cannot be quantized"
        if mode not in kind.modes:
            return f"{type(module).__name__} supports {', '.join(kind.modes)}, not {mode}"
    variant = copy.deepcopy(module).eval()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            apply_policy(variant, DTypePolicyMap("float32", {root_path_of(variant): policy}))
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as e:
        return f"{candidate.label}: {e}"
    if mode is not None and layout is not None:
        if not expanded(variant):
            return f"{candidate.label}: {type(module).__name__}'s experts were not quantized"
    elif mode is not None:
        quantized = attach.quantization_of(variant)
        if quantized is None or quantized.config != policy.quantization_config:
            return f"{candidate.label}: {_why_not_quantized(module, policy)}"
    return variant


def _calibrated_config(policy, first: torch.Tensor):
    """The policy's GPTQ/AWQ config with `first` (a module's recorded input) as data."""
    config = policy.quantization_config
    return type(config).from_config({**config.get_config(), "dataset": [first.detach().float()]})


def _first_input(inputs: tuple | None) -> torch.Tensor | None:
    first = next((a for a in inputs or () if isinstance(a, torch.Tensor)), None)
    return first if first is not None and first.is_floating_point() else None


def _is_calibrated(policy) -> bool:
    mode = policy.quantization_mode
    return mode is not None and mode_record(mode).calibrated


def apply_advised(
    model: torch.nn.Module,
    policy_map: DTypePolicyMap,
    inputs: dict[str, tuple],
    **kwargs: Any,
) -> PolicyHandle:
    """`apply_policy(model, policy_map)`, where each module under a gptq/awq
    entry is calibrated on its recorded inputs (`inputs[path]`), as the
    advisor measured it: all or nothing. Each calibration runs first, on a
    copy of its module under the entry's source policy (as the advisor
    measured); then the map is applied (gptq/awq entries rounded to nearest
    in their layout) and each copy's stored tensors are loaded in."""
    entries = policy_map.policy_map
    calibrated = {key for key, policy in entries.items() if _is_calibrated(policy)}
    if not calibrated and not _is_calibrated(policy_map.default_policy):
        return apply_policy(model, policy_map, **kwargs)
    results = []
    for path, module in named_module_paths(model, root_path_of(model)):
        key = policy_map.matching_key(path)
        if key not in calibrated:
            continue
        policy = entries[key]
        first = _first_input(inputs.get(path))
        if first is None:
            raise ValueError(
                f"advise(): no recorded input of '{path}' to calibrate {policy.name} on; "
                "nothing was changed."
            )
        copied = _calibrated_copy(module, policy, first)
        if isinstance(copied, str):
            raise ValueError(
                f"advice.apply(): cannot calibrate '{path}' ({type(module).__name__}) by "
                f"{policy.name} on the input the advisor recorded there (is this the model "
                f"that was advised?): {copied}; nothing was changed."
            )
        results.append((module, copied))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r".* without calibration data", UserWarning)
        handle = apply_policy(model, policy_map, **kwargs)
    for module, copied in results:
        module.load_state_dict(copied.state_dict())
    return handle


def _calibrated_variant(
    module: torch.nn.Module, candidate: Candidate, inputs: tuple | None
) -> torch.nn.Module | str:
    first = _first_input(inputs)
    if first is None:
        return f"{candidate.label}: no recorded floating-point input to calibrate on"
    variant = _calibrated_copy(module, candidate.policy, first)
    if isinstance(variant, str):
        return f"{candidate.label}: {variant}"
    return variant


def _calibrated_copy(
    module: torch.nn.Module, policy: Any, first: torch.Tensor
) -> torch.nn.Module | str:
    """A copy of `module` under `policy`'s source policy, calibrated by
    `policy` on `first`, or why it cannot be."""
    kind = kind_of(module)
    if kind is None or policy.quantization_mode not in kind.modes:
        return f"{type(module).__name__} cannot be quantized by {policy.quantization_mode}"
    config = _calibrated_config(policy, first)
    variant = copy.deepcopy(module).eval()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            source = policy.source_policy
            apply_policy(variant, DTypePolicyMap("float32", {root_path_of(variant): source}))
            quantize(variant, config=config, progress=False)
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as e:
        return str(e)
    if attach.quantization_of(variant) is None:
        return _why_not_quantized(module, policy)
    return variant


def _why_not_quantized(module: torch.nn.Module, policy: Any) -> str:
    try:
        attach.plan(
            module,
            policy.quantization_config,
            type_check=False,
            source=policy.source_policy,
        )
    except (NotImplementedError, ValueError) as e:
        return str(e)
    return "not quantized by apply_policy"


def stored_tensors(variant: torch.nn.Module) -> list[torch.Tensor]:
    """The module's own parameters and buffers (int8/int4 data and scales,
    float weights); of an expanded experts module, those of its experts'
    linears too."""
    modules = variant.modules() if expanded(variant) else (variant,)
    return [
        tensor
        for module in modules
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False))
    ]


def stored_bytes(variant: torch.nn.Module) -> int:
    """The bytes of `stored_tensors(variant)` (as `summary` counts them)."""
    return sum(tensor.nbytes for tensor in stored_tensors(variant))


def storage_key(tensor: torch.Tensor) -> tuple:
    """Equal for two tensors holding the same memory (tied weights)."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.nbytes)


def shared_tensors(modules: dict[str, torch.nn.Module]) -> dict[str, str]:
    """`{path: earlier path}` for each module holding a tensor that a module
    before it holds too (a head tied to an embedding)."""
    first: dict[tuple, str] = {}
    shared: dict[str, str] = {}
    for path, module in modules.items():
        for tensor in stored_tensors(module):
            earlier = first.setdefault(storage_key(tensor), path)
            if earlier != path:
                shared.setdefault(path, earlier)
    return shared


def group_bytes(
    modules: dict[str, torch.nn.Module],
    candidate: Candidate,
    inputs: dict[str, tuple],
    routers: set[str],
) -> dict[str, int]:
    """Per module, the bytes of its stored tensors that no module before it
    holds, with `candidate` applied to copies of them all together, as
    `Advice.apply` applies a map: a tied weight is counted once where
    `apply_policy` stores it once (each module's own copy, from
    `build_variant`, would count it in each). `routers` compute with a
    quantized candidate's float source; `inputs` calibrate gptq/awq."""
    copies = copy.deepcopy(list(modules.values()))  # one deep copy: ties kept
    holder = torch.nn.ModuleList(copies).eval()
    policy: Any = candidate.policy
    entries = {
        str(i): policy.source_policy if path in routers and candidate.mode else policy
        for i, path in enumerate(modules)
    }
    recorded = {str(i): inputs.get(path, ()) for i, path in enumerate(modules)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        apply_advised(holder, DTypePolicyMap("float32", entries), recorded)
    counted: set[tuple] = set()
    result = {}
    for path, module in zip(modules, copies):
        result[path] = 0
        for tensor in stored_tensors(module):
            if storage_key(tensor) not in counted:
                counted.add(storage_key(tensor))
                result[path] += tensor.nbytes
    return result


def model_bytes(model: torch.nn.Module) -> int:
    """The bytes of a whole model's state dict, tensors shared by several
    entries (tied weights) counted once."""
    seen, total = set(), 0
    for tensor in model.state_dict().values():
        key = storage_key(tensor)
        if key not in seen:
            seen.add(key)
            total += tensor.nbytes
    return total
