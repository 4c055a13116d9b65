"""`DeferredWeight`: reading the weight of a quantized torch module without
computing it. What a read's layout says (`dtype`, `shape`, `device`,
`size()`, `dim()`, `numel()`, `stride()`, `requires_grad`, ...) it answers
from the stored tensors' shapes; at its first other use it computes the
dequantized weight (the `WeightCopy` an eager read gives, writes refused) from
the stored tensors as they were when it was read, and from then on stands for
it. Hugging Face models read a quantized child's `weight.dtype` or `.device`
on every call (T5's feed-forward, Mamba's head, Llama 4's embedding): those
reads no longer dequantize the whole weight.

A read holds the stored tensors it was read from (until its first use), so
`.to()`, `remove()` or a new quantization after it change nothing it gives.
`load_state_dict` into the module computes its outstanding reads before
writing. Any other in-place write to a stored tensor after a read and before
its first use makes that use raise `RuntimeError` (as torch's saved
tensors): read the weight again.

>>> import torch
>>> from dtype_policies import quantize
>>> linear = torch.nn.Linear(4, 2)
>>> _ = quantize(linear, "int8")
>>> read = linear.weight
>>> read.dtype, read.shape, read.device  # nothing dequantized yet
(torch.float32, torch.Size([2, 4]), device(type='cpu'))
>>> torch.equal(read, linear.weight)  # computed at its first use
True
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from dtype_policies.quantization.schemes.base import QuantizedWeight, StoredTensors
from dtype_policies.quantization.weight_copy import (
    LOADED_FLAG,
    WeightCopy,
    guarded_read,
    loaded_read,
    read_weight,
    refusal,
)
from dtype_policies.quantization.weight_guard import describe

_T = torch.Tensor
_LAYOUT = frozenset(
    {
        *(
            getattr(_T, name).__get__
            for name in (
                "dtype",
                "shape",
                "device",
                "ndim",
                "layout",
                "requires_grad",
                "is_leaf",
                "grad_fn",
                "is_cuda",
                "is_cpu",
                "is_meta",
                "is_sparse",
                "is_quantized",
                "is_mkldnn",
                "nbytes",
                "itemsize",
            )
        ),
        *(
            getattr(_T, name)
            for name in (
                "size",
                "dim",
                "ndimension",
                "numel",
                "nelement",
                "element_size",
                "stride",
                "is_contiguous",
                "is_floating_point",
                "is_complex",
                "is_signed",
                "get_device",
                "__len__",
                "__hash__",
            )
        ),
    }
)
"""What a pending read answers from its layout (none of them reads values)."""

READS = "dequantized from"
_COMPUTING = threading.Lock()
_LAYOUTS: weakref.WeakKeyDictionary[QuantizedWeight, dict[tuple, torch.Tensor | None]] = (
    weakref.WeakKeyDictionary()
)
_PENDING: weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakValueDictionary] = (
    weakref.WeakKeyDictionary()
)


class StaleRead(RuntimeError):
    """A deferred read whose stored tensors were written in place since."""


class _Read:
    """What a pending `DeferredWeight` computes its values from."""

    __slots__ = ("described", "dtype", "qw", "stored", "versions")

    def __init__(
        self, module: torch.nn.Module, qw: QuantizedWeight, stored: dict, dtype: torch.dtype
    ) -> None:
        self.qw = qw
        self.stored = stored
        self.versions = {name: _version(t) for name, t in stored.items()}
        self.dtype = dtype
        self.described = describe(module, qw)  # for errors: no module kept alive


class DeferredWeight(WeightCopy):
    """A quantized module's weight as read, computed at its first use other
    than its layout (see the module docstring)."""

    _dp_read: _Read | None
    _dp_values: WeightCopy | None

    @staticmethod
    def __new__(cls, like: torch.Tensor, device: torch.device) -> DeferredWeight:
        shell = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            like.shape,
            strides=like.stride(),
            storage_offset=like.storage_offset(),
            dtype=like.dtype,
            device=device,
            requires_grad=False,
        )
        shell._dp_read = None
        shell._dp_values = None
        return shell

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    @classmethod
    @torch._disable_dynamo  # a read handed to a compiled function: run, not traced
    def __torch_function__(
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func in _LAYOUT and type(first) is cls and first._dp_values is None:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = tree_map_only(cls, _values_of, (tuple(args), kwargs))
        result = func(*args, **kwargs)
        if type(first) is cls:
            if result is first._dp_values:  # in place, or `float()` of float32: itself
                return first
            if func is _T.detach and type(result) is WeightCopy:
                return _standing_for(result)  # `nn.Parameter(read)` needs its own type
        return result

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict | None = None
    ) -> Any:
        """The ops that skip `__torch_function__` (`as_subclass`,
        `torch.tensor(read)`, ...), on the values."""
        kwargs = kwargs or {}
        for index, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            target = args[index] if index < len(args) else kwargs.get(argument.name)
            if type(target) is cls and not target._takes_writes():
                values = _values_of(target)
                raise TypeError(refusal(values._dp_copy_of, func.__name__))
        plain_args, plain_kwargs = tree_map_only(cls, _plain_values, (tuple(args), kwargs))
        return func(*plain_args, **plain_kwargs)

    def _takes_writes(self) -> bool:
        values = _values_of(self)
        return bool(self.__dict__.get("_is_param") or values._dp_copy_of.view)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return _values_of(self).__repr__(tensor_contents=tensor_contents)  # type: ignore[call-arg]

    def __reduce_ex__(self, protocol: Any) -> Any:
        return _values_of(self).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        return _values_of(self).__deepcopy__(memo)


def _standing_for(values: WeightCopy) -> DeferredWeight:
    """A `DeferredWeight` whose values are `values` already."""
    shell = DeferredWeight(values, values.device)
    shell._dp_values = values
    return shell


def _plain_values(shell: DeferredWeight) -> torch.Tensor:
    return _values_of(shell).as_subclass(torch.Tensor)


def _values_of(shell: DeferredWeight) -> WeightCopy:
    """`shell`'s values, computed at the first call."""
    values = shell._dp_values
    if values is None:
        read = shell._dp_read
        assert read is not None
        computed = _compute(read, shell)
        with _COMPUTING:  # one value for every thread
            if shell._dp_values is None:
                shell._dp_values, shell._dp_read = computed, None
            values = shell._dp_values
    if shell.__dict__.get("_is_param") and not values.__dict__.get("_is_param"):
        values._is_param = True  # type: ignore[attr-defined]  # `nn.Parameter(read)`: the caller's
    return values


