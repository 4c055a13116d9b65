"""int8 products on the layouts torch's integer product misreads: a weight
of one input (K = 1), and a one-row input stored as a transposed column
(strides (1, 1), which torch calls contiguous). `torch._int_mm` returned
uninitialised memory for both (errors of 1e3 to 1e5)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dtype_policies import apply_policy, quantize
from dtype_policies.quantization import Int8QuantizationConfig

CONFIGS = {
    "W8A8 per token": Int8QuantizationConfig(),
    "default (per block of 32)": None,
}


def _quantized(inputs: int, outputs: int, policy: str, config) -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(inputs, outputs)
    apply_policy(layer, policy)
    quantize(layer, "int8", config)
    return layer


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_a_one_row_input_stored_as_a_column_gives_the_row_s_values(config, policy):
    layer = _quantized(576, 64, policy, config)
    dtype = torch.bfloat16 if policy == "mixed_bfloat16" else torch.float32
    column = torch.randn(576, 1, generator=torch.Generator().manual_seed(1)).to(dtype)
    row = column.t()
    assert row.stride() == (1, 1) and row.is_contiguous()
    with torch.no_grad():
        assert torch.equal(layer(row), layer(row.clone(memory_format=torch.contiguous_format)))
        assert torch.equal(layer(row), layer(column.flatten()[None, :].contiguous()))


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_weight_of_one_input_multiplies_exactly(config, compiled):
    layer = _quantized(1, 16, "float32", config)
    x = torch.randn(4, 1, generator=torch.Generator().manual_seed(2))
    # one input per row: its int8 rounding is exact (the row's step is |x| / 127);
    # the default rounds its steps (float16, as llama.cpp's Q8_0): within 1%
    expected = F.linear(x, layer.weight, layer.bias)
    run = torch.compile(layer, backend="inductor") if compiled else layer
    with torch.no_grad():
        got = run(x)
    tolerance = 1e-5 if config is not None else 1e-2 * float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=0, atol=tolerance)


def test_keras_w8a8_under_bfloat16_compute_rounds_once_after_the_bias():
    """The bfloat16 result is the exact one (float64, with the inputs rounded
    as the kernel rounds them) rounded once: the bias is added to the
    unrounded product, so outputs the bias nearly cancels stay right."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1000, 520))
    with torch.no_grad():
        model[0].bias.copy_(torch.randn(520) * 3)
    apply_policy(model, "mixed_bfloat16")
    quantize(model, config=Int8QuantizationConfig())
    x = torch.randn(64, 1000)
    with torch.no_grad():
        got = model(x).double()
    rounded = x.bfloat16().float()
    step = (rounded.abs().amax(-1, keepdim=True) + 1e-7) / 127
    inputs = (torch.round(rounded / step).clamp(-127, 127) * step).double()
    layer = model[0]
    exact = inputs @ layer.weight.detach().double().t() + layer.bias.detach().bfloat16().double()
    ulps = (got - exact).abs() / 2.0 ** (torch.floor(torch.log2(exact.abs())) - 7)
    assert float(ulps.max()) <= 1.5


@pytest.mark.parametrize(
    ("value_range", "epsilon"), [((-20, 20), 1e-7), ((-127, 127), 100.0), ((-20, 30), 1e-7)]
)
@pytest.mark.parametrize("compiled", [False, True])
def test_an_activation_quantizer_of_its_own_rounds_the_inputs_by_its_rule(
    value_range, epsilon, compiled
):
    """Keras's rule, `q = clip(round(x * s), value_range)` with `s = high /
    (max|x| + epsilon)` per row, for a quantizer other than the default
    (the integer kernels implement only the default's)."""
    from dtype_policies.quantizers import AbsMaxQuantizer

    torch.manual_seed(0)
    quantizer = AbsMaxQuantizer(axis=-1, value_range=value_range, epsilon=epsilon)
    config = Int8QuantizationConfig(activation_quantizer=quantizer)
    assert config.own_input_rounding and not Int8QuantizationConfig().own_input_rounding
    linear = nn.Linear(32, 8)
    quantize(linear, "int8", config)
    x = torch.randn(5, 32)
    step = value_range[1] / (x.abs().amax(-1, keepdim=True) + epsilon)
    xq = torch.clamp(torch.round(x * step), *value_range)
    weights = linear.weight_int8.float()
    expected = (xq @ weights.t()) / (step * linear.weight_scale[None, :]) + linear.bias
    run = torch.compile(linear, backend="aot_eager", fullgraph=True) if compiled else linear
    with torch.no_grad():
        assert torch.allclose(run(x), expected, rtol=1e-6, atol=1e-6)
    x.requires_grad_()
    run(x).sum().backward()  # straight through the rounding: the dequantized weight
    dequantized = weights / linear.weight_scale[:, None]
    assert torch.allclose(x.grad, dequantized.sum(0).expand_as(x), rtol=1e-5, atol=1e-6)


def test_an_activation_quantizer_of_its_own_compiles_to_eager_s_values_in_bfloat16():
    """Inductor drops a fused bfloat16 cast pair: the inputs are rounded to
    the compute dtype's values before the quantizer sees them, as eager."""
    from dtype_policies.apply.kernel_report import kernel_of
    from dtype_policies.quantizers import AbsMaxQuantizer

    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    apply_policy(linear, "mixed_bfloat16")
    quantizer = AbsMaxQuantizer(axis=-1, value_range=(-20, 30))
    quantize(linear, "int8", Int8QuantizationConfig(activation_quantizer=quantizer))
    assert kernel_of(linear).startswith("inputs rounded to int8 by the config's")
    torch._dynamo.reset()  # the tests above compiled nn.Linear's forward already
    compiled = torch.compile(linear, fullgraph=True)
    with torch.no_grad():  # the bias's bfloat16 values too: small outputs, 3-D inputs
        for x in (torch.randn(7, 64) * 100, torch.randn(3, 7, 64) * 2):
            assert torch.equal(compiled(x), linear(x))


def test_a_default_quantizer_written_otherwise_is_the_default():
    import numpy as np

    from dtype_policies.quantizers import AbsMaxQuantizer

    for quantizer in (
        AbsMaxQuantizer(axis=-1),
        AbsMaxQuantizer(value_range=[-127, 127], epsilon=1e-7),
    ):
        config = Int8QuantizationConfig(activation_quantizer=quantizer, activation_block_size=32)
        assert not config.own_input_rounding
    assert AbsMaxQuantizer(epsilon=np.float32(1e-3)).epsilon == pytest.approx(1e-3)
