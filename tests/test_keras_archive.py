"""`policy_map_from_keras`: layer paths and policies read from `.keras` archives.

Real archives come from Keras (skipped without it): for every layer of the
saved model, and of the model `keras.saving.load_model` rebuilds, the map gives
the policy Keras gives that layer. Hand-written archives cover Keras 2 and
Keras 3.0-3.3 configs, maps with null defaults, escaping and the errors.
"""

import json
import os
import subprocess
import sys
import warnings
import zipfile
from unittest import mock

import pytest

import dtype_policies
from dtype_policies import (
    DTypePolicy,
    Int4DTypePolicy,
    QuantizedDTypePolicy,
    QuantizedFloat8DTypePolicy,
)
from dtype_policies.saving import policy_map_from_keras

# --------------------------------------------------------------------------
# Real Keras models


@pytest.fixture(scope="module")
def keras():
    os.environ["KERAS_BACKEND"] = "torch"
    return pytest.importorskip("keras")


@pytest.fixture(scope="module")
def custom(keras):
    """Custom layer and model classes, registered once (they need keras)."""
    layers = keras.layers
    register = keras.saving.register_keras_serializable(package="dtype_policies_tests")

    @register
    class Block(layers.Layer):
        """A composite layer that records its quantized sublayers in a map, the
        pattern of Keras's own `dtype_policy_map_test.py`."""

        def __init__(self, dtype=None, name="block", **kwargs):
            super().__init__(dtype=dtype, name=name, **kwargs)
            self.dense = layers.Dense(8, dtype=dtype, name="dense")
            self.mha = layers.MultiHeadAttention(2, 4, dtype=dtype, name="mha")
            self.norm = layers.LayerNormalization(dtype=dtype, name="norm")

        def call(self, inputs):
            x = self.dense(inputs)
            return self.norm(self.mha(x, x))

        def get_config(self):
            config = super().get_config()
            policy_map = keras.dtype_policies.DTypePolicyMap()
            for layer in self._flatten_layers():
                if layer.quantization_mode is not None:
                    policy_map[layer.path] = layer.dtype_policy
            if len(policy_map) > 0:
                config["dtype"] = policy_map
            return config

    @register
    class Tower(keras.Model):
        """A subclassed model whose get_config lists its layers; its `dtype`
        (a policy or a map) is passed to every layer but the head."""

        def __init__(self, dtype=None, name="tower", **kwargs):
            super().__init__(dtype=dtype, name=name, **kwargs)
            self.proj = layers.Dense(8, dtype=dtype, name="proj")
            self.norm = layers.LayerNormalization(dtype=dtype, name="norm")
            self.hidden = layers.Dense(8, dtype=dtype, name="hidden")
            self.head = layers.Dense(2, dtype="float32", name="head")

        def call(self, x):
            return self.head(self.hidden(self.norm(self.proj(x))))

        def get_config(self):
            return {
                "name": self.name,
                "dtype": keras.dtype_policies.serialize(self.dtype_policy),
                "layers": [
                    keras.layers.serialize(layer)
                    for layer in (self.proj, self.norm, self.hidden, self.head)
                ],
            }

        @classmethod
        def from_config(cls, config):
            return cls(dtype=config["dtype"], name=config["name"])

    @register
    class AttentionModel(keras.Model):
        """A subclassed model with a MultiHeadAttention (its sublayers are not in
        any config)."""

        def __init__(self, dtype=None, name="attention_model", **kwargs):
            super().__init__(dtype=dtype, name=name, **kwargs)
            self.mha = layers.MultiHeadAttention(2, 4, dtype=dtype, name="mha")
            self.head = layers.Dense(2, dtype="float32", name="head")

        def call(self, x):
            return self.head(self.mha(x, x))

        def get_config(self):
            return {
                "name": self.name,
                "dtype": keras.dtype_policies.serialize(self.dtype_policy),
                "mha": keras.layers.serialize(self.mha),
                "head": keras.layers.serialize(self.head),
            }

        @classmethod
        def from_config(cls, config):
            return cls(dtype=config["dtype"], name=config["name"])

    return {"Block": Block, "Tower": Tower, "AttentionModel": AttentionModel}


def _describe(policy):
    return (
        type(policy).__name__.replace("FloatDTypePolicy", "DTypePolicy"),
        policy.name,
        policy.quantization_mode,
        getattr(policy, "source_name", None),
        getattr(policy, "block_size", None),
        getattr(policy, "amax_history_length", None),
    )


