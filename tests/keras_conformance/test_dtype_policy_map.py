"""Origin: keras/src/dtype_policies/dtype_policy_map_test.py (Keras 3.15)."""

import pytest
import torch

import dtype_policies
from dtype_policies import DTypePolicyMap, layers, saving, set_dtype_policy

from .helpers import assert_all_close, deliberate, quantize_quietly


class TestDTypePolicyMapTest:
    def test_basic_usage(self, tmp_path):
        # Keras's BatchNormalization and ReLU are LayerNormalization and
        # Activation("relu") here; `model.save`/`load_model` is `saving`.
        class Subclass(layers.Layer):
            def __init__(self, dtype=None, name="subclass", **kwargs):
                super().__init__(dtype=dtype, name=name, **kwargs)
                self.dense = layers.Dense(8, dtype=dtype, name=f"{name}_dense")
                self.bn = layers.LayerNormalization(dtype=dtype, name=f"{name}_bn")
                self.relu = layers.Activation("relu", dtype=dtype, name=f"{name}_relu")

            def call(self, inputs, training=None):
                return self.relu(self.bn(self.dense(inputs)))

        model = Subclass()
        x = torch.rand(16, 4)
        model(x)
        quantize_quietly(model, "int8")
        for layer in model.modules():
            if isinstance(layer, layers.Dense):
                assert layer.dtype_policy == dtype_policies.QuantizedDTypePolicy("int8")
            elif isinstance(layer, (layers.LayerNormalization, layers.Activation)):
                assert layer.dtype_policy == dtype_policies.DTypePolicy()
        y = model(x)
        saving.save(model, tmp_path / "model")
        reloaded = Subclass()
        reloaded(x)
        saving.load(reloaded, tmp_path / "model")
        assert_all_close(y, reloaded(x))

    def test_add(self):
        policy_map = DTypePolicyMap()
        policy_map["layer/dense_0"] = dtype_policies.DTypePolicy("bfloat16")
        policy_map["layer/dense_1"] = dtype_policies.QuantizedDTypePolicy("int8", "mixed_bfloat16")
        policy_map["layer/dense_2"] = dtype_policies.QuantizedFloat8DTypePolicy(
            "float8", "mixed_float16"
        )
        assert len(policy_map) == 3
        policy = policy_map["layer/dense_0"]
        assert isinstance(policy, dtype_policies.DTypePolicy) and policy.name == "bfloat16"
        policy = policy_map["layer/dense_1"]
        assert isinstance(policy, dtype_policies.QuantizedDTypePolicy)
        assert policy.source_name == "mixed_bfloat16" and policy.quantization_mode == "int8"
        policy = policy_map["layer/dense_2"]
        assert isinstance(policy, dtype_policies.QuantizedFloat8DTypePolicy)
        assert policy.source_name == "mixed_float16" and policy.quantization_mode == "float8"
        with pytest.raises(ValueError, match="layer/dense_0 already exist in the DTypePolicyMap"):
            policy_map["layer/dense_0"] = dtype_policies.DTypePolicy("float32")
        with pytest.raises(ValueError, match="Cannot interpret the assigned value."):
            policy_map["layer/dense_3"] = 123

    def test_get(self):
        bfloat16_policy = dtype_policies.DTypePolicy("bfloat16")
        int8_policy = dtype_policies.QuantizedDTypePolicy("int8", "mixed_bfloat16")
        float32_policy = dtype_policies.DTypePolicy("float32")
        float16_policy = dtype_policies.DTypePolicy("float16")
        policy_map = DTypePolicyMap()
        policy_map["model/encoder/layer_0/dense"] = bfloat16_policy
        policy_map["model/encoder/attention/query"] = int8_policy
        policy_map["model/decoder/.*"] = float32_policy
        policy_map["model/decoder/attention/.*"] = float16_policy
        assert policy_map["model/encoder/layer_0/dense"] == bfloat16_policy
        assert policy_map["model/encoder/attention/query"] == int8_policy
        assert policy_map["model/decoder/layer_0"] == float32_policy
        assert policy_map["model/encoder/attention/query_norm"] == policy_map.default_policy
        policy_map["model/decoder"] = bfloat16_policy
        assert policy_map["model/decoder/layer_0"] == float32_policy
        assert policy_map["model/decoder"] == bfloat16_policy
        assert policy_map["model/embedding"] == policy_map.default_policy
        with pytest.raises(
            ValueError, match="Path 'model/decoder/attention/output' matches multiple dtype policy"
        ):
            policy_map["model/decoder/attention/output"]

    def test_delete(self):
        policy_map = DTypePolicyMap()
        policy_map["layer/dense_0"] = dtype_policies.DTypePolicy("bfloat16")
        policy_map["layer/dense_1"] = dtype_policies.QuantizedDTypePolicy("int8", "mixed_bfloat16")
        assert policy_map.pop("layer/dense_0") == dtype_policies.DTypePolicy("bfloat16")
        with pytest.raises(KeyError):
            policy_map.pop("layer/dense_0")
        del policy_map["layer/dense_1"]
        assert policy_map["layer/dense_1"] == policy_map.default_policy
        assert len(policy_map) == 0

    def test_len(self):
        policy_map = DTypePolicyMap()
        assert len(policy_map) == 0
        policy_map["layer/dense_0"] = dtype_policies.DTypePolicy("bfloat16")
        policy_map["layer/dense_1"] = dtype_policies.QuantizedDTypePolicy("int8", "mixed_bfloat16")
        assert len(policy_map) == 2

    def test_iter(self):
        policy_map = DTypePolicyMap()
        policy_map["layer/dense_0"] = dtype_policies.DTypePolicy("bfloat16")
        policy_map["layer/dense_1"] = dtype_policies.QuantizedDTypePolicy("int8", "mixed_bfloat16")
        assert list(policy_map.keys()) == ["layer/dense_0", "layer/dense_1"]
        assert [k for k, _ in policy_map.items()] == ["layer/dense_0", "layer/dense_1"]
        assert [v for _, v in policy_map.items()] == [
            dtype_policies.DTypePolicy("bfloat16"),
            dtype_policies.QuantizedDTypePolicy("int8", "mixed_bfloat16"),
        ]

    def test_in(self):
        policy_map = DTypePolicyMap()
        policy_map["layer/dense_0"] = dtype_policies.DTypePolicy("bfloat16")
        policy_map["layer/dense_1"] = dtype_policies.QuantizedDTypePolicy("int8", "mixed_bfloat16")
        assert "layer/dense_0" in policy_map and "layer/dense_1" in policy_map
        assert "layer/dense_2" not in policy_map

    @deliberate("maps")
    def test_default_policy(self):
        policy_map = DTypePolicyMap(default_policy="mixed_bfloat16")
        policy_map["layer/dense_0"] = dtype_policies.DTypePolicy("mixed_bfloat16")
        policy_map["layer/dense_1"] = dtype_policies.QuantizedDTypePolicy("int8", "mixed_bfloat16")
        policy_map = DTypePolicyMap.from_config(policy_map.get_config())
        assert policy_map["layer/dense_0"] == dtype_policies.DTypePolicy("mixed_bfloat16")
        assert policy_map["layer/dense_1"] == dtype_policies.QuantizedDTypePolicy(
            "int8", "mixed_bfloat16"
        )
        assert policy_map["layer/dense_2"] == policy_map.default_policy
        # the default defers to the default policy in force during loading
        set_dtype_policy("bfloat16")
        policy_map = DTypePolicyMap()
        policy_map["layer/dense_0"] = dtype_policies.DTypePolicy("mixed_bfloat16")
        policy_map["layer/dense_1"] = dtype_policies.QuantizedDTypePolicy("int8", "mixed_bfloat16")
        policy_map = DTypePolicyMap.from_config(policy_map.get_config())
        assert policy_map["layer/dense_0"] == dtype_policies.DTypePolicy("bfloat16")
        assert policy_map["layer/dense_1"] == dtype_policies.QuantizedDTypePolicy(
            "int8", "bfloat16"
        )
        assert policy_map["layer/dense_2"] == policy_map.default_policy
        assert policy_map["layer/dense_2"] == dtype_policies.get("bfloat16")

    def test_serialization(self):
        policy_map = DTypePolicyMap(default_policy="mixed_bfloat16")
        policy_map["layer/dense_0"] = dtype_policies.DTypePolicy("mixed_bfloat16")
        policy_map["layer/dense_1"] = dtype_policies.QuantizedDTypePolicy("int8", "mixed_bfloat16")
        reloaded = dtype_policies.deserialize(dtype_policies.serialize(policy_map))
        assert policy_map.default_policy == reloaded.default_policy
        for key, value in policy_map.items():
            assert reloaded[key] == value
        config = policy_map.get_config()
        original_config = config.copy()
        DTypePolicyMap.from_config(config)
        assert config == original_config

    def test_repr(self):
        policy_map = DTypePolicyMap()
        policy_map["layer/dense_0"] = dtype_policies.DTypePolicy("mixed_bfloat16")
        text = repr(policy_map)
        assert "DTypePolicyMap" in text and "default_policy" in text
        assert "mapping=[('layer/dense_0', 'mixed_bfloat16')]" in text

    def test_invalid_policy_map(self):
        with pytest.raises(TypeError, match="If specified, `policy_map` must be a dict."):
            DTypePolicyMap(policy_map=123)
        with pytest.raises(TypeError, match="If specified, `policy_map` must be a dict."):
            DTypePolicyMap(policy_map=dtype_policies.DTypePolicy("mixed_bfloat16"))
