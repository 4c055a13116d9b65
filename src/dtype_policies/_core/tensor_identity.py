"""What tells a tensor's contents apart between two calls, for the caches
that keep what they compute from a tensor (kept casts, packed layouts).

A tensor's address and version counter are not enough: `p.data = new` does
not move `p`'s version counter, and the allocator may hand the new tensor
the address of a storage freed a moment before (two `p.data = ...` between
two calls). The storage itself is the identity that cannot come back: torch
keeps one Python object per live storage, and a weak reference to a storage
that has died compares equal to nothing but itself.

>>> import torch
>>> p = torch.nn.Parameter(torch.ones(4))
>>> before = contents_key(p)
>>> p.data = torch.zeros(4)
>>> before == contents_key(p)
False
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.autograd.graph import increment_version
from torch.optim.optimizer import register_optimizer_step_post_hook


def storage_ref(tensor: torch.Tensor) -> weakref.ref | None:
    """A weak reference to `tensor`'s storage (the same object while the
    storage lives), or None for a tensor without one of its own (a tensor
    subclass that keeps none)."""
    try:
        return weakref.ref(tensor.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def view_key(tensor: torch.Tensor) -> tuple:
    """What a write to `tensor` changes, read cheaply: its version counter
    (in-place writes; -1 for an inference tensor, which cannot be written
    outside inference mode), address, dtype, shape and strides (`p.data =
    p.data[:k]` or `.t()` keep the address and the version; a sparse or
    nested tensor has no strides and no address of its own: its layout and
    its parts' addresses and shapes instead, `parts_key`)."""
    version = _version_of(tensor)
    if not has_strides(tensor):
        return (version, data_address(tensor), tensor.dtype, tensor.layout, parts_key(tensor))
    return (version, data_address(tensor), tensor.dtype, tensor.shape, tensor.stride())


def has_strides(tensor: torch.Tensor) -> bool:
    """Whether `tensor` has an address, shape and strides of its own (a
    sparse or nested tensor has not: `parts_key`, `sparse_parts`)."""
    return tensor.layout is torch.strided and not tensor.is_nested


def _version_of(tensor: torch.Tensor) -> int:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor
        return -1


_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def sparse_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The strided tensors a sparse tensor is made of (its indices and
    values); none for any other layout.

    >>> [tuple(part.shape) for part in sparse_parts(torch.eye(3).to_sparse())]
    [(2, 3), (3,)]
    """
    return [getattr(tensor, name)() for name in _PARTS.get(tensor.layout, ())]


def parts_key(tensor: torch.Tensor) -> tuple:
    """The addresses, shapes and versions of the strided tensors a sparse or
    nested tensor is made of (`p.data = other` on a sparse parameter replaces
    them and moves no version counter; a write to a jagged tensor's offsets
    moves only theirs), with the tensor's own shape where it has one.

    >>> adjacency = torch.eye(3).to_sparse()
    >>> before = parts_key(adjacency)
    >>> adjacency.data = torch.eye(3).to_sparse()
    >>> before == parts_key(adjacency)
    False
    """
    names = _PARTS.get(tensor.layout, ("values", "offsets") if tensor.is_nested else ())
    key: list[Any] = []
    for name in names:
        try:
            part = getattr(tensor, name)()
        except (AttributeError, RuntimeError, NotImplementedError):
            continue  # a nested tensor of the strided layout has no offsets
        key.append((data_address(part), tuple(part.shape), _version_of(part)))
    if not tensor.is_nested:
        key.append(tuple(tensor.shape))
    return tuple(key)


def contents_key(tensor: torch.Tensor) -> tuple:
    """A key equal between two reads of `tensor` only if nothing torch tracks
    wrote it in between and it views the same memory the same way: its
    storage (which a freed address given to a new tensor does not share)
    and its `view_key`."""
    return (storage_ref(tensor), *view_key(tensor))


def data_address(tensor: torch.Tensor) -> int | None:
    """`tensor.data_ptr()`, or `None` for a tensor without storage (the
    wrappers of `torch.func` transforms, some tensor subclasses)."""
    try:
        return tensor.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def tensor_key(*tensors: torch.Tensor) -> tuple:
    """A key that changes whenever any of `tensors` is replaced or written
    through torch: each one's `contents_key` and how it views its storage.
    A fresh view of the same values (`buffer.t()` made in every call) keys
    equal: the key is not the Python object's.

    >>> scale = torch.ones(3, 2)
    >>> tensor_key(scale.t()) == tensor_key(scale.t()) != tensor_key(scale)
    True
    """
    return tuple(part for t in tensors for part in contents_key(t))


def _count_fused_steps(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A fused optimizer step (`Adam(fused=True)`) writes its parameters
    without moving their version counters, unlike every other step: moved
    here, so that what is kept from a parameter (casts, packed layouts,
    compiled graphs' watches) sees the step as it sees any other write."""
    for group in optimizer.param_groups:
        if group.get("fused"):
            for parameter in group["params"]:
                # what the step wrote: a parameter without a gradient is skipped
                # by the fused kernels, and a frozen one's graph stays valid
                if parameter.grad is not None and not parameter.is_inference():
                    increment_version(parameter)


register_optimizer_step_post_hook(_count_fused_steps)
