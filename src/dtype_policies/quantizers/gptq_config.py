"""`GPTQConfig` (Keras's `keras.quantizers.GPTQConfig`) and the part it shares
with `AWQConfig`: calibration text or ids, `num_samples` x `sequence_length`."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from dtype_policies.quantizers.calibration_data import calibration_inputs
from dtype_policies.quantizers.config import CalibratedQuantizationConfig
from dtype_policies.quantizers.gptq import GRIDS

GPTQ_WEIGHT_BITS = (2, 3, 4, 8)
DEFAULT_CALIBRATION_BATCH_SIZE = 4


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool) or type(value).__name__ in ("bool_", "bool")  # NumPy


def as_int(name: str, value: Any) -> int:
    """`value` as an int: Python's or NumPy's integers, or a float holding
    one (`4.0`: Keras's checks, `weight_bits in [2, 3, 4, 8]`, take it);
    never a bool."""
    if not _is_bool(value) and isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real) and not _is_bool(value) and float(value).is_integer():
        return int(float(value))
    raise ValueError(f"{name} must be an integer. Received: {name}={value!r}")


def as_bool(name: str, value: Any) -> bool:
    if _is_bool(value):
        return bool(value)
    raise ValueError(f"{name} must be True or False. Received: {name}={value!r}")


def checked_structure(structure: Any) -> Any:
    """`quantization_layer_structure` once checked to be one of the forms
    calibration reads: None, a sequence of submodules or their paths (a
    `ModuleList` or `Sequential` too), or Keras's dict of them; its entries
    as lists (a generator is read once)."""
    if structure is None:
        return None
    if isinstance(structure, dict):
        if structure.get("sequential_blocks") is None:
            raise ValueError(
                "quantization_layer_structure['sequential_blocks'] must hold the blocks "
                f"(submodules or their paths). Received: {structure!r}"
            )
        checked = dict(structure)
        for key in ("sequential_blocks", "pre_block_layers"):
            if checked.get(key) is not None:
                checked[key] = _check_entries(
                    f"quantization_layer_structure[{key!r}]", checked[key]
                )
        return checked
    return _check_entries("quantization_layer_structure", structure)


def _check_entries(name: str, entries: Any) -> list[Any]:
    if isinstance(entries, (str, bytes)) or not isinstance(entries, Iterable):
        raise ValueError(
            f"{name} must be a sequence of submodules or their paths (a list, even of "
            f"one block), or Keras's dict of them. Received: {entries!r}"
        )
    entries = list(entries)
    for entry in entries:
        if not isinstance(entry, (str, torch.nn.Module)):
            raise ValueError(
                f"{name} holds {entry!r} ({type(entry).__name__}); its entries are "
                "submodules of the model or their paths."
            )
    return entries


def _structure_config(structure: Any) -> Any:
    """The structure as `get_config` keeps it: paths (strings) are kept;
    modules are not serializable, so a structure holding them is `None`."""
    if structure is None:
        return None
    if not isinstance(structure, dict):
        return _paths_only(structure)
    kept = {}
    for key, entries in structure.items():
        kept[key] = entries if entries is None else _paths_only(entries)
        if entries is not None and kept[key] is None:
            return None
    return kept


def _paths_only(entries: Any) -> list[str] | None:
    """The entries as a list when they are all paths, else None."""
    entries = list(entries)
    return entries if all(isinstance(entry, str) for entry in entries) else None


class TokenCalibrationConfig(CalibratedQuantizationConfig):
    """The calibration part of `GPTQConfig` and `AWQConfig`: a dataset of text
    (with a tokenizer) or token ids, cut into `num_samples` windows of
    `sequence_length` tokens (`quantizers.calibration_data`), the block
    structure calibration walks, and the grids the levels are chosen on
    (`grid`: this library's `"refined"` or Keras's `"keras"`, see
    `GPTQConfig`).

    Settings that only change how the stored values are chosen (the data,
    the damping, the search) are quantize-time settings: two configs with
    the same bits and group size store tensors of the same layout and compare
    equal, so a checkpoint calibrated one way loads into a model quantized
    (or built from its policy) another way.
    """

    group_size_meaning: ClassVar[str] = "-1 (whole-tensor)"

    def __init__(
        self,
        dataset: Any,
        tokenizer: Any,
        *,
        weight_bits: int,
        num_samples: int,
        sequence_length: int,
        group_size: int,
        quantization_layer_structure: Any,
        calibration_batch_size: int = DEFAULT_CALIBRATION_BATCH_SIZE,
        grid: str = "refined",
    ) -> None:
        if grid not in GRIDS:
            raise ValueError(f"grid must be one of {GRIDS}. Received: grid={grid!r}")
        weight_bits = as_int("weight_bits", weight_bits)
        num_samples = as_int("num_samples", num_samples)
        sequence_length = as_int("sequence_length", sequence_length)
        group_size = as_int("group_size", group_size)
        calibration_batch_size = as_int("calibration_batch_size", calibration_batch_size)
        if calibration_batch_size <= 0:
            raise ValueError("calibration_batch_size must be a positive integer.")
        if num_samples <= 0:
            raise ValueError("num_samples must be a positive integer.")
        if sequence_length <= 0:
            raise ValueError("sequence_length must be a positive integer.")
        if group_size < -1 or group_size == 0:
            raise ValueError(
                f"Invalid group_size. Supported values are {self.group_size_meaning} or a "
                f"positive integer, but got {group_size}."
            )
        super().__init__(
            dataset, quantization_layer_structure=checked_structure(quantization_layer_structure)
        )
        self.tokenizer = tokenizer
        self.weight_bits = weight_bits
        self.num_samples = num_samples
        self.sequence_length = sequence_length
        self.group_size = group_size
        self.calibration_batch_size = calibration_batch_size
        self.grid = grid

    def dtype_policy_string(self) -> str:
        """`"<mode>/<weight_bits>/<group_size>"`, the mode part of the policy name."""
        return f"{self.mode}/{self.weight_bits}/{self.group_size}"

    def calibration_batches(self, model: torch.nn.Module) -> list[Any]:
        """`num_samples` windows of `sequence_length` token ids as model
        inputs, `calibration_batch_size` windows a batch
        (`{"input_ids": (B, L), "use_cache": False}` for Hugging Face models,
        the `(B, L)` ids otherwise), or the dataset's own floating-point inputs."""
        if self.dataset is None:
            raise ValueError(
                f"{self.mode.upper()} quantization requires a dataset (text with a tokenizer, "
                f"or token ids). Please provide it in the `{type(self).__name__}`."
            )
        return calibration_inputs(
            self.dataset,
            self.tokenizer,
            self.num_samples,
            self.sequence_length,
            model,
            self.calibration_batch_size,
        )

    def _extra_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """`config` plus this library's settings that differ from their
        defaults (absent otherwise: Keras's configs have no such keys)."""
        if self.calibration_batch_size != DEFAULT_CALIBRATION_BATCH_SIZE:
            config["calibration_batch_size"] = self.calibration_batch_size
        if self.grid != "refined":
            config["grid"] = self.grid
        return config

    def block_size(self, in_features: int) -> int:
        """The group size in input features (`in_features` for `group_size=-1`)."""
        return in_features if self.group_size == -1 else self.group_size


class GPTQConfig(TokenCalibrationConfig):
    """GPTQ (Frantar et al., 2022): weights quantized column by column, each
    column's rounding error compensated on the columns not yet quantized
    through the inverse Hessian of the layer's inputs (`2 XᵀX / n` over the
    calibration data), block by block through the model.

    Keras's config (names, defaults, errors, `get_config`). The result is
    stored as int4 data (2, 3 and 4 bits: `(q - zero) * scale` per group of
    `group_size` input features, `g_idx` giving each feature's group) or int8
    data (8 bits), and runs on the same kernels as `int4` / `int8` weight-only.

    Args:
        dataset: The calibration data: an iterable of strings (with
            `tokenizer`), of token ids (tensors, arrays, lists), or of
            floating-point model inputs (see `quantizers.calibration_data`).
        tokenizer: For text: a Hugging Face tokenizer or any callable from a
            string to token ids (`None` for ids).
        weight_bits: 2, 3, 4 or 8.
        num_samples: How many windows of `sequence_length` tokens.
        per_channel: Scales per output channel (`True`) or one per tensor.
        sequence_length: Tokens per calibration sample.
        hessian_damping: Fraction of the Hessian's mean diagonal added to its
            diagonal before it is inverted.
        group_size: Input features sharing a scale and zero point (-1: all).
        symmetric: A zero point in the middle of the range.
        activation_order: Quantize the columns in order of decreasing
            Hessian diagonal. With `grid="refined"` the groups stay the
            natural ones (no cost when running); with `grid="keras"` the
            permutation is stored as `g_idx` and the kernels permute the
            input once per call.
        quantization_layer_structure: The blocks to calibrate one at a time:
            Keras's `{"pre_block_layers": [...], "sequential_blocks": [...]}`,
            a list of blocks (modules or paths), or `None` to find them (the
            repeated decoder blocks of a Hugging Face model; otherwise the
            whole model is one block).
        calibration_batch_size: Windows per model call while calibrating
            (not Keras's, which runs one at a time: batching them is 4-5x
            faster on CPU and gives the same statistics). Each call's
            temporaries grow with it: 4 (the default) against 8 lowered the
            peak above a float32 SmolLM2-135M from 526-577 MB to 445-466 MB
            at the same speed. In `get_config` only when not 4.
        grid: How each group's scale and zero point are chosen (not
            Keras's; in `get_config` only when not `"refined"`).
            `"refined"`: fixed before the column loop from the float
            weights by int4's rule with refined zero points
            (`quantizers.gptq.refined_grid`; a weight already on a grid,
            such as a GGUF's, keeps it), then re-fitted to the chosen levels
            on the layer's output error (`quantizers.gptq.refit_grid`).
            `"keras"`: Keras's, min/max with a rounded zero point, from each
            group's columns as the loop reaches them. Measured on
            SmolLM2-135M (32 x 512 tokens, float32 24.92): gptq/4/32
            perplexity 24.95 against 28.0, gptq/4/128 with activation
            order 27.5 against 30.1 (docs/quantization.md).

    >>> from dtype_policies.quantizers import GPTQConfig
    >>> config = GPTQConfig(dataset=None, tokenizer=None, weight_bits=4, group_size=64)
    >>> config.mode, config.dtype_policy_string()
    ('gptq', 'gptq/4/64')
    >>> config == GPTQConfig(None, None, group_size=64, activation_order=True)
    True
    >>> try:
    ...     GPTQConfig(None, None, weight_bits=5)
    ... except ValueError as e:
    ...     print(e)
    Unsupported weight_bits 5. Supported values are 2, 3, 4, and 8.
    """

    mode = "gptq"  # type: ignore[assignment]
    quantize_time_settings = (
        "num_samples",
        "per_channel",
        "sequence_length",
        "calibration_batch_size",
        "hessian_damping",
        "symmetric",
        "activation_order",
        "quantization_layer_structure",
        "grid",
    )

    def __init__(
        self,
        dataset: Any,
        tokenizer: Any,
        *,
        weight_bits: int = 4,
        num_samples: int = 128,
        per_channel: bool = True,
        sequence_length: int = 512,
        hessian_damping: float = 0.01,
        group_size: int = 128,
        symmetric: bool = False,
        activation_order: bool = False,
        quantization_layer_structure: Any = None,
        calibration_batch_size: int = DEFAULT_CALIBRATION_BATCH_SIZE,
        grid: str = "refined",
    ) -> None:
        if weight_bits not in GPTQ_WEIGHT_BITS or isinstance(weight_bits, bool):
            raise ValueError(
                f"Unsupported weight_bits {weight_bits}. Supported values are 2, 3, 4, and 8."
            )
        if not isinstance(hessian_damping, numbers.Real) or _is_bool(hessian_damping):
            raise ValueError(f"hessian_damping must be a number. Received: {hessian_damping!r}")
        damping = float(hessian_damping)
        if not math.isfinite(damping) or damping < 0 or damping > 1:
            raise ValueError(
                f"hessian_damping must be between 0 and 1. Received: {hessian_damping!r}"
            )
        super().__init__(
            dataset,
            tokenizer,
            weight_bits=weight_bits,
            num_samples=num_samples,
            sequence_length=sequence_length,
            group_size=group_size,
            quantization_layer_structure=quantization_layer_structure,
            calibration_batch_size=calibration_batch_size,
            grid=grid,
        )
        self.per_channel: bool = as_bool("per_channel", per_channel)
        self.hessian_damping: float = damping
        self.symmetric: bool = as_bool("symmetric", symmetric)
        self.activation_order: bool = as_bool("activation_order", activation_order)

    def get_config(self) -> dict[str, Any]:
        config = {
            # the data is needed once, for calibration, and never saved (as Keras)
            "dataset": None,
            "tokenizer": None,
            "weight_bits": self.weight_bits,
            "num_samples": self.num_samples,
            "per_channel": self.per_channel,
            "sequence_length": self.sequence_length,
            "hessian_damping": self.hessian_damping,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "activation_order": self.activation_order,
            "quantization_layer_structure": _structure_config(self.quantization_layer_structure),
        }
        return self._extra_config(config)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        config = dict(config)
        return cls(config.pop("dataset", None), config.pop("tokenizer", None), **config)
