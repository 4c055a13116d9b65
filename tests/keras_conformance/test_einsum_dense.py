"""Origin: keras/src/layers/core/einsum_dense_test.py (Keras 3.15), its
quantization cases.

Not ported: LoRA (`test_quantize_lora_integration`,
`test_int4_block_size_with_lora`), `test_legacy_load_own_variables` (Keras's
variable store), Keras's internal `quantized_build`/`quantized_call` checks.
`layer._int4_block_size` is `layer.quantization_config.block_size` here
(Keras's per-channel `None`: `group_size == -1`).
"""

import math

import pytest
import torch

from dtype_policies import layers, quantizers
from dtype_policies.quantizers import (
    AbsMaxQuantizer,
    Int4QuantizationConfig,
    Int8QuantizationConfig,
)

from .helpers import (
    assert_all_close,
    assert_dtype,
    assert_float8_delayed_scaling,
    deliberate,
    non_trainable_weights,
    reload_model,
    reload_weights,
    run_layer_test,
    trainable_weights,
    variables,
)
from .test_dense import FLOAT8_STATE, stored_kernel

GENERAL_EINSUM = deliberate("einsum")
MHA_VALUE = {"equation": "ab,bcd->acd", "output_shape": (8, 32), "bias_axes": "d"}
MODES3 = pytest.mark.parametrize("mode", ["int8", "float8", "int4"], ids=["int8", "float8", "int4"])


