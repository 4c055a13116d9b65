"""What the workloads share: optional libraries, a train step, an inference call."""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn as nn
import torch.nn.functional as F

os.environ.setdefault("KERAS_BACKEND", "torch")


def optional_module(module: str):
    try:
        return __import__(module, fromlist=["_"])
    except Exception:
        return None


def keras_module():
    keras = optional_module("keras")
    if keras is None or keras.backend.backend() != "torch":
        return None
    return keras


def train_step(model, x, target, optimizer, context=None) -> Callable[[], None]:
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with context() if context else contextlib.nullcontext():
            out = model(x)
        F.mse_loss(out.float(), target).backward()
        optimizer.step()

    return step


def inference_call(model, x) -> Callable[[], object]:
    def run():
        with torch.no_grad():
            return model(x)

    return run


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def policied_copy(
    base: ModuleT,
    policy: str,
    mode: str | None = None,
    config: object | None = None,
    **apply_options: Any,
) -> ModuleT:
    """A deep copy of `base` under `apply_policy(policy)`, then quantized to
    `mode` (with `config`) when one is given."""
    from dtype_policies import apply_policy, quantize

    model = copy.deepcopy(base)
    apply_policy(model, policy, **apply_options)
    if mode is not None:
        quantize(model, mode, config)
    return model


def torchao_int8(model: nn.Module) -> nn.Module | None:
    torchao = optional_module("torchao.quantization")
    if torchao is None or not hasattr(torchao, "Int8DynamicActivationInt8WeightConfig"):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torchao.quantize_(model, torchao.Int8DynamicActivationInt8WeightConfig())
    return model
