"""get / serialize / deserialize, including Keras 3 dicts written by hand."""

import json

import numpy as np
import pytest
import torch

import dtype_policies
from dtype_policies import (
    DTypePolicy,
    DTypePolicyMap,
    FloatDTypePolicy,
    Int4DTypePolicy,
    QuantizedDTypePolicy,
    QuantizedFloat8DTypePolicy,
    deserialize,
    get,
    policy_scope,
    serialize,
)

# Dicts exactly as Keras 3 writes them (reference section 1.11).
KERAS_DICTS = [
    (
        {
            "module": "keras",
            "class_name": "DTypePolicy",
            "config": {"name": "float32"},
            "registered_name": None,
        },
        DTypePolicy("float32"),
    ),
    (
        {
            "module": "keras",
            "class_name": "FloatDTypePolicy",
            "config": {"name": "mixed_bfloat16"},
            "registered_name": None,
        },
        FloatDTypePolicy("mixed_bfloat16"),
    ),
    (
        {
            "module": "keras.dtype_policies",
            "class_name": "QuantizedDTypePolicy",
            "config": {"mode": "int8", "source_name": "float32"},
            "registered_name": None,
        },
        QuantizedDTypePolicy("int8", "float32"),
    ),
    (
        {
            "module": "keras.dtype_policies",
            "class_name": "QuantizedDTypePolicy",
            "config": {"mode": "int4", "source_name": "mixed_bfloat16"},
            "registered_name": None,
        },
        QuantizedDTypePolicy("int4", "mixed_bfloat16"),
    ),
    (
        {
            "module": "keras.dtype_policies",
            "class_name": "QuantizedFloat8DTypePolicy",
            "config": {"mode": "float8", "source_name": "float32", "amax_history_length": 1024},
            "registered_name": None,
        },
        QuantizedFloat8DTypePolicy("float8", "float32"),
    ),
    (
        {
            "module": "keras.dtype_policies",
            "class_name": "Int4DTypePolicy",
            "config": {"mode": "int4/128", "source_name": "float32"},
            "registered_name": None,
        },
        Int4DTypePolicy("int4/128", "float32"),
    ),
]


@pytest.mark.parametrize(("config", "policy"), KERAS_DICTS)
def test_keras_dicts_round_trip(config, policy):
    restored = deserialize(config)
    assert restored == policy
    assert type(restored) is type(policy)
    assert serialize(restored) == config
    assert get(config) == policy
    assert json.loads(json.dumps(serialize(policy))) == config


def test_keras_map_dict_written_with_deferred_default():
    # Keras writes `None` names when the map's default was deferred to the global.
    config = {
        "module": "keras.dtype_policies",
        "class_name": "DTypePolicyMap",
        "config": {
            "default_policy": None,
            "policy_map": {
                "dense": {
                    "module": "keras.dtype_policies",
                    "class_name": "QuantizedDTypePolicy",
                    "config": {"mode": "int8", "source_name": None},
                    "registered_name": None,
                },
                "other": {
                    "module": "keras",
                    "class_name": "DTypePolicy",
                    "config": {"name": None},
                    "registered_name": None,
                },
            },
        },
        "registered_name": None,
    }
    dtype_policies.set_dtype_policy("bfloat16")
    restored = deserialize(config)
    assert restored.default_policy == DTypePolicy("bfloat16")
    assert restored["dense"] == QuantizedDTypePolicy("int8", "bfloat16")
    assert restored["other"] == DTypePolicy("bfloat16")


def test_keras2_policy_class_name_accepted():
    assert deserialize({"class_name": "Policy", "config": {"name": "mixed_float16"}}) == (
        DTypePolicy("mixed_float16")
    )


@pytest.mark.parametrize("class_name", ["Policy", "PolicyV1"])
@pytest.mark.parametrize("loss_scale", ["dynamic", None, {"class_name": "DynamicLossScale"}])
def test_tf_keras_policies_read_as_tf_keras_reads_them(class_name, loss_scale):
    """TF 2.3 and earlier wrote a `loss_scale` into a policy's config, and its
    experimental policy as `PolicyV1`: tf.keras reads both as a `Policy`,
    dropping the loss scale. `get` and `deserialize` refused them (a `.keras`
    archive's reader did not)."""
    config = {
        "class_name": class_name,
        "config": {"name": "mixed_float16", "loss_scale": loss_scale},
    }
    assert deserialize(config) == DTypePolicy("mixed_float16")
    assert get(config) == DTypePolicy("mixed_float16")
    with pytest.raises(
        TypeError, match=rf"Cannot rebuild {class_name}.*unexpected keys \['scale'\]"
    ):
        deserialize({"class_name": class_name, "config": {"name": "float32", "scale": 1}})
    with pytest.raises(ValueError, match=rf"tf.keras {class_name} needs a 'config' with a 'name'"):
        deserialize({"class_name": class_name, "config": {"name": 16}})


def test_a_config_without_its_config_gives_the_class_defaults_as_keras_reads_it():
    assert deserialize({"class_name": "DTypePolicy"}) == DTypePolicy()
    with policy_scope("mixed_bfloat16"):
        assert deserialize({"class_name": "DTypePolicy"}).name == "mixed_bfloat16"
    with pytest.raises(TypeError, match="Cannot rebuild QuantizedDTypePolicy"):
        deserialize({"class_name": "QuantizedDTypePolicy"})  # it needs its mode


@pytest.mark.parametrize(
    ("python_type", "name"),
    [(bool, "bool"), (int, "int32"), (float, "float32"), (complex, "complex64")],
)
def test_get_of_a_python_type_as_keras(python_type, name):
    assert get(python_type).name == name


