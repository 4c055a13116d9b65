"""Validation of LossScaleOptimizer arguments and state, with Keras's
messages, and the float32 rounding Keras applies to the scale."""

from __future__ import annotations

import array
import math
import numbers
from typing import Any

# Keras's base-optimizer arguments, accepted only at these (default) values so
# that configs written for Keras's LossScaleOptimizer keep working.
_KERAS_BASE_ARGUMENTS = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}

_TORCH_HINTS = {
    "clipnorm": "call `unscale_()` and then `torch.nn.utils.clip_grad_norm_` before `step()`",
    "global_clipnorm": (
        "call `unscale_()` and then `torch.nn.utils.clip_grad_norm_` before `step()`"
    ),
    "clipvalue": "call `unscale_()` and then `torch.nn.utils.clip_grad_value_` before `step()`",
    "gradient_accumulation_steps": (
        "scale every micro-batch loss with `scale_loss`, call `backward()` on each, "
        "then `step()` once"
    ),
    "use_ema": "use `torch.optim.swa_utils.AveragedModel`",
    "ema_momentum": "use `torch.optim.swa_utils.AveragedModel`",
    "ema_overwrite_frequency": "use `torch.optim.swa_utils.AveragedModel`",
}


def to_float32(value: float) -> float:
    """`value` rounded to float32 (overflowing to inf, underflowing to 0), as a
    Python float: Keras keeps the scale in a float32 variable."""
    return array.array("f", (value,))[0]


def check_kwargs(kwargs: dict[str, Any]) -> None:
    if not kwargs.pop("dynamic", True):  # any false value, as Keras reads it
        raise ValueError(
            "LossScaleOptimizer no longer supports `dynamic=False`. Instead, simply set "
            "`loss_scale_factor` directly on the `inner_optimizer`."
        )
    for arg, default in _KERAS_BASE_ARGUMENTS.items():
        if arg not in kwargs:
            continue
        value = kwargs.pop(arg)
        if value is not default and value != default:
            hint = _TORCH_HINTS.get(arg)
            raise ValueError(
                f"LossScaleOptimizer does not support `{arg}`. Instead, set `{arg}` on the "
                "`inner_optimizer`." + (f" With torch optimizers, {hint}." if hint else "")
            )
    if kwargs:
        names = ", ".join(f"`{arg}`" for arg in kwargs)
        raise ValueError(f"LossScaleOptimizer does not support arguments: {names}.")


def check_scale(value: Any, arg: str) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(
            f"`{arg}` must be a finite positive number. Received: {arg}={value!r} "
            f"(of type {type(value).__name__})"
        )
    scale = to_float32(_as_float(value))
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(
            f"`{arg}` must be a finite positive number representable in float32 "
            f"(about 1.4e-45 to 3.4e38). Received: {arg}={value!r}"
        )
    return scale


def check_loss_scale_state(loss_scale: Any) -> tuple[float, int, int, int]:
    expected = {"scale", "step_counter", "iterations", "dynamic_growth_steps"}
    if not isinstance(loss_scale, dict) or set(loss_scale) != expected:
        raise ValueError(
            "The 'loss_scale' entry of a LossScaleOptimizer state dict must be a dict "
            f"with the keys {sorted(expected)}. Received: {loss_scale!r}"
        )
    value = loss_scale["scale"]
    # 0 and inf are states a run reaches (about 165 skipped steps; growth)
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not _as_float(value) >= 0:
        raise ValueError(
            f"loss_scale['scale'] must be a number >= 0 (inf included). Received: {value!r}"
        )
    scale = to_float32(_as_float(value))
    counts = []
    for key, minimum in (("step_counter", 0), ("iterations", 0), ("dynamic_growth_steps", 1)):
        value = loss_scale[key]
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
            raise ValueError(
                f"loss_scale[{key!r}] must be an int >= {minimum}. Received: {value!r}"
            )
        counts.append(int(value))
    if counts[0] >= counts[2]:
        raise ValueError(
            f"loss_scale['step_counter'] must be below loss_scale['dynamic_growth_steps']. "
            f"Received: {loss_scale!r}"
        )
    return scale, counts[0], counts[1], counts[2]


def _as_float(value: Any) -> float:
    """`float(value)`; an int too large for a float counts as inf (out of
    float32's range like any other value beyond it)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf
