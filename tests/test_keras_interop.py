"""Configs move between Keras 3 and this library (skipped without keras)."""

import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")
keras = pytest.importorskip("keras")

import dtype_policies  # noqa: E402

NAMES = [
    "float32",
    "mixed_float16",
    "mixed_bfloat16",
    "bfloat16",
    "int8_from_float32",
    "int8_from_mixed_bfloat16",
    "int4_from_float32",
    "int4/128_from_mixed_bfloat16",
    "int4/-1_from_float32",
    "float8_from_float32",
]


@pytest.mark.parametrize("name", NAMES)
def test_same_serialized_dict_as_keras(name):
    ours = dtype_policies.serialize(dtype_policies.get(name))
    theirs = keras.dtype_policies.serialize(keras.dtype_policies.get(name))
    assert ours == theirs
    assert dtype_policies.deserialize(theirs) == dtype_policies.get(name)
    assert keras.dtype_policies.deserialize(ours).name == name


def test_map_written_here_reads_in_keras_and_back():
    policy_map = dtype_policies.DTypePolicyMap("mixed_bfloat16")
    policy_map["enc/.*"] = "int8_from_mixed_bfloat16"
    policy_map["dec"] = dtype_policies.QuantizedFloat8DTypePolicy("float8", "float32", 16)
    keras_map = keras.dtype_policies.deserialize(dtype_policies.serialize(policy_map))
    assert keras_map["enc/attention"].name == "int8_from_mixed_bfloat16"
    assert keras_map["dec"].amax_history_length == 16
    assert keras_map["other"].name == "mixed_bfloat16"
    back = dtype_policies.deserialize(keras.dtype_policies.serialize(keras_map))
    assert back == policy_map


def test_keras_map_with_deferred_default_reads_here():
    keras_map = keras.dtype_policies.DTypePolicyMap()
    keras_map["a"] = keras.dtype_policies.get("int8_from_float32")
    config = keras.dtype_policies.serialize(keras_map)
    dtype_policies.set_dtype_policy("bfloat16")
    restored = dtype_policies.deserialize(config)
    assert restored["a"].name == "int8_from_bfloat16"
    assert restored.default_policy.name == "bfloat16"


INITIALIZER_NAMES = [
    "RandomNormal",
    "RandomUniform",
    "TruncatedNormal",
    "VarianceScaling",
    "GlorotUniform",
    "GlorotNormal",
    "HeNormal",
    "HeUniform",
    "LecunNormal",
    "LecunUniform",
    "Orthogonal",
    "Constant",
    "Zeros",
    "Ones",
]


@pytest.mark.parametrize("name", INITIALIZER_NAMES)
def test_initializer_configs_are_keras_configs(name):
    from dtype_policies import initializers

    theirs = getattr(keras.initializers, name)().get_config()
    assert getattr(initializers, name)().get_config() == theirs
    configured = {k: 7 if k == "seed" else v for k, v in theirs.items()}
    assert getattr(initializers, name)(**configured).get_config() == configured


def test_a_keras_dense_config_with_its_initializers_reads_here():
    from dtype_policies import saving

    dense = keras.layers.Dense(
        8, dtype="mixed_bfloat16", name="d", kernel_initializer=keras.initializers.HeNormal(seed=3)
    )
    config = keras.saving.serialize_keras_object(dense)
    layer = saving.deserialize_layer(config)
    assert layer.kernel_initializer.get_config() == {
        "seed": 3,
        "input_axes": None,
        "output_axes": None,
    }
    assert layer.dtype_policy.name == "mixed_bfloat16"