def _compute(read: _Read, shell: DeferredWeight) -> WeightCopy:
    qw = read.qw
    for name, tensor in read.stored.items():
        if read.versions[name] is not None and _version(tensor) != read.versions[name]:
            raise StaleRead(
                f"The weight of the {qw.mode}-quantized {read.described} was read before its "
                f"stored tensor '{name}' was written in place, and not used until after: its "
                "values at the read are gone. Read the weight again for the values it has now."
            )
    with torch.no_grad():
        stand_in: Any = StoredTensors(read.stored)
        weight = qw.spec.from_nk(qw.scheme.dequantize(stand_in, qw))
        weight = weight.to(read.dtype)
    values = guarded_read(weight, qw, read.described, READS, tuple(read.stored.values()))
    told = (shell.shape, shell.stride(), shell.dtype, shell.device)
    computed = (values.shape, values.stride(), values.dtype, values.device)
    if told != computed:
        raise RuntimeError(
            f"A read of a {qw.mode}-quantized weight told its layout {told} and computed "
            f"{computed}: a defect of dtype-policies, please report it."
        )
    if getattr(shell, LOADED_FLAG, False):
        setattr(values, LOADED_FLAG, True)
    return values  # type: ignore[return-value]


def _version(tensor: torch.Tensor) -> int | None:
    return None if tensor.is_inference() else tensor._version


def deferred(module: torch.nn.Module, qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight of the quantized `module` read in `dtype`: a pending
    `DeferredWeight`, or the dequantized weight at once where the read must
    be computed now (under a compiler, a mode, a graph through the stored
    tensors, stored tensors of another type)."""
    buffers = module.__dict__["_buffers"]
    stored = {name: buffers[name] for name in qw.buffer_names if buffers.get(name) is not None}
    like = None if not _can_defer(stored) else _layout(qw, stored, dtype)
    if like is None:
        weight = qw.spec.from_nk(qw.scheme.dequantize(module, qw)).to(dtype)
        return read_weight(module, qw, weight, READS)
    shell = DeferredWeight(like, next(iter(stored.values())).device)
    shell._dp_read = _Read(module, qw, stored, dtype)
    if loaded_read(module, tuple(stored.values())):
        setattr(shell, LOADED_FLAG, True)
    _PENDING.setdefault(module, weakref.WeakValueDictionary())[id(shell)] = shell
    return shell


def compute_pending_reads(module: torch.nn.Module) -> None:
    """Computes the reads of `module`'s weight not used yet (before its
    stored tensors are written in place: `load_state_dict`)."""
    pending = _PENDING.pop(module, None)
    for shell in list(pending.values()) if pending else ():
        with contextlib.suppress(StaleRead):  # raises at its use, as it would have
            _values_of(shell)


def _can_defer(stored: dict[str, torch.Tensor]) -> bool:
    if not stored or torch.compiler.is_compiling():
        return False
    if torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
        return False
    grad = torch.is_grad_enabled()
    return all(
        type(t) is torch.Tensor
        and t.layout is torch.strided
        and t.device.type in ("cpu", "cuda")
        and not (grad and t.requires_grad)
        and not torch._C._functorch.is_functorch_wrapped_tensor(t)
        for t in stored.values()
    )


def _layout(qw: QuantizedWeight, stored: dict, dtype: torch.dtype) -> torch.Tensor | None:
    """A meta tensor laid out as the read's values (None: the read cannot
    tell without computing), cached per layout of the stored tensors."""
    key = (dtype, *((n, t.shape, t.stride(), t.dtype, t.device) for n, t in stored.items()))
    layouts = _LAYOUTS.get(qw)
    if layouts is None:
        layouts = _LAYOUTS.setdefault(qw, {})
    if key in layouts:
        return layouts[key]
    meta = {
        n: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        for n, t in stored.items()
    }
    try:
        with torch.no_grad():
            stand_in: Any = StoredTensors(meta)
            like = qw.spec.from_nk(qw.scheme.dequantize(stand_in, qw)).to(dtype)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        like = None  # data-dependent: computed at each read, as before
    if like is not None and not like.is_meta:
        like = None
    layouts[key] = like
    return like
