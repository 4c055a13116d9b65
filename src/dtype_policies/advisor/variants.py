"""A unit under one candidate: a deep copy of just that module with the
candidate applied (and quantized), never the model's own module."""

from __future__ import annotations

import copy
import warnings

import torch

from dtype_policies.advisor.candidates import Candidate
from dtype_policies.apply import apply_policy, module_summaries
from dtype_policies.policies import DTypePolicyMap
from dtype_policies.quantization import attach
from dtype_policies.quantization.kinds import kind_of


def build_variant(module: torch.nn.Module, candidate: Candidate) -> torch.nn.Module | str:
    """A copy of `module` computing by `candidate` (its children, if any, in
    float32), or the reason it cannot take the candidate."""
    mode = candidate.mode
    if mode is not None:
        kind = kind_of(module)
        if kind is None:
            return f"{type(module).__name__} cannot be quantized"
        if mode not in kind.modes:
            return f"{type(module).__name__} supports {', '.join(kind.modes)}, not {mode}"
    variant = copy.deepcopy(module).eval()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            apply_policy(variant, DTypePolicyMap("float32", {"": candidate.policy}))
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as e:
        return f"{candidate.label}: {e}"
    if mode is not None:
        quantized = attach.quantization_of(variant)
        if quantized is None or quantized.config != candidate.policy.quantization_config:
            return f"{candidate.label}: {_why_not_quantized(module, candidate)}"
    return variant


def _why_not_quantized(module: torch.nn.Module, candidate: Candidate) -> str:
    try:
        attach.plan(
            module,
            candidate.policy.quantization_config,
            type_check=False,
            source=candidate.policy.source_policy,
        )
    except (NotImplementedError, ValueError) as e:
        return str(e)
    return "not quantized by apply_policy"


def stored_bytes(variant: torch.nn.Module) -> int:
    """The bytes of the module's own parameters and buffers (as `summary`
    counts them: int8/int4 data and scales, float weights)."""
    return module_summaries(variant)[0].bytes


def model_bytes(model: torch.nn.Module) -> int:
    """The bytes of a whole model's state dict, tensors shared by several
    entries (tied weights) counted once."""
    seen, total = set(), 0
    for tensor in model.state_dict().values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.nbytes)
        if key not in seen:
            seen.add(key)
            total += tensor.nbytes
    return total
