"""The registry of quantization modes: one record per mode.

Every list of modes in the package is derived from these records: the mode
names (`QUANTIZATION_MODES`), policy name parsing, the policy a config gives
and the config a policy implies, the config classes (de)serialization knows,
the modes each module kind supports, the suffixes that mark quantized weights
in a checkpoint, the labels of `summary`, the command line's choices.

The registry sits at the bottom of the package and imports nothing of it:
each mode's own file (`quantization/schemes/<mode>.py`) builds its record from
its config class, its policy class and its scheme, and registers it when the
package is imported. Nothing reads the registry at import time.

Keras modes this library does not implement (`gptq`, `awq`, `ternary`) are
known by name only, so that their policies and configs are refused with a
specific error, until a record for them is registered.

>>> from dtype_policies._modes import mode_record
>>> record = mode_record("int8")
>>> record.name, record.config_class.__name__, record.calibrated
('int8', 'Int8QuantizationConfig', False)
>>> try:
...     mode_record("int7")
... except ValueError as e:
...     print(e)  # doctest: +NORMALIZE_WHITESPACE
Invalid quantization mode. Expected one of ('int8', 'float8', 'int4', 'gptq',
'awq'). Received: mode=int7
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

KERAS_ONLY_MODES: dict[str, str] = {
    "gptq": "GPTQDTypePolicy",
    "awq": "AWQDTypePolicy",
    "ternary": "TernaryDTypePolicy",
}
"""Keras 3 modes (and their policy classes) recognised by name; refused while
no record implements them."""


@dataclass(frozen=True, eq=False)
class QuantizationMode:
    """Everything the package needs to know about one quantization mode.

    Attributes:
        name: The mode (`"int8"`), the first part of its policy names
            (`"int8_from_float32"`, `"int4/128_from_float32"`).
        config_class: Its `QuantizationConfig` subclass.
        policy_class: The policy class of its names; `policy_class(mode, source)`
            builds a policy from a name's two parts unless `parse_policy` is given.
        scheme: The `Scheme` that stores and computes with it; `scheme.roles`
            says which weights (`"linear"`, `"embedding"`) it quantizes.
        stored_suffixes: Every suffix it appends to a weight's name for the
            tensors it stores (`"_int8"`, `"_scale"`), used to recognise them
            in checkpoints.
        data_suffix: The suffix of its integer data (`"_int8"`): a checkpoint
            key `<weight><data_suffix>` means a quantized weight.
        module_buffers: The names of the tensors it stores on the module itself,
            not beside the weight (float8's scales and amax histories): a
            checkpoint key `<module>.<name>` means a module in this mode.
        calibrated: Quantizing needs activations (a calibration dataset in
            the config): `quantize()` runs the model block by block on it and
            the scheme's `new_statistics` / `quantize_calibrated` compute the
            stored tensors.
        refused_compute_dtypes: Compute dtypes the mode does not work with
            (int8 refuses float16, as Keras).
        parse_policy: `(mode part of a name, source name) -> policy`, when the
            policy class alone does not say it (legacy names).
        config_for_policy: `policy -> config` the policy implies, for policies
            of a class that does not say it itself (default: `config_class()`).
        policy_for_config: `(config, source name) -> policy` of a module
            quantized with `config` (default: `policy_class(name, source)`).
        label: `config -> str` shown by `summary` and `inspect` (default: the name).
        default: `() -> config` that `quantize(mode)` and the mode's policies
            use when none is given (default: `config_class()`).
    """

    name: str
    config_class: type
    policy_class: type
    scheme: Any
    stored_suffixes: tuple[str, ...] = ()
    data_suffix: str | None = None
    module_buffers: tuple[str, ...] = ()
    calibrated: bool = False
    refused_compute_dtypes: tuple[str, ...] = ()
    parse_policy: Callable[[str, str], Any] | None = None
    config_for_policy: Callable[[Any], Any] | None = None
    policy_for_config: Callable[[Any, str], Any] | None = None
    label: Callable[[Any], str] | None = None
    default: Callable[[], Any] | None = None

    @property
    def roles(self) -> tuple[str, ...]:
        """The weight roles its scheme quantizes (`"linear"`, `"embedding"`)."""
        return tuple(self.scheme.roles)

    @property
    def keeps_float_weight(self) -> bool:
        """Whether the float weight stays a parameter (float8)."""
        return bool(self.scheme.keeps_float_weight)

    def policy(self, mode_part: str, source_name: str) -> Any:
        """The policy named `f"{mode_part}_from_{source_name}"`."""
        build = self.parse_policy or self.policy_class
        return build(mode_part, source_name)

    def config_of(self, policy: Any) -> Any:
        """The config `policy` implies."""
        if self.config_for_policy is not None:
            return self.config_for_policy(policy)
        return self.default() if self.default is not None else self.config_class()

    def policy_of(self, config: Any, source_name: str) -> Any:
        """The policy of a module quantized with `config` from `source_name`."""
        if self.policy_for_config is not None:
            return self.policy_for_config(config, source_name)
        return self.policy_class(self.name, source_name)

    def label_of(self, config: Any) -> str:
        """The quantization column's text for `config`."""
        return self.label(config) if self.label is not None else self.name

    def default_config(self) -> Any:
        """The config `quantize(mode)` runs with when none is given; a
        calibrated mode has none (its config carries the calibration data)."""
        if self.calibrated:
            raise ValueError(
                f"For {self.name.upper()}, you must pass a `{self.config_class.__name__}` "
                "object in the `config` argument (it holds the calibration data)."
            )
        return self.default() if self.default is not None else self.config_class()

    def check_compute_dtype(self, compute_dtype: str) -> None:
        """Raises `ValueError` if this mode does not work with `compute_dtype`."""
        if compute_dtype in self.refused_compute_dtypes:
            raise ValueError(
                f"Quantization mode='{self.name}' doesn't work well with "
                f"compute_dtype='{compute_dtype}'. Use a bfloat16 or float32 source policy "
                "such as 'mixed_bfloat16'."
            )

    def __repr__(self) -> str:
        return f"<QuantizationMode {self.name!r}>"


_MODES: dict[str, QuantizationMode] = {}


def register_mode(record: QuantizationMode) -> QuantizationMode:
    """Makes `record` the implementation of its mode (replacing any earlier
    record of the same name, and the refusal of a Keras-only mode)."""
    name = record.name
    if not isinstance(name, str) or not name.isidentifier() or "_from_" in name:
        raise ValueError(f"A mode name must be an identifier without '_from_'. Received: {name!r}")
    if getattr(record.scheme, "mode", name) != name:
        raise ValueError(
            f"The scheme {record.scheme!r} is for mode '{record.scheme.mode}', not '{name}'."
        )
    _MODES[name] = record
    return record


def unregister_mode(name: str) -> None:
    """Removes a registered mode (for tests that register their own)."""
    _MODES.pop(name, None)


def registered_modes() -> tuple[QuantizationMode, ...]:
    """The records, in registration order."""
    return tuple(_MODES.values())


def keras_only_modes() -> tuple[str, ...]:
    """Keras modes known by name that no record implements."""
    return tuple(name for name in KERAS_ONLY_MODES if name not in _MODES)


def known_mode_names() -> tuple[str, ...]:
    """Implemented modes, then the Keras-only ones (what policy names may start with)."""
    return (*_MODES, *keras_only_modes())


def refusal(name: str, what: str | None = None) -> ValueError:
    """The error for a Keras mode this library does not implement."""
    subject = f"Quantization mode '{name}'" + (f" (from {what})" if what else "")
    return ValueError(
        f"{subject} is a Keras mode that dtype_policies does not implement. "
        f"Supported modes: {tuple(_MODES)}."
    )


def mode_record(name: Any) -> QuantizationMode:
    """The record of mode `name`; `ValueError` (Keras's message) for an
    unknown mode, and a specific one for a Keras mode not implemented here."""
    record = _MODES.get(name) if isinstance(name, str) else None
    if record is not None:
        return record
    if isinstance(name, str) and name in KERAS_ONLY_MODES:
        raise refusal(name)
    raise ValueError(
        f"Invalid quantization mode. Expected one of {tuple(_MODES)}. Received: mode={name}"
    )


def policy_name_hint(name: Any) -> str:
    """What to pass to `quantize()` instead of a policy name given as its
    mode ("int4/32"), to add to its error; "" for other names."""
    if not isinstance(name, str):
        return ""
    base, _, source = name.partition("_from_")
    mode, _, block = base.partition("/")
    if mode not in _MODES or not (block or source):
        return ""
    record = _MODES[mode]
    if mode == "int4" and block.lstrip("-").isdigit():
        config = f", Int4QuantizationConfig(block_size={block})"
    elif block or record.calibrated:
        config = f", config={record.config_class.__name__}(...)"
    else:
        config = ""
    hint = (
        f". '{name}' names a policy, not a mode: quantize(model, '{mode}'{config}) (the "
        "configs are in dtype_policies.quantization)"
    )
    if record.calibrated:  # a policy alone holds no calibrated weights
        return hint
    return f"{hint}, or apply the policy: apply_policy(model, '{base}_from_{source or 'float32'}')"


def quantized_suffixes() -> tuple[str, ...]:
    """The data suffixes (`"_int8"`, `"_int4"`) that mark quantized weights,
    each once."""
    return tuple(dict.fromkeys(r.data_suffix for r in _MODES.values() if r.data_suffix))


def module_buffer_modes() -> dict[str, str]:
    """`{name: mode}` of the tensors modes store on a module itself
    (float8's `"kernel_scale"`, ...): they mark a module in that mode."""
    return {name: r.name for r in _MODES.values() for name in r.module_buffers}


def stored_suffixes() -> tuple[str, ...]:
    """Every suffix any mode appends to a weight's name for its stored tensors."""
    seen: dict[str, None] = {}
    for record in _MODES.values():
        seen.update(dict.fromkeys(record.stored_suffixes))
    return tuple(seen)


def mode_names() -> tuple[str, ...]:
    """The names of the implemented modes, in registration order: what the
    public `QUANTIZATION_MODES` (a plain tuple, as Keras's) holds when read.

    >>> from dtype_policies import QUANTIZATION_MODES
    >>> QUANTIZATION_MODES
    ('int8', 'float8', 'int4', 'gptq', 'awq')
    >>> "int8_from_float32".startswith(QUANTIZATION_MODES), ["int8"] in QUANTIZATION_MODES
    (True, False)
    """
    return tuple(_MODES)


def module_attribute(module_name: str, name: str) -> Any:
    """A public namespace's `__getattr__`: `QUANTIZATION_MODES` read from the
    registry at each access, so modes registered after import appear in it."""
    if name == "QUANTIZATION_MODES":
        return mode_names()
    raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
