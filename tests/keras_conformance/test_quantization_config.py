"""Origin: keras/src/quantizers/quantization_config_test.py (Keras 3.15)."""

import pytest
import torch

from dtype_policies import layers, saving
from dtype_policies.quantizers import (
    AbsMaxQuantizer,
    Int4QuantizationConfig,
    Int8QuantizationConfig,
    QuantizationConfig,
    validate_and_resolve_config,
)


class TestQuantizationConfigTest:
    def test_base_quantization_config(self):
        config = QuantizationConfig()
        with pytest.raises(NotImplementedError):
            _ = config.mode

    def test_int8_quantization_config_valid(self):
        config = Int8QuantizationConfig()
        assert config.mode == "int8"
        assert config.weight_quantizer is None
        q = AbsMaxQuantizer(axis=0, value_range=(-127, 127))
        config = Int8QuantizationConfig(weight_quantizer=q)
        assert config.weight_quantizer == q

    def test_int8_quantization_config_invalid(self):
        with pytest.raises(ValueError, match="value_range"):
            AbsMaxQuantizer(axis=0, value_range=(-256, 256))

    def test_int4_quantization_config_valid(self):
        config = Int4QuantizationConfig()
        assert config.mode == "int4"
        assert config.weight_quantizer is None
        q = AbsMaxQuantizer(axis=0, value_range=(-8, 7))
        config = Int4QuantizationConfig(weight_quantizer=q, block_size=None)
        assert config.weight_quantizer == q

    def test_int4_quantization_config_invalid(self):
        q = AbsMaxQuantizer(axis=0, value_range=(-127, 127))
        with pytest.raises(ValueError, match="value_range"):
            Int4QuantizationConfig(weight_quantizer=q, block_size=None)

    def test_int4_quantization_config_subchannel_rejects_custom_quantizer(self):
        weight_q = AbsMaxQuantizer(axis=0, value_range=(-8, 7))
        activation_q = AbsMaxQuantizer(axis=-1)
        with pytest.raises(ValueError, match="sub-channel quantization.*does not support"):
            Int4QuantizationConfig(weight_quantizer=weight_q)
        with pytest.raises(ValueError, match="sub-channel quantization.*does not support"):
            Int4QuantizationConfig(weight_quantizer=weight_q, block_size=64)
        with pytest.raises(ValueError, match="sub-channel quantization.*does not support"):
            Int4QuantizationConfig(activation_quantizer=activation_q)
        with pytest.raises(ValueError, match="sub-channel quantization.*does not support"):
            Int4QuantizationConfig(activation_quantizer=activation_q, block_size=64)
        config = Int4QuantizationConfig(weight_quantizer=weight_q, block_size=None)
        assert config.weight_quantizer == weight_q
        config = Int4QuantizationConfig(weight_quantizer=weight_q, block_size=-1)
        assert config.weight_quantizer == weight_q
        config = Int4QuantizationConfig(activation_quantizer=activation_q, block_size=None)
        assert config.activation_quantizer == activation_q
        config = Int4QuantizationConfig(activation_quantizer=activation_q, block_size=-1)
        assert config.activation_quantizer == activation_q

    def test_quantization_config_serialization(self):
        config = Int8QuantizationConfig(
            weight_quantizer=AbsMaxQuantizer(axis=0),
            activation_quantizer=AbsMaxQuantizer(axis=-1),
        )
        deserialized = Int8QuantizationConfig.from_config(config.get_config())
        assert isinstance(deserialized, Int8QuantizationConfig)
        assert isinstance(deserialized.weight_quantizer, AbsMaxQuantizer)
        assert isinstance(deserialized.activation_quantizer, AbsMaxQuantizer)
        assert deserialized.weight_quantizer.axis == (0,)
        assert deserialized.activation_quantizer.axis == (-1,)

    def test_validate_and_resolve_config(self):
        config = validate_and_resolve_config("int8", None)
        assert isinstance(config, Int8QuantizationConfig) and config.mode == "int8"
        config = validate_and_resolve_config("int4", None)
        assert isinstance(config, Int4QuantizationConfig) and config.mode == "int4"
        config_in = Int8QuantizationConfig()
        assert validate_and_resolve_config(None, config_in) is config_in
        assert validate_and_resolve_config("int8", config_in) is config_in
        with pytest.raises(ValueError, match="Contradictory arguments"):
            validate_and_resolve_config("int4", Int8QuantizationConfig())
        with pytest.raises(ValueError, match="Invalid quantization mode"):
            validate_and_resolve_config("invalid_mode", None)

    def test_validate_and_resolve_config_gptq(self):
        """The GPTQ half of Keras's test_validate_and_resolve_config."""
        with pytest.raises(ValueError, match="must pass a `GPTQConfig`"):
            validate_and_resolve_config("gptq", None)
        with pytest.raises(ValueError, match="Contradictory arguments"):
            validate_and_resolve_config("gptq", Int8QuantizationConfig())

        class FakeGPTQConfig(QuantizationConfig):
            @property
            def mode(self):
                return "gptq"

        with pytest.raises(ValueError, match="requires a valid `config`"):
            validate_and_resolve_config("gptq", FakeGPTQConfig())

    def test_int8_quantization_config_output_dtype_mismatch(self):
        q = AbsMaxQuantizer(axis=0, value_range=(-127, 127), output_dtype="int16")
        with pytest.raises(ValueError, match="output_dtype='int8'"):
            Int8QuantizationConfig(weight_quantizer=q)

    def test_int4_quantization_config_output_dtype_mismatch(self):
        q = AbsMaxQuantizer(axis=0, value_range=(-8, 7), output_dtype="int16")
        with pytest.raises(ValueError, match="output_dtype='int8'"):
            Int4QuantizationConfig(weight_quantizer=q, block_size=None)

    def test_model_save_and_load(self, tmp_path):
        weight_range = [-100, 100]
        custom_quantizer = AbsMaxQuantizer(axis=0, value_range=weight_range)
        config = Int8QuantizationConfig(
            weight_quantizer=custom_quantizer, activation_quantizer=None
        )
        layer = layers.Dense(10)
        layer.build((None, 5))
        layer.quantize("int8", config=config)
        model = layers.Sequential([layer])
        model.build((None, 5))
        saving.save(model, tmp_path / "quantized_model")
        loaded_model = layers.Sequential([layers.Dense(10)])
        loaded_model.build((None, 5))
        saving.load(loaded_model, tmp_path / "quantized_model")
        loaded_layer = loaded_model.layers[0]
        assert isinstance(loaded_layer.quantization_config, Int8QuantizationConfig)
        quantizer = loaded_layer.quantization_config.weight_quantizer
        assert isinstance(quantizer, AbsMaxQuantizer)
        assert quantizer.axis == (0,)
        assert list(quantizer.value_range) == weight_range
        assert loaded_layer.quantization_config.activation_quantizer is None
        assert loaded_layer.is_quantized
        x = torch.randn(3, 5)
        assert torch.equal(loaded_model(x), model(x))

    def test_awq_requires_config(self):
        with pytest.raises(ValueError, match="AWQConfig"):
            validate_and_resolve_config("awq", None)

    def test_awq_requires_correct_config_type(self):
        with pytest.raises(ValueError, match="Contradictory arguments"):
            validate_and_resolve_config("awq", Int8QuantizationConfig())
