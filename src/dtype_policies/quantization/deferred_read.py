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
`.to()` or a new quantization after it change nothing it gives.
`load_state_dict` computes the outstanding reads of the stored tensors it
writes (a tied table's, read through either module, too). Any other
in-place write to a stored tensor after a read and before its first use
makes that use raise `RuntimeError` (as torch's saved tensors): read the
weight again. Stored tensors that are inference tensors keep no version, so
their reads are computed at once, as are small weights (fewer than
`DEFERRED_MIN_ELEMENTS`, for which computing costs less than deferring).

A read cannot become a parameter itself: `nn.Parameter(read)` raises
`TypeError` (`nn.Parameter(read.clone())` is a float weight of your own).

>>> import torch
>>> from dtype_policies import quantize
>>> linear = torch.nn.Linear(1024, 256)
>>> _ = quantize(linear, "int8")
>>> read = linear.weight
>>> read.dtype, read.shape, read.device  # nothing dequantized yet
(torch.float32, torch.Size([256, 1024]), device(type='cpu'))
>>> torch.equal(read, linear.weight)  # computed at its first use
True
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from dtype_policies._compat import compiling
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
_FIXED = frozenset(
    {
        *(
            getattr(_T, name).__get__
            for name in (
                "dtype",
                "shape",
                "device",
                "ndim",
                "layout",
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
            )
        ),
    }
)
"""What a read answers from its layout, which its values share."""
_FRESH = frozenset(getattr(_T, name).__get__ for name in ("requires_grad", "is_leaf", "grad_fn"))
"""What a read answers itself until computed; then its values answer
(`read.requires_grad_()` sets theirs)."""
_DETACH = frozenset({_T.detach})

DEFERRED_MIN_ELEMENTS = 1 << 18
"""Weights with fewer elements are dequantized at the read (well under a
millisecond: deferring saves little and costs some)."""

_COMPUTING = threading.Lock()
_LAYOUTS: weakref.WeakKeyDictionary[QuantizedWeight, dict[tuple, torch.Tensor | None]] = (
    weakref.WeakKeyDictionary()
)
READS = "dequantized from"


class StaleRead(RuntimeError):
    """A deferred read whose stored tensors were written in place since."""


class _Read:
    """What a pending read computes its values from, and then its values."""

    __slots__ = ("__weakref__", "described", "dtype", "qw", "stored", "values", "versions")

    def __init__(
        self, module: torch.nn.Module, qw: QuantizedWeight, stored: dict, dtype: torch.dtype
    ) -> None:
        self.qw: QuantizedWeight | None = qw
        self.stored: dict[str, torch.Tensor] = stored
        self.versions = {name: t._version for name, t in stored.items()}
        self.dtype = dtype
        self.described = describe(module, qw)  # for errors: no module kept alive
        self.values: WeightCopy | None = None

    @classmethod
    def computed(cls, values: WeightCopy, described: str) -> _Read:
        read = cls.__new__(cls)
        read.qw, read.stored, read.versions, read.dtype = None, {}, {}, values.dtype
        read.described, read.values = described, values
        return read


_PENDING: weakref.WeakSet[_Read] = weakref.WeakSet()


class DeferredWeight(WeightCopy):
    """A quantized module's weight as read, computed at its first use other
    than its layout (see the module docstring)."""

    _dp_read: _Read

    @staticmethod
    def __new__(cls, like: torch.Tensor, device: torch.device, read: _Read) -> DeferredWeight:
        shell = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            like.shape,
            strides=like.stride(),
            storage_offset=like.storage_offset(),
            dtype=like.dtype,
            device=device,
            requires_grad=False,
        )
        shell._dp_read = read
        return shell

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __hash__(self) -> int:
        return id(self)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_is_param":  # `nn.Parameter(read)` marks what `read.detach()` gave
            raise TypeError(_not_a_parameter(self))
        super().__setattr__(name, value)

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict | None = None
    ) -> Any:
        return _torch_function(cls, func, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict | None = None
    ) -> Any:
        """The ops that skip `__torch_function__` (`as_subclass`,
        `torch.tensor(read)`), on the values."""
        kwargs = kwargs or {}
        for index, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            target = args[index] if index < len(args) else kwargs.get(argument.name)
            for tensor in target if isinstance(target, (list, tuple)) else (target,):
                copy_of = _values_of(tensor)._dp_copy_of if type(tensor) is cls else None
                if copy_of is not None and not copy_of.view:
                    raise TypeError(refusal(copy_of, func.overloadpacket.__name__))
        plain_args = tuple(_plain(a) for a in args)
        plain_kwargs = {k: _plain(v) for k, v in kwargs.items()}
        return func(*plain_args, **plain_kwargs)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return _plain(self).__repr__(tensor_contents=tensor_contents)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return _values_of(self).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        return copy.deepcopy(_values_of(self), memo)


def _not_a_parameter(read: DeferredWeight) -> str:
    copy_of = _values_of(read)._dp_copy_of
    return (
        f"nn.Parameter(module.{copy_of.attribute}) of the {copy_of.mode}-quantized "
        f"{copy_of.module}: the read is computed at its first use and cannot become a "
        f"parameter itself. Use nn.Parameter(module.{copy_of.attribute}.clone()) for a "
        "float weight of your own."
    )


_UNTRACED: Any = None


def _torch_function(cls: Any, func: Any, args: Sequence[Any], kwargs: dict) -> Any:
    """A read handed to a compiled function runs, untraced (Dynamo is
    imported at the first call, not with the package)."""
    global _UNTRACED
    if _UNTRACED is None:
        _UNTRACED = torch.compiler.disable(_ops_of)
    return _UNTRACED(cls, func, args, kwargs)


