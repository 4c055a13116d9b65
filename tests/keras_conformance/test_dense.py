"""Origin: keras/src/layers/core/dense_test.py (Keras 3.15), its
quantization cases.

Not ported: LoRA (`enable_lora`, `test_quantize_lora_integration`,
`test_int4_block_size_with_lora`: this library's layers take LoRA through
`peft`), `test_legacy_load_own_variables` (Keras's variable store format), and
Keras's internal `quantized_build`/`quantized_call` checks inside
`test_quantize_invalid_mode`. GPTQ and AWQ cases are strict expected failures
until those modes land.
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

FLOAT8_STATE = deliberate("buffers")


def stored_kernel(layer):
    """Keras's `layer._kernel` of a quantized layer: the stored integer data."""
    return layer.kernel_int8 if "kernel_int8" in layer._buffers else layer.kernel_int4


class TestDenseTest:
    @pytest.mark.parametrize(
        "mode, weight_quantizer_args, activation_quantizer_args",
        [
            ("int8", {"axis": 0}, {}),
            pytest.param(
                "int4",
                {"axis": 0, "value_range": (-8, 7), "output_dtype": "int8"},
                {"axis": -1},
            ),
            ("int8", {"axis": 0}, None),
        ],
        ids=["int8", "int4", "int8_weight_only"],
    )
    def test_dense_quantize_config(self, mode, weight_quantizer_args, activation_quantizer_args):
        layer = layers.Dense(units=32)
        layer.build((None, 8))
        weight_quantizer = AbsMaxQuantizer(**weight_quantizer_args)
        activation_quantizer = (
            AbsMaxQuantizer(**activation_quantizer_args)
            if activation_quantizer_args is not None
            else None
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
        inputs_quantizer = layer.quantization_config.activation_quantizer  # Keras: inputs_quantizer
        if activation_quantizer_args is not None:
            assert isinstance(inputs_quantizer, AbsMaxQuantizer)
        else:
            assert inputs_quantizer is None
        y = layer(torch.rand(2, 8))
        assert tuple(y.shape) == (2, 32)
        if mode == "int4":
            assert_dtype(stored_kernel(layer), "int8")

    @pytest.mark.parametrize(
        "mode, error_threshold", [("int8", 1e-3), ("int4", 5e-3)], ids=["int8", "int4"]
    )
    def test_quantize_int(self, mode, error_threshold, tmp_path):
        layer = layers.Dense(units=16)
        layer.build((None, 8))
        x = torch.rand(2, 8)
        y_float = layer(x)
        layer.quantize(mode)
        assert_dtype(stored_kernel(layer), "int8")
        assert str(layer.kernel_scale.dtype).removeprefix("torch.") == layer.variable_dtype
        y_quantized = layer(x)
        assert float(((y_float - y_quantized) ** 2).mean()) < error_threshold
        model = layers.Sequential([layer])
        new_model = reload_model(model, tmp_path / "quantized_model", (None, 8))
        assert_all_close(model(x), new_model(x))
        new_model = layers.Sequential([layers.Dense(units=16)])
        new_model.build((None, 8))
        new_model.layers[0].quantize(mode)
        reload_weights(model, new_model)
        assert_all_close(model(x), new_model(x))

    @pytest.mark.parametrize("mode", ["int8", "int4", "float8"], ids=["int8", "int4", "float8"])
    def test_quantize_on_unbuilt_layer(self, mode):
        layer = layers.Dense(units=2)
        with pytest.raises(ValueError, match="Cannot quantize a layer that isn't yet built."):
            layer.quantize(mode)

    @pytest.mark.parametrize("mode", ["int8", "int4", "float8"], ids=["int8", "int4", "float8"])
    def test_quantize_on_subclass(self, mode):
        class MyDense(layers.Dense):
            pass

        layer = MyDense(units=16)
        layer.build((None, 8))
        with pytest.raises(NotImplementedError):
            layer.quantize(mode)
        layer.quantize(mode, type_check=False)

    @pytest.mark.parametrize("mode", ["int8", "int4", "float8"], ids=["int8", "int4", "float8"])
    def test_quantize_when_already_quantized(self, mode):
        layer = layers.Dense(units=2)
        layer.build((None, 2))
        layer.quantize(mode)
        for m in ["int8", "int4", "float8"]:
            with pytest.raises(ValueError, match="is already quantized with dtype_policy="):
                layer.quantize(m)
        layer = layers.Dense(units=2, dtype=f"{mode}_from_float32")
        layer.build((None, 2))
        for m in ["int8", "int4", "float8"]:
            with pytest.raises(ValueError, match="is already quantized with dtype_policy="):
                layer.quantize(m)

    @pytest.mark.parametrize(
        "policy, expected_num_variables",
        [
            ("int8_from_float32", 3),
            pytest.param("int4_from_float32", 5),  # + zero + g_idx
            ("float8_from_float32", 8),
        ],
        ids=["int8", "int4", "float8"],
    )
    def test_quantize_by_setting_dtype_policy(self, policy, expected_num_variables):
        layer = layers.Dense(units=2)
        layer.build((None, 2))
        layer.dtype_policy = policy
        assert len(variables(layer)) == expected_num_variables

    @pytest.mark.parametrize("mode", ["int7", "float7"], ids=["int7", "float7"])
    def test_quantize_invalid_mode(self, mode):
        layer = layers.Dense(units=2)
        layer.build((None, 2))
        original_dtype_policy = layer.dtype_policy
        with pytest.raises(ValueError, match="Invalid quantization mode."):
            layer.quantize(mode)
        assert layer.dtype_policy == original_dtype_policy

    @pytest.mark.parametrize(
        "dtype, num_trainable_weights, num_non_trainable_weights",
        [
            ("int8_from_mixed_bfloat16", 1, 2),
            ("int4_from_mixed_bfloat16", 1, 2),
            pytest.param("float8_from_mixed_bfloat16", 8, 0, marks=FLOAT8_STATE),
        ],
        ids=["int8", "int4", "float8"],
    )
    def test_quantize_dtype_argument(self, dtype, num_trainable_weights, num_non_trainable_weights):
        run_layer_test(
            layers.Dense,
            init_kwargs={"units": 5, "dtype": dtype},
            input_shape=(2, 3, 4),
            expected_output_shape=(2, 3, 5),
            expected_num_trainable_weights=num_trainable_weights,
            expected_num_non_trainable_weights=num_non_trainable_weights,
        )

    def test_quantize_float8(self):
        layer = layers.Dense(units=32)
        layer.build((None, 16))
        layer.quantize("float8")
        assert_float8_delayed_scaling(layer, 16, 32)

    @FLOAT8_STATE
    def test_quantize_float8_fitting(self, tmp_path):
        layer = layers.Dense(units=16)
        layer.build((None, 8))
        layer.quantize("float8")
        assert len(trainable_weights(layer)) == 8
        assert len(non_trainable_weights(layer)) == 0

    def test_quantize_float8_fitting_training(self, tmp_path):
        """The rest of Keras's test_quantize_float8_fitting: fit, save, reload."""
        layer = layers.Dense(units=16)
        layer.build((None, 8))
        layer.quantize("float8")
        x, y = torch.rand(64, 8), torch.rand(64, 16)
        model = layers.Sequential([layer])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(2):
            for start in range(0, 64, 32):
                optimizer.zero_grad()
                loss = ((model(x[start : start + 32]) - y[start : start + 32]) ** 2).mean()
                loss.backward()
                optimizer.step()
        model.eval()
        new_model = reload_model(model, tmp_path / "quantized_float8_model", (None, 8))
        new_model.eval()
        assert_all_close(model(x), new_model(x))
        new_model = layers.Sequential([layers.Dense(units=16)])
        new_model.build((None, 8))
        new_model.layers[0].quantize("float8")
        reload_weights(model, new_model)
        new_model.eval()
        assert_all_close(model(x), new_model(x))

    def test_quantize_float8_inference(self):
        layer = layers.Dense(units=16)
        layer.build((None, 8))
        layer.quantize("float8")
        x = torch.rand(64, 8)
        assert_all_close(layer(x, training=False), layer(x, training=True))

    def test_gptq_serialization(self):
        layer = layers.Dense(units=16)
        layer.build((None, 8))
        config = quantizers.GPTQConfig(dataset=None, tokenizer=None, weight_bits=4, group_size=8)
        layer.quantize("gptq", config=config)
        new_layer = layers.Dense.from_config(layer.get_config())
        new_layer.build((None, 8))
        assert new_layer.quantization_mode == "gptq"

    def test_awq_serialization(self):
        layer = layers.Dense(units=16)
        layer.build((None, 8))
        config = quantizers.AWQConfig(
            dataset=None, tokenizer=None, group_size=8, num_grid_points=10
        )
        layer.quantize("awq", config=config)
        new_layer = layers.Dense.from_config(layer.get_config())
        new_layer.build((None, 8))
        assert new_layer.quantization_mode == "awq"

    def test_int4_kernel_returns_unpacked_form(self):
        layer = layers.Dense(units=2)
        layer.build((None, 2))
        layer.quantize("int4")
        expected = quantizers.unpack_int4(layer.kernel_int4, 2, axis=-1)
        assert_all_close(layer.kernel, expected)

    def test_int4_gptq_kernel_returns_unpacked_form(self):
        layer = layers.Dense(units=2)
        layer.build((None, 2))
        config = quantizers.GPTQConfig(dataset=None, tokenizer=None, weight_bits=4, group_size=8)
        layer.quantize("gptq", config=config)
        assert layer.quantization_mode == "gptq"

    def test_gptq_kernel_packing(self):
        layer = layers.Dense(units=16, use_bias=False)
        layer.build((None, 8))
        config = quantizers.GPTQConfig(dataset=None, tokenizer=None, weight_bits=4, group_size=8)
        layer.quantize("gptq", config=config)
        assert layer.quantization_mode == "gptq"

    def test_int4_awq_kernel_returns_unpacked_form(self):
        layer = layers.Dense(units=2)
        layer.build((None, 2))
        config = quantizers.AWQConfig(
            dataset=None, tokenizer=None, group_size=8, num_grid_points=10
        )
        layer.quantize("awq", config=config)
        assert layer.quantization_mode == "awq"

    def test_awq_kernel_packing(self):
        layer = layers.Dense(units=16, use_bias=False)
        layer.build((None, 8))
        config = quantizers.AWQConfig(
            dataset=None, tokenizer=None, group_size=8, num_grid_points=10
        )
        layer.quantize("awq", config=config)
        assert layer.quantization_mode == "awq"

    @staticmethod
    def _check_quantizer_config(quantizer, valid_class, axis, value_range):
        assert isinstance(quantizer, valid_class)
        assert quantizer.axis == axis
        if value_range is not None:
            assert tuple(quantizer.value_range) == tuple(value_range)

    def test_dense_int8_custom_quantizer(self):
        weight_range, act_range = (-127, 127), (-5, 5)
        config = Int8QuantizationConfig(
            weight_quantizer=AbsMaxQuantizer(axis=0, value_range=weight_range),
            activation_quantizer=AbsMaxQuantizer(axis=-1, value_range=act_range),
        )
        layer = layers.Dense(10)
        layer.build((None, 5))
        layer.quantize("int8", config=config)
        new_layer = layers.Dense.from_config(layer.get_config())
        assert isinstance(new_layer.quantization_config, Int8QuantizationConfig)
        self._check_quantizer_config(
            new_layer.quantization_config.weight_quantizer, AbsMaxQuantizer, (0,), weight_range
        )
        self._check_quantizer_config(
            new_layer.quantization_config.activation_quantizer, AbsMaxQuantizer, (-1,), act_range
        )

    def test_dense_int8_weight_only_quantizer(self):
        config = Int8QuantizationConfig(
            weight_quantizer=AbsMaxQuantizer(axis=0), activation_quantizer=None
        )
        layer = layers.Dense(10)
        layer.build((None, 5))
        layer.quantize("int8", config=config)
        new_layer = layers.Dense.from_config(layer.get_config())
        assert isinstance(new_layer.quantization_config, Int8QuantizationConfig)
        assert isinstance(new_layer.quantization_config.weight_quantizer, AbsMaxQuantizer)
        assert new_layer.quantization_config.activation_quantizer is None

    def test_dense_int4_custom_quantizer(self):
        weight_range, act_range = (-8, 7), (-2, 2)
        config = Int4QuantizationConfig(
            weight_quantizer=AbsMaxQuantizer(axis=0, value_range=weight_range),
            activation_quantizer=AbsMaxQuantizer(axis=-1, value_range=act_range),
            block_size=None,
        )
        layer = layers.Dense(10)
        layer.build((None, 5))
        layer.quantize("int4", config=config)
        new_layer = layers.Dense.from_config(layer.get_config())
        assert isinstance(new_layer.quantization_config, Int4QuantizationConfig)
        self._check_quantizer_config(
            new_layer.quantization_config.weight_quantizer, AbsMaxQuantizer, (0,), weight_range
        )
        self._check_quantizer_config(
            new_layer.quantization_config.activation_quantizer, AbsMaxQuantizer, (-1,), act_range
        )

    @pytest.mark.parametrize(
        "block_size",
        [64, 128, None, -1],
        ids=["grouped_block_64", "grouped_block_128", "per_channel_none", "per_channel_neg1"],
    )
    def test_int4_quantization_block_size(self, block_size):
        input_dim, output_dim = 256, 64
        layer = layers.Dense(units=output_dim)
        layer.build((None, input_dim))
        x = torch.rand(2, input_dim)
        y_float = layer(x)
        layer.quantize("int4", config=Int4QuantizationConfig(block_size=block_size))
        assert layer.quantization_config.block_size == block_size  # Keras: _int4_block_size
        if block_size is None or block_size == -1:
            expected_scale_shape = (output_dim,)
        else:
            expected_scale_shape = (math.ceil(input_dim / block_size), output_dim)
        assert tuple(layer.kernel_scale.shape) == expected_scale_shape
        assert float(((y_float - layer(x)) ** 2).mean()) < 0.01

    @pytest.mark.parametrize(
        "block_size",
        [64, 128, None],
        ids=["grouped_block_64", "grouped_block_128", "per_channel_none"],
    )
    def test_int4_block_size_serialization(self, block_size, tmp_path):
        layer = layers.Dense(units=32)
        layer.build((None, 128))
        layer.quantize("int4", config=Int4QuantizationConfig(block_size=block_size))
        x = torch.rand(2, 128)
        y_before = layer(x)
        model = layers.Sequential([layer])
        loaded_model = reload_model(model, tmp_path / "int4_block_size_model", (None, 128))
        loaded_layer = loaded_model.layers[0]
        assert isinstance(loaded_layer.quantization_config, Int4QuantizationConfig)
        assert loaded_layer.quantization_config.block_size == block_size
        assert_all_close(y_before, loaded_model(x))

    def test_int4_grouped_vs_perchannel_scale_shapes(self):
        input_dim, output_dim, block_size = 256, 64, 64
        layer_pc = layers.Dense(units=output_dim)
        layer_pc.build((None, input_dim))
        layer_pc.quantize("int4", config=Int4QuantizationConfig(block_size=None))
        layer_grouped = layers.Dense(units=output_dim)
        layer_grouped.build((None, input_dim))
        layer_grouped.quantize("int4", config=Int4QuantizationConfig(block_size=block_size))
        assert tuple(layer_pc.kernel_scale.shape) == (output_dim,)
        assert tuple(layer_grouped.kernel_scale.shape) == (input_dim // block_size, output_dim)

    @pytest.mark.parametrize("block_size", [64, 128], ids=["grouped_block_64", "grouped_block_128"])
    def test_int4_subchannel_g_idx_created(self, block_size):
        input_dim, output_dim = 256, 64
        layer = layers.Dense(units=output_dim)
        layer.build((None, input_dim))
        layer.quantize("int4", config=Int4QuantizationConfig(block_size=block_size))
        assert hasattr(layer, "g_idx")
        assert tuple(layer.g_idx.shape) == (input_dim,)
        assert_all_close(layer.g_idx, torch.arange(input_dim) // block_size)

    def test_int4_perchannel_no_g_idx(self):
        layer = layers.Dense(units=32)
        layer.build((None, 64))
        layer.quantize("int4", config=Int4QuantizationConfig(block_size=None))
        assert not hasattr(layer, "g_idx")

    def test_int4_subchannel_g_idx_serialization(self, tmp_path):
        input_dim, output_dim, block_size = 128, 32, 64
        layer = layers.Dense(units=output_dim)
        layer.build((None, input_dim))
        layer.quantize("int4", config=Int4QuantizationConfig(block_size=block_size))
        x = torch.rand(2, input_dim)
        y_before = layer(x)
        g_idx_before = layer.g_idx
        model = layers.Sequential([layer])
        loaded_model = reload_model(model, tmp_path / "int4_g_idx_model", (None, input_dim))
        loaded_layer = loaded_model.layers[0]
        assert hasattr(loaded_layer, "g_idx")
        assert_all_close(loaded_layer.g_idx, g_idx_before)
        assert_all_close(y_before, loaded_model(x))
