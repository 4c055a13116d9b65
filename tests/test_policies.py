"""Policy objects: names, dtypes, errors, equality, hashing, copying."""

import copy
import pickle

import pytest
import torch

import dtype_policies
from dtype_policies import (
    DTypePolicy,
    FloatDTypePolicy,
    Int4DTypePolicy,
    QuantizedDTypePolicy,
    QuantizedFloat8DTypePolicy,
)

FLOAT_CASES = [
    ("float32", "float32", "float32"),
    ("float64", "float64", "float64"),
    ("bfloat16", "bfloat16", "bfloat16"),
    ("float16", "float16", "float16"),
    ("mixed_float16", "float16", "float32"),
    ("mixed_bfloat16", "bfloat16", "float32"),
    ("uint8", "uint8", "uint8"),
    ("int32", "int32", "int32"),
    ("int", "int32", "int32"),
    ("float8_e4m3fn", "float8_e4m3fn", "float8_e4m3fn"),
    ("complex64", "complex64", "complex64"),
]


@pytest.mark.parametrize(("name", "compute", "variable"), FLOAT_CASES)
def test_float_policy_dtypes(name, compute, variable):
    policy = DTypePolicy(name)
    assert policy.name == name
    assert policy.compute_dtype == compute
    assert policy.variable_dtype == variable
    assert policy.quantization_mode is None
    assert policy.torch_compute_dtype == getattr(torch, compute)
    assert policy.torch_variable_dtype == getattr(torch, variable)


@pytest.mark.parametrize(
    ("dtype", "name"),
    [
        (torch.float32, "float32"),
        (torch.bfloat16, "bfloat16"),
        (torch.half, "float16"),
        (torch.float64, "float64"),
        (torch.int8, "int8"),
    ],
)
def test_policy_from_torch_dtype(dtype, name):
    policy = DTypePolicy(dtype)
    assert policy.name == name
    assert policy.torch_compute_dtype == dtype
    assert policy == DTypePolicy(name)


def test_string_policy_has_no_torch_dtype():
    policy = DTypePolicy("string")
    assert policy.compute_dtype == "string"
    with pytest.raises(ValueError, match="no torch equivalent"):
        _ = policy.torch_compute_dtype


@pytest.mark.parametrize(
    "name",
    [
        "invalid_name",
        "",
        "@mixed_float16!",
        "mixed_float16" * 100,
        "mixed_float15",
        "mixed_bfloat15",
        "float7",
        "int7",
        "Float32",
    ],
)
def test_invalid_names_raise_cannot_convert(name):
    with pytest.raises(ValueError, match="Cannot convert"):
        DTypePolicy(name)


@pytest.mark.parametrize("name", [123, 1.5, ["float32"], {"name": "float32"}])
def test_non_string_name_raises_type_error(name):
    with pytest.raises(TypeError, match="'name' must be a string"):
        DTypePolicy(name)


@pytest.mark.parametrize(
    "name", ["float32", "float16", "bfloat16", "mixed_float16", "mixed_bfloat16"]
)
def test_default_name_comes_from_default_policy(name):
    dtype_policies.set_dtype_policy(name)
    assert DTypePolicy().name == name
    assert QuantizedDTypePolicy("float8").name == f"float8_from_{name}"


def test_default_from_quantized_global_uses_its_source():
    dtype_policies.set_dtype_policy("int8_from_mixed_bfloat16")
    assert DTypePolicy().name == "mixed_bfloat16"
    assert QuantizedDTypePolicy("int4").name == "int4_from_mixed_bfloat16"


def test_repr_matches_keras():
    assert repr(DTypePolicy("mixed_float16")) == '<DTypePolicy "mixed_float16">'
    assert repr(FloatDTypePolicy("float32")) == '<DTypePolicy "float32">'
    assert repr(QuantizedDTypePolicy("int8", "mixed_bfloat16")) == (
        '<QuantizedDTypePolicy "int8_from_mixed_bfloat16">'
    )
    assert repr(QuantizedFloat8DTypePolicy("float8", "float32")) == (
        '<QuantizedFloat8DTypePolicy "float8_from_float32">'
    )
    assert repr(Int4DTypePolicy("int4/128", "float32")) == (
        '<Int4DTypePolicy "int4/128_from_float32">'
    )


