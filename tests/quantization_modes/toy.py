"""Two quantization modes defined in test code alone, to prove that adding a
mode is one record (`dtype_policies._modes.register_mode`) plus its scheme and
config, and that the package derives everything else from it.

* `toy8`: plain (no calibration). Weights per output channel, symmetric
  int8 with a multiplicative step: `W ~= q * step`. Stored: `<w>_toy8`
  (int8, (N, K)) and `<w>_toystep` (float32, (N,)). Linear weights only.
* `toyact`: calibrated, in the way of AWQ: each input channel `k` gets the
  mean absolute input `a_k` it saw on the calibration data; the weight is
  quantized as `W * a` (salient channels get finer steps) and dequantized as
  `q * step / a`. Stored: `<w>_toyact` (int8, (N, K)), `<w>_toyact_step`
  (float32, (N,)), `<w>_toyact_mean` (float32, (K,)).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from dtype_policies._modes import QuantizationMode, register_mode, unregister_mode
from dtype_policies.policies import QuantizedDTypePolicy
from dtype_policies.quantization.schemes.base import QuantizedWeight, Scheme, WeightSpec
from dtype_policies.quantizers.config import CalibratedQuantizationConfig, QuantizationConfig


def _per_row_int8(w_nk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    step = w_nk.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w_nk / step[:, None]).clamp(-127, 127).to(torch.int8)
    return q, step


class ToyConfig(QuantizationConfig):
    mode = "toy8"  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__(None, None)

    def get_config(self) -> dict[str, Any]:
        return {}


class ToyScheme(Scheme):
    mode = "toy8"
    roles = ("linear",)
    suffixes = ("_toy8", "_toystep")

    def buffer_names(self, spec: WeightSpec, config: Any) -> tuple[str, ...]:
        return tuple(spec.weight + suffix for suffix in self.suffixes)

    def stored_shapes(self, spec: WeightSpec, config: Any) -> dict:
        data, step = self.buffer_names(spec, config)
        n, k = spec.out_features, spec.in_features
        return {data: ((n, k), torch.int8), step: ((n,), torch.float32)}

    def quantize(self, weight: torch.Tensor, spec: WeightSpec, config: Any) -> dict:
        q, step = _per_row_int8(spec.nk(spec.matrix(weight.detach())).float())
        data, step_name = self.buffer_names(spec, config)
        return {data: q.contiguous(), step_name: step.contiguous()}

    def dequantize(self, module: torch.nn.Module, qw: QuantizedWeight) -> torch.Tensor:
        data, step = (module._buffers[n] for n in self.buffer_names(qw.spec, qw.config))
        return data.float() * step[:, None]

    def integer_values(self, module: torch.nn.Module, qw: QuantizedWeight) -> torch.Tensor:
        return module._buffers[self.buffer_names(qw.spec, qw.config)[0]]

    def linear(self, module, qw, x2, bias, compute):
        weight = self.dequantize(module, qw).to(compute)
        return torch.nn.functional.linear(
            x2.to(compute), weight, None if bias is None else bias.to(compute)
        )


class ToyActConfig(CalibratedQuantizationConfig):
    mode = "toyact"  # type: ignore[assignment]


class MeanAbsolute:
    """The per-channel mean of |x| over every input row seen (`ActivationStatistics`)."""

    fail_after: int | None = None  # tests: raise on the n-th update
    failure: type[BaseException] = RuntimeError
    updates = 0

    def __init__(self, channels: int) -> None:
        self.total = torch.zeros(channels, dtype=torch.float64)
        self.rows = 0

    def update(self, rows: torch.Tensor, row_weights: torch.Tensor | None = None) -> None:
        MeanAbsolute.updates += 1
        if MeanAbsolute.fail_after is not None and MeanAbsolute.updates > MeanAbsolute.fail_after:
            raise MeanAbsolute.failure("toyact: stopped part-way (test)")
        assert rows.is_floating_point() and rows.dim() == 2
        self.total += rows.float().abs().sum(0).double()
        self.rows += rows.shape[0]

    @property
    def mean(self) -> torch.Tensor:
        return (self.total / max(self.rows, 1)).float().clamp(min=1e-6)


class ToyActScheme(ToyScheme):
    mode = "toyact"
    suffixes = ("_toyact", "_toyact_step", "_toyact_mean")

    def stored_shapes(self, spec: WeightSpec, config: Any) -> dict:
        data, step, mean = self.buffer_names(spec, config)
        n, k = spec.out_features, spec.in_features
        return {
            data: ((n, k), torch.int8),
            step: ((n,), torch.float32),
            mean: ((k,), torch.float32),
        }

    def quantize(self, weight: torch.Tensor, spec: WeightSpec, config: Any) -> dict:
        raise ValueError("toyact quantizes from calibration data only")

    def new_statistics(self, spec: WeightSpec, config: Any) -> MeanAbsolute:
        return MeanAbsolute(spec.in_features)

    def quantize_calibrated(self, weight, spec, config, statistics) -> dict:
        mean = statistics.mean
        q, step = _per_row_int8(spec.nk(spec.matrix(weight.detach())).float() * mean[None, :])
        data, step_name, mean_name = self.buffer_names(spec, config)
        return {data: q.contiguous(), step_name: step.contiguous(), mean_name: mean.contiguous()}

    def dequantize(self, module: torch.nn.Module, qw: QuantizedWeight) -> torch.Tensor:
        data, step, mean = (module._buffers[n] for n in self.buffer_names(qw.spec, qw.config))
        return data.float() * step[:, None] / mean[None, :]


TOY8 = QuantizationMode(
    name="toy8",
    config_class=ToyConfig,
    policy_class=QuantizedDTypePolicy,
    scheme=ToyScheme(),
    stored_suffixes=ToyScheme.suffixes,
    data_suffix="_toy8",
    label=lambda config: "toy8 (test)",
)
TOYACT = QuantizationMode(
    name="toyact",
    config_class=ToyActConfig,
    policy_class=QuantizedDTypePolicy,
    scheme=ToyActScheme(),
    stored_suffixes=ToyActScheme.suffixes,
    data_suffix="_toyact",
    calibrated=True,
    label=lambda config: "toyact (test, calibrated)",
)


@contextlib.contextmanager
def registered(*records: QuantizationMode):
    """The toy modes registered for the duration of a test."""
    for record in records:
        register_mode(record)
    try:
        yield
    finally:
        for record in records:
            unregister_mode(record.name)