def _keras_policies(keras, model):
    """`{layer.path: policy}` for every layer Keras gives a path, as this
    library's policies; a layer with a map as its policy resolves it by path,
    as Keras does. Functional models are left out: their config has no dtype."""
    policies = {}
    for layer in model._flatten_layers():
        if layer.path is None or type(layer).__name__ == "Functional":
            continue
        policy = layer.dtype_policy
        if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
            policy = policy[layer.path]
        assert layer.path not in policies, f"two layers with path {layer.path!r}"
        policies[layer.path] = dtype_policies.get(keras.dtype_policies.serialize(policy))
    return policies


def _assert_all_layers(policy_map, expected):
    assert expected
    actual = {path: _describe(policy_map[path]) for path in expected}
    assert actual == {path: _describe(policy) for path, policy in expected.items()}


def _save_and_read(keras, model, tmp_path):
    """Saves `model` and reads the archive; asserts the map against every layer
    of the model and of the model `load_model` rebuilds. Returns the map."""
    # Read before saving: the get_config of a Keras map without a default
    # policy sets the names of its policies to None.
    expected = _keras_policies(keras, model)
    file = tmp_path / "m.keras"
    model.save(file)
    policy_map = policy_map_from_keras(file)
    _assert_all_layers(policy_map, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = keras.saving.load_model(file)
    _assert_all_layers(policy_map, _keras_policies(keras, reloaded))
    return policy_map


def _config(file):
    with zipfile.ZipFile(file) as archive:
        return json.loads(archive.read("config.json"))


def test_sequential_with_mixed_policies_and_float32_island(keras, tmp_path):
    layers = keras.layers
    model = keras.Sequential(
        [
            keras.Input((4,)),
            layers.Dense(8, dtype="mixed_bfloat16", name="d0"),
            layers.LayerNormalization(dtype="float32", name="norm"),
            layers.Dense(8, dtype="mixed_float16", name="d1"),
            layers.Dense(2, dtype="mixed_bfloat16", name="d2"),
        ],
        name="seq",
    )
    policy_map = _save_and_read(keras, model, tmp_path)
    assert model.layers[0].path == "seq/d0"
    assert policy_map["seq/d0"] == DTypePolicy("mixed_bfloat16")
    assert policy_map["seq/norm"] == DTypePolicy("float32")
    assert policy_map["seq/d1"] == DTypePolicy("mixed_float16")
    # The model's own policy is the default (Keras's global policy here).
    assert policy_map.default_policy == DTypePolicy("float32")
    # load_model builds each layer from its build_config: bare paths, also keys.
    assert policy_map["d1"] == DTypePolicy("mixed_float16")
    exact = policy_map_from_keras(tmp_path / "m.keras", include_other_paths=False)
    assert "d1" not in exact and "seq/d1" in exact
    assert set(exact) == {"seq", "seq/d0", "seq/norm", "seq/d1", "seq/d2"}


def test_functional_with_nested_sequential_and_functional(keras, tmp_path):
    layers = keras.layers
    inner_seq = keras.Sequential(
        [
            layers.Dense(8, dtype="mixed_bfloat16", name="s0"),
            layers.Dense(8, dtype="bfloat16", name="s1"),
        ],
        name="inner_seq",
    )
    inner_in = keras.Input((8,))
    inner_fn = keras.Model(
        inner_in, layers.Dense(8, dtype="float16", name="f0")(inner_in), name="inner_fn"
    )
    with_input = keras.Sequential(
        [keras.Input((8,)), layers.Dense(8, dtype="mixed_float16", name="w0")], name="with_input"
    )
    x = keras.Input((4,))
    h = layers.Dense(8, dtype="mixed_bfloat16", name="first")(x)
    h = inner_fn(inner_seq(h))
    y = layers.Dense(2, dtype="mixed_bfloat16", name="last")(with_input(h))
    model = keras.Model(x, y, name="outer")
    policy_map = _save_and_read(keras, model, tmp_path)

    paths = {layer.name: layer.path for layer in model._flatten_layers()}
    # Functional: bare names, also inside a nested Functional; Sequential: nested.
    assert paths["first"] == "first" and paths["f0"] == "f0"
    assert paths["s1"] == "inner_seq/s1" and paths["w0"] == "with_input/w0"
    assert policy_map["inner_seq/s1"] == DTypePolicy("bfloat16")
    assert policy_map["f0"] == DTypePolicy("float16")
    # No dtype in a Functional's config: the default is the most common policy.
    assert "dtype" not in _config(tmp_path / "m.keras")["config"]
    assert policy_map.default_policy == DTypePolicy("mixed_bfloat16")


def test_sequential_nested_in_sequential(keras, tmp_path):
    layers = keras.layers
    lazy = keras.Sequential([layers.Dense(4, dtype="bfloat16", name="l0")], name="lazy")
    built = keras.Sequential(
        [keras.Input((4,)), layers.Dense(4, dtype="float16", name="b0")], name="built"
    )
    model = keras.Sequential([keras.Input((4,)), lazy, built], name="top")
    policy_map = _save_and_read(keras, model, tmp_path)
    assert model.get_layer("lazy").layers[0].path == "top/lazy/l0"
    assert model.get_layer("built").layers[0].path == "built/b0"  # built on its own
    assert policy_map["top/lazy/l0"] == DTypePolicy("bfloat16")
    assert policy_map["built/b0"] == DTypePolicy("float16")


def test_multi_head_attention_sublayers(keras, tmp_path):
    layers = keras.layers
    x = keras.Input((3, 8))
    y = layers.MultiHeadAttention(2, 4, dtype="mixed_bfloat16", name="mha")(x, x)
    y = layers.GroupQueryAttention(4, 2, 1, use_gate=True, dtype="bfloat16", name="gqa")(y, y)
    y = layers.LayerNormalization(dtype="float32", name="norm")(y)
    model = keras.Model(x, y)
    policy_map = _save_and_read(keras, model, tmp_path)
    for sub in ("query", "key", "value", "attention_output"):
        assert policy_map[f"mha/{sub}"] == DTypePolicy("mixed_bfloat16")
    assert policy_map["gqa/gate"] == DTypePolicy("bfloat16")
    assert "mha/softmax" not in policy_map  # no path in Keras


def test_subclassed_model_with_listed_layers(keras, custom, tmp_path):
    model = custom["AttentionModel"](dtype="mixed_bfloat16")
    model(keras.ops.ones((1, 3, 8)))
    policy_map = _save_and_read(keras, model, tmp_path)
    assert policy_map["attention_model/mha/query"] == DTypePolicy("mixed_bfloat16")
    assert policy_map["attention_model/head"] == DTypePolicy("float32")
    assert policy_map.default_policy == DTypePolicy("mixed_bfloat16")


def test_wrappers_and_recurrent_cells(keras, tmp_path):
    layers = keras.layers
    x = keras.Input((3, 4))
    y = layers.Bidirectional(layers.LSTM(2, return_sequences=True, name="lstm"), name="bi")(x)
    y = layers.TimeDistributed(layers.Dense(2, dtype="float16", name="td_dense"), name="td")(y)
    y = layers.GRU(2, dtype="float64", name="gru")(y)
    policy_map = _save_and_read(keras, keras.Model(x, y), tmp_path)
    assert policy_map["bi/forward_lstm/lstm_cell"] == DTypePolicy("float32")
    assert policy_map["td/td_dense"] == DTypePolicy("float16")
    assert policy_map["gru/gru_cell"] == DTypePolicy("float64")


def _quantizable_model(keras, custom, plain_mha=False):
    layers = keras.layers
    x = keras.Input((3, 8))
    ids = keras.Input((3,), dtype="int32")
    h = layers.Add()([x, layers.Embedding(10, 8, name="emb")(ids)])
    h = custom["Block"](name="block")(h)
    if plain_mha:
        h = layers.MultiHeadAttention(2, 4, name="plain_mha")(h, h)
    h = layers.EinsumDense("abc,cd->abd", (3, 8), bias_axes="d", name="ed")(h)
    h = layers.LayerNormalization(name="norm")(h)
    return keras.Model([x, ids], layers.Dense(2, dtype="float32", name="head")(h))


def _quantize(model, mode):
    # Keras runs gc.collect() for every replaced kernel (0.3 s each here): only
    # a memory hint, skipped to keep the tests fast.
    with warnings.catch_warnings(), mock.patch("gc.collect", return_value=0):
        warnings.simplefilter("ignore")  # "Layer Add does not have a `quantize` method"
        model.quantize(mode)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("int8", QuantizedDTypePolicy("int8", "float32")),
        ("int4", Int4DTypePolicy("int4/128", "float32")),
    ],
)
def test_quantized_model(keras, custom, tmp_path, mode, expected):
    model = _quantizable_model(keras, custom)
    _quantize(model, mode)
    policy_map = _save_and_read(keras, model, tmp_path)
    for path in ("emb", "ed", "head", "block/dense", "block/mha/query", "block/mha/value"):
        assert _describe(policy_map[path]) == _describe(expected), path
    assert policy_map["norm"] == DTypePolicy("float32")
    # The Block writes a map of its quantized sublayers, with a null default and
    # null source names (Keras resolves them at load time: so does the reader).
    block = next(
        c for c in _config(tmp_path / "m.keras")["config"]["layers"] if c["name"] == "block"
    )
    assert block["config"]["dtype"]["class_name"] == "DTypePolicyMap"
    assert block["config"]["dtype"]["config"]["default_policy"] is None
    entry = block["config"]["dtype"]["config"]["policy_map"]["block/mha/query"]
    assert entry["config"]["source_name"] is None
    # Layers the Block's config does not list and that are not quantized (its
    # MultiHeadAttention and norm) get the default, the most common source policy.
    assert "block/norm" not in policy_map
    assert policy_map.default_policy == DTypePolicy("float32")
    with dtype_policies.policy_scope("mixed_bfloat16"):
        later = policy_map_from_keras(tmp_path / "m.keras")
    assert later["block/mha/query"].source_name == "mixed_bfloat16"
    assert later["ed"] == policy_map["ed"]  # written in full: not affected


