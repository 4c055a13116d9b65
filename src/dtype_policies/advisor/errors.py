"""The end-to-end error of a model's outputs against the reference outputs.

By default the error is the relative Frobenius error over every floating
tensor the model returns on every batch, taken together:
`sqrt(sum ||y - y_ref||^2) / sqrt(sum ||y_ref||^2)`. For a Hugging Face
model called without labels that is the error of the logits (the cache is
not a tensor); with labels the loss counts too, and with
`output_hidden_states=True` the hidden states. A `metric` callable
`(outputs, reference_outputs) -> float` replaces it; with several batches its
values are averaged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Real
from typing import Any

import torch

from dtype_policies.advisor.batches import Batch, floating_tensors

Metric = Callable[[Any, Any], float]


def relative_error(outputs: Any, reference: Any) -> float:
    """The relative Frobenius error of `outputs` against `reference` (both
    possibly nested); `inf` when their floating tensors do not line up.

    >>> import torch
    >>> from dtype_policies.advisor import relative_error
    >>> relative_error(torch.tensor([3.0, 5.0]), torch.tensor([3.0, 4.0]))
    0.2
    >>> relative_error((torch.ones(2),), torch.ones(3))
    inf
    """
    diff, norm = _squared_norms(outputs, reference)
    return _ratio(diff, norm)


def _squared_norms(outputs: Any, reference: Any) -> tuple[float, float]:
    got = list(floating_tensors(outputs))
    want = list(floating_tensors(reference))
    if len(got) != len(want) or any(a.shape != b.shape for a, b in zip(got, want)):
        return math.inf, 1.0
    diff = norm = 0.0
    for a, b in zip(got, want):
        b64 = b.detach().to(torch.float64)
        diff += float((a.detach().to(torch.float64) - b64).square().sum())
        norm += float(b64.square().sum())
    return diff, norm


def _ratio(diff: float, norm: float) -> float:
    if not math.isfinite(diff):
        return math.inf
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return math.sqrt(diff / norm)


def _metric_value(metric: Metric, outputs: Any, reference: Any) -> float:
    """`metric(outputs, reference)` as a float: a number or a one-element
    tensor, not negative (NaN and inf are kept: the variant failed)."""
    value = metric(outputs, reference)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(
            "advise(): `metric` must return a number (a float or a one-element tensor); "
            f"it returned {value!r}"
        )
    if value < 0:
        raise ValueError(
            f"advise(): `metric` returned {value!r}: an error, 0 for outputs equal to the "
            "reference and larger for worse ones, is never negative"
        )
    return float(value)


class NoFloatingOutputs(ValueError):
    """The model's outputs hold no floating tensor to compare, and no
    `metric` replaces the relative error."""


class ErrorMeter:
    """Runs a model on the batches and measures its error against the
    reference outputs (computed once, from the model as given)."""

    def __init__(self, batches: list[Batch], references: list[Any], metric: Metric | None):
        self.batches = batches
        self.references = references
        self.metric = metric
        self.evaluations = 0
        if metric is None and next(floating_tensors(references), None) is None:
            raise NoFloatingOutputs(
                "advise(): the model's outputs hold no floating tensor to compare; pass "
                "`metric=` (a callable (outputs, reference_outputs) -> float)."
            )

    def __call__(self, model: torch.nn.Module) -> float:
        self.evaluations += 1
        with torch.inference_mode():
            if self.metric is not None:
                values = [
                    _metric_value(self.metric, batch(model), reference)
                    for batch, reference in zip(self.batches, self.references)
                ]
                value = sum(values) / len(values)
                return value if math.isfinite(value) else math.inf
            diff = norm = 0.0
            for batch, reference in zip(self.batches, self.references):
                d, n = _squared_norms(batch(model), reference)
                diff, norm = diff + d, norm + n
            return _ratio(diff, norm)