class TestEinsumDenseTest:
    @pytest.mark.parametrize(
        "mode, weight_quantizer_args, activation_quantizer_args",
        [
            ("int8", {"axis": 0}, {"axis": -1}),
            pytest.param(
                "int4",
                {"axis": 0, "value_range": (-8, 7), "output_dtype": "int8"},
                {"axis": -1},
            ),
            ("int8", {"axis": 0}, None),
            ("int4", {"axis": 0, "value_range": (-8, 7), "output_dtype": "int8"}, None),
        ],
        ids=["int8", "int4", "int8_weight_only", "int4_weight_only"],
    )
    def test_einsum_dense_quantize(self, mode, weight_quantizer_args, activation_quantizer_args):
        layer = layers.EinsumDense(**MHA_VALUE)
        layer.build((None, 3))
        weight_quantizer = AbsMaxQuantizer(**weight_quantizer_args)
        activation_quantizer = (
            AbsMaxQuantizer(**activation_quantizer_args) if activation_quantizer_args else None
        )
        if mode == "int8":
            config = Int8QuantizationConfig(
                weight_quantizer=weight_quantizer, activation_quantizer=activation_quantizer
            )
        else:
            config = Int4QuantizationConfig(
                weight_quantizer=weight_quantizer,
                activation_quantizer=activation_quantizer,
                block_size=None,
            )
        layer.quantize(mode, config=config)
        inputs_quantizer = layer.quantization_config.activation_quantizer
        if activation_quantizer_args is not None:
            assert isinstance(inputs_quantizer, AbsMaxQuantizer)
        else:
            assert inputs_quantizer is None
        assert tuple(layer(torch.rand(2, 3)).shape) == (2, 8, 32)
        if mode == "int4":
            assert_dtype(stored_kernel(layer), "int8")

    @pytest.mark.parametrize(
        "mode, error_threshold", [("int8", 2e-2), ("int4", 3e-3)], ids=["int8", "int4"]
    )
    def test_quantize_int(self, mode, error_threshold, tmp_path):
        layer = layers.EinsumDense(**MHA_VALUE)
        layer.build((None, 3))
        x = torch.rand(2, 3)
        y_float = layer(x)
        layer.quantize(mode)
        assert_dtype(stored_kernel(layer), "int8")
        assert str(layer.kernel_scale.dtype).removeprefix("torch.") == layer.variable_dtype
        assert float(((y_float - layer(x)) ** 2).mean()) < error_threshold
        model = layers.Sequential([layer])
        new_model = reload_model(model, tmp_path / "quantized_model", (None, 3))
        assert_all_close(model(x), new_model(x))
        new_model = layers.Sequential([layers.EinsumDense(**MHA_VALUE)])
        new_model.build((None, 3))
        new_model.layers[0].quantize(mode)
        assert_all_close(model(x), reload_weights(model, new_model)(x))

    @GENERAL_EINSUM
    @pytest.mark.parametrize("mode", ["int8", "int4"], ids=["int8", "int4"])
    def test_quantize_int_general_equations(self, mode):
        """The end of Keras's test_quantize_int: building with a quantized
        policy on equations that reduce and transpose, expand, squeeze."""
        layer = layers.EinsumDense(
            equation="abcde,afce->acdbf",
            output_shape=(2, 4, 8, 16),
            bias_axes="d",
            dtype=f"{mode}_from_mixed_bfloat16",
        )
        layer.build((1, 8, 2, 4, 32))
        assert_dtype(stored_kernel(layer), "int8")
        assert_dtype(layer.kernel_scale, "float32")
        layer = layers.EinsumDense(
            equation="a,b->ab", output_shape=(4,), dtype=f"{mode}_from_float32"
        )
        layer.build((None,))
        assert_dtype(stored_kernel(layer), "int8")
        layer = layers.EinsumDense(
            equation="ab,ab->a", output_shape=(2,), dtype="int8_from_float32"
        )
        layer.build((2, 4))
        assert_dtype(stored_kernel(layer), "int8")

    @pytest.mark.parametrize(
        "quantization_mode, equation, output_shape, input_shape, error_threshold",
        [
            ("int8", "btnh,nhd->btd", (None, 8), (1, 2, 2, 4), 1e-3),
            ("int8", "btd,ndh->btnh", (None, 2, 8), (1, 2, 4), 1e-3),
            ("int8", "btd,df->btf", (None, 4), (1, 2, 4), 1e-3),
            ("int4", "btnh,nhd->btd", (None, 8), (1, 2, 2, 4), 4e-3),
            ("int4", "btd,ndh->btnh", (None, 2, 8), (1, 2, 4), 4e-3),
            ("int4", "btd,df->btf", (None, 4), (1, 2, 4), 4e-3),
        ],
        ids=[
            "int8_btnh,nhd->btd",
            "int8_btd,ndh->btnh",
            "int8_btd,df->btf",
            "int4_btnh,nhd->btd",
            "int4_btd,ndh->btnh",
            "int4_btd,df->btf",
        ],
    )
    def test_quantize_with_specific_equations(
        self, quantization_mode, equation, output_shape, input_shape, error_threshold
    ):
        layer = layers.EinsumDense(equation=equation, output_shape=output_shape)
        layer.build(input_shape)
        x = torch.rand(input_shape)
        y_float = layer(x)
        layer.quantize(quantization_mode)
        assert float(((y_float - layer(x)) ** 2).mean()) < error_threshold

    @MODES3
    def test_quantize_on_unbuilt_layer(self, mode):
        layer = layers.EinsumDense(**MHA_VALUE)
        with pytest.raises(ValueError, match="Cannot quantize a layer that isn't yet built."):
            layer.quantize(mode)

    @MODES3
    def test_quantize_on_subclass(self, mode):
        class MyEinsumDense(layers.EinsumDense):
            pass

        layer = MyEinsumDense(**MHA_VALUE)
        layer.build((None, 3))
        with pytest.raises(NotImplementedError):
            layer.quantize(mode)
        layer.quantize(mode, type_check=False)

    @MODES3
    def test_quantize_when_already_quantized(self, mode):
        config = {"equation": "ab,bcd->acd", "output_shape": (8, 16), "bias_axes": "d"}
        layer = layers.EinsumDense(**config)
        layer.build((None, 3))
        layer.quantize(mode)
        for m in ["int8", "float8"]:
            with pytest.raises(ValueError, match="is already quantized with dtype_policy="):
                layer.quantize(m)
        layer = layers.EinsumDense(**config, dtype=f"{mode}_from_float32")
        layer.build((None, 3))
        for m in ["int8", "float8"]:
            with pytest.raises(ValueError, match="is already quantized with dtype_policy="):
                layer.quantize(m)

    @pytest.mark.parametrize(
        "policy, expected_num_variables",
        [
            ("int8_from_float32", 3),
            ("float8_from_float32", 8),
            pytest.param("int4_from_float32", 5),  # + zero + g_idx
        ],
        ids=["int8", "float8", "int4"],
    )
    def test_quantize_by_setting_dtype_policy(self, policy, expected_num_variables):
        layer = layers.EinsumDense(**MHA_VALUE)
        layer.build((None, 3))
        layer.dtype_policy = policy
        assert len(variables(layer)) == expected_num_variables

    @pytest.mark.parametrize("mode", ["int7", "float7", "int3"], ids=["int7", "float7", "int3"])
    def test_quantize_invalid_mode(self, mode):
        layer = layers.EinsumDense(**MHA_VALUE)
        layer.build((None, 3))
        original_dtype_policy = layer.dtype_policy
        with pytest.raises(ValueError, match="Invalid quantization mode."):
            layer.quantize(mode)
        assert layer.dtype_policy == original_dtype_policy

    @pytest.mark.parametrize(
        "dtype, num_trainable_weights, num_non_trainable_weights",
        [
            ("int8_from_mixed_bfloat16", 1, 2),
            pytest.param("float8_from_mixed_bfloat16", 8, 0, marks=FLOAT8_STATE),
            ("int4_from_mixed_bfloat16", 1, 2),
        ],
        ids=["int8", "float8", "int4"],
    )
    def test_quantize_dtype_argument(self, dtype, num_trainable_weights, num_non_trainable_weights):
        run_layer_test(
            layers.EinsumDense,
            init_kwargs={**MHA_VALUE, "dtype": dtype},
            input_shape=(2, 3),
            expected_output_shape=(2, 8, 32),
            expected_num_trainable_weights=num_trainable_weights,
            expected_num_non_trainable_weights=num_non_trainable_weights,
        )

    def test_quantize_float8(self):
        layer = layers.EinsumDense("ab,bc->ac", output_shape=[32], bias_axes="c")
        layer.build((None, 16))
        layer.quantize("float8")
        assert_float8_delayed_scaling(layer, 16, 32)

    @FLOAT8_STATE
    def test_quantize_float8_fitting(self):
        layer = layers.EinsumDense(**MHA_VALUE)
        layer.build((None, 3))
        layer.quantize("float8")
        assert len(trainable_weights(layer)) == 8
        assert len(non_trainable_weights(layer)) == 0

    def test_quantize_float8_inference(self):
        layer = layers.EinsumDense(**MHA_VALUE)
        layer.build((None, 3))
        layer.quantize("float8")
        x = torch.rand(64, 3)
        assert_all_close(layer(x, training=False), layer(x, training=True))

    @pytest.mark.parametrize(
        "mode", ["gptq", "awq"], ids=["test_gptq_serialization", "test_awq_serialization"]
    )
    def test_calibrated_serialization(self, mode):
        layer = layers.EinsumDense(**MHA_VALUE)
        layer.build((None, 3))
        if mode == "gptq":
            config = quantizers.GPTQConfig(
                dataset=None, tokenizer=None, weight_bits=4, group_size=8
            )
        else:
            config = quantizers.AWQConfig(
                dataset=None, tokenizer=None, group_size=8, num_grid_points=10
            )
        layer.quantize(mode, config=config)
        new_layer = layers.EinsumDense.from_config(layer.get_config())
        new_layer.build((None, 3))
        assert new_layer.quantization_mode == mode

    def test_int4_kernel_returns_unpacked_form(self):
        layer = layers.EinsumDense(equation="ab,bc->ac", output_shape=(2,))
        layer.build((None, 2))
        layer.quantize("int4")
        unpacked = quantizers.unpack_int4(layer.kernel_int4, 2, axis=-1)
        assert_all_close(layer.kernel, unpacked.reshape(2, 2))

    def test_einsum_dense_int8_custom_quantizer(self):
        weight_range = (-10, 10)
        config = Int8QuantizationConfig(
            weight_quantizer=AbsMaxQuantizer(axis=0, value_range=weight_range),
            activation_quantizer=None,
        )
        layer = layers.EinsumDense("ab,bc->ac", output_shape=10)
        layer.build((None, 5))
        layer.quantize("int8", config=config)
        new_layer = layers.EinsumDense.from_config(layer.get_config())
        assert isinstance(new_layer.quantization_config, Int8QuantizationConfig)
        quantizer = new_layer.quantization_config.weight_quantizer
        assert isinstance(quantizer, AbsMaxQuantizer)
        assert quantizer.axis == (0,) and tuple(quantizer.value_range) == weight_range

    @pytest.mark.parametrize(
        "block_size",
        [64, 128, None, -1],
        ids=["grouped_block_64", "grouped_block_128", "per_channel_none", "per_channel_neg1"],
    )
    def test_int4_quantization_block_size(self, block_size):
        layer = layers.EinsumDense(equation="ab,bc->ac", output_shape=(64,), bias_axes="c")
        layer.build((None, 256))
        x = torch.rand(2, 256)
        y_float = layer(x)
        layer.quantize("int4", config=Int4QuantizationConfig(block_size=block_size))
        if block_size is None or block_size == -1:
            assert layer.quantization_config.group_size == -1
            expected_scale_shape = (64,)
        else:
            assert layer.quantization_config.block_size == block_size
            expected_scale_shape = (math.ceil(256 / block_size), 64)
        assert tuple(layer.kernel_scale.shape) == expected_scale_shape
        assert float(((y_float - layer(x)) ** 2).mean()) < 0.01

    @pytest.mark.parametrize(
        "block_size",
        [64, 128, None],
        ids=["grouped_block_64", "grouped_block_128", "per_channel_none"],
    )
    def test_int4_block_size_serialization(self, block_size, tmp_path):
        layer = layers.EinsumDense(equation="ab,bc->ac", output_shape=(32,), bias_axes="c")
        layer.build((None, 128))
        layer.quantize("int4", config=Int4QuantizationConfig(block_size=block_size))
        x = torch.rand(2, 128)
        y_before = layer(x)
        loaded_model = reload_model(layers.Sequential([layer]), tmp_path / "model", (None, 128))
        loaded_layer = loaded_model.layers[0]
        assert isinstance(loaded_layer.quantization_config, Int4QuantizationConfig)
        assert loaded_layer.quantization_config.block_size == block_size
        assert_all_close(y_before, loaded_model(x))

    def test_int4_grouped_vs_perchannel_scale_shapes(self):
        input_dim, output_dim, block_size = 256, 64, 64
        layer_pc = layers.EinsumDense(equation="ab,bc->ac", output_shape=(output_dim,))
        layer_pc.build((None, input_dim))
        layer_pc.quantize("int4", config=Int4QuantizationConfig(block_size=None))
        layer_grouped = layers.EinsumDense(equation="ab,bc->ac", output_shape=(output_dim,))
        layer_grouped.build((None, input_dim))
        layer_grouped.quantize("int4", config=Int4QuantizationConfig(block_size=block_size))
        assert tuple(layer_pc.kernel_scale.shape) == (output_dim,)
        assert tuple(layer_grouped.kernel_scale.shape) == (input_dim // block_size, output_dim)

    @pytest.mark.parametrize(
        "equation, output_shape, input_shape, block_size",
        [
            ("btd,df->btf", (8, 32), (None, 8, 256), 64),
            ("btd,df->btf", (8, 32), (None, 8, 256), None),
            ("ab,bcd->acd", (8, 32), (None, 64), 32),
            ("ab,bcd->acd", (8, 32), (None, 64), None),
        ],
        ids=["btd_df_btf_grouped", "btd_df_btf_pc", "ab_bcd_acd_grouped", "ab_bcd_acd_pc"],
    )
    def test_int4_block_size_various_equations(
        self, equation, output_shape, input_shape, block_size
    ):
        layer = layers.EinsumDense(equation=equation, output_shape=output_shape)
        layer.build(input_shape)
        x = torch.rand((2, *input_shape[1:]))
        y_float = layer(x)
        layer.quantize("int4", config=Int4QuantizationConfig(block_size=block_size))
        y_quantized = layer(x)
        assert y_float.shape == y_quantized.shape
        assert float(((y_float - y_quantized) ** 2).mean()) < 0.02

    @pytest.mark.parametrize(
        "equation, output_shape, input_shape, block_size",
        [
            ("bnh,nhd->bd", (64,), (None, 4, 32), 64),
            ("bnh,nhd->bd", (64,), (None, 4, 32), None),
            ("ab,bcd->acd", (8, 32), (None, 64), 32),
            ("ab,bcd->acd", (8, 32), (None, 64), None),
        ],
        ids=["attn_output_grouped", "attn_output_pc", "mha_value_grouped", "mha_value_pc"],
    )
    def test_int4_grouped_multi_reduced_axes(self, equation, output_shape, input_shape, block_size):
        layer = layers.EinsumDense(equation=equation, output_shape=output_shape)
        layer.build(input_shape)
        x = torch.rand((2, *input_shape[1:]))
        y_float = layer(x)
        layer.quantize("int4", config=Int4QuantizationConfig(block_size=block_size))
        y_quantized = layer(x)
        assert y_float.shape == y_quantized.shape
        assert float(((y_float - y_quantized) ** 2).mean()) < 0.1

    def test_int4_multi_reduced_axes_scale_shape(self):
        layer = layers.EinsumDense(equation="bnh,nhd->bd", output_shape=(64,))
        layer.build((None, 4, 32))
        layer.quantize("int4", config=Int4QuantizationConfig(block_size=64))
        assert layer.kernel_scale is not None and layer.kernel_scale.shape[0] == 2

    def test_int4_multi_reduced_axes_serialization(self, tmp_path):
        layer = layers.EinsumDense(equation="bnh,nhd->bd", output_shape=(64,))
        layer.build((None, 4, 32))
        layer.quantize("int4", config=Int4QuantizationConfig(block_size=64))
        x = torch.rand(2, 4, 32)
        y_before = layer(x)
        loaded_model = reload_model(layers.Sequential([layer]), tmp_path / "model", (None, 4, 32))
        assert_all_close(y_before, loaded_model(x), atol=1e-5)

    def test_int4_multi_reduced_vs_single_reduced(self):
        block_size = 64
        layer_single = layers.EinsumDense(equation="bd,df->bf", output_shape=(32,))
        layer_single.build((None, 128))
        layer_multi = layers.EinsumDense(equation="bnh,nhd->bd", output_shape=(128,))
        layer_multi.build((None, 4, 32))
        config = Int4QuantizationConfig(block_size=block_size)
        layer_single.quantize("int4", config=config)
        layer_multi.quantize("int4", config=config)
        assert layer_single.quantization_config.block_size == block_size
        assert layer_multi.quantization_config.block_size == block_size
        assert tuple(layer_single(torch.rand(2, 128)).shape) == (2, 32)
        assert tuple(layer_multi(torch.rand(2, 4, 32)).shape) == (2, 128)

    @pytest.mark.parametrize("block_size", [64, 128], ids=["grouped_block_64", "grouped_block_128"])
    def test_int4_subchannel_g_idx_created(self, block_size):
        layer = layers.EinsumDense(equation="ab,bc->ac", output_shape=(32,), bias_axes="c")
        layer.build((None, 128))
        layer.quantize("int4", config=Int4QuantizationConfig(block_size=block_size))
        assert hasattr(layer, "g_idx")
        assert tuple(layer.g_idx.shape) == (128,)
        assert_all_close(layer.g_idx, torch.arange(128) // block_size)

    def test_int4_perchannel_no_g_idx(self):
        layer = layers.EinsumDense(equation="ab,bc->ac", output_shape=(32,), bias_axes="c")
        layer.build((None, 64))
        layer.quantize("int4", config=Int4QuantizationConfig(block_size=None))
        assert not hasattr(layer, "g_idx")

    def test_int4_subchannel_g_idx_serialization(self, tmp_path):
        layer = layers.EinsumDense(equation="ab,bc->ac", output_shape=(32,), bias_axes="c")
        layer.build((None, 128))
        layer.quantize("int4", config=Int4QuantizationConfig(block_size=64))
        x = torch.rand(2, 128)
        y_before = layer(x)
        g_idx_before = layer.g_idx
        loaded_model = reload_model(layers.Sequential([layer]), tmp_path / "model", (None, 128))
        loaded_layer = loaded_model.layers[0]
        assert hasattr(loaded_layer, "g_idx")
        assert_all_close(loaded_layer.g_idx, g_idx_before)
        assert_all_close(y_before, loaded_model(x))
