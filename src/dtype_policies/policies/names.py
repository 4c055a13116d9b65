"""Parsing policy names: float names and quantized names alike.

A quantized name is `"<mode>_from_<source>"`, where `<mode>` starts with a
registered mode's name (`"int8"`, `"int4/128"`); the mode's record builds the
policy. Names starting with a Keras mode this library does not implement
(`"gptq/4/128_from_float32"`) are refused with a specific error.
"""

from __future__ import annotations

from dtype_policies._dtypes import ALLOWED_DTYPES
from dtype_policies._modes import keras_only_modes, known_mode_names, refusal, registered_modes
from dtype_policies.policies.dtype_policy import DTypePolicy
from dtype_policies.policies.quantized import QuantizedDTypePolicy


def parse_policy_name(name: str) -> DTypePolicy:
    """Parses any policy name.

    `"int8_from_float32"`, `"int4/128_from_mixed_bfloat16"`, `"float8_from_X"` and
    the legacy per-channel `"int4_from_X"` give quantized policies; plain dtype
    names (including `"int8"` and `"float8_e4m3fn"`) give a `DTypePolicy`.

    >>> parse_policy_name("int4/64_from_float32")
    <Int4DTypePolicy "int4/64_from_float32">
    >>> parse_policy_name("int8")
    <DTypePolicy "int8">
    """
    if not isinstance(name, str):
        raise TypeError(f"`policy` must be a string. Received: policy={name!r}")
    if name in ALLOWED_DTYPES or not name.startswith(known_mode_names()):
        return DTypePolicy(name)
    return parse_quantized_policy_name(name)


def parse_quantized_policy_name(policy: str) -> QuantizedDTypePolicy:
    """Parses `"<mode>_from_<source>"` (Keras's rules and messages); an error
    about either part names the whole policy as written.

    >>> try:
    ...     parse_quantized_policy_name("int8_from_")
    ... except ValueError as e:
    ...     message = str(e)
    >>> message.startswith("Cannot convert ''"), "in the policy 'int8_from_'" in message
    (True, True)
    """
    if not isinstance(policy, str):
        raise TypeError(f"`policy` must be a string. Received: policy={policy!r}")
    if not policy.startswith(known_mode_names()):
        raise ValueError(
            "`policy` is incompatible with the current supported quantization. "
            f"Received: policy={policy!r}"
        )
    if policy.startswith(keras_only_modes()):
        raise refusal(policy.split("/")[0].split("_")[0], f"policy '{policy}'")
    parts = policy.split("_from_")
    if len(parts) != 2:
        raise ValueError(
            "Cannot convert `policy` into a valid pair (`mode`, `source_name`) to "
            f"instantiate `QuantizedDTypePolicy`. Received: policy={policy}"
        )
    mode, source_name = parts
    record = next((r for r in registered_modes() if r.name == mode.split("/")[0]), None)
    try:
        if record is not None:
            return record.policy(mode, source_name)
        return QuantizedDTypePolicy(mode, source_name)  # Keras's errors, in Keras's order
    except ValueError as e:
        if f"'{source_name}'" in str(e) and "Cannot convert" in str(e):
            raise ValueError(
                f"{e} (Received: {source_name!r} in the policy '{policy}': its source, after "
                "'_from_', must be a float policy such as 'float32' or 'mixed_bfloat16'.)"
            ) from None
        if policy not in str(e):
            raise ValueError(f"{e} (Received in the policy '{policy}'.)") from None
        raise