def test_quantized_plain_multi_head_attention_loses_sublayer_policies(keras, custom, tmp_path):
    # Keras 3.15: model.quantize() quantizes the EinsumDense sublayers of a
    # MultiHeadAttention whose dtype is a plain policy, but its get_config only
    # writes its own policy, so config.json says float32 for them.
    model = _quantizable_model(keras, custom, plain_mha=True)
    _quantize(model, "int8")
    expected = _keras_policies(keras, model)
    model.save(tmp_path / "m.keras")
    policy_map = policy_map_from_keras(tmp_path / "m.keras")
    mha = next(
        c for c in _config(tmp_path / "m.keras")["config"]["layers"] if c["name"] == "plain_mha"
    )
    assert mha["config"]["dtype"]["class_name"] == "DTypePolicy"
    for sub in ("query", "key", "value", "attention_output"):
        assert expected[f"plain_mha/{sub}"].quantization_mode == "int8"  # in memory
        assert policy_map[f"plain_mha/{sub}"] == DTypePolicy("float32")  # in the archive
    others = {p: q for p, q in expected.items() if not p.startswith("plain_mha/")}
    _assert_all_layers(policy_map, others)


def test_float8_policy_keeps_amax_history_length(keras, tmp_path):
    layers = keras.layers
    float8 = keras.dtype_policies.QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16", 16)
    x = keras.Input((3, 8))
    y = layers.Dense(8, dtype=float8, name="d8")(x)
    y = layers.EinsumDense("abc,cd->abd", (3, 4), dtype="float8_from_float32", name="e8")(y)
    policy_map = _save_and_read(keras, keras.Model(x, y), tmp_path)
    assert _describe(policy_map["d8"]) == _describe(
        QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16", 16)
    )
    assert policy_map["e8"].amax_history_length == 1024


