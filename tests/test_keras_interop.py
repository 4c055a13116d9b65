"""Configs move between Keras 3 and this library (skipped without keras)."""

import os

import numpy as np
import pytest
import torch

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


def _configs(library):
    """The same quantization configs, built by Keras or by this library."""
    quantizers = library.quantizers
    return [
        quantizers.Int8QuantizationConfig(),
        quantizers.Int8QuantizationConfig(
            weight_quantizer=quantizers.AbsMaxQuantizer(axis=0), activation_quantizer=None
        ),
        quantizers.Int4QuantizationConfig(block_size=64),
        quantizers.Float8QuantizationConfig(),
    ]


@pytest.mark.parametrize("index", range(4))
def test_quantization_configs_read_in_both_directions(index):
    """Nested quantizers were written as bare dicts: Keras read them as dicts
    (and failed at the first call), and this library failed on Keras's form."""
    ours, theirs = _configs(dtype_policies)[index], _configs(keras)[index]
    written_here = dtype_policies.quantizers.serialize(ours)
    assert written_here == keras.quantizers.serialize(theirs)
    read_by_keras = keras.quantizers.deserialize(written_here)
    assert type(read_by_keras) is type(theirs)
    for name in ("weight_quantizer", "activation_quantizer"):
        quantizer = getattr(read_by_keras, name, None)
        assert quantizer is None or isinstance(quantizer, keras.quantizers.AbsMaxQuantizer)
    read_here = dtype_policies.quantizers.deserialize(keras.quantizers.serialize(theirs))
    assert read_here == ours


def test_a_keras_int8_dense_config_reads_here_and_a_policy_built_layer_writes_none():
    from dtype_policies import layers

    dense = keras.layers.Dense(8, name="d")
    dense.build((2, 64))
    dense.quantize("int8")
    layer = layers.Dense.from_config(dense.get_config())
    assert layer.quantization_config == dtype_policies.quantizers.Int8QuantizationConfig(
        weight_quantizer=dtype_policies.quantizers.AbsMaxQuantizer(axis=0)
    ).__class__.from_config(dense.get_config()["quantization_config"]["config"])
    built = layers.Dense(8, dtype="int8_from_float32", name="d")
    built.build((2, 64))
    assert built.get_config()["quantization_config"] is None  # as Keras writes it


def _copy_attention_weights(theirs, ours):
    """A Keras MultiHeadAttention's projection weights into ours."""
    names = ["_query_dense", "_key_dense", "_value_dense", "_output_dense"]
    for name, mine in zip(names, ["query", "key", "value", "attention_output"]):
        dense = getattr(theirs, name)
        with torch.no_grad():
            for weight in ("kernel", "bias"):
                value = keras.ops.convert_to_numpy(getattr(dense, weight))
                getattr(getattr(ours, mine), weight).copy_(torch.as_tensor(value))


@pytest.mark.parametrize("causal", [False, True])
def test_a_keras_multi_head_attention_with_a_sliding_window_computes_as_keras(causal):
    theirs = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, sliding_window=2)
    x = np.random.default_rng(0).standard_normal((2, 6, 8)).astype("float32")
    expected = keras.ops.convert_to_numpy(theirs(x, x, use_causal_mask=causal))
    ours = dtype_policies.saving.deserialize_layer(keras.saving.serialize_keras_object(theirs))
    assert ours.sliding_window == 2 and ours.get_config()["sliding_window"] == 2
    ours.build((2, 6, 8), (2, 6, 8))
    _copy_attention_weights(theirs, ours)
    actual = ours(torch.as_tensor(x), torch.as_tensor(x), use_causal_mask=causal)
    np.testing.assert_allclose(actual.detach().numpy(), expected, atol=1e-5)
    with pytest.raises(ValueError, match="sliding_window=0"):
        dtype_policies.layers.MultiHeadAttention(2, 4, sliding_window=0)


