"""`WeightCopy`: what reading the weight of a quantized module that holds no
float weight gives (int8, int4 and the calibrated modes that store them:
`module.weight` of a torch module, dequantized; `layer.kernel` of a `Dense`,
the integer values). It is computed from the stored tensors at each read and
the forward never reads it, so a write to it would change nothing the model
computes: its writes raise `TypeError`, before anything is written. A read
that is a view of a stored tensor (an int8 `Dense`'s `kernel`, as Keras's
int8 variable) takes in-place writes, which the forward sees; only
rebinding it (`t.data = ...`, `set_`) raises.

A write is an op that writes its first argument (torch's in-place
convention, a name ending in `_`: `zero_`, `copy_`, `add_`, `normal_` and
`torch.nn.init`'s, `_foreach_*_` over a list holding it), item assignment,
`t.data = ...`, or `out=` naming it. Its aliases (`.data`, `detach()`, views
and the rows iteration gives) are `WeightCopy`s too; every other result is a
plain tensor, so the type spreads no further than the copy itself. Pickled
and deep-copied, it is a plain tensor. `nn.Parameter(copy)` is the caller's
own float weight: its writes go through.

>>> import torch
>>> from dtype_policies import quantize
>>> linear = torch.nn.Linear(4, 2)
>>> _ = quantize(linear, "int8")
>>> type(linear.weight * 2) is torch.Tensor
True
>>> with torch.no_grad():
...     linear.weight.zero_()
Traceback (most recent call last):
...
TypeError: Cannot write to the weight of the int8-quantized Linear: 'zero_' ...
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtype_policies._compat import compiling
from dtype_policies.quantization.weight_guard import describe

_IN_PLACE_OPERATORS = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul")
_IN_PLACE_BITWISE = ("and", "or", "xor", "lshift", "rshift")
_WRITING_DUNDERS = frozenset(f"__i{op}__" for op in (*_IN_PLACE_OPERATORS, *_IN_PLACE_BITWISE)) | {
    "__setitem__"
}
_WRITTEN_ATTRIBUTES = frozenset({"data", "real", "imag"})  # `t.<name> = ...` writes its values
LOADED_FLAG = "_is_hf_initialized"
"""transformers' mark on the tensors `from_pretrained` loaded, which its
weight initialization (`init.normal_(module.weight)`, also from a parent's
`_init_weights`) leaves alone: a weight made from loaded tensors is loaded."""
_BASE = frozenset({torch.Tensor._base.__get__})  # type: ignore[union-attr]  # equal, not identical
COPY_FLAGS = frozenset({"requires_grad_", "retain_grad", "share_memory_", "record_stream"})
"""Ops whose schemas write their tensor but which change only the copy's own
autograd flags or where its memory lives: they stay allowed
(`nn.Parameter(copy)` calls `requires_grad_`)."""


@dataclass(frozen=True)
class CopyOf:
    """What a `WeightCopy` was read from, for its error (strings only: a
    copy kept alive keeps no module or kernel layout alive)."""

    module: str  # "Linear 'encoder/layers/0/linear1'"
    mode: str
    attribute: str  # what was read: "weight", "kernel"
    stored: tuple[str, ...]  # the stored tensors the forward reads
    reads: str  # what a read gives: "dequantized from", "the integer values of"
    view: bool = False  # a view of a stored tensor: writes through it reach the forward


class WeightCopy(torch.Tensor):
    """A quantized module's weight as read, computed from its stored tensors;
    writes raise `TypeError` (see the module docstring)."""

    _dp_copy_of: CopyOf

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        written = written_copy(func, args, kwargs)
        if written is not None and (not written._dp_copy_of.view or rebinds(func)):
            raise TypeError(refusal(written._dp_copy_of, _op_name(func)))
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        source = args[0] if args and type(args[0]) is cls else None
        if source is None or source.__dict__.get("_is_param") or func in _BASE:
            return result  # `_base` plain: guarded, each alias's base would be another alias
        return _aliases_guarded(result, source)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        plain: Any = self.as_subclass(torch.Tensor)
        return plain.__repr__(tensor_contents=tensor_contents)

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self.__dict__.get("_is_param"):
            return super().__reduce_ex__(protocol)
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        if self.__dict__.get("_is_param"):
            return super().__deepcopy__(memo)
        return copy.deepcopy(self.as_subclass(torch.Tensor), memo)


def guarded_copy(tensor: torch.Tensor, copy_of: CopyOf) -> torch.Tensor:
    """`tensor` (a copy read from a quantized module's stored tensors) as a
    `WeightCopy` whose writes raise; it shares `tensor`'s memory and graph."""
    if compiling():
        return tensor  # a compiled forward reads it; compilers do not trace the subclass
    guarded = tensor.as_subclass(WeightCopy)
    guarded._dp_copy_of = copy_of
    return guarded


def writes_first_argument(func: Any) -> bool:
    """Whether `func`, as `__torch_function__` receives it, writes the values
    of its first argument (tensor or sequence of tensors)."""
    name = getattr(func, "__name__", "")
    if name == "__set__":
        return getattr(getattr(func, "__self__", None), "__name__", None) in _WRITTEN_ATTRIBUTES
    if name in _WRITING_DUNDERS:
        return True
    return name.endswith("_") and not name.endswith("__") and name not in COPY_FLAGS


def rebinds(func: Any) -> bool:
    """Whether `func` points its first argument at other memory (`t.data =
    ...`, `set_`) instead of writing the memory it has."""
    name = getattr(func, "__name__", "")
    if name == "__set__":
        return getattr(getattr(func, "__self__", None), "__name__", None) == "data"
    return name == "set_"


def written_copy(func: Any, args: Sequence[Any], kwargs: dict) -> WeightCopy | None:
    """The guarded `WeightCopy` `func(*args, **kwargs)` would write, if any."""
    out = kwargs.get("out")
    if out is not None:
        found = _guarded_in(out)
        if found is not None:
            return found
    if writes_first_argument(func):
        # `torch.nn.init`'s functions hand their tensor over by keyword
        first = args[0] if args else next(iter(kwargs.values()), None)
        return _guarded_in(first)
    return None


def _guarded_in(value: Any) -> WeightCopy | None:
    candidates = value if isinstance(value, (list, tuple)) else (value,)
    for candidate in candidates:
        if type(candidate) is WeightCopy and not candidate.__dict__.get("_is_param"):
            return candidate
    return None


def _aliases_guarded(result: Any, source: WeightCopy) -> Any:
    """`result` with the tensors in it that alias `source`'s memory as
    `WeightCopy`s of the same weight (a tensor, or a tuple or list of them)."""
    if isinstance(result, torch.Tensor):
        return _guard_alias(result, source)
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], torch.Tensor):
        return type(result)(
            _guard_alias(r, source) if isinstance(r, torch.Tensor) else r for r in result
        )
    return result


