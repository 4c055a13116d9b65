"""Origin: keras/src/quantizers/quantizers_test.py (Keras 3.15): the
quantizers this library mirrors.

Not ported: `fake_quant_with_min_max_vars` (checked against Keras itself in
tests/test_keras_namespaces.py) and GPTQ's primitives
(`compute_quantization_parameters`, `quantize_with_sz_map`,
`dequantize_with_sz_map`: `GPTQQuantizerTest`, `ComputeScaleZeroTest`,
`GroupedQuantizationParametersTest`), which arrive with GPTQ. Keras's
`abs_max_quantize_grouped_with_zero_point` is
`grouped_quantize_with_zero_point` in this library's int4 path (Keras's
function, with its numerics, is here too) and its `dequantize_with_sz_map`
over a `g_idx` is `dequantize_grouped`.
"""

import math
import warnings

import pytest
import torch

from dtype_policies import quantizers

from .helpers import assert_all_close, assert_dtype


def uniform(shape, dtype=torch.float32, seed=None, low=-1.0, high=1.0):
    generator = torch.Generator().manual_seed(seed if seed is not None else 0)
    return (torch.rand(shape, generator=generator) * (high - low) + low).to(dtype)


SHAPE_AXIS_SCENARIOS = [
    ("2d_axis0_odd", (5, 8), 0),
    ("2d_axis0_even", (4, 8), 0),
    ("2d_axis1_odd", (8, 7), 1),
    ("2d_axis_neg1_even", (8, 6), -1),
    ("4d_axis1_odd", (2, 5, 4, 6), 1),
    ("4d_axis2_even", (2, 4, 8, 6), 2),
    ("4d_axis_neg1_odd", (2, 4, 6, 7), -1),
]
DTYPE_PARAMS = [("int8", "int8", -8, 8), ("uint8", "uint8", 0, 16)]


class TestQuantizersTest:
    def test_get_method(self):
        quantizer = quantizers.get("abs_max_quantizer")
        assert isinstance(quantizer, quantizers.AbsMaxQuantizer)
        assert quantizers.get(None) is None
        with pytest.raises(ValueError):
            quantizers.get("typo")

    def test_abs_max_quantizer(self):
        values = uniform((3, 4, 5))
        quantizer = quantizers.AbsMaxQuantizer()
        quantized_values, scale = quantizer(values, axis=-1)
        assert_dtype(quantized_values, "int8")
        assert_dtype(scale, "float32")
        assert tuple(quantized_values.shape) == (3, 4, 5)
        assert tuple(scale.shape) == (3, 4, 1)
        assert quantized_values.max() <= 127 and quantized_values.min() >= -127
        dequantized = quantized_values / scale
        assert float(((values - dequantized) ** 2).mean().sqrt()) < 1e-1
        # run_class_serialization_test
        config = quantizer.get_config()
        revived = quantizers.AbsMaxQuantizer.from_config(config)
        assert revived.get_config() == config
        assert quantizers.deserialize(quantizers.serialize(quantizer)).get_config() == config
        # bfloat16 and float16 inputs: the scale is in the input's dtype
        for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
            quantized_values, scale = quantizer(uniform((3, 4, 5), dtype), axis=-1)
            assert_dtype(quantized_values, "int8")
            assert_dtype(scale, name)

    def test_abs_max_quantizer_to_numpy(self):
        values = uniform((3, 4, 5))
        quantized_values, scale = quantizers.abs_max_quantize(values, axis=-1, to_numpy=True)
        ref_quantized_values, ref_scale = quantizers.abs_max_quantize(values, axis=-1)
        assert_all_close(quantized_values, ref_quantized_values)
        assert_all_close(scale, ref_scale)

    def test_compute_float8_scale(self):
        amax, scale, dtype_max = 3.0, 4.0, 448.0
        expected_scale = 1.0 / (dtype_max / amax) / (2**0)
        computed_scale = quantizers.compute_float8_scale(amax, scale, dtype_max)
        assert_all_close(computed_scale, expected_scale)

    def test_compute_float8_amax_history(self):
        values = uniform((3, 4, 5))
        amax_history = uniform((123,), low=0.0)
        amax_from_values = values.abs().max()
        computed = quantizers.compute_float8_amax_history(values, amax_history)
        assert_all_close(computed[0], amax_from_values)
        assert_all_close(computed[1:], torch.roll(amax_history, -1)[1:])

    def test_quantize_and_dequantize(self):
        scale = 1.0 / 100.0
        values = uniform((3, 4, 5))
        qdq_values = quantizers.quantize_and_dequantize(values, scale, "float8_e4m3fn", "float32")
        assert_all_close(qdq_values, values, atol=1e-1)
        qdq_values = quantizers.quantize_and_dequantize(values, scale, "float8_e5m2", "float32")
        assert_all_close(qdq_values, values, atol=5e-1)

    @pytest.mark.parametrize(
        "shape, axis, dtype, minval, maxval",
        [
            pytest.param(shape, axis, dtype, low, high, id=f"{name}_{dtype_name}")
            for name, shape, axis in SHAPE_AXIS_SCENARIOS
            for dtype_name, dtype, low, high in DTYPE_PARAMS
        ],
    )
    def test_pack_unpack_int4(self, shape, axis, dtype, minval, maxval):
        arr = torch.floor(uniform(shape, low=minval, high=maxval)).to(getattr(torch, dtype))
        packed, packed_shape, orig_len = quantizers.pack_int4(arr, axis=axis)
        assert packed_shape == tuple(packed.shape) and orig_len == arr.shape[axis]
        unpacked = quantizers.unpack_int4(packed, orig_len, axis=axis, dtype=dtype)
        assert_dtype(packed, dtype)
        assert_dtype(unpacked, dtype)
        assert torch.equal(unpacked, arr)
        expected_packed_shape = list(shape)
        expected_packed_shape[axis] = (expected_packed_shape[axis] + 1) // 2
        assert list(packed.shape) == expected_packed_shape

    @pytest.mark.parametrize("block_size", [32, 64, 128], ids=["block_32", "block_64", "block_128"])
    def test_grouped_quantize_dequantize_roundtrip(self, block_size):
        kernel = uniform((256, 128))
        quantized, scale, zero = quantizers.grouped_quantize_with_zero_point(kernel, block_size)
        dequantized = quantizers.dequantize_grouped(quantized, scale, zero, block_size)
        assert float(((kernel - dequantized) ** 2).mean().sqrt()) < 0.15

    def test_grouped_quantize_with_padding(self):
        input_dim, output_dim, block_size = 500, 256, 128
        quantized, scale, zero = quantizers.grouped_quantize_with_zero_point(
            uniform((input_dim, output_dim)), block_size
        )
        n_groups = math.ceil(input_dim / block_size)
        assert tuple(quantized.shape) == (input_dim, output_dim)
        assert tuple(scale.shape) == (n_groups, output_dim) == tuple(zero.shape)

    def test_grouped_vs_perchannel_accuracy(self):
        input_dim, output_dim, block_size = 512, 256, 128
        kernel = uniform((input_dim, output_dim), seed=42)
        quantizer = quantizers.AbsMaxQuantizer(axis=0, value_range=(-8, 7), output_dtype="int8")
        pc_quantized, pc_scale = quantizer(kernel)
        pc_rmse = float(((kernel - pc_quantized.float() / pc_scale) ** 2).mean().sqrt())
        quantized, scale, zero = quantizers.grouped_quantize_with_zero_point(kernel, block_size)
        grouped = quantizers.dequantize_grouped(quantized, scale, zero, block_size)
        grouped_rmse = float(((kernel - grouped) ** 2).mean().sqrt())
        assert grouped_rmse <= pc_rmse + 0.01

    def test_grouped_quantize_various_block_sizes(self):
        input_dim, output_dim = 512, 128
        kernel = uniform((input_dim, output_dim))
        for block_size in [32, 64, 128, 256]:
            quantized, scale, zero = quantizers.grouped_quantize_with_zero_point(kernel, block_size)
            n_groups = math.ceil(input_dim / block_size)
            assert tuple(quantized.shape) == (input_dim, output_dim)
            assert tuple(scale.shape) == (n_groups, output_dim) == tuple(zero.shape)


