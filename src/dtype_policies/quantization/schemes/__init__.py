"""The quantization schemes: one file per mode, each registering its mode's
record (`dtype_policies._modes.QuantizationMode`: config class, policy class,
scheme, stored suffixes, label) when imported.

A new mode is one new file here defining a `Scheme` subclass and registering
its record (and its config in `dtype_policies.quantizers`); see
`docs/architecture.md`.
"""

from __future__ import annotations

from dtype_policies._modes import mode_record

# Registered in Keras's order of QUANTIZATION_MODES.
# isort: off
from dtype_policies.quantization.schemes import int8  # noqa: F401
from dtype_policies.quantization.schemes import float8  # noqa: F401
from dtype_policies.quantization.schemes import int4  # noqa: F401
from dtype_policies.quantization.schemes import gptq  # noqa: F401
from dtype_policies.quantization.schemes import awq  # noqa: F401

# isort: on
from dtype_policies.quantization.schemes.base import (
    ActivationStatistics,
    QuantizedWeight,
    Scheme,
    WeightSpec,
)


def scheme_for(mode: str) -> Scheme:
    """The scheme of a registered mode (`ValueError` naming the modes otherwise)."""
    return mode_record(mode).scheme


__all__ = ["ActivationStatistics", "QuantizedWeight", "Scheme", "WeightSpec", "scheme_for"]