def test_deserialize_errors():
    with pytest.raises(TypeError, match="expects a dict"):
        deserialize("float32")
    with pytest.raises(ValueError, match="needs the key 'class_name'"):
        deserialize({"config": {"name": "float32"}})
    with pytest.raises(ValueError, match="Unknown dtype policy class 'Nope'"):
        deserialize({"class_name": "Nope", "config": {}})
    with pytest.raises(ValueError, match="does not implement"):
        deserialize({"class_name": "TernaryDTypePolicy", "config": {"mode": "ternary"}})
    with pytest.raises(ValueError, match="Invalid weight_bits in mode"):
        deserialize({"class_name": "GPTQDTypePolicy", "config": {"mode": "gptq/5/128"}})
    with pytest.raises(TypeError, match="Cannot rebuild DTypePolicy"):
        deserialize({"class_name": "DTypePolicy", "config": {"nom": "float32"}})
    with pytest.raises(ValueError, match="Cannot convert"):
        deserialize({"class_name": "DTypePolicy", "config": {"name": "float99"}})


def test_deserialize_custom_objects():
    class MyPolicy(DTypePolicy):
        pass

    config = serialize(MyPolicy("bfloat16"))
    assert config["class_name"] == "MyPolicy"
    assert config["registered_name"].endswith(">MyPolicy")
    restored = deserialize(config, custom_objects={"MyPolicy": MyPolicy})
    assert type(restored) is MyPolicy and restored.name == "bfloat16"


def test_serialize_rejects_non_policies():
    with pytest.raises(TypeError, match="expects a DTypePolicy"):
        serialize("float32")


@pytest.mark.parametrize(
    ("identifier", "expected"),
    [
        ("float32", DTypePolicy("float32")),
        ("mixed_float16", DTypePolicy("mixed_float16")),
        ("uint8", DTypePolicy("uint8")),
        ("int32", DTypePolicy("int32")),
        ("int8", DTypePolicy("int8")),
        ("float8_e4m3fn", DTypePolicy("float8_e4m3fn")),
        ("float8_e5m2", DTypePolicy("float8_e5m2")),
        ("int8_from_float32", QuantizedDTypePolicy("int8", "float32")),
        ("int8_from_mixed_bfloat16", QuantizedDTypePolicy("int8", "mixed_bfloat16")),
        ("float8_from_mixed_float16", QuantizedFloat8DTypePolicy("float8", "mixed_float16")),
        ("int4_from_float32", QuantizedDTypePolicy("int4", "float32")),
        ("int4/128_from_float32", Int4DTypePolicy("int4/128", "float32")),
        ("int4/-1_from_float32", Int4DTypePolicy("int4/-1", "float32")),
        ("int4/None_from_float32", Int4DTypePolicy("int4/-1", "float32")),
        (torch.bfloat16, DTypePolicy("bfloat16")),
        (np.float16, DTypePolicy("float16")),
        (np.dtype("float64"), DTypePolicy("float64")),
        (float, DTypePolicy("float32")),
    ],
)
def test_get(identifier, expected):
    policy = get(identifier)
    assert policy == expected
    assert type(policy) is type(expected)


def test_get_passes_policies_through_and_none_gives_default():
    policy = QuantizedDTypePolicy("int8", "float32")
    assert get(policy) is policy
    policy_map = DTypePolicyMap()
    assert get(policy_map) is policy_map
    dtype_policies.set_dtype_policy("mixed_bfloat16")
    assert get(None) is dtype_policies.dtype_policy()


def test_float8_string_always_uses_default_history_length():
    assert get("float8_from_float32").amax_history_length == 1024


@pytest.mark.parametrize(
    ("identifier", "error", "message"),
    [
        ("float7", ValueError, "Cannot convert"),
        ("int7", ValueError, "Cannot convert"),
        ("mixed_float15", ValueError, "Cannot convert"),
        ("int8_from_mixed_bfloat15", ValueError, "Cannot convert"),
        ("int8_abc_", ValueError, "Cannot convert `policy` into a valid pair"),
        ("int4", ValueError, "Cannot convert `policy` into a valid pair"),
        ("int8_from_", ValueError, "Cannot convert ''"),
        ("int8_from_float16", ValueError, "doesn't work well"),
        ("int8_from_mixed_float16", ValueError, "doesn't work well"),
        ("int4/0_from_float32", ValueError, "Invalid block_size"),
        ("int4/-2_from_float32", ValueError, "Invalid block_size"),
        ("int4/abc_from_float32", ValueError, "must be an integer"),
        ("ternary_from_float32", ValueError, "does not implement"),
        ("gptq/5/128_from_float32", ValueError, "Invalid weight_bits in mode"),
        ("gptq_from_float32", ValueError, "Invalid mode for GPTQDTypePolicy"),
        ("awq/8/128_from_float32", ValueError, "only supports 4-bit"),
        (12345, ValueError, "Cannot interpret `dtype` argument"),
        (torch.complex32, ValueError, "Cannot interpret `dtype` argument"),
        ([1, 2], ValueError, "Cannot interpret `dtype` argument"),
    ],
)
def test_get_errors(identifier, error, message):
    with pytest.raises(error, match=message):
        get(identifier)


def test_private_parser_errors_match_keras_wording():
    from dtype_policies.policies.names import (
        parse_quantized_policy_name as _parse_quantized_policy_name,
    )

    with pytest.raises(TypeError, match=r"must be a string\."):
        _parse_quantized_policy_name(12)
    with pytest.raises(ValueError, match="is incompatible with the current supported"):
        _parse_quantized_policy_name("abc_from_float32")
