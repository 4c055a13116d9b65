"""Refuses changes to a quantized module's weight that its forward would not see.

A quantized module computes from its stored tensors (`weight_int8`,
`weight_scale`, ...); int8 and int4 hold no float weight (`module.weight`
reads a dequantized copy), float8 keeps its float weight as a parameter and
reads it in each call. Assigning, deleting, registering or pruning the weight
would leave a model computing with the old weights (a float weight that the
forward never reads) or crash later inside the forward, so the module's
attribute writes (`__setattr__`, `__delattr__`, `register_parameter`,
`register_buffer`: every route torch's utilities take) go through
`refuse_weight_change` first, and raise `TypeError` before anything changed.

The library's own writes (quantizing, loading, removing float8) touch the
module's `_parameters` and `_buffers` directly; a state-dict load with
`assign=True` assigns the stored tensors and float8's float weight, which
stay allowed. In-place writes to the weight as read (`weight.copy_(t)`,
`weight.data = t`) are refused by the copy itself (`weight_copy`).
"""

from __future__ import annotations

from typing import Any

import torch

from dtype_policies._core.compose import ModuleMixin, original_class
from dtype_policies._core.module_state import quantization_of

REMOVED = object()
"""The value `refuse_weight_change` is given for a deletion."""


class QuantizedWeightGuard(ModuleMixin):
    """The attribute writes of a module that may be quantized, each checked
    by `refuse_weight_change` before torch's."""

    def __setattr__(self, name: str, value: Any) -> None:
        refuse_weight_change(self, name, value)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        refuse_weight_change(self, name, REMOVED)
        super().__delattr__(name)

    def register_parameter(self, name: str, param: Any) -> None:
        refuse_weight_change(self, name, param)
        super().register_parameter(name, param)

    def register_buffer(self, name: str, tensor: Any, persistent: bool = True) -> None:
        refuse_weight_change(self, name, tensor, as_buffer=True)
        super().register_buffer(name, tensor, persistent)


def refuse_weight_change(
    module: torch.nn.Module, name: str, value: Any, *, as_buffer: bool = False
) -> None:
    """Raises `TypeError` when writing `value` to attribute `name` of
    `module` (`REMOVED`: deleting it; `as_buffer`: registering a buffer)
    would change a quantized weight behind its forward's back."""
    qw = quantization_of(module)
    if qw is None:
        return
    weight = qw.weight_name
    if name != weight:
        current = module.__dict__["_parameters"].get(weight)
        if current is not None and value is current:
            _refuse(module, qw, f"moving the float '{weight}' to '{name}' (as pruning does)")
        if not qw.scheme.keeps_float_weight and _plain_tensor_parameter(module, name, value):
            action = f"registering '{name}' from the dequantized '{weight}' (as pruning does)"
            _refuse(module, qw, action)
        return
    if value is REMOVED:
        _refuse(module, qw, f"deleting '{weight}'")
    if as_buffer:
        _refuse(module, qw, f"registering a buffer '{weight}'")
    if qw.scheme.keeps_float_weight:
        if value is None or not isinstance(value, torch.nn.Parameter):
            _refuse(module, qw, f"setting '{weight}' to a {type(value).__name__}")
        return  # float8 reads its float weight in every call: a new one is used
    _refuse(module, qw, f"setting '{weight}'")


def _plain_tensor_parameter(module: torch.nn.Module, name: str, value: Any) -> bool:
    """Whether `value` is a tensor that is not a parameter going in as the
    parameter `name`: the dequantized weight `torch.nn.utils.prune` reads and
    registers as `<weight>_orig` (torch refuses it with a message about the
    type alone)."""
    return (
        isinstance(value, torch.Tensor)
        and not isinstance(value, torch.nn.Parameter)
        and name not in module.__dict__["_buffers"]
        and name.endswith("_orig")
    )


def _refuse(module: torch.nn.Module, qw: Any, action: str) -> None:
    weight = qw.weight_name
    stored = ", ".join(f"'{n}'" for n in sorted(qw.stored_names))
    if qw.scheme.keeps_float_weight:
        reads = f"computes from its float '{weight}' parameter and {qw.mode} state ({stored})"
    else:
        reads = f"holds no float '{weight}': its forward computes from {stored} alone"
    raise TypeError(
        f"Cannot change the weight of the {qw.mode}-quantized {describe(module, qw)}: {action} "
        f"is refused, as this module {reads}. Nothing was changed. To give it other "
        f"weights, load them (`load_state_dict` with this mode's tensors or a float "
        f"'{weight}', which is quantized on loading); to prune or reparametrize it, do so "
        "on the float model before quantize()."
    )


def describe(module: torch.nn.Module, qw: Any) -> str:
    """The module's kind and its name (a layer's) or path (in the model
    `quantize()` was given), for errors: "Linear 'encoder/layers/0/linear1'"."""
    name = module.__dict__.get("_name") or module.__dict__.get("name") or qw.path
    kind = original_class(module).__name__
    return f"{kind} '{name}'" if isinstance(name, str) and name else kind