@pytest.mark.parametrize(
    "name",
    [
        "Dense",
        "EinsumDense",
        "Embedding",
        "LayerNormalization",
        "MultiHeadAttention",
        "Dropout",
        "Activation",
    ],
)
def test_the_layers_take_keras_positional_arguments_in_keras_order(name):
    """A positional call written for Keras configures the same: ours had
    `rms_scaling` fifth in LayerNormalization (Keras 3.15 takes it by name
    only), `seed, use_gate` in MultiHeadAttention (Keras: `use_gate, seed`)
    and `activity_regularizer` among EinsumDense's (Keras: by name)."""
    import inspect

    from dtype_policies import layers

    def positional(cls):
        parameters = inspect.signature(cls.__init__).parameters.values()
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        return [p.name for p in parameters if p.kind == kind and p.name != "self"]

    ours, theirs = positional(getattr(layers, name)), positional(getattr(keras.layers, name))
    assert ours == theirs[: len(ours)]  # Keras's later ones (LoRA, ...) are not mirrored


@pytest.mark.parametrize(
    "name",
    [
        "abs_max_quantize",
        "pack_int4",
        "unpack_int4",
        "compute_float8_amax_history",
        "compute_float8_scale",
        "quantize_and_dequantize",
        "serialize",
        "deserialize",
        "get",
        "dtype_policies.serialize",
        "dtype_policies.deserialize",
        "dtype_policies.get",
    ],
)
def test_the_quantizers_mirror_takes_keras_arguments(name):
    """The same names in the same order: positional and keyword calls
    written for Keras agree (`serialize(dtype_policy=...)`,
    `quantizers.deserialize(config, custom_objects=...)` raised here)."""
    import inspect

    namespace, _, function = name.rpartition(".")
    ours_module = dtype_policies if namespace else dtype_policies.quantizers
    keras_module = keras.dtype_policies if namespace else keras.quantizers
    ours = list(inspect.signature(getattr(ours_module, function)).parameters)
    theirs = list(inspect.signature(getattr(keras_module, function)).parameters)
    assert ours == theirs


def test_quantizers_get_and_deserialize_take_keras_extra_arguments():
    from dtype_policies import quantizers

    assert quantizers.get("abs_max_quantizer", axis=0).axis == (0,)

    class Custom(quantizers.AbsMaxQuantizer):
        pass

    config = {**quantizers.serialize(Custom(axis=-1)), "class_name": "Custom"}
    restored = quantizers.deserialize(config, custom_objects={"Custom": Custom})
    assert type(restored) is Custom and restored.axis == (-1,)


@pytest.mark.parametrize("axis", [-1, 1])
def test_layer_normalization_rms_scaling_computes_as_keras(axis):
    from dtype_policies import layers

    x = np.random.default_rng(0).normal(1.0, 2.0, size=(2, 3, 4)).astype("float32")
    with pytest.warns(UserWarning, match="deprecated"):
        theirs = keras.layers.LayerNormalization(axis=axis, rms_scaling=True, scale=False)
    with pytest.warns(UserWarning, match="deprecated"):
        ours = layers.LayerNormalization(axis=axis, rms_scaling=True, scale=False)
    theirs.build(x.shape)
    ours.build(x.shape)
    with torch.no_grad():
        gamma = np.linspace(0.5, 2.0, x.shape[axis]).astype("float32")
        ours.gamma.copy_(torch.from_numpy(gamma))
        theirs.gamma.assign(gamma)
    expected = keras.ops.convert_to_numpy(theirs(x))
    assert [w.name for w in theirs.weights] == ["gamma"]
    assert [name for name, _ in ours.named_parameters()] == ["gamma"]
    actual = ours(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "call",
    [
        lambda lib: lib.serialize(None),
        lambda lib: lib.deserialize(None),
        lambda lib: lib.deserialize({"class_name": "DTypePolicy", "config": None}),
    ],
)
def test_none_passes_through_serialization_as_in_keras(call):
    theirs, ours = call(keras.dtype_policies), call(dtype_policies)
    assert (ours is None) == (theirs is None)
    if theirs is not None:
        assert ours.name == theirs.name == "float32"


def test_convert_input_without_a_dtype_casts_to_float32_as_keras():
    x = np.ones((2, 2), dtype="float64")
    theirs = keras.DTypePolicy("float32").convert_input(x, autocast=True, dtype=None)
    ours = dtype_policies.DTypePolicy("float32").convert_input(x, autocast=True, dtype=None)
    assert str(theirs.dtype) == "torch.float32" and ours.dtype == torch.float32
    assert dtype_policies.DTypePolicy("float32").convert_input("text", True, None) == "text"