def _ops_of(cls: Any, func: Any, args: Sequence[Any], kwargs: dict) -> Any:
    """A read's ops: its layout from itself, the rest on its values (a
    `WeightCopy`, by its rules)."""
    first: Any = args[0] if args else None
    if type(first) is cls:
        read = first._dp_read
        if func in _FIXED or (read.values is None and func in _FRESH):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
    args = tuple(_read_values(a) for a in args)
    kwargs = {k: _read_values(v) for k, v in kwargs.items()}
    result = func(*args, **kwargs)
    if type(first) is cls:
        if result is first._dp_read.values:  # in place, or `float()` of float32: itself
            return first
        if func in _DETACH and type(result) is WeightCopy:
            return _standing_for(result, first)  # so that `nn.Parameter(read)` says why not
    return result


def _standing_for(values: WeightCopy, read: DeferredWeight) -> DeferredWeight:
    """A read whose values are `values` already."""
    done = _Read.computed(values, read._dp_read.described)
    return DeferredWeight(values, values.device, done)


def _read_values(value: Any) -> Any:
    """`value` with the reads in it (one level of lists) replaced by their values."""
    return _each_read(value, _values_of)


def _plain(value: Any) -> Any:
    """`value` with the reads in it (one level of lists) as plain tensors."""
    return _each_read(value, lambda read: _values_of(read).as_subclass(torch.Tensor))


def _each_read(value: Any, replace: Any) -> Any:
    if type(value) is DeferredWeight:
        return replace(value)
    if isinstance(value, (list, tuple)) and any(type(v) is DeferredWeight for v in value):
        return type(value)(replace(v) if type(v) is DeferredWeight else v for v in value)
    return value


def _values_of(shell: DeferredWeight) -> WeightCopy:
    """A read's values, computed at the first call."""
    return _computed(shell._dp_read, shell)


def _computed(read: _Read, shell: DeferredWeight | None) -> WeightCopy:
    if read.values is None:
        computed = _compute(read, shell)
        with _COMPUTING:  # one value for every thread
            if read.values is None:
                read.values, read.stored, read.qw = computed, {}, None
                _PENDING.discard(read)
    return read.values  # type: ignore[return-value]


def _compute(read: _Read, shell: DeferredWeight | None) -> WeightCopy:
    qw = read.qw
    assert qw is not None
    for name, tensor in read.stored.items():
        if tensor._version != read.versions[name]:
            raise StaleRead(
                f"The weight of the {qw.mode}-quantized {read.described} was read before its "
                f"stored tensor '{name}' was written in place, and not used until after: its "
                "values at the read are gone. Read the weight again for the values it has now."
            )
    # outside the caller's transforms: a cached value must not be a functorch
    # wrapper or an inference tensor (it outlives them)
    with (
        torch.no_grad(),
        torch.inference_mode(False),
        torch._C._DisableFuncTorch(),
        _disable_current_modes(),
    ):
        stand_in: Any = StoredTensors(read.stored)
        weight = qw.dequantized(stand_in).to(read.dtype)
        values = guarded_read(weight, qw, read.described, READS, tuple(read.stored.values()))
    if shell is not None:
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


def deferred(module: torch.nn.Module, qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight of the quantized `module` read in `dtype`: a pending
    `DeferredWeight`, or the dequantized weight at once where the read must
    be computed now (a small weight; under a compiler, a mode or a graph
    through the stored tensors; stored tensors of another type or without
    versions)."""
    buffers = module.__dict__["_buffers"]
    stored = {name: buffers[name] for name in qw.buffer_names if buffers.get(name) is not None}
    like = None if not _can_defer(qw, stored) else _layout(qw, stored, dtype)
    if like is None:
        weight = qw.dequantized(module).to(dtype)
        return read_weight(module, qw, weight, READS)
    read = _Read(module, qw, stored, dtype)
    shell = DeferredWeight(like, next(iter(stored.values())).device, read)
    if loaded_read(module, tuple(stored.values())):
        setattr(shell, LOADED_FLAG, True)
    _PENDING.add(read)
    return shell


def compute_pending_reads(module: torch.nn.Module, qw: QuantizedWeight) -> None:
    """Computes the reads not used yet of the stored tensors of `module`
    (`qw`, its quantization) before they are written in place
    (`load_state_dict`), whichever module they were read through (tied
    modules share stored tensors)."""
    if not _PENDING:
        return
    buffers = module.__dict__["_buffers"]
    stored = [buffers[name] for name in qw.stored_names if buffers.get(name) is not None]
    memory = {_storage(t) for t in stored} - {0}
    for read in list(_PENDING):
        if any(_storage(t) in memory for t in read.stored.values()):
            with contextlib.suppress(StaleRead):  # raises at its use, as it would have
                _computed(read, None)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _can_defer(qw: QuantizedWeight, stored: dict[str, torch.Tensor]) -> bool:
    if not stored or compiling():
        return False
    if torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
        return False
    if torch.Size(qw.spec.float_shape).numel() < DEFERRED_MIN_ELEMENTS:
        return False
    grad = torch.is_grad_enabled()
    return all(
        type(t) is torch.Tensor
        and t.layout is torch.strided
        and t.device.type in ("cpu", "cuda")
        and not t.is_inference()  # no version to tell an in-place write by
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
            like = qw.dequantized(stand_in).to(dtype)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        like = None  # data-dependent: computed at each read, as before
    if like is not None and not like.is_meta:
        like = None
    layouts[key] = like
    return like