def test_equality_rules():
    assert DTypePolicy("float32") == FloatDTypePolicy("float32")
    assert FloatDTypePolicy("bfloat16") == DTypePolicy("bfloat16")
    assert DTypePolicy("float32") != DTypePolicy("float16")
    assert DTypePolicy("float32") != "float32"
    assert DTypePolicy("float32") != QuantizedDTypePolicy("int8", "float32")
    assert QuantizedDTypePolicy("int8", "float32") == QuantizedDTypePolicy("int8", "float32")
    assert QuantizedDTypePolicy("int8", "float32") != QuantizedDTypePolicy("int8", "bfloat16")
    assert QuantizedDTypePolicy("float8", "float32") != QuantizedFloat8DTypePolicy(
        "float8", "float32"
    )
    assert QuantizedFloat8DTypePolicy("float8", "float32", 16) != (
        QuantizedFloat8DTypePolicy("float8", "float32", 32)
    )
    assert Int4DTypePolicy("int4/None", "float32") == Int4DTypePolicy("int4/-1", "float32")
    assert Int4DTypePolicy("int4/64", "float32") != Int4DTypePolicy("int4/128", "float32")
    assert QuantizedDTypePolicy("int4", "float32") != Int4DTypePolicy("int4/-1", "float32")


def test_policies_are_hashable_and_consistent_with_equality():
    policies = {
        DTypePolicy("float32"): "a",
        QuantizedDTypePolicy("int8", "float32"): "b",
        Int4DTypePolicy("int4/128", "float32"): "c",
        QuantizedFloat8DTypePolicy("float8", "float32", 8): "d",
    }
    assert policies[FloatDTypePolicy("float32")] == "a"
    assert policies[QuantizedDTypePolicy("int8", "float32")] == "b"
    assert policies[Int4DTypePolicy("int4/128", "float32")] == "c"
    assert policies[QuantizedFloat8DTypePolicy("float8", "float32", 8)] == "d"
    assert len({DTypePolicy("bfloat16"), FloatDTypePolicy("bfloat16")}) == 1


def test_policies_are_immutable():
    policy = DTypePolicy("float32")
    with pytest.raises(AttributeError, match="immutable"):
        policy._name = "float16"
    with pytest.raises(AttributeError):
        policy.name = "float16"
    with pytest.raises(AttributeError, match="immutable"):
        del policy._compute_dtype
    assert policy.name == "float32"


@pytest.mark.parametrize(
    "policy",
    [
        DTypePolicy("mixed_bfloat16"),
        FloatDTypePolicy("float64"),
        QuantizedDTypePolicy("int8", "mixed_bfloat16"),
        QuantizedDTypePolicy("int4", "float32"),
        QuantizedFloat8DTypePolicy("float8", "float32", amax_history_length=123),
        Int4DTypePolicy("int4/32", "bfloat16"),
    ],
)
def test_copy_deepcopy_pickle(policy):
    for clone in (copy.copy(policy), copy.deepcopy(policy), pickle.loads(pickle.dumps(policy))):
        assert clone == policy
        assert type(clone) is type(policy)
        assert clone.name == policy.name
        assert clone.get_config() == policy.get_config()


class _PolicyWithState(QuantizedDTypePolicy):
    """A user subclass in Keras's style: state of its own, kept by get_config."""

    def __init__(self, mode, source_name=None, extra=0):
        super().__init__(mode, source_name)
        self._set("_extra", extra)

    def get_config(self):
        return {**super().get_config(), "extra": self._extra}


def test_copies_of_a_subclass_keep_its_own_state():
    policy = _PolicyWithState("int8", "float32", extra=5)
    for clone in (copy.copy(policy), copy.deepcopy(policy), pickle.loads(pickle.dumps(policy))):
        assert type(clone) is _PolicyWithState
        assert clone._extra == 5 and clone.name == "int8_from_float32"
    assert _PolicyWithState.from_config(policy.get_config())._extra == 5


def test_pickle_does_not_depend_on_default_at_load_time():
    policy = QuantizedDTypePolicy("int8", "float32")
    data = pickle.dumps(policy)
    dtype_policies.set_dtype_policy("bfloat16")
    assert pickle.loads(data).name == "int8_from_float32"


