"""The registry of quantization schemes: one per mode.

A new mode is one new file defining a `Scheme` subclass, registered here with
`register_scheme` (and its config in `dtype_policies.quantizers`).
"""

from __future__ import annotations

from dtype_policies.quantization.schemes.base import QuantizedWeight, Scheme, WeightSpec
from dtype_policies.quantization.schemes.float8 import Float8Scheme
from dtype_policies.quantization.schemes.int4 import Int4Scheme
from dtype_policies.quantization.schemes.int8 import Int8Scheme

SCHEMES: dict[str, Scheme] = {}


def register_scheme(scheme: Scheme) -> Scheme:
    """Makes `scheme` the implementation of its mode."""
    SCHEMES[scheme.mode] = scheme
    return scheme


def scheme_for(mode: str) -> Scheme:
    try:
        return SCHEMES[mode]
    except KeyError:
        raise ValueError(
            f"Invalid quantization mode. Expected one of {tuple(SCHEMES)}. Received: mode={mode}"
        ) from None


for _scheme in (Int8Scheme(), Int4Scheme(), Float8Scheme()):
    register_scheme(_scheme)

__all__ = ["SCHEMES", "QuantizedWeight", "Scheme", "WeightSpec", "register_scheme", "scheme_for"]
