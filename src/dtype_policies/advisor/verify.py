"""Verification and back-off: the map after k steps is applied (with
`apply_policy`, quantizing as it says) to a fresh deep copy of the model and
its end-to-end error measured; from the predicted prefix, steps are undone
one at a time (the last one taken saves the least per unit of error) until
the measured error is within the budget. With no step left the map is
float32 everywhere: the model as given."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dtype_policies.advisor.variants import apply_advised
from dtype_policies.policies import DTypePolicyMap


@dataclass(frozen=True)
class Check:
    """One verification: the number of steps taken and the measured error."""

    steps: int
    error: float


def prepared(
    model: torch.nn.Module, policy_map: DTypePolicyMap, inputs: dict[str, tuple] | None = None
) -> torch.nn.Module:
    """A deep copy of `model` (eval mode) with `policy_map` applied (gptq/awq
    entries calibrated on the modules' recorded `inputs`)."""
    candidate = copy.deepcopy(model).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        apply_advised(candidate, policy_map, inputs or {})
    return candidate


def back_off(
    start: int,
    budget: float,
    evaluate: Callable[[int], float],
    report: Callable[[Check], None] | None = None,
) -> tuple[int, float, list[Check]]:
    """The largest k <= start whose measured error is within the budget, its
    error, and every check made. k = 0 is returned even if it is not within
    the budget (nothing is left to undo)."""
    checks = []
    for k in range(start, -1, -1):
        error = evaluate(k)
        checks.append(Check(k, error))
        if report is not None:
            report(checks[-1])
        if error <= budget:
            return k, error, checks
    return 0, checks[-1].error, checks