def test_quantized_policy_properties():
    policy = QuantizedDTypePolicy("int8", "mixed_bfloat16")
    assert policy.name == "int8_from_mixed_bfloat16"
    assert policy.quantization_mode == "int8"
    assert (policy.compute_dtype, policy.variable_dtype) == ("bfloat16", "float32")
    assert policy.source_name == "mixed_bfloat16"
    assert policy.source_policy == DTypePolicy("mixed_bfloat16")
    assert policy.get_config() == {"mode": "int8", "source_name": "mixed_bfloat16"}


def test_quantized_policy_accepts_torch_dtype_and_policy_sources():
    assert QuantizedDTypePolicy("int8", torch.bfloat16).name == "int8_from_bfloat16"
    assert QuantizedDTypePolicy("int8", DTypePolicy("mixed_bfloat16")).name == (
        "int8_from_mixed_bfloat16"
    )


@pytest.mark.parametrize("mode", ["int7", "float7", "", None, "INT8", "int4/128"])
def test_invalid_quantization_mode(mode):
    with pytest.raises(ValueError, match="Invalid quantization mode"):
        QuantizedDTypePolicy(mode, "float32")


@pytest.mark.parametrize(
    "mode, hint",
    [
        ("int4/32", "quantize(model, 'int4', Int4QuantizationConfig(block_size=32))"),
        ("int4/32_from_mixed_bfloat16", "apply_policy(model, 'int4/32_from_mixed_bfloat16')"),
        ("int8_from_float32", "quantize(model, 'int8') "),
        ("gptq/4/128", "quantize(model, 'gptq', config=GPTQConfig(...))"),
    ],
)
def test_a_policy_name_given_to_quantize_as_its_mode_says_what_to_pass(mode, hint):
    """A new user's first try ("int4/32" is a policy name in the README) was
    refused with Keras's list of modes alone."""
    layer = torch.nn.Linear(64, 8)
    with pytest.raises(ValueError, match="Invalid quantization mode") as raised:
        dtype_policies.quantize(layer, mode)
    assert f"'{mode}' names a policy, not a mode" in str(raised.value)
    assert hint in str(raised.value)
    assert ("apply_policy" in str(raised.value)) is not mode.startswith("gptq")
    assert not hasattr(layer, "weight_int8") and not hasattr(layer, "weight_int4")


@pytest.mark.parametrize("mode", [["int8"], {"int8": 1}, {"int8"}])
def test_unhashable_quantization_mode_is_named_in_a_value_error(mode):
    with pytest.raises(ValueError, match=r"Invalid quantization mode.*Received: mode="):
        QuantizedDTypePolicy(mode, "float32")
    with pytest.raises(ValueError, match="Invalid quantization mode"):
        dtype_policies.quantize(torch.nn.Linear(4, 4), mode)
    assert mode not in dtype_policies.QUANTIZATION_MODES


def test_quantization_modes_is_a_plain_tuple_as_in_keras():
    import json

    modes = dtype_policies.QUANTIZATION_MODES
    assert type(modes) is tuple and modes[:3] == ("int8", "float8", "int4")
    assert (
        modes
        == dtype_policies.quantizers.QUANTIZATION_MODES
        == (dtype_policies.policies.QUANTIZATION_MODES)
    )
    assert "int4/128_from_float32".startswith(modes)
    assert not "mixed_bfloat16".startswith(modes)
    assert json.loads(json.dumps(modes)) == list(modes)
    assert modes + ("ternary",) == (*modes, "ternary")  # noqa: RUF005


@pytest.mark.parametrize(
    "mode, policy_class", [("gptq", "GPTQDTypePolicy"), ("awq", "AWQDTypePolicy")]
)
def test_a_calibrated_mode_without_bits_is_refused_where_it_is_used(mode, policy_class):
    policy = QuantizedDTypePolicy(mode, "float32")  # accepted, as Keras does
    assert policy.name == f"{mode}_from_float32"
    message = f"weight_bits must be specified.*`{policy_class}`.*'{mode}_from_float32'"
    with pytest.raises(ValueError, match=message):
        _ = policy.quantization_config
    dense = dtype_policies.layers.Dense(4, dtype=policy)
    with pytest.raises(ValueError, match=message):
        dense.build((None, 8))
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        dtype_policies.apply_policy(model, policy)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not dtype_policies.summary(model).strip().count(mode)


def test_source_is_parsed_before_mode():
    with pytest.raises(ValueError, match="Cannot convert"):
        QuantizedDTypePolicy("int7", "mixed_float15")