def test_a_map_s_serialized_form_as_a_map_s_default_is_refused_as_the_map_is():
    inner = dtype_policies.DTypePolicyMap("bfloat16", {"attn/.*": "float16"})
    for default in (inner, dtype_policies.serialize(inner)):
        with pytest.raises(ValueError, match="cannot be a `DTypePolicyMap`"):
            dtype_policies.DTypePolicyMap(default_policy=default)


@pytest.mark.parametrize("output_shape", [7, (2, 4)])
def test_a_keras_multi_head_attention_with_an_output_shape_and_activity_losses(output_shape):
    """Keras writes `output_shape` as a tuple (which crashed the first call
    here), takes a multi-dimensional one, and gives its activity regularizer
    to the four projections (one loss each), not to its own output."""
    theirs = keras.layers.MultiHeadAttention(
        num_heads=2, key_dim=3, output_shape=output_shape, activity_regularizer="l1"
    )
    x = np.random.default_rng(0).standard_normal((2, 5, 6)).astype("float32")
    expected = keras.ops.convert_to_numpy(theirs(x, x))
    expected_losses = sorted(float(keras.ops.convert_to_numpy(loss)) for loss in theirs.losses)
    config = theirs.get_config()
    ours = dtype_policies.layers.MultiHeadAttention.from_config(config)
    ours.build((2, 5, 6), (2, 5, 6))
    assert ours.get_config()["output_shape"] == config["output_shape"]
    assert ours.get_config()["attention_axes"] == config["attention_axes"] == (1,)
    assert ours.get_config()["activity_regularizer"] == config["activity_regularizer"]
    _copy_attention_weights(theirs, ours)
    ours.eval()
    actual = ours(torch.as_tensor(x), torch.as_tensor(x))
    np.testing.assert_allclose(actual.detach().numpy(), expected, atol=1e-5)
    assert ours.compute_output_shape((None, 5, 6), (None, 5, 6)) == (
        None,
        5,
        *np.atleast_1d(output_shape),
    )
    assert sorted(float(loss) for loss in ours.losses) == pytest.approx(expected_losses, rel=1e-5)
    with pytest.raises(ValueError, match=r"except the last one, must be equal"):
        ours.compute_output_shape((None, 5, 6), (None, 5, 6), (None, 4, 6))
    with pytest.raises(ValueError, match=r"Invalid `output_shape`: 'a'"):
        dtype_policies.layers.MultiHeadAttention(2, 3, output_shape="a")


def test_containers_built_frozen_freeze_what_they_build_as_keras():
    """`trainable=False` at construction only reached the weights that
    existed then: a MultiHeadAttention's projections (made in `build`) and a
    Sequential's layers trained anyway."""
    x = torch.randn(2, 3, 6)
    for ours, theirs in (
        (
            dtype_policies.layers.MultiHeadAttention(num_heads=2, key_dim=3, trainable=False),
            keras.layers.MultiHeadAttention(num_heads=2, key_dim=3, trainable=False),
        ),
        (
            dtype_policies.layers.Sequential(
                [dtype_policies.layers.Dense(4), dtype_policies.layers.Dense(2)], trainable=False
            ),
            keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(2)], trainable=False),
        ),
    ):
        args = (x, x) if isinstance(ours, dtype_policies.layers.MultiHeadAttention) else (x,)
        ours(*args)
        theirs(*[a.numpy() for a in args])
        assert len(ours.trainable_weights) == len(theirs.trainable_weights) == 0
        assert not any(p.requires_grad for p in ours.parameters())
        assert len(ours.non_trainable_weights) == len(theirs.non_trainable_weights)
    model = dtype_policies.layers.Sequential([dtype_policies.layers.Dense(4)])
    model(x)
    model.trainable = False
    model.layers[0].trainable = True  # Keras: the frozen container still trains nothing
    assert model.trainable_weights == []


def test_a_mode_a_layer_cannot_take_leaves_it_unbuilt_as_keras():
    layer = dtype_policies.layers.Embedding(10, 4, dtype="float8_from_float32")
    ids = torch.tensor([[1, 2, 3]])
    for _ in range(2):  # raised once, then computed in float32
        with pytest.raises(NotImplementedError, match="Invalid quantization mode"):
            layer(ids)
        assert not layer.built and list(layer.parameters()) == []
    einsum = dtype_policies.layers.EinsumDense("abc,cd->adb", (4, None), dtype="int8_from_float32")
    einsum(torch.randn(2, 3, 6))  # no matrix product: computes in float (documented)
    assert not einsum.is_quantized and einsum.quantization_mode is None