def test_model_with_a_policy_map_as_dtype(keras, custom, tmp_path):
    kp = keras.dtype_policies
    keras_map = kp.DTypePolicyMap(
        kp.DTypePolicy("mixed_bfloat16"),
        {
            "tower/norm": kp.DTypePolicy("float32"),
            "tower/h.*": kp.DTypePolicy("bfloat16"),  # a regex key: matches "tower/hidden"
        },
    )
    model = custom["Tower"](dtype=keras_map)
    model(keras.ops.ones((2, 4)))
    policy_map = _save_and_read(keras, model, tmp_path)
    # Keras writes the whole map in each layer's config.
    layer_configs = _config(tmp_path / "m.keras")["config"]["layers"]
    assert layer_configs[0]["config"]["dtype"]["class_name"] == "DTypePolicyMap"
    assert policy_map["tower/proj"] == DTypePolicy("mixed_bfloat16")
    assert policy_map["tower/norm"] == DTypePolicy("float32")
    assert policy_map["tower/hidden"] == DTypePolicy("bfloat16")
    assert policy_map["tower/head"] == DTypePolicy("float32")  # its own dtype
    # The model's own policy is a map: the result's default is the map's default,
    # and the map's regex key is kept as Keras wrote it.
    assert policy_map.default_policy == DTypePolicy("mixed_bfloat16")
    assert policy_map.matching_key("tower/hidden") == "tower/hidden"
    assert policy_map["tower/h2"] == DTypePolicy("bfloat16")  # through "tower/h.*"
    # Reloaded, the layers have bare paths ("norm") that the map's keys do not
    # match: Keras gives them the map's default; the extra keys say the same.
    assert policy_map["norm"] == DTypePolicy("mixed_bfloat16")
    assert policy_map["head"] == DTypePolicy("float32")