@pytest.mark.parametrize("source", ["float16", "mixed_float16"])
def test_int8_with_float16_compute_is_rejected(source):
    with pytest.raises(ValueError, match="doesn't work well"):
        QuantizedDTypePolicy("int8", source)
    # int4 and float8 accept float16 compute.
    assert QuantizedDTypePolicy("int4", source).compute_dtype == "float16"
    assert QuantizedFloat8DTypePolicy("float8", source).compute_dtype == "float16"


@pytest.mark.parametrize(
    "source", ["invalid", "", "@mixed_float16!", "mixed_float16" * 100, "mixed_bfloat15"]
)
def test_invalid_source_names(source):
    with pytest.raises(ValueError, match="Cannot convert"):
        QuantizedDTypePolicy("int8", source)


@pytest.mark.parametrize("source", ["int32", "uint8", "bool", "float8_e4m3fn", "complex64"])
def test_non_float_sources_are_rejected(source):
    with pytest.raises(ValueError, match="floating dtype"):
        QuantizedDTypePolicy("int8", source)


def test_non_string_source_raises_type_error():
    with pytest.raises(TypeError, match="must be a string"):
        QuantizedDTypePolicy("int8", 123)


def test_float8_policy():
    policy = QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16")
    assert policy.amax_history_length == 1024
    assert QuantizedFloat8DTypePolicy.default_amax_history_length == 1024
    assert policy.get_config() == {
        "mode": "float8",
        "source_name": "mixed_bfloat16",
        "amax_history_length": 1024,
    }
    custom = QuantizedFloat8DTypePolicy("float8", "float32", amax_history_length=512)
    assert custom.amax_history_length == 512


@pytest.mark.parametrize("length", ["512", 512.0, None, True])
def test_float8_amax_history_length_must_be_integer(length):
    with pytest.raises(TypeError, match="must be an integer"):
        QuantizedFloat8DTypePolicy("float8", "float32", amax_history_length=length)


def test_float8_amax_history_length_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        QuantizedFloat8DTypePolicy("float8", "float32", amax_history_length=0)


def test_float8_policy_needs_float8_mode():
    with pytest.raises(ValueError, match="only supports mode='float8'"):
        QuantizedFloat8DTypePolicy("int8", "float32")


@pytest.mark.parametrize(
    ("mode", "block_size", "name"),
    [
        ("int4/128", 128, "int4/128_from_float32"),
        ("int4/-1", -1, "int4/-1_from_float32"),
        ("int4/None", -1, "int4/-1_from_float32"),
        ("int4/32", 32, "int4/32_from_float32"),
    ],
)
def test_int4_policy_modes(mode, block_size, name):
    policy = Int4DTypePolicy(mode, "float32")
    assert policy.block_size == block_size
    assert policy.name == name
    assert policy.quantization_mode == "int4"
    assert policy.get_config() == {"mode": f"int4/{block_size}", "source_name": "float32"}


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("int4/abc", "must be an integer"),
        ("int4/0", "Invalid block_size"),
        ("int4/-2", "Invalid block_size"),
        ("int4", "Expected format"),
        ("int8/128", "Expected format"),
        ("int4/128/1", "Expected format"),
        (128, "Expected format"),
    ],
)
def test_int4_policy_invalid_modes(mode, message):
    with pytest.raises(ValueError, match=message):
        Int4DTypePolicy(mode, "float32")


def test_convert_input_rules():
    policy = DTypePolicy("mixed_bfloat16")
    x = torch.ones(2, dtype=torch.float64)
    assert policy.convert_input(x, True, "bfloat16").dtype == torch.bfloat16
    assert policy.convert_input(x, False, "bfloat16").dtype == torch.float64
    ints = torch.ones(2, dtype=torch.int64)
    assert policy.convert_input(ints, True, "bfloat16") is ints
    complex_x = torch.ones(2, dtype=torch.complex64)
    assert policy.convert_input(complex_x, True, "bfloat16") is complex_x
    assert policy.convert_input(3.0, True, "bfloat16") == 3.0
    assert policy.convert_input(None, True, "bfloat16") is None
    np = pytest.importorskip("numpy")
    converted = policy.convert_input(np.ones(3, dtype=np.float64), False, "bfloat16")
    assert isinstance(converted, torch.Tensor) and converted.dtype == torch.float64
    converted = policy.convert_input(np.ones(3, dtype=np.float64), True, torch.bfloat16)
    assert converted.dtype == torch.bfloat16