class TestInt4QuantizationConfigTest:
    def test_default_block_size(self):
        config = quantizers.Int4QuantizationConfig()
        assert config.block_size == 128 and config.mode == "int4"

    @pytest.mark.parametrize(
        "block_size", [32, 64, 128, 256], ids=["block_32", "block_64", "block_128", "block_256"]
    )
    def test_custom_block_size(self, block_size):
        assert quantizers.Int4QuantizationConfig(block_size=block_size).block_size == block_size

    def test_per_channel_mode_with_none(self):
        assert quantizers.Int4QuantizationConfig(block_size=None).block_size is None

    def test_per_channel_mode_with_negative_one(self):
        assert quantizers.Int4QuantizationConfig(block_size=-1).block_size == -1

    def test_invalid_block_size_raises(self):
        with pytest.raises(ValueError, match="block_size must be"):
            quantizers.Int4QuantizationConfig(block_size=0)
        with pytest.raises(ValueError, match="block_size must be"):
            quantizers.Int4QuantizationConfig(block_size=-2)

    def test_get_config_includes_block_size(self):
        assert quantizers.Int4QuantizationConfig(block_size=64).get_config()["block_size"] == 64

    def test_from_config_restores_block_size(self):
        serialized = quantizers.Int4QuantizationConfig(block_size=64).get_config()
        assert quantizers.Int4QuantizationConfig.from_config(serialized).block_size == 64

    def test_serialization_roundtrip(self):
        config = quantizers.Int4QuantizationConfig(block_size=128)
        deserialized = quantizers.deserialize(quantizers.serialize(config))
        assert deserialized.block_size == 128 and deserialized.mode == "int4"

    def test_serialization_with_per_channel(self):
        config = quantizers.Int4QuantizationConfig(block_size=None)
        assert quantizers.deserialize(quantizers.serialize(config)).block_size is None


def test_no_warnings_from_the_quantizers():
    """Not in Keras: the functions above run without warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantizers.AbsMaxQuantizer()(uniform((2, 3)))
