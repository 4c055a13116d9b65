"""Origin: keras/src/layers/attention/multi_head_attention_test.py (Keras
3.15): its quantization cases and those of `use_gate`.

Keras's sublayers `_query_dense`, `_key_dense`, `_value_dense`,
`_output_dense` and `_gate_dense` are `query`, `key`, `value`,
`attention_output` and `gate` here; a weight's constraint is in the layer's
`_weight_constraints`. The other cases (masks, flash attention, attention
axes, shapes) test attention itself, not dtype policies or quantization, and
are left out; so is `test_lora` (LoRA through `peft` here).
"""

import contextlib

import pytest
import torch

from dtype_policies import DTypePolicyMap, QuantizedDTypePolicy, constraints, initializers, layers

from .helpers import assert_dtype, non_trainable_weights, trainable_weights

QUERY = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
KEY = torch.tensor([[[0.0, 1.0], [1.0, 0.0]]])
VALUE = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])


def sublayers(layer, gate=False):
    names = ["query", "key", "value", "attention_output"] + (["gate"] if gate else [])
    return [getattr(layer, name) for name in names]


class TestMultiHeadAttentionTest:
    @pytest.mark.parametrize(
        "init_kwargs, expected_num_trainable_weights",
        [
            ({"num_heads": 2, "key_dim": 2}, 8),
            ({"num_heads": 2, "key_dim": 2, "value_dim": 4, "use_bias": False, "dropout": 0.5}, 4),
            ({"num_heads": 2, "key_dim": 2, "use_gate": True}, 10),
            (
                {
                    "num_heads": 2,
                    "key_dim": 2,
                    "value_dim": 4,
                    "use_bias": False,
                    "dropout": 0.5,
                    "use_gate": True,
                },
                5,
            ),
        ],
        ids=["default", "no_bias_dropout", "use_gate", "use_gate_no_bias_dropout"],
    )
    def test_basics(self, init_kwargs, expected_num_trainable_weights):
        layer = layers.MultiHeadAttention(**init_kwargs)
        layer.eval()
        out = layer(torch.rand(2, 8, 16), torch.rand(2, 4, 16))
        assert tuple(out.shape) == (2, 8, 16)
        assert len(trainable_weights(layer)) == expected_num_trainable_weights
        assert len(non_trainable_weights(layer)) == 0
        revived = layers.MultiHeadAttention.from_config(layer.get_config())
        assert revived.get_config() == layer.get_config()

    def test_initializer(self):
        layer = layers.MultiHeadAttention(
            num_heads=12,
            key_dim=64,
            use_gate=True,
            kernel_initializer=initializers.TruncatedNormal(stddev=0.02),
        )
        layer.build((2, 4, 8), (2, 4, 8))
        query = layer.query.kernel
        for other in (layer.key, layer.value, layer.attention_output, layer.gate):
            assert query.shape != other.kernel.shape or not torch.allclose(query, other.kernel)

    def test_mha_constraints(self):
        for argument, weight in (("kernel_constraint", "kernel"), ("bias_constraint", "bias")):
            layer = layers.MultiHeadAttention(
                num_heads=2, key_dim=2, use_gate=True, **{argument: "non_neg"}
            )
            layer.build(QUERY.shape, KEY.shape, VALUE.shape)
            for sublayer in (layer.query, layer.value, layer.key, layer.gate):
                assert isinstance(sublayer._weight_constraints[weight], constraints.NonNeg)

    def test_dtype_policy_map(self):
        quantized_policy = QuantizedDTypePolicy("int8", "float32")
        policy_map = DTypePolicyMap()
        policy_map["mha/query"] = quantized_policy
        policy_map["mha/key"] = quantized_policy
        policy_map["mha/value"] = quantized_policy
        layer = layers.MultiHeadAttention(
            num_heads=3, key_dim=8, use_bias=False, dtype=policy_map, name="mha"
        )
        layer.build(QUERY.shape, KEY.shape, VALUE.shape)
        for sublayer in (layer.query, layer.key, layer.value):
            assert_dtype(sublayer.kernel_int8, "int8")

    @pytest.mark.parametrize("use_gate", [False, True], ids=["no_gate", "use_gate"])
    def test_quantize_int8(self, use_gate):
        torch.manual_seed(1347)
        layer = layers.MultiHeadAttention(num_heads=3, key_dim=8, use_gate=use_gate, use_bias=False)
        layer.build(QUERY.shape, VALUE.shape, KEY.shape)
        output_float = layer(QUERY, KEY, VALUE)
        for sublayer in layer.modules():
            with contextlib.suppress(AttributeError, NotImplementedError, ValueError):
                sublayer.quantize("int8")
        for sublayer in sublayers(layer, gate=use_gate):
            assert_dtype(sublayer.kernel_int8, "int8")
        output_quantized = layer(QUERY, KEY, VALUE)
        assert float(((output_float - output_quantized) ** 2).mean()) < 1e-2
