"""DTypePolicyMap: lookup rules, mutation, iteration, equality, config."""

import copy
import pickle

import pytest

import dtype_policies
from dtype_policies import (
    DTypePolicy,
    DTypePolicyMap,
    QuantizedDTypePolicy,
    deserialize,
    serialize,
)

BF16 = DTypePolicy("bfloat16")
F16 = DTypePolicy("float16")
F32 = DTypePolicy("float32")


def test_seed_docstring_example():
    policy_map = DTypePolicyMap(default_policy=F32)
    policy_map["encoder/layer_0/dense"] = BF16
    policy_map["encoder/.*"] = F16
    policy_map["decoder"] = BF16
    assert policy_map["encoder/layer_0/dense"].name == "bfloat16"
    assert policy_map["encoder/attention/query"].name == "float16"
    assert policy_map["decoder/attention"].name == "float32"
    policy_map["encoder/attention/.*"] = BF16
    with pytest.raises(ValueError, match="Path 'encoder/attention/query' matches multiple dtype"):
        policy_map["encoder/attention/query"]


def test_ambiguous_error_names_path_and_keys():
    policy_map = DTypePolicyMap(F32, {"model/decoder/.*": BF16, "model/decoder/attention/.*": F16})
    with pytest.raises(ValueError) as info:
        policy_map["model/decoder/attention/output"]
    message = str(info.value)
    assert "'model/decoder/attention/output'" in message
    assert "model/decoder/.*" in message and "model/decoder/attention/.*" in message


def test_exact_key_wins_over_regex_keys():
    policy_map = DTypePolicyMap(F32, {"enc/.*": F16, "enc/a.*": F16, "enc/attn": BF16})
    assert policy_map["enc/attn"] == BF16


def test_fullmatch_not_prefix_or_substring():
    policy_map = DTypePolicyMap(F32, {"attention/query": BF16, "decoder": F16})
    assert policy_map["attention/query"] == BF16
    assert policy_map["attention/query_norm"] == F32
    assert policy_map["model/attention/query"] == F32
    assert policy_map["decoder/attention"] == F32


def test_dotted_torch_keys_match_slash_paths():
    policy_map = DTypePolicyMap(F32, {"encoder.layers.0.attention": BF16})
    assert policy_map["encoder/layers/0/attention"] == BF16
    assert policy_map["encoder/layers/1/attention"] == F32


def test_no_match_gives_default_and_never_key_error():
    policy_map = DTypePolicyMap(BF16)
    assert policy_map["anything"] == BF16
    assert policy_map.get("anything") == BF16


def test_duplicate_key_raises_and_keeps_old_value():
    policy_map = DTypePolicyMap(F32, {"a": BF16})
    with pytest.raises(ValueError, match="already exist"):
        policy_map["a"] = F16
    assert policy_map["a"] == BF16
    del policy_map["a"]
    policy_map["a"] = F16
    assert policy_map["a"] == F16


def test_values_are_normalised_with_get():
    policy_map = DTypePolicyMap(F32)
    policy_map["a"] = "mixed_bfloat16"
    policy_map["b"] = serialize(QuantizedDTypePolicy("int8", "float32"))
    policy_map["c"] = "int4/128_from_float32"
    assert policy_map["a"] == DTypePolicy("mixed_bfloat16")
    assert policy_map["b"] == QuantizedDTypePolicy("int8", "float32")
    assert policy_map["c"].name == "int4/128_from_float32"
    constructed = DTypePolicyMap(F32, {"a": "bfloat16"})
    assert constructed["a"] == BF16


@pytest.mark.parametrize("bad", [123, object(), "not_a_policy"])
def test_bad_values_raise(bad):
    policy_map = DTypePolicyMap(F32)
    with pytest.raises(ValueError, match="Cannot interpret the assigned value"):
        policy_map["a"] = bad
    assert "a" not in policy_map


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("int8_from_mixed_float16", "float16"),
        ("int4/0_from_float32", "int4/0"),
        ("gptq/5/128_from_float32", "gptq/5/128"),
    ],
)
def test_a_value_refused_names_its_key_and_the_reason(value, reason):
    """The reason `get` gave was dropped and the key not named."""
    with pytest.raises(ValueError, match="Cannot interpret the assigned value") as raised:
        DTypePolicyMap(F32, {"decoder/.*": value})
    message = str(raised.value)
    assert "for the key 'decoder/.*': " in message and reason in message.split(": ", 2)[-1]


def test_bad_keys_raise():
    policy_map = DTypePolicyMap(F32)
    with pytest.raises(TypeError, match="keys must be strings"):
        policy_map[3] = BF16
    with pytest.raises(ValueError, match="not a valid regular expression"):
        policy_map["enc/(unclosed"] = BF16
    assert len(policy_map) == 0


def test_nested_map_values_rejected():
    with pytest.raises(ValueError, match="cannot itself be a DTypePolicyMap"):
        DTypePolicyMap(F32, {"a": DTypePolicyMap(F32)})


