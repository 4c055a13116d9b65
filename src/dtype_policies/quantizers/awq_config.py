"""`AWQConfig` (Keras's `keras.quantizers.AWQConfig`)."""

from __future__ import annotations

from typing import Any

from dtype_policies.quantizers.gptq_config import (
    DEFAULT_CALIBRATION_BATCH_SIZE,
    TokenCalibrationConfig,
    _structure_config,
    as_int,
)

AWQ_OBJECTIVES = ("output", "weight")


class AWQConfig(TokenCalibrationConfig):
    """AWQ (Lin et al., 2023): each input channel `k` of a weight gets a scale
    `s_k` from the activations it sees (salient channels get larger ones);
    the weight is quantized as `W * s` and the layer computes
    `(x / s) @ dequantize(q)`, so salient channels lose less to rounding.
    Stored: int4 data, scales and zero points per group (as GPTQ's), plus
    `awq_scales` (K,); it runs on the int4 kernel after one division of the
    input.

    Keras's config (names, defaults, errors, `get_config`), plus `objective`,
    how the per-layer grid search over `s = a ** ratio` (`a` the channel's
    activation magnitude, `ratio` in `[0, 1]`) scores a candidate:

    * `"output"` (the default): the layer's output error on the calibration
      inputs, `tr((W - Ŵ) H (W - Ŵ)ᵀ)` with `H = XᵀX` (the original AWQ's
      criterion, computed exactly from the inputs' second moments), with
      `a` the mean |x| per channel, on this library's grids (`grid`);
    * `"weight"`: Keras's criterion, the weight error weighted by each
      channel's squared maximum |x|, `mean((W - Ŵ)² * max|x|²)` (Keras's
      integers exactly).

    Args:
        dataset, tokenizer, num_samples, sequence_length,
        quantization_layer_structure, calibration_batch_size: As `GPTQConfig`'s.
        weight_bits: 4 (the only width AWQ supports).
        group_size: Input features sharing a scale and zero point (-1: all).
        num_grid_points: Ratios tried in the scale search (`0, 1/n, ..., 1`).
        objective: `"output"` or `"weight"` (see above); a quantize-time
            setting, kept in `get_config` only when not the default.
        grid: With the `"output"` objective, each group's grid (not Keras's;
            in `get_config` only when not `"refined"`). `"refined"`: the
            candidates rounded by int4's rule, the result on
            `quantizers.gptq.refined_grid` re-fitted to its levels on the
            output error (as GPTQ's). `"keras"`: Keras's grids (min/max, a
            rounded zero point), each group's range clipped by the original
            AWQ's search. Measured on SmolLM2-135M, awq/4/128 on 32 x 512
            tokens: perplexity 28.0 against 29.6 (float32 24.92). The
            `"weight"` objective always uses Keras's grids.

    >>> from dtype_policies.quantizers import AWQConfig
    >>> config = AWQConfig(dataset=None, tokenizer=None, group_size=64)
    >>> config.dtype_policy_string(), config.objective
    ('awq/4/64', 'output')
    >>> AWQConfig(None, None, objective="weight").get_config()["objective"]
    'weight'
    """

    mode = "awq"  # type: ignore[assignment]
    group_size_meaning = "-1 (per-channel)"
    quantize_time_settings = (
        "num_samples",
        "sequence_length",
        "calibration_batch_size",
        "num_grid_points",
        "objective",
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
        sequence_length: int = 512,
        group_size: int = 128,
        num_grid_points: int = 20,
        quantization_layer_structure: Any = None,
        objective: str = "output",
        calibration_batch_size: int = DEFAULT_CALIBRATION_BATCH_SIZE,
        grid: str = "refined",
    ) -> None:
        if weight_bits != 4 or isinstance(weight_bits, bool):
            raise ValueError(
                f"AWQ only supports 4-bit quantization. Received weight_bits={weight_bits}."
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
        num_grid_points = as_int("num_grid_points", num_grid_points)
        if num_grid_points <= 0:
            raise ValueError(
                f"num_grid_points must be a positive integer. Received: {num_grid_points}"
            )
        if objective not in AWQ_OBJECTIVES:
            raise ValueError(
                f"`objective` must be one of {AWQ_OBJECTIVES}. Received: objective={objective!r}"
            )
        self.num_grid_points = num_grid_points
        self.objective = objective

    def get_config(self) -> dict[str, Any]:
        config = {
            # the data is needed once, for calibration, and never saved (as Keras)
            "dataset": None,
            "tokenizer": None,
            "weight_bits": self.weight_bits,
            "num_samples": self.num_samples,
            "sequence_length": self.sequence_length,
            "group_size": self.group_size,
            "num_grid_points": self.num_grid_points,
            "quantization_layer_structure": _structure_config(self.quantization_layer_structure),
        }
        if self.objective != "output":  # absent by default: Keras's configs have no such key
            config["objective"] = self.objective
        return self._extra_config(config)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        config = dict(config)
        return cls(config.pop("dataset", None), config.pop("tokenizer", None), **config)
