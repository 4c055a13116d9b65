"""Origin: keras/src/layers/core/embedding_test.py (Keras 3.15), its
quantization cases.

Not ported: LoRA (`test_quantize_lora_integration`,
`test_int4_block_size_with_lora`), `test_legacy_load_own_variables` (Keras's
variable store), Keras's internal `quantized_build`/`quantized_call` checks.
Keras's `layer._embeddings` of a quantized layer is `embeddings_int8` /
`embeddings_int4` here.
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
    reload_model,
    reload_weights,
    variables,
)

MODES = pytest.mark.parametrize("mode", ["int8", "int4"], ids=["int8", "int4"])


def stored_embeddings(layer):
    return layer._buffers.get("embeddings_int8", layer._buffers.get("embeddings_int4"))


def ids(high, shape):
    return torch.randint(0, high, shape)


class TestEmbeddingTest:
    @pytest.mark.parametrize(
        "mode, weight_quantizer_args",
        [
            ("int8", {"axis": -1}),
            ("int4", {"axis": -1, "value_range": (-8, 7), "output_dtype": "int8"}),
            ("int8", {"axis": -1}),
        ],
        ids=["int8", "int4", "int8_custom"],
    )
    def test_embedding_quantize_config(self, mode, weight_quantizer_args):
        layer = layers.Embedding(input_dim=10, output_dim=6)
        layer.build((None,))
        weight_quantizer = AbsMaxQuantizer(**weight_quantizer_args)
        if mode == "int8":
            config = Int8QuantizationConfig(
                weight_quantizer=weight_quantizer, activation_quantizer=None
            )
        else:
            config = Int4QuantizationConfig(
                weight_quantizer=weight_quantizer, activation_quantizer=None, block_size=None
            )
        layer.quantize(mode, config=config)
        assert_dtype(stored_embeddings(layer), "int8")
        assert hasattr(layer, "embeddings_scale")
        assert tuple(layer(ids(10, (2, 3))).shape) == (2, 3, 6)

    @MODES
    def test_quantize_int(self, mode, tmp_path):
        layer = layers.Embedding(10, 16)
        layer.build()
        x = ids(9, (64, 3))
        y_float = layer(x)
        layer.quantize(mode)
        assert_dtype(stored_embeddings(layer), "int8")
        assert str(layer.embeddings_scale.dtype).removeprefix("torch.") == layer.variable_dtype
        if mode == "int4":
            assert_all_close(
                layer.embeddings, quantizers.unpack_int4(layer.embeddings_int4, 16, axis=-1)
            )
        assert float(((y_float - layer(x)) ** 2).mean()) < 1e-3
        model = layers.Sequential([layer])
        new_model = reload_model(model, tmp_path / "quantized_model", (None, 3))
        assert_all_close(model(x), new_model(x))
        new_model = layers.Sequential([layers.Embedding(10, 16)])
        new_model.build((None, 3))
        new_model.layers[0].quantize(mode)
        assert_all_close(model(x), reload_weights(model, new_model)(x))

    @MODES
    def test_quantize_on_unbuilt_layer(self, mode):
        layer = layers.Embedding(10, 16)
        with pytest.raises(ValueError, match="Cannot quantize a layer that isn't yet built."):
            layer.quantize(mode)

    @MODES
    def test_quantize_on_subclass(self, mode):
        class MyEmbedding(layers.Embedding):
            pass

        layer = MyEmbedding(10, 16)
        layer.build()
        with pytest.raises(NotImplementedError):
            layer.quantize(mode)
        layer.quantize(mode, type_check=False)

    @MODES
    def test_quantize_when_already_quantized(self, mode):
        layer = layers.Embedding(10, 16)
        layer.build()
        layer.quantize(mode)
        for m in ("int8", "int4"):
            with pytest.raises(ValueError, match="is already quantized with dtype_policy="):
                layer.quantize(m)
        layer = layers.Embedding(10, 16, dtype=f"{mode}_from_float32")
        layer.build()
        for m in ("int8", "int4"):
            with pytest.raises(ValueError, match="is already quantized with dtype_policy="):
                layer.quantize(m)

    @pytest.mark.parametrize(
        "policy, expected_num_variables",
        [
            ("int8_from_float32", 2),
            pytest.param("int4_from_float32", 4),  # + zero + g_idx
        ],
        ids=["int8", "int4"],
    )
    def test_quantize_by_setting_dtype_policy(self, policy, expected_num_variables):
        layer = layers.Embedding(10, 16)
        layer.build()
        layer.dtype_policy = policy
        assert len(variables(layer)) == expected_num_variables

    @pytest.mark.parametrize("mode", ["int7", "float7"], ids=["int7", "float7"])
    def test_quantize_invalid_mode(self, mode):
        layer = layers.Embedding(10, 16)
        layer.build()
        original_dtype_policy = layer.dtype_policy
        with pytest.raises(ValueError, match="Invalid quantization mode."):
            layer.quantize(mode)
        assert layer.dtype_policy == original_dtype_policy

    @pytest.mark.parametrize(
        "dtype, num_trainable_weights, num_non_trainable_weights",
        [("int8_from_mixed_bfloat16", 0, 2), ("int4_from_mixed_bfloat16", 0, 2)],
        ids=["int8", "int4"],
    )
    def test_quantize_dtype_argument(self, dtype, num_trainable_weights, num_non_trainable_weights):
        """Keras's run_layer_test, for integer inputs."""
        for kwargs, input_shape, output_shape in (
            ({"input_dim": 4, "output_dim": 3}, (2,), (2, 3)),
            ({"input_dim": 5, "output_dim": 4, "mask_zero": True}, (2, 3), (2, 3, 4)),
        ):
            layer = layers.Embedding(**kwargs, dtype=dtype)
            out = layer(torch.randint(0, kwargs["input_dim"], input_shape))
            assert tuple(out.shape) == output_shape
            assert len([p for p in layer.parameters() if p.requires_grad]) == num_trainable_weights
            assert len(variables(layer)) == num_trainable_weights + num_non_trainable_weights
            revived = layers.Embedding.from_config(layer.get_config())
            assert revived.get_config() == layer.get_config()

    def test_embedding_int8_custom_quantizer(self):
        weight_range = (-50, 50)
        config = Int8QuantizationConfig(
            weight_quantizer=AbsMaxQuantizer(axis=-1, value_range=weight_range)
        )
        layer = layers.Embedding(input_dim=100, output_dim=16)
        layer.build(None)
        layer.quantize("int8", config=config)
        new_layer = layers.Embedding.from_config(layer.get_config())
        assert isinstance(new_layer.quantization_config, Int8QuantizationConfig)
        quantizer = new_layer.quantization_config.weight_quantizer
        assert isinstance(quantizer, AbsMaxQuantizer)
        assert quantizer.axis == (-1,) and tuple(quantizer.value_range) == weight_range

    @pytest.mark.parametrize(
        "block_size",
        [
            pytest.param(64),
            pytest.param(128),
            None,
            -1,
        ],
        ids=["grouped_block_64", "grouped_block_128", "per_channel_none", "per_channel_neg1"],
    )
    def test_int4_quantization_block_size(self, block_size):
        input_dim, output_dim = 100, 256
        layer = layers.Embedding(input_dim=input_dim, output_dim=output_dim)
        layer.build()
        x = ids(input_dim, (4, 8))
        y_float = layer(x)
        layer.quantize("int4", config=Int4QuantizationConfig(block_size=block_size))
        assert layer.quantization_config.block_size == block_size  # Keras: _int4_block_size
        if block_size is None or block_size == -1:
            expected_scale_shape = (input_dim,)
        else:  # Keras: (rows, groups)
            expected_scale_shape = (input_dim, math.ceil(output_dim / block_size))
        assert tuple(layer.embeddings_scale.shape) == expected_scale_shape
        assert float(((y_float - layer(x)) ** 2).mean()) < 1e-3

    @pytest.mark.parametrize(
        "block_size",
        [64, 128, None],
        ids=["grouped_block_64", "grouped_block_128", "per_channel_none"],
    )
    def test_int4_block_size_serialization(self, block_size, tmp_path):
        input_dim, output_dim = 50, 128
        layer = layers.Embedding(input_dim=input_dim, output_dim=output_dim)
        layer.build()
        layer.quantize("int4", config=Int4QuantizationConfig(block_size=block_size))
        x = ids(input_dim, (2, 8))
        y_before = layer(x)
        loaded_model = reload_model(layers.Sequential([layer]), tmp_path / "model", (None, 8))
        loaded_layer = loaded_model.layers[0]
        assert isinstance(loaded_layer.quantization_config, Int4QuantizationConfig)
        assert loaded_layer.quantization_config.block_size == block_size
        assert_all_close(y_before, loaded_model(x))

    def test_int4_grouped_vs_perchannel_scale_shapes(self):
        input_dim, output_dim, block_size = 100, 256, 64
        layer_pc = layers.Embedding(input_dim=input_dim, output_dim=output_dim)
        layer_pc.build()
        layer_pc.quantize("int4", config=Int4QuantizationConfig(block_size=None))
        layer_grouped = layers.Embedding(input_dim=input_dim, output_dim=output_dim)
        layer_grouped.build()
        layer_grouped.quantize("int4", config=Int4QuantizationConfig(block_size=block_size))
        assert tuple(layer_pc.embeddings_scale.shape) == (input_dim,)
        n_groups = math.ceil(output_dim / block_size)
        assert tuple(layer_grouped.embeddings_scale.shape) == (input_dim, n_groups)

    @pytest.mark.parametrize("block_size", [4, 8], ids=["grouped_block_4", "grouped_block_8"])
    def test_int4_subchannel_g_idx_created(self, block_size):
        layer = layers.Embedding(input_dim=10, output_dim=16)
        layer.build()
        layer.quantize("int4", config=Int4QuantizationConfig(block_size=block_size))
        assert hasattr(layer, "g_idx")
        assert tuple(layer.g_idx.shape) == (16,)
        assert_all_close(layer.g_idx, torch.arange(16) // block_size)

    def test_int4_perchannel_no_g_idx(self):
        layer = layers.Embedding(input_dim=10, output_dim=16)
        layer.build()
        layer.quantize("int4", config=Int4QuantizationConfig(block_size=None))
        assert not hasattr(layer, "g_idx")

    def test_int4_subchannel_g_idx_serialization(self, tmp_path):
        layer = layers.Embedding(input_dim=10, output_dim=16)
        layer.build()
        layer.quantize("int4", config=Int4QuantizationConfig(block_size=8))
        x = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
        y_before = layer(x)
        g_idx_before = layer.g_idx
        loaded_model = reload_model(layers.Sequential([layer]), tmp_path / "model", (None, 3))
        loaded_layer = loaded_model.layers[0]
        assert hasattr(loaded_layer, "g_idx")
        assert_all_close(loaded_layer.g_idx, g_idx_before)
        assert_all_close(y_before, loaded_model(x))