def test_constructor_errors():
    with pytest.raises(ValueError, match="cannot be a `DTypePolicyMap`"):
        DTypePolicyMap(DTypePolicyMap(F32))
    with pytest.raises(TypeError, match="must be a dict"):
        DTypePolicyMap(F32, policy_map=BF16)
    with pytest.raises(TypeError, match="must be a dict"):
        DTypePolicyMap(F32, policy_map=[("a", BF16)])


def test_deletion_and_pop():
    policy_map = DTypePolicyMap(F32, {"a": BF16, "b/.*": F16})
    assert policy_map.pop("a") == BF16
    assert "a" not in policy_map
    with pytest.raises(KeyError):
        policy_map.pop("a")
    assert policy_map.pop("a", None) is None
    with pytest.raises(KeyError):
        del policy_map["missing"]
    del policy_map["b/.*"]
    assert policy_map["b/c"] == F32
    assert len(policy_map) == 0


def test_len_iter_contains_order():
    policy_map = DTypePolicyMap(F32)
    for key in ["z", "a/.*", "m"]:
        policy_map[key] = BF16
    assert list(policy_map) == ["z", "a/.*", "m"]
    assert list(policy_map.keys()) == ["z", "a/.*", "m"]
    assert len(policy_map) == 3
    assert "a/.*" in policy_map
    assert "a/b" not in policy_map  # `in` looks at explicit keys only
    assert dict(policy_map.items()) == {"z": BF16, "a/.*": BF16, "m": BF16}


def test_default_policy_none_takes_default_in_force_at_creation():
    dtype_policies.set_dtype_policy("mixed_bfloat16")
    policy_map = DTypePolicyMap()
    dtype_policies.set_dtype_policy("float32")
    assert policy_map.default_policy == DTypePolicy("mixed_bfloat16")
    assert policy_map["x"] == DTypePolicy("mixed_bfloat16")
    config = policy_map.get_config()
    assert config["default_policy"]["config"] == {"name": "mixed_bfloat16"}


def test_policy_properties_delegate_to_default():
    policy_map = DTypePolicyMap(QuantizedDTypePolicy("int8", "mixed_bfloat16"), {"a": F16})
    assert policy_map.name == "map_int8_from_mixed_bfloat16"
    assert policy_map.compute_dtype == "bfloat16"
    assert policy_map.variable_dtype == "float32"
    assert policy_map.quantization_mode == "int8"


def test_get_config_does_not_mutate_policies():
    entry = QuantizedDTypePolicy("int8", "float32")
    policy_map = DTypePolicyMap(None, {"a": entry, "b": F16})
    config = policy_map.get_config()
    assert entry.name == "int8_from_float32" and entry.source_name == "float32"
    assert policy_map["a"] is entry
    assert config["policy_map"]["a"]["config"] == {"mode": "int8", "source_name": "float32"}


def test_config_round_trip_and_input_left_untouched():
    policy_map = DTypePolicyMap(BF16, {"a/.*": "int8_from_bfloat16", "b": F16})
    config = policy_map.get_config()
    snapshot = copy.deepcopy(config)
    restored = DTypePolicyMap.from_config(config)
    assert config == snapshot
    assert restored == policy_map
    assert list(restored) == ["a/.*", "b"]
    assert deserialize(serialize(policy_map)) == policy_map


def test_from_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="Unrecognized DTypePolicyMap config keys"):
        DTypePolicyMap.from_config({"default_policy": None, "policy_map": {}, "extra": 1})


def test_equality():
    a = DTypePolicyMap(F32, {"x": BF16})
    b = DTypePolicyMap(F32, {"x": "bfloat16"})
    assert a == b
    b["y"] = F16
    assert a != b
    assert DTypePolicyMap(F32) != DTypePolicyMap(BF16)
    assert DTypePolicyMap(F32) != F32
    assert F32 != DTypePolicyMap(F32)
    with pytest.raises(TypeError):
        hash(a)


def test_copy_and_pickle():
    policy_map = DTypePolicyMap(BF16, {"a": F16})
    for clone in (
        copy.copy(policy_map),
        copy.deepcopy(policy_map),
        pickle.loads(pickle.dumps(policy_map)),
    ):
        assert clone == policy_map
        clone["b"] = F32
        assert "b" not in policy_map


def test_repr():
    policy_map = DTypePolicyMap(F32, {"layer/dense_0": "mixed_bfloat16"})
    text = repr(policy_map)
    assert text.startswith("<DTypePolicyMap at 0x")
    assert text.endswith("default_policy=float32, mapping=[('layer/dense_0', 'mixed_bfloat16')]>")


def test_map_attributes_are_read_only():
    policy_map = DTypePolicyMap(F32)
    with pytest.raises(AttributeError):
        policy_map.default_policy = BF16
