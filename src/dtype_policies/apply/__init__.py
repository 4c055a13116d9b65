"""Dtype policies for any `torch.nn.Module`: `apply_policy` and `summary`."""

from dtype_policies.apply import joining as _joining  # noqa: F401 (registers its hook)
from dtype_policies.apply.apply import DEFAULT_FLOAT32_MODULES, PolicyHandle, apply_policy
from dtype_policies.apply.summary import ModuleSummary, model_totals, module_summaries, summary

__all__ = [
    "DEFAULT_FLOAT32_MODULES",
    "ModuleSummary",
    "PolicyHandle",
    "apply_policy",
    "model_totals",
    "module_summaries",
    "summary",
]