def _guard_alias(tensor: torch.Tensor, source: WeightCopy) -> torch.Tensor:
    if type(tensor) is not torch.Tensor or not _shares_memory(tensor, source):
        return tensor
    guarded = tensor.as_subclass(WeightCopy)
    guarded._dp_copy_of = source._dp_copy_of
    return guarded


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    with torch._C.DisableTorchFunctionSubclass():
        try:
            return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() != 0
        except (RuntimeError, NotImplementedError):  # no storage (functorch's wrappers)
            return False


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", repr(func))
    if name == "__set__":
        return f"setting .{getattr(func.__self__, '__name__', '?')}"
    return name


def refusal(copy_of: CopyOf, op: str) -> str:
    stored = ", ".join(f"'{name}'" for name in copy_of.stored)
    if copy_of.view:
        return (
            f"Cannot rebind the weight of the {copy_of.mode}-quantized {copy_of.module}: "
            f"'{op}' on its '{copy_of.attribute}' ({copy_of.reads} {stored}, a view) is "
            "refused, as it would point the view at other memory while the forward computes "
            "from the stored tensors. Nothing was changed. Write the values in place "
            f"(`{copy_of.attribute}.copy_(...)` under `torch.no_grad()`) or load them."
        )
    return (
        f"Cannot write to the weight of the {copy_of.mode}-quantized {copy_of.module}: "
        f"'{op}' on its '{copy_of.attribute}' ({copy_of.reads} {stored}, made at each read) "
        "is refused, as its forward computes from the stored tensors alone. Nothing was "
        "changed. To give it other weights, load them (`load_state_dict` with this mode's "
        f"tensors or a float '{copy_of.attribute}', which is quantized on loading); to change "
        "them in place (an EMA, surgery by hand), do so on the float model before quantize()."
    )


def read_weight(module: torch.nn.Module, qw: Any, tensor: torch.Tensor, reads: str) -> torch.Tensor:
    """`tensor`, read as the weight of the quantized `module` (`qw`, its
    `QuantizedWeight`) from its stored tensors, as a `WeightCopy`; `reads`
    says what it is of them ("dequantized from"). A `tensor` that is a view
    of a stored tensor (a `Dense`'s int8 `kernel`, Keras's int8 variable)
    takes writes, which reach what the forward reads; only pointing it at
    other memory (`.data = ...`) raises."""
    if compiling():
        return tensor  # a compiled forward reads it; compilers do not trace the subclass
    buffers = module.__dict__["_buffers"]
    stored = tuple(buffers[name] for name in qw.buffer_names if buffers.get(name) is not None)
    guarded = guarded_read(tensor, qw, describe(module, qw), reads, stored)
    if loaded_read(module, stored):
        setattr(guarded, LOADED_FLAG, True)
    return guarded


def guarded_read(
    tensor: torch.Tensor, qw: Any, module: str, reads: str, stored: Sequence[torch.Tensor]
) -> torch.Tensor:
    """`tensor` read from the `stored` tensors of `qw` (of the module
    `module` names) as a `WeightCopy`."""
    view = any(_shares_memory(tensor, buffer) for buffer in stored)
    copy_of = CopyOf(module, qw.mode, qw.weight_name, qw.buffer_names, reads, view)
    return guarded_copy(tensor, copy_of)


def loaded_read(module: torch.nn.Module, stored: Sequence[torch.Tensor]) -> bool:
    """Whether a read of `module`'s weight from its `stored` tensors is of
    loaded tensors: its stored tensors, or the module as a whole (a tied
    module's, shared with another's once loaded; ModernBERT's root
    initialized its tied decoder's weight)."""
    return bool(getattr(module, LOADED_FLAG, False)) or bool(
        stored and all(getattr(buffer, LOADED_FLAG, False) for buffer in stored)
    )
