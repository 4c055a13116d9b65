"""Keras's `testing.TestCase` assertions, for torch tensors."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch

import dtype_policies

DELIBERATE = {
    "maps": "Policies are immutable and hashable; maps compare by content and `get_config()` "
    "never mutates them (a map built with no default policy saves the default in force then, "
    "instead of resolving its entries against the default in force at load time).",
    "buffers": "Quantized state is plain tensors: integer data, scales and float8's scaling "
    "state are buffers, not parameters, so an optimizer never sees them; float8's scales and "
    "amax histories are updated once per backward pass (by the maximum over the layer's "
    "calls), not overwritten by the optimizer; a step `LossScaleOptimizer` skips undoes them, "
    "as Keras never applies them, and with gradient accumulation they advance once per "
    "micro-batch where Keras advances once per step.",
    "einsum": "`EinsumDense` takes int8 and int4 only when its equation is a matrix product of "
    "the input's last axes (the integer kernels are matrix products); other equations take "
    "float8.",
}
"""The README's "Deliberate differences" entries that Keras tests cover, verbatim."""


def deliberate(key: str) -> pytest.MarkDecorator:
    """A strict expected failure quoting a "Deliberate differences" entry of the README."""
    return pytest.mark.xfail(
        strict=True, reason=f"Deliberate difference (README): {DELIBERATE[key]}"
    )


def as_array(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.dtype == torch.bfloat16:
            value = value.float()
        return value.cpu().numpy()
    return np.asarray(value)


def assert_all_close(actual: Any, expected: Any, atol: float = 1e-6, rtol: float = 1e-6) -> None:
    np.testing.assert_allclose(
        as_array(actual).astype(np.float64),
        as_array(expected).astype(np.float64),
        atol=atol,
        rtol=rtol,
    )


def assert_dtype(value: Any, dtype: str) -> None:
    assert str(value.dtype).removeprefix("torch.") == dtype, (value.dtype, dtype)


def variables(layer: torch.nn.Module) -> list[torch.Tensor]:
    """Keras's `layer.variables`: weights and state tensors (parameters and buffers)."""
    return [*layer.parameters(), *layer.buffers()]


def trainable_weights(layer: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in layer.parameters() if p.requires_grad]


def quantize_quietly(model: torch.nn.Module, *args: Any, **kwargs: Any):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return dtype_policies.quantize(model, *args, **kwargs)


def non_trainable_weights(layer: torch.nn.Module) -> list[torch.Tensor]:
    """Keras's `non_trainable_weights`: frozen parameters and state buffers."""
    return [p for p in layer.parameters() if not p.requires_grad] + list(layer.buffers())


def reload_model(model: torch.nn.Module, directory: Any, input_shape: tuple) -> torch.nn.Module:
    """Keras's `model.save(...)` then `saving.load_model(...)`: the model's
    config rebuilt (`layers.deserialize_layer`), built, and its saved tensors
    loaded (`saving.save` / `saving.load`)."""
    from dtype_policies import layers, saving

    saving.save(model, directory)
    fresh = layers.deserialize_layer(layers.serialize_layer(model))
    fresh.build(input_shape)
    saving.load(fresh, directory)
    return fresh


def reload_weights(model: torch.nn.Module, fresh: torch.nn.Module) -> torch.nn.Module:
    """Keras's `save_weights` / `load_weights`: the state dict into `fresh`."""
    fresh.load_state_dict(model.state_dict())
    return fresh


def run_layer_test(
    layer_cls: type,
    init_kwargs: dict,
    input_shape: tuple,
    expected_output_shape: tuple,
    expected_num_trainable_weights: int,
    expected_num_non_trainable_weights: int,
) -> None:
    """The parts of Keras's `run_layer_test` that apply: build and call,
    output shape, weight counts, and the config round trip."""
    layer = layer_cls(**init_kwargs)
    out = layer(torch.rand(input_shape))
    assert tuple(out.shape) == tuple(expected_output_shape)
    assert len(trainable_weights(layer)) == expected_num_trainable_weights
    assert len(non_trainable_weights(layer)) == expected_num_non_trainable_weights
    revived = layer_cls.from_config(layer.get_config())
    assert revived.get_config() == layer.get_config()


def assert_float8_delayed_scaling(layer: torch.nn.Module, inputs: int, units: int) -> None:
    """Keras's test_quantize_float8: three training steps (AdamW) replayed by
    hand; every scale and amax history matches."""
    from dtype_policies import quantizers

    optimizer = torch.optim.AdamW(trainable_weights(layer), lr=0.1)
    scale_x, amax_history_x = torch.ones(()), torch.zeros(1024)
    scale_k, amax_history_k = torch.ones(()), torch.zeros(1024)
    scale_g, amax_history_g = torch.ones(()), torch.zeros(1024)
    e4m3_max = float(torch.finfo(torch.float8_e4m3fn).max)
    e5m2_max = float(torch.finfo(torch.float8_e5m2).max)
    for _ in range(3):
        x, g = torch.randn(16, inputs), torch.randn(16, units)
        k = layer.kernel.detach().clone()
        scale_x = quantizers.compute_float8_scale(amax_history_x.max(), scale_x, e4m3_max)
        scale_k = quantizers.compute_float8_scale(amax_history_k.max(), scale_k, e4m3_max)
        scale_g = quantizers.compute_float8_scale(amax_history_g.max(), scale_g, e5m2_max)
        amax_history_x = quantizers.compute_float8_amax_history(x, amax_history_x)
        amax_history_k = quantizers.compute_float8_amax_history(k, amax_history_k)
        amax_history_g = quantizers.compute_float8_amax_history(g, amax_history_g)
        layer.zero_grad()
        (layer(x, training=True) * g).sum().backward()
        optimizer.step()
        assert_all_close(layer.inputs_amax_history, amax_history_x)
        assert_all_close(layer.kernel_amax_history, amax_history_k)
        assert_all_close(layer.outputs_grad_amax_history, amax_history_g)
        assert_all_close(layer.inputs_scale, scale_x)
        assert_all_close(layer.kernel_scale, scale_k)
        assert_all_close(layer.outputs_grad_scale, scale_g)