def test_configs_write_keras_s_keys_and_forms():
    for ours, theirs in (
        (
            dtype_policies.layers.EinsumDense("ab,bc->ac", 5),
            keras.layers.EinsumDense("ab,bc->ac", 5),
        ),
        (dtype_policies.layers.Embedding(4, 3), keras.layers.Embedding(4, 3)),
        (
            dtype_policies.layers.MultiHeadAttention(2, 3, output_shape=7),
            keras.layers.MultiHeadAttention(2, 3, output_shape=7),
        ),
    ):
        mine, keras_config = ours.get_config(), theirs.get_config()
        assert set(mine) == set(keras_config), set(mine) ^ set(keras_config)
        for key in ("output_shape", "activity_regularizer", "attention_axes"):
            if key in keras_config:
                assert mine[key] == keras_config[key], key
    with pytest.raises(ValueError, match="Unrecognized keyword arguments passed to Dense"):
        dtype_policies.layers.Dense(4, foo=1)  # Keras's type


def test_a_keras_sequential_config_starting_with_an_input_reads_here_built():
    theirs = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(2, dtype="mixed_bfloat16")]
    )
    ours = dtype_policies.layers.Sequential.from_config(theirs.get_config())
    assert [type(layer).__name__ for layer in ours.layers] == ["Dense", "Dense"]
    assert ours.built and all(layer.built for layer in ours.layers)
    assert tuple(ours.layers[0].kernel.shape) == (5, 4)
    assert ours(torch.randn(3, 5)).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.DTypePolicy("mixed_float16"),
        lambda: keras.dtype_policies.get("int8_from_mixed_bfloat16"),
        lambda: keras.dtype_policies.get("int4/64_from_float32"),
        lambda: keras.dtype_policies.DTypePolicyMap(
            "mixed_bfloat16", {"dense": keras.DTypePolicy("float32")}
        ),
    ],
)
def test_a_keras_policy_object_reads_as_the_same_policy_here(make):
    theirs = make()
    ours = dtype_policies.get(theirs)
    # the default policy takes it too (it was refused: "Expected ... a DTypePolicy
    # instance. Received: policy=<DTypePolicy ...>")
    with dtype_policies.policy_scope(theirs):
        assert dtype_policies.dtype_policy() == ours
    dtype_policies.set_dtype_policy(theirs)
    try:
        assert dtype_policies.dtype_policy() == ours
    finally:
        dtype_policies.set_dtype_policy("float32")
    assert ours.name == theirs.name
    if isinstance(ours, dtype_policies.DTypePolicyMap):
        assert ours["dense"].name == "float32" and ours.default_policy.name == "mixed_bfloat16"
    else:
        assert ours.get_config() == theirs.get_config()


@pytest.mark.parametrize("keras_default", ["float32", "mixed_bfloat16"])
def test_a_keras_map_with_a_deferred_default_reads_as_it_is_and_stays_as_it_was(keras_default):
    """Read by its `get_config()`, a Keras map built with `default_policy=None`
    set its entries' names to None in place (Keras's save-time deferral): the
    caller's map was emptied and its entries read as this library's default."""
    keras.config.set_dtype_policy(keras_default)
    try:
        theirs = keras.dtype_policies.DTypePolicyMap(
            None,
            {
                "dense": keras.dtype_policies.QuantizedDTypePolicy("int8", "mixed_bfloat16"),
                "head": keras.DTypePolicy("bfloat16"),
                "tail": "float16",
            },
        )
        ours = dtype_policies.get(theirs)
        expected = {"dense": "int8_from_mixed_bfloat16", "head": "bfloat16", "tail": "float16"}
        assert {key: ours[key].name for key in ours} == expected
        assert ours.default_policy.name == keras_default
        assert [theirs["dense"].name, theirs["head"].name, theirs["tail"]] == [
            "int8_from_mixed_bfloat16", "bfloat16", "float16"
        ]  # fmt: skip
    finally:
        keras.config.set_dtype_policy("float32")
