"""Inference contexts x modes x module kinds, and gradients through quantized layers."""

import warnings

import pytest
import torch
import torch.nn as nn

from dtype_policies import apply_policy, layers, quantize
from dtype_policies.quantization import Int4QuantizationConfig, Int8QuantizationConfig

MODES = {
    "int8": ("int8", None),
    "int8_weight_only": ("int8", Int8QuantizationConfig(activation_quantizer=None)),
    "int4": ("int4", None),
    "int4_per_channel": ("int4", Int4QuantizationConfig(block_size=-1)),
    "float8": ("float8", None),
}
CONTEXTS = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "grad": torch.enable_grad,
}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def torch_linear():
    return nn.Sequential(nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 32))


def keras_dense():
    model = layers.Sequential([layers.Dense(48, activation="gelu"), layers.Dense(32)])
    model(torch.zeros(1, 64))
    return model


def keras_einsum():
    model = layers.Sequential(
        [layers.EinsumDense("ab,bc->ac", output_shape=48, bias_axes="c"), layers.Dense(32)]
    )
    model(torch.zeros(1, 64))
    return model


BUILDERS = {"nn.Linear": torch_linear, "Dense": keras_dense, "EinsumDense": keras_einsum}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("context", list(CONTEXTS))
@pytest.mark.parametrize("kind", list(BUILDERS))
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_every_mode_runs_in_every_context(mode, context, kind, rows):
    torch.manual_seed(0)
    model = BUILDERS[kind]()
    x = torch.randn(rows, 64)
    with torch.no_grad():
        reference = model(x)
    apply_policy(model, "mixed_bfloat16")
    quantize(model, *MODES[mode])
    with CONTEXTS[context]():
        out = model(x)
        empty = model(x[:0])
    assert out.dtype == torch.bfloat16 and out.shape == reference.shape
    assert relative_error(out, reference) < (0.25 if mode.startswith("int4") else 0.1)
    assert empty.shape == (0, 32)


@pytest.mark.parametrize("mode", list(MODES))
def test_quantize_inside_inference_mode_then_use_elsewhere(mode):
    torch.manual_seed(0)
    model = torch_linear()
    x = torch.randn(20, 64)
    with torch.inference_mode():
        apply_policy(model, "mixed_bfloat16")
        quantize(model, *MODES[mode])
        inside = model(x)
    with torch.no_grad():
        outside = model(x)
    assert torch.equal(inside, outside)
    out = model(x.requires_grad_())
    out.float().sum().backward()  # buffers made in inference mode never block autograd
    assert x.grad is not None


def test_models_built_in_inference_mode_work_under_no_grad_and_quantize():
    with torch.inference_mode():
        model = torch_linear()
        dense = layers.Dense(8, dtype="mixed_bfloat16")
        dense(torch.randn(2, 4))
    apply_policy(model, "mixed_bfloat16")
    with torch.no_grad():
        assert model(torch.randn(2, 64)).dtype == torch.bfloat16
        assert dense(torch.randn(2, 4)).dtype == torch.bfloat16
    quantize(model, "int8")
    with torch.no_grad():
        assert model(torch.randn(20, 64)).dtype == torch.bfloat16


@pytest.mark.parametrize("mode", ["int8", "int8_weight_only", "int4", "int4_per_channel"])
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_input_gradient_is_the_straight_through_one(mode, policy):
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    apply_policy(linear, policy)
    quantize(linear, *MODES[mode])
    x = torch.randn(8, 64, requires_grad=True)
    linear(x).float().square().sum().backward()
    dequantized = linear.weight.detach().float()  # reads as the dequantized weight
    reference_x = x.detach().clone().requires_grad_(True)
    y = torch.nn.functional.linear(reference_x, dequantized, linear.bias.detach())
    y.square().sum().backward()
    cosine = torch.nn.functional.cosine_similarity(
        x.grad.flatten(), reference_x.grad.flatten(), dim=0
    )
    assert cosine > (0.999 if policy == "float32" else 0.99)
    assert linear.bias.grad is not None and linear.bias.grad.dtype == torch.float32
    assert all(not t.requires_grad for t in linear.buffers())


def test_adapter_before_a_quantized_layer_learns():
    torch.manual_seed(0)
    frozen = nn.Linear(32, 16)
    target = torch.randn(64, 16)
    x = torch.randn(64, 32)
    quantize(frozen, "int8")
    adapter = nn.Linear(32, 32)
    optimizer = torch.optim.Adam(adapter.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        loss = (frozen(adapter(x)) - target).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
