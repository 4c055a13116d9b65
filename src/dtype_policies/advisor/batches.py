"""The inputs of `advise`: one batch or an iterable of batches, each called
as the model is called, and the floating tensors of what the model returns."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Batch:
    """One call of the model: `model(*args, **kwargs)`."""

    args: tuple
    kwargs: dict

    def __call__(self, model: torch.nn.Module) -> Any:
        return model(*self.args, **self.kwargs)


def _as_batch(item: Any, where: str) -> Batch:
    if isinstance(item, torch.Tensor):
        return Batch((item,), {})
    if isinstance(item, tuple):
        return Batch(item, {})
    if isinstance(item, Mapping):
        bad = [key for key in item if not isinstance(key, str)]
        if bad:
            raise TypeError(f"advise(): {where} is a dict with non-string keys {bad[:3]!r}")
        return Batch((), dict(item))
    raise TypeError(
        f"advise(): {where} must be a tensor, a tuple of positional arguments or a dict of "
        f"keyword arguments. Received: {type(item).__name__}"
    )


def as_batches(inputs: Any) -> list[Batch]:
    """`inputs` as a list of batches.

    A tensor, a tuple (positional arguments) or a dict (keyword arguments,
    a Hugging Face `BatchEncoding` included) is one batch; a list or any
    other iterable (a generator, a `DataLoader`) holds several, each of those
    forms. The batches are kept: every measurement runs all of them.
    """
    if inputs is None:
        raise ValueError("advise(): `inputs` is None; pass a batch or an iterable of batches.")
    if isinstance(inputs, (torch.Tensor, tuple, Mapping)) or _is_mapping_like(inputs):
        batches = [_as_batch(_plain(inputs), "`inputs`")]
    elif isinstance(inputs, (str, bytes)) or not isinstance(inputs, Iterable):
        raise TypeError(
            "advise(): `inputs` must be a tensor, a tuple of positional arguments, a dict of "
            f"keyword arguments, or an iterable of them. Received: {type(inputs).__name__}"
        )
    else:
        batches = [_as_batch(_plain(item), f"batch {i}") for i, item in enumerate(inputs)]
    if not batches:
        raise ValueError("advise(): `inputs` is empty; pass at least one batch.")
    for i, batch in enumerate(batches):
        if not batch.args and not batch.kwargs:
            raise ValueError(f"advise(): batch {i} is empty (no arguments).")
        for tensor in _tensors((batch.args, batch.kwargs)):
            # every measured error would be inf, or 0 over no values at all
            if tensor.numel() == 0:
                raise ValueError(
                    f"advise(): batch {i} holds an empty tensor of shape "
                    f"{tuple(tensor.shape)}; errors need values to measure."
                )
            floating = tensor.is_floating_point() and tensor.device.type != "meta"
            if floating and not bool(torch.isfinite(tensor).all()):
                raise ValueError(
                    f"advise(): batch {i} holds a non-finite value (NaN or inf) in a "
                    f"tensor of shape {tuple(tensor.shape)}; errors measured on it are "
                    "meaningless."
                )
    return batches


def _is_mapping_like(value: Any) -> bool:
    """`BatchEncoding` and other `UserDict`s are dicts of keyword arguments."""
    return hasattr(value, "keys") and hasattr(value, "__getitem__") and hasattr(value, "data")


def _plain(item: Any) -> Any:
    if not isinstance(item, Mapping) and _is_mapping_like(item):
        return dict(item.data)
    return item


def floating_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The floating tensors in `value`, in order: tensors, tuples, lists, dicts
    (Hugging Face `ModelOutput`s included, in field order); other objects
    (a `DynamicCache`, strings, numbers) are skipped."""
    return (tensor for tensor in _tensors(value) if tensor.is_floating_point())


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in `value`, in order, through tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
