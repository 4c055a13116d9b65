"""Quantized matrix products: the fastest correct path for each shape and device."""

from __future__ import annotations

import torch


def tensor_key(*tensors: torch.Tensor) -> tuple:
    """A key that changes whenever any of `tensors` is written through torch
    (identity, address, version). Inference tensors have no version counter:
    they are keyed by identity and address only (they cannot be written
    outside inference mode)."""
    key = []
    for t in tensors:
        key.append(id(t))
        key.append(t.data_ptr())
        key.append(-1 if t.is_inference() else t._version)
    return tuple(key)