def test_reader_does_not_import_keras(keras, tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="d")], name="s")
    model.save(tmp_path / "m.keras")
    code = (
        "import sys\n"
        "from dtype_policies.saving import policy_map_from_keras\n"
        f"m = policy_map_from_keras({str(tmp_path / 'm.keras')!r})\n"
        "assert m['s/d'].name == 'float32'\n"
        "assert not [n for n in sys.modules if n == 'keras' or n.startswith('keras.')]\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# --------------------------------------------------------------------------
# Hand-written archives


def _policy(name):
    return {"module": "keras", "class_name": "DTypePolicy", "config": {"name": name}}


def _layer(class_name, name, dtype, **config):
    return {
        "module": "keras.layers",
        "class_name": class_name,
        "config": {"name": name, "trainable": True, "dtype": dtype, **config},
        "registered_name": None,
        "build_config": {"input_shape": [None, 4]},
    }


def _sequential(layers, name="sequential", dtype=None):
    config = {"name": name, "trainable": True, "layers": layers}
    if dtype is not None:
        config["dtype"] = dtype
    return {"module": "keras", "class_name": "Sequential", "config": config}


def _archive(tmp_path, config, name="m.keras"):
    file = tmp_path / name
    with zipfile.ZipFile(file, "w") as archive:
        archive.writestr("metadata.json", json.dumps({"keras_version": "3.15.1"}))
        archive.writestr("config.json", config if isinstance(config, str) else json.dumps(config))
        archive.writestr("model.weights.h5", b"not read")
    return file


def test_keras_2_and_keras_3_0_string_dtypes(tmp_path):
    config = _sequential(
        [
            {"class_name": "InputLayer", "config": {"name": "in", "dtype": "int32"}},
            _layer("Dense", "a", "mixed_float16"),
            _layer("Dense", "b", "float32"),
            _layer(
                "Dense",
                "c",
                {"class_name": "Policy", "config": {"name": "mixed_bfloat16"}},  # Keras 2
            ),
            _layer("Dense", "d", "int8_from_mixed_bfloat16"),
        ],
        dtype="mixed_float16",
    )
    policy_map = policy_map_from_keras(str(_archive(tmp_path, config)))
    assert policy_map["sequential/a"] == DTypePolicy("mixed_float16")
    assert policy_map["sequential/b"] == DTypePolicy("float32")
    assert policy_map["sequential/c"] == DTypePolicy("mixed_bfloat16")
    assert policy_map["sequential/d"] == QuantizedDTypePolicy("int8", "mixed_bfloat16")
    assert policy_map.default_policy == DTypePolicy("mixed_float16")
    assert "sequential/in" not in policy_map and "in" not in policy_map


def test_null_dtype_is_the_default_policy_in_force(tmp_path):
    file = _archive(tmp_path, _sequential([_layer("Dense", "a", None)]))
    with dtype_policies.policy_scope("mixed_bfloat16"):
        policy_map = policy_map_from_keras(file)
    assert policy_map["sequential/a"] == DTypePolicy("mixed_bfloat16")


def test_policy_map_dtype_with_null_default_and_regex_keys(tmp_path):
    keras_map = {
        "module": "keras.dtype_policies",
        "class_name": "DTypePolicyMap",
        "config": {
            "default_policy": None,
            "policy_map": {
                "sequential/q.*": {
                    "module": "keras.dtype_policies",
                    "class_name": "QuantizedDTypePolicy",
                    "config": {"mode": "int8", "source_name": None},
                    "registered_name": None,
                },
                "sequential/unlisted": _policy("float16"),
                "odd(key": _policy("float16"),  # not a regex: Keras only matches it exactly
            },
        },
    }
    config = _sequential([_layer("Dense", "q1", keras_map), _layer("Dense", "plain", keras_map)])
    with dtype_policies.policy_scope("bfloat16"):
        policy_map = policy_map_from_keras(_archive(tmp_path, config))
    assert policy_map["sequential/q1"] == QuantizedDTypePolicy("int8", "bfloat16")
    assert policy_map["sequential/plain"] == DTypePolicy("bfloat16")
    # Entries of the archive's map are kept: unlisted paths, regex keys.
    assert policy_map["sequential/unlisted"] == DTypePolicy("float16")
    assert policy_map["sequential/q2"] == QuantizedDTypePolicy("int8", "bfloat16")
    assert policy_map["odd(key"] == DTypePolicy("float16")
    assert policy_map.matching_key("oddkey") is None  # "odd(key" is escaped


def test_names_with_regex_characters_are_escaped(tmp_path):
    config = _sequential(
        [
            _layer("Dense", "block.1", _policy("bfloat16")),
            _layer("Dense", "blockx1", _policy("float16")),
            _layer("Dense", "head(2)", _policy("float64")),
        ],
        name="m",
        dtype=_policy("float32"),
    )
    policy_map = policy_map_from_keras(_archive(tmp_path, config), include_other_paths=False)
    assert list(policy_map) == ["m", r"m/block\.1", "m/blockx1", r"m/head\(2\)"]
    assert policy_map["m/block.1"] == DTypePolicy("bfloat16")
    assert policy_map["m/blockx1"] == DTypePolicy("float16")
    assert policy_map["m/head(2)"] == DTypePolicy("float64")
    assert policy_map["m/blockY1"] == DTypePolicy("float32")  # "block.1" is no regex
    for path in ("m/block.1", "m/blockx1", "m/head(2)"):
        assert policy_map.matching_key(path) is not None


def test_a_name_with_regex_characters_that_an_archive_maps_regex_matches(tmp_path):
    """`Dense(name="proj-in", dtype=DTypePolicyMap(..., {"proj-.*": ...}))`:
    the layer's escaped key and the copied regex both matched its path, and
    reading it raised "matches multiple keys"."""
    keras_map = {
        "module": "keras.dtype_policies",
        "class_name": "DTypePolicyMap",
        "config": {
            "default_policy": _policy("mixed_bfloat16"),
            "policy_map": {"proj-.*": _policy("float32")},
        },
    }
    config = _sequential([_layer("Dense", "proj-in", keras_map)], name="m")
    policy_map = policy_map_from_keras(_archive(tmp_path, config))
    for path in ("proj-in", "m/proj-in"):
        assert policy_map[path] == DTypePolicy("float32")
    assert policy_map["proj-out"] == DTypePolicy("float32")  # the archive's regex, kept


def test_most_common_default_counts_quantized_as_source(tmp_path):
    int8 = {
        "module": "keras.dtype_policies",
        "class_name": "QuantizedDTypePolicy",
        "config": {"mode": "int8", "source_name": "mixed_bfloat16"},
    }
    functional = {
        "module": "keras.src.models.functional",
        "class_name": "Functional",
        "config": {
            "name": "f",
            "trainable": True,
            "layers": [
                _layer("Dense", "a", int8),
                _layer("Dense", "b", int8),
                _layer("Dense", "c", _policy("mixed_bfloat16")),
                _layer("LayerNormalization", "n1", _policy("float32")),
                _layer("LayerNormalization", "n2", _policy("float32")),
            ],
            "input_layers": [],
            "output_layers": [],
        },
    }
    policy_map = policy_map_from_keras(_archive(tmp_path, functional))
    assert policy_map.default_policy == DTypePolicy("mixed_bfloat16")
    assert set(policy_map) == {"a", "b", "c", "n1", "n2"}


def test_shared_layer_keeps_its_first_path(tmp_path):
    shared = {**_layer("Dense", "shared", _policy("bfloat16")), "shared_object_id": 7}
    model = {
        "module": None,
        "class_name": "MyModel",
        "config": {"name": "my_model", "encoder": shared, "decoder": {"layers": [shared]}},
        "registered_name": "Custom>MyModel",
    }
    policy_map = policy_map_from_keras(_archive(tmp_path, model), include_other_paths=False)
    assert list(policy_map) == ["my_model/shared"]


def test_errors_name_the_file_and_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.keras"):
        policy_map_from_keras(tmp_path / "missing.keras")

    not_zip = tmp_path / "plain.keras"
    not_zip.write_text("{}")
    with pytest.raises(ValueError, match=r"plain\.keras.*not a zip file"):
        policy_map_from_keras(not_zip)

    with pytest.raises(ValueError, match="directory"):
        policy_map_from_keras(tmp_path)

    no_config = tmp_path / "no_config.keras"
    with zipfile.ZipFile(no_config, "w") as archive:
        archive.writestr("model.weights.h5", b"")
    with pytest.raises(ValueError, match=r"no_config\.keras.*without 'config\.json'"):
        policy_map_from_keras(no_config)

    bad_json = _archive(tmp_path, '{"class_name": "Sequential", ', name="bad.keras")
    with pytest.raises(ValueError, match=r"bad\.keras.*config\.json is not valid JSON"):
        policy_map_from_keras(bad_json)

    not_a_model = _archive(tmp_path, [1, 2], name="list.keras")
    with pytest.raises(ValueError, match=r"list\.keras.*does not describe a Keras model"):
        policy_map_from_keras(not_a_model)


@pytest.mark.parametrize("damage", ["compressed", "encrypted"])
def test_a_damaged_compressed_or_encrypted_entry_is_a_value_error(tmp_path, damage):
    """zipfile raises `zlib.error` for a damaged deflated entry and
    `RuntimeError` for an encrypted one: both escaped as themselves."""
    file = tmp_path / "damaged.keras"
    config = json.dumps(_sequential([_layer("Dense", "a", "float32")])).encode() * 8
    with zipfile.ZipFile(file, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("config.json", config)
    raw = bytearray(file.read_bytes())
    if damage == "compressed":  # the deflated bytes after the 30-byte local header and name
        start = 30 + len("config.json")
        raw[start + 4 : start + 24] = bytes(20)
    else:  # the general-purpose flag's encryption bit, in the local and the central header
        raw[6] |= 1
        central = raw.rfind(b"PK\x01\x02")
        raw[central + 8] |= 1
    file.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"damaged\.keras.*cannot read config\.json"):
        policy_map_from_keras(file)


def test_tf_keras_policy_dicts_with_a_loss_scale_or_as_policy_v1(tmp_path):
    old = {"class_name": "PolicyV1", "config": {"name": "mixed_float16", "loss_scale": "dynamic"}}
    file = _archive(tmp_path, _sequential([_layer("Dense", "a", old)]))
    assert policy_map_from_keras(file)["sequential/a"] == DTypePolicy("mixed_float16")


@pytest.mark.parametrize(
    "dtype, message",
    [
        ({"module": "x", "class_name": "MyPolicy", "config": {}}, "Unknown dtype policy class"),
        (
            {"module": "keras.dtype_policies", "class_name": "GPTQDTypePolicy", "config": {}},
            "GPTQDTypePolicy",
        ),
        ("not_a_dtype", "Cannot convert 'not_a_dtype'"),
        (3, "expected a policy name"),
    ],
)
def test_unreadable_policy_names_file_and_layer(tmp_path, dtype, message):
    file = _archive(tmp_path, _sequential([_layer("Dense", "bad", dtype)]))
    with pytest.raises(ValueError) as info:
        policy_map_from_keras(file)
    text = str(info.value)
    assert str(file) in text and "'sequential/bad' (Dense)" in text and message in text


def test_ambiguous_archive_map_names_the_layer(tmp_path):
    keras_map = {
        "class_name": "DTypePolicyMap",
        "config": {
            "default_policy": _policy("float32"),
            "policy_map": {"seq/.*": _policy("float16"), "seq/d.*": _policy("bfloat16")},
        },
    }
    file = _archive(tmp_path, _sequential([_layer("Dense", "d", keras_map)], name="seq"))
    with pytest.raises(ValueError, match=r"layer 'seq/d' \(Dense\).*matches multiple"):
        policy_map_from_keras(file)
