"""The policies of the calibrated modes: `GPTQDTypePolicy`
(`"gptq/<weight_bits>/<group_size>_from_<source>"`) and `AWQDTypePolicy`
(`"awq/4/<group_size>_from_<source>"`), with Keras's names, parsing and
messages. Each implies a config without calibration data: a layer built
under one holds placeholder tensors until a checkpoint is loaded into it
(Keras's loading path); quantizing needs a `GPTQConfig` / `AWQConfig` with
data."""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch

from dtype_policies._modes import mode_record
from dtype_policies.policies.quantized import QuantizedDTypePolicy
from dtype_policies.quantizers.awq_config import AWQConfig
from dtype_policies.quantizers.config import QuantizationConfig
from dtype_policies.quantizers.gptq_config import GPTQ_WEIGHT_BITS, GPTQConfig

_INTEGER = re.compile(r"-?[0-9]+")  # ASCII digits only


class _CalibratedPolicy(QuantizedDTypePolicy):
    """`"<mode>/<weight_bits>/<group_size>"` policies (Keras's parsing and errors)."""

    base_mode: ClassVar[str]
    group_size_meaning: ClassVar[str]
    _weight_bits: int
    _group_size: int

    def __init__(self, mode: str, source_name: str | torch.dtype | None = None) -> None:
        bits, group_size = self._parse(mode)
        super().__init__(self.base_mode, source_name)
        self._set("_weight_bits", bits)
        self._set("_group_size", group_size)
        self._set("_name", f"{self.mode_string}_from_{self._source_name}")

    @classmethod
    def _parse(cls, mode: Any) -> tuple[int, int]:
        expected = f"'{cls.base_mode}/<weight_bits>/<group_size>'"
        parts = mode.split("/") if isinstance(mode, str) else []
        if len(parts) != 3 or parts[0] != cls.base_mode:
            raise ValueError(
                f"Invalid mode for {cls.__name__}. Expected format {expected}, but got '{mode}'."
            )
        if not all(_INTEGER.fullmatch(part) for part in parts[1:]):
            # read strictly, as int4's block sizes: `int()` takes " 4", "+4", "٤"
            raise ValueError(
                f"Invalid mode for {cls.__name__}. <weight_bits> and <group_size> must be "
                f"integers. Expected format {expected}, but got '{mode}'."
            )
        bits, group_size = int(parts[1]), int(parts[2])
        cls._check_bits(bits, mode)
        if group_size < -1 or group_size == 0:
            raise ValueError(
                f"Invalid group_size in mode. Supported values are {cls.group_size_meaning} or "
                f"a positive integer, but got {group_size} from '{mode}'."
            )
        return bits, group_size

    @classmethod
    def _check_bits(cls, bits: int, mode: str) -> None:
        raise NotImplementedError

    @property
    def mode(self) -> str:
        return self.base_mode

    @property
    def weight_bits(self) -> int:
        return self._weight_bits

    @property
    def group_size(self) -> int:
        """Input features sharing a scale and zero point; `-1`: all of them."""
        return self._group_size

    @property
    def mode_string(self) -> str:
        """`"<mode>/<weight_bits>/<group_size>"`."""
        return f"{self.base_mode}/{self._weight_bits}/{self._group_size}"

    def get_config(self) -> dict[str, Any]:
        return {"mode": self.mode_string, "source_name": self._source_name}

    def _equality_key(self) -> tuple:
        return (*super()._equality_key(), self._weight_bits, self._group_size)


class GPTQDTypePolicy(_CalibratedPolicy):
    """A GPTQ policy: `mode` is `"gptq/<weight_bits>/<group_size>"` (bits 2, 3,
    4 or 8; group size -1 or positive).

    >>> from dtype_policies import GPTQDTypePolicy
    >>> policy = GPTQDTypePolicy("gptq/4/128", "mixed_bfloat16")
    >>> policy.name, policy.weight_bits, policy.group_size, policy.quantization_mode
    ('gptq/4/128_from_mixed_bfloat16', 4, 128, 'gptq')
    >>> policy.quantization_config.dtype_policy_string()
    'gptq/4/128'
    """

    keras_module = "keras.dtype_policies"
    base_mode = "gptq"
    group_size_meaning = "-1 (whole-tensor)"

    @classmethod
    def _check_bits(cls, bits: int, mode: str) -> None:
        if bits not in GPTQ_WEIGHT_BITS:
            raise ValueError(
                "Invalid weight_bits in mode. Supported values are 2, 3, 4, and 8, but got "
                f"{bits} from '{mode}'."
            )

    @property
    def quantization_config(self) -> QuantizationConfig:
        return GPTQConfig(None, None, weight_bits=self._weight_bits, group_size=self._group_size)


class AWQDTypePolicy(_CalibratedPolicy):
    """An AWQ policy: `mode` is `"awq/4/<group_size>"`.

    >>> from dtype_policies import AWQDTypePolicy
    >>> AWQDTypePolicy("awq/4/64", "float32").name
    'awq/4/64_from_float32'
    >>> try:
    ...     AWQDTypePolicy("awq/8/128", "float32")
    ... except ValueError as e:
    ...     print(e)
    Invalid weight_bits in mode. AWQ only supports 4-bit quantization, but got 8 from 'awq/8/128'.
    """

    keras_module = "keras.dtype_policies"
    base_mode = "awq"
    group_size_meaning = "-1 (per-channel)"

    @classmethod
    def _check_bits(cls, bits: int, mode: str) -> None:
        if bits != 4:
            raise ValueError(
                "Invalid weight_bits in mode. AWQ only supports 4-bit quantization, but got "
                f"{bits} from '{mode}'."
            )

    @property
    def quantization_config(self) -> QuantizationConfig:
        return AWQConfig(None, None, weight_bits=self._weight_bits, group_size=self._group_size)


def bits_not_given(policy: QuantizedDTypePolicy) -> QuantizationConfig:
    """The config record of a calibrated mode for a policy that is not its own
    class (`QuantizedDTypePolicy("gptq", ...)`, which Keras also accepts):
    `ValueError`, as Keras's layers raise, since the policy has no weight bits.

    >>> try:
    ...     QuantizedDTypePolicy("awq", "float32").quantization_config
    ... except ValueError as e:
    ...     print(str(e)[:62])
    For AWQ quantization, the weight_bits must be specified either
    """
    mode = policy.quantization_mode or ""
    policy_class = mode_record(mode).policy_class.__name__  # the record that called this
    raise ValueError(
        f"For {mode.upper()} quantization, the weight_bits must be specified either through a "
        f"`dtype_policy` of type `{policy_class}` (a name such as "
        f"'{mode}/4/128_from_float32') or the `config` argument. Received: "
        f"dtype_policy={policy.name!r}"
    )
