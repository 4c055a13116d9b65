"""Keras dtype names, their standardization, and the matching torch dtypes."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

# The dtype names Keras 3 accepts (`keras/src/backend/common/dtypes.py::ALLOWED_DTYPES`).
ALLOWED_DTYPES = frozenset(
    {
        "float16",
        "float32",
        "float64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
        "bfloat16",
        "bool",
        "string",
        "float8_e4m3fn",
        "float8_e5m2",
        "complex64",
        "complex128",
    }
)

# Floating dtypes a layer can compute in (and so a quantized policy can start from).
COMPUTE_FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})

_PYTHON_DTYPES = {
    bool: "bool",
    int: "int32",
    float: "float32",
    complex: "complex64",
    str: "string",
    "int": "int32",
}

_TORCH_DTYPES = {name: getattr(torch, name) for name in ALLOWED_DTYPES if name != "string"}
_NAMES_BY_TORCH_DTYPE = {dtype: name for name, dtype in _TORCH_DTYPES.items()}


def standardize_dtype(dtype: Any) -> str:
    """Returns the Keras name of `dtype` ("float32", "bfloat16", ...).

    Accepts Keras names, torch dtypes, numpy dtypes and the Python types
    `bool`, `int`, `float` and `str`. Raises `ValueError` for anything else.
    """
    if isinstance(dtype, torch.dtype):
        name = _NAMES_BY_TORCH_DTYPE.get(dtype)
        if name is None:
            raise ValueError(f"Invalid dtype: {dtype}")
        return name
    with contextlib.suppress(TypeError):  # unhashable values are not Python types
        dtype = _PYTHON_DTYPES.get(dtype, dtype)
    if isinstance(dtype, str):
        name = dtype
    elif hasattr(dtype, "name") and isinstance(dtype.name, str):
        name = dtype.name  # numpy dtypes
    elif isinstance(dtype, type) and hasattr(dtype, "__name__"):
        name = dtype.__name__  # numpy scalar types such as np.float16
    else:
        raise ValueError(f"Invalid dtype: {dtype!r}")
    if name not in ALLOWED_DTYPES:
        raise ValueError(f"Invalid dtype: {dtype!r}")
    return name


def to_torch_dtype(name: str) -> torch.dtype:
    """Returns the torch dtype for a Keras dtype name."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(
            f"dtype '{name}' has no torch equivalent. Expected one of {sorted(_TORCH_DTYPES)}."
        ) from None


def is_float_dtype(name: str) -> bool:
    """Keras's rule: float, bfloat and float8 dtypes are floating; complex is not."""
    return name.startswith(("float", "bfloat"))
