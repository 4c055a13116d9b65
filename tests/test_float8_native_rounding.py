"""float8 inputs rounded in one native call (`float8_e4m3_qdq`): the values
of torch's ops (`compute_float8_dynamic_scale`, `quantize_and_dequantize`)
bit for bit, on every float dtype, with zeros, NaN, inf and subnormal
scales; and the layers reach it only where it applies."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtype_policies import apply_policy, quantize
from dtype_policies.quantization import Float8QuantizationConfig
from dtype_policies.quantization.kernels import float8 as float8_kernels
from dtype_policies.quantizers.math import (
    FLOAT8_E4M3_MAX,
    compute_float8_dynamic_scale,
    quantize_and_dequantize,
)
from native_kernels import needs_kernel

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def in_torch(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if scale is None:
        scale = compute_float8_dynamic_scale(x, FLOAT8_E4M3_MAX)
    return quantize_and_dequantize(x, scale, torch.float8_e4m3fn, x.dtype)


def native(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.dtype_policies.float8_e4m3_qdq(x, scale)


def assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(nan=0.0), expected.nan_to_num(nan=0.0))


def edge_cases(dtype: torch.dtype) -> list[torch.Tensor]:
    torch.manual_seed(0)
    spread = torch.randn(3, 576) * torch.logspace(-8, 4, 576)
    special = torch.randn(64)
    special[3], special[5], special[7] = float("nan"), float("inf"), -float("inf")
    return [
        t.to(dtype)
        for t in (
            spread,
            torch.randn(512, 576) * 30,  # above the parallel grain
            special,
            torch.zeros(10),
            torch.full((4,), float("nan")),
            torch.randn(100) * 1e-30,  # a scale below float32's normals
            torch.zeros(0, 5),
            torch.randn(2, 3, 8).transpose(1, 2),  # not contiguous
        )
    ]


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [None, 0.37, 1e-3, 2.0**-140], ids=str)
def test_native_rounding_equals_torchs_ops(dtype, scale):
    given_scale = None if scale is None else torch.tensor(scale)
    for x in edge_cases(dtype):
        assert_same(native(x, given_scale), in_torch(x, given_scale))


@needs_kernel
@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(
        st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=64
    ),
    dtype=st.sampled_from(DTYPES),
    scale=st.one_of(st.none(), st.floats(min_value=2.0**-100, max_value=2.0**20, width=32)),
)
def test_native_rounding_equals_torchs_ops_on_any_values(values, dtype, scale):
    x = torch.tensor(values).to(dtype)
    given_scale = None if scale is None else torch.tensor(scale)
    assert_same(native(x, given_scale), in_torch(x, given_scale))


@needs_kernel
def test_native_rounding_refuses_what_it_cannot_round_naming_it():
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16 inputs; got Long"):
        native(torch.arange(4), None)
    with pytest.raises(RuntimeError, match="a scale of one element; got 2"):
        native(torch.ones(4), torch.ones(2))


@needs_kernel
@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
def test_eager_float8_layers_round_inputs_natively_with_torchs_values(scaling, monkeypatch):
    """A float8 layer's eager call outside autograd rounds its inputs in the
    native call, with the values the torch ops give (the same layer with the
    native path turned off)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32)
    apply_policy(layer, "mixed_bfloat16")
    quantize(layer, "float8", Float8QuantizationConfig(scaling=scaling))
    layer.eval()
    x = torch.randn(5, 64) * 7
    calls = []
    original = float8_kernels._native_rounding
    monkeypatch.setattr(
        float8_kernels,
        "_native_rounding",
        lambda *args: calls.append(original(*args)) or calls[-1],
    )
    with torch.inference_mode():
        fast = layer(x)
        assert calls == [True]
        monkeypatch.setattr(float8_kernels, "_native_rounding", lambda *args: False)
        layer_in_torch = layer(x)
    assert fast.dtype == torch.bfloat16
    assert torch.equal(fast, layer_in_torch)


def test_tensors_the_native_call_does_not_take_are_rounded_by_torch():
    x = torch.randn(4, 8)
    assert not float8_kernels._native_rounding(x.double(), None)
    assert not float8_kernels._native_rounding(x.to("meta"), None)
    assert not float8_kernels._native_rounding(x, torch.tensor(1.0, device="meta"))
    assert not float8_kernels._native_rounding(x, torch.tensor(0.3, dtype=torch.float64))
    large = torch.randn(float8_kernels._NATIVE_ROUNDING_MAX_ELEMENTS + 1)
    assert not float8_kernels._native_rounding(large, None)  # torch's ops are faster
    expected = in_torch(x.double(), None)
    assert torch.equal(float8_kernels.rounded_inputs(x.double(), None), expected)
