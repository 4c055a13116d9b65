"""Origin: keras/src/dtype_policies/dtype_policy_test.py (Keras 3.15)."""

import copy
import pickle

import pytest

from dtype_policies import (
    DTypePolicy,
    FloatDTypePolicy,
    QuantizedDTypePolicy,
    QuantizedFloat8DTypePolicy,
    deserialize,
    dtype_policy,
    get,
    quantizers,
    serialize,
    set_dtype_policy,
)
from dtype_policies.policies.names import parse_quantized_policy_name

BOTH = pytest.mark.parametrize("cls", [DTypePolicy, FloatDTypePolicy], ids=["DTypePolicy", "Float"])


class TestDTypePolicyTest:
    @BOTH
    def test_initialization_valid_name(self, cls):
        policy = cls("mixed_float16")
        assert (policy.compute_dtype, policy.variable_dtype) == ("float16", "float32")

    @pytest.mark.parametrize(
        "global_dtype_policy, expected_compute_dtype, expected_variable_dtype",
        [
            ("float32", "float32", "float32"),
            ("float16", "float16", "float16"),
            ("bfloat16", "bfloat16", "bfloat16"),
            ("mixed_float16", "float16", "float32"),
            ("mixed_bfloat16", "bfloat16", "float32"),
        ],
        ids=["float32", "float16", "bfloat16", "mixed_float16", "mixed_bfloat16"],
    )
    @BOTH
    def test_initialization_from_global(
        self, cls, global_dtype_policy, expected_compute_dtype, expected_variable_dtype
    ):
        set_dtype_policy(global_dtype_policy)
        policy = cls(name=None)
        assert policy.name == global_dtype_policy
        assert policy.compute_dtype == expected_compute_dtype
        assert policy.variable_dtype == expected_variable_dtype

    @BOTH
    def test_initialization_invalid_name(self, cls):
        with pytest.raises(ValueError, match="Cannot convert"):
            cls("invalid_name")

    @BOTH
    def test_initialization_non_string_name(self, cls):
        with pytest.raises(TypeError, match="'name' must be a string"):
            cls(123)

    @BOTH
    def test_properties_mixed_float16(self, cls):
        policy = cls("mixed_float16")
        assert (policy.compute_dtype, policy.variable_dtype) == ("float16", "float32")

    @BOTH
    def test_properties_mixed_bfloat16(self, cls):
        policy = cls("mixed_bfloat16")
        assert (policy.compute_dtype, policy.variable_dtype) == ("bfloat16", "float32")

    @BOTH
    def test_initialization_with_invalid_name_behaviour(self, cls):
        with pytest.raises(ValueError, match="Cannot convert"):
            cls("invalid_name")

    @BOTH
    def test_properties(self, cls):
        policy = cls("mixed_float16")
        assert policy.variable_dtype == "float32" and policy.compute_dtype == "float16"
        assert policy.name == "mixed_float16" and policy.quantization_mode is None

    @BOTH
    def test_properties_uint8(self, cls):
        policy = cls("uint8")
        assert (policy.compute_dtype, policy.variable_dtype, policy.name) == ("uint8",) * 3

    @BOTH
    def test_repr(self, cls):
        assert repr(cls("mixed_float16")) == '<DTypePolicy "mixed_float16">'

    @BOTH
    def test_get_config_from_config(self, cls):
        config = cls("mixed_float16").get_config()
        assert config == {"name": "mixed_float16"}
        assert cls.from_config(config).name == "mixed_float16"

    @BOTH
    def test_serialization(self, cls):
        policy = cls("mixed_float16")
        config = serialize(policy)
        assert deserialize(config).name == policy.name
        assert get(config).name == policy.name

    @BOTH
    def test_python_serialization(self, cls, tmp_path):
        policy = cls("mixed_float16")
        assert repr(copy.deepcopy(policy)) == '<DTypePolicy "mixed_float16">'
        assert repr(copy.copy(policy)) == '<DTypePolicy "mixed_float16">'
        (tmp_path / "policy.pickle").write_bytes(pickle.dumps(policy))
        copied = pickle.loads((tmp_path / "policy.pickle").read_bytes())
        assert repr(copied) == '<DTypePolicy "mixed_float16">'

    def test_eq(self):
        policy = DTypePolicy("mixed_bfloat16")
        assert policy == DTypePolicy("mixed_bfloat16")
        assert policy == FloatDTypePolicy("mixed_bfloat16")
        assert policy != "mixed_float16"
        assert policy != QuantizedDTypePolicy("int8", "mixed_bfloat16")


SOURCES_INT8 = [
    ("float32", "float32", "float32"),
    ("bfloat16", "bfloat16", "bfloat16"),
    ("mixed_bfloat16", "bfloat16", "float32"),
]
SOURCES_FLOAT8 = [
    ("float32", "float32", "float32"),
    ("float16", "float16", "float16"),
    ("bfloat16", "bfloat16", "bfloat16"),
    ("mixed_float16", "float16", "float32"),
    ("mixed_bfloat16", "bfloat16", "float32"),
]


def _ids(cases):
    return [case[0] for case in cases]


class TestQuantizedDTypePolicyTest:
    @pytest.mark.parametrize("source_name, compute, variable", SOURCES_INT8, ids=_ids(SOURCES_INT8))
    def test_initialization_for_int8(self, source_name, compute, variable):
        name = f"int8_from_{source_name}"
        policy = QuantizedDTypePolicy(mode="int8", source_name=source_name)
        assert (policy.name, policy.compute_dtype, policy.variable_dtype) == (
            name,
            compute,
            variable,
        )
        assert repr(policy) == f'<QuantizedDTypePolicy "{name}">'

    @pytest.mark.parametrize(
        "global_policy, compute, variable", SOURCES_INT8, ids=_ids(SOURCES_INT8)
    )
    def test_initialization_for_int8_from_global(self, global_policy, compute, variable):
        set_dtype_policy(global_policy)
        policy = QuantizedDTypePolicy(mode="int8", source_name=None)
        assert policy.name == f"int8_from_{global_policy}"
        assert (policy.compute_dtype, policy.variable_dtype) == (compute, variable)

    @pytest.mark.parametrize(
        "source_name, compute, variable", SOURCES_FLOAT8, ids=_ids(SOURCES_FLOAT8)
    )
    def test_initialization_for_float8(self, source_name, compute, variable):
        name = f"float8_from_{source_name}"
        policy = QuantizedFloat8DTypePolicy(mode="float8", source_name=source_name)
        assert (policy.name, policy.compute_dtype, policy.variable_dtype) == (
            name,
            compute,
            variable,
        )
        assert repr(policy) == f'<QuantizedFloat8DTypePolicy "{name}">'

    @pytest.mark.parametrize(
        "global_policy, compute, variable", SOURCES_FLOAT8, ids=_ids(SOURCES_FLOAT8)
    )
    def test_initialization_for_float8_from_global(self, global_policy, compute, variable):
        set_dtype_policy(global_policy)
        policy = QuantizedFloat8DTypePolicy(mode="float8", source_name=None)
        assert policy.name == f"float8_from_{global_policy}"
        assert (policy.compute_dtype, policy.variable_dtype) == (compute, variable)

    @pytest.mark.parametrize("invalid_name", ["abc", "def"], ids=["abc", "abc_from_def"])
    def test_initialization_with_invalid_name(self, invalid_name):
        with pytest.raises(ValueError, match="Cannot convert"):
            QuantizedDTypePolicy(mode="int8", source_name=invalid_name)
        with pytest.raises(ValueError, match="Cannot convert"):
            QuantizedFloat8DTypePolicy(mode="float8", source_name=invalid_name)

    @pytest.mark.parametrize("invalid_mode", ["int7", "float7"], ids=["int7", "float7"])
    def test_initialization_with_invalid_mode(self, invalid_mode):
        with pytest.raises(ValueError, match="Invalid quantization mode."):
            QuantizedDTypePolicy(mode=invalid_mode)
        with pytest.raises(ValueError, match="Invalid quantization mode."):
            QuantizedFloat8DTypePolicy(mode=invalid_mode)

    @pytest.mark.parametrize(
        "invalid_name",
        ["float16", "mixed_float16"],
        ids=["int8_from_float16", "int8_from_mixed_float16"],
    )
    def test_initialization_with_invalid_compute_dtype(self, invalid_name):
        with pytest.raises(ValueError, match="doesn't work well"):
            QuantizedDTypePolicy(mode="int8", source_name=invalid_name)

    def test_initialization_non_string_name(self):
        with pytest.raises(TypeError, match="'name' must be a string"):
            QuantizedDTypePolicy(mode="int8", source_name=123)
        with pytest.raises(TypeError, match="'name' must be a string"):
            QuantizedFloat8DTypePolicy(mode="float8", source_name=123)

    def test_properties(self):
        policy = QuantizedDTypePolicy(mode="int8", source_name="mixed_bfloat16")
        assert (policy.variable_dtype, policy.compute_dtype) == ("float32", "bfloat16")
        assert policy.name == "int8_from_mixed_bfloat16" and policy.quantization_mode == "int8"
        policy = QuantizedFloat8DTypePolicy(mode="float8", source_name="mixed_bfloat16")
        assert (policy.variable_dtype, policy.compute_dtype) == ("float32", "bfloat16")
        assert policy.name == "float8_from_mixed_bfloat16" and policy.quantization_mode == "float8"
        assert policy.amax_history_length == 1024
        policy = QuantizedFloat8DTypePolicy(
            mode="float8", source_name="mixed_bfloat16", amax_history_length=512
        )
        assert policy.amax_history_length == 512
        assert QuantizedFloat8DTypePolicy.default_amax_history_length == 1024

    def test_invalid_properties_for_float8(self):
        with pytest.raises(TypeError, match="must be an integer."):
            QuantizedFloat8DTypePolicy(
                mode="float8", source_name="float32", amax_history_length="512"
            )
        with pytest.raises(TypeError, match="must be an integer."):
            QuantizedFloat8DTypePolicy(
                mode="float8", source_name="float32", amax_history_length=512.0
            )

    def test_get_config_from_config(self):
        policy = QuantizedDTypePolicy(mode="int8", source_name="mixed_bfloat16")
        config = policy.get_config()
        assert config == {"mode": "int8", "source_name": "mixed_bfloat16"}
        assert QuantizedDTypePolicy.from_config(config).name == "int8_from_mixed_bfloat16"
        policy = QuantizedFloat8DTypePolicy(mode="float8", source_name="mixed_bfloat16")
        config = policy.get_config()
        assert config == {
            "mode": "float8",
            "source_name": "mixed_bfloat16",
            "amax_history_length": 1024,
        }
        assert QuantizedFloat8DTypePolicy.from_config(config).name == "float8_from_mixed_bfloat16"

    def test_serialization(self):
        for policy in (
            QuantizedDTypePolicy(mode="int8", source_name="float32"),
            QuantizedFloat8DTypePolicy(mode="float8", source_name="float32"),
        ):
            config = serialize(policy)
            assert deserialize(config).name == policy.name
            assert get(config).name == policy.name

    @pytest.mark.parametrize(
        "mode, source_name, repr_str",
        [
            ("int8", "mixed_bfloat16", '<QuantizedDTypePolicy "int8_from_mixed_bfloat16">'),
            (
                "float8",
                "mixed_bfloat16",
                '<QuantizedFloat8DTypePolicy "float8_from_mixed_bfloat16">',
            ),
        ],
        ids=["int8_from_mixed_bfloat16", "float8_from_mixed_bfloat16"],
    )
    def test_python_serialization(self, mode, source_name, repr_str, tmp_path):
        if mode == "int8":
            policy = QuantizedDTypePolicy(mode=mode, source_name=source_name)
        else:
            policy = QuantizedFloat8DTypePolicy(
                mode=mode, source_name=source_name, amax_history_length=123
            )
        (tmp_path / "policy.pickle").write_bytes(pickle.dumps(policy))
        for copied in (
            copy.deepcopy(policy),
            copy.copy(policy),
            pickle.loads((tmp_path / "policy.pickle").read_bytes()),
        ):
            assert repr(copied) == repr_str
            if mode == "float8":
                assert copied.amax_history_length == 123

    def test_serialization_for_float8(self):
        policy = QuantizedFloat8DTypePolicy(mode="float8", source_name="mixed_float16")
        config = serialize(policy)
        for reloaded in (deserialize(config), get(config)):
            assert reloaded.name == policy.name
            assert reloaded.amax_history_length == policy.amax_history_length

    def test_eq(self):
        policy = QuantizedDTypePolicy("int8", "mixed_bfloat16")
        assert policy == QuantizedDTypePolicy("int8", "mixed_bfloat16")
        assert policy != "mixed_bfloat16"
        assert policy != DTypePolicy("mixed_bfloat16")
        assert policy != QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16")

    @pytest.mark.parametrize(
        "name",
        ["int8_from_mixed_bfloat16", "float8_from_mixed_bfloat16"],
        ids=["int8_from_mixed_bfloat16", "float8_from_mixed_bfloat16"],
    )
    def test_get_quantized_dtype_policy_by_str(self, name):
        assert parse_quantized_policy_name(name).name == name

    def test_invalid_get_quantized_dtype_policy_by_str(self):
        with pytest.raises(TypeError, match="must be a string."):
            parse_quantized_policy_name(123)
        with pytest.raises(
            ValueError, match="is incompatible with the current supported quantization."
        ):
            parse_quantized_policy_name("float7")


class TestDTypePolicyGlobalFunctionsTest:
    @pytest.fixture(autouse=True)
    def _float32(self):
        set_dtype_policy("float32")

    def test_set_dtype_policy_valid_string(self):
        set_dtype_policy("mixed_float16")
        assert dtype_policy().name == "mixed_float16"

    def test_set_dtype_policy_valid_string_quantized(self):
        set_dtype_policy("int8_from_mixed_bfloat16")
        assert dtype_policy().name == "int8_from_mixed_bfloat16"

    def test_set_dtype_policy_valid_policy(self):
        set_dtype_policy(DTypePolicy("mixed_float16"))
        assert dtype_policy().name == "mixed_float16"

    def test_set_dtype_policy_valid_policy_quantized(self):
        set_dtype_policy(QuantizedDTypePolicy(mode="int8", source_name="mixed_bfloat16"))
        assert dtype_policy().name == "int8_from_mixed_bfloat16"

    def test_set_dtype_policy_invalid(self):
        with pytest.raises(ValueError, match="Invalid `policy` argument"):
            set_dtype_policy(12345)

    def test_dtype_policy_default(self):
        assert dtype_policy().name == "float32"

    def test_get_valid_policy(self):
        assert get("bfloat16").name == "bfloat16"
        assert get("mixed_float16").name == "mixed_float16"
        assert get(DTypePolicy("bfloat16")).name == "bfloat16"
        assert get(FloatDTypePolicy("mixed_float16")).name == "mixed_float16"

    def test_get_valid_policy_quantized(self):
        assert get("int8_from_mixed_bfloat16").name == "int8_from_mixed_bfloat16"
        assert get("float8_from_float32").name == "float8_from_float32"
        assert (
            get(QuantizedDTypePolicy("int8", "mixed_bfloat16")).name == "int8_from_mixed_bfloat16"
        )
        assert (
            get(QuantizedFloat8DTypePolicy("float8", "mixed_float16")).name
            == "float8_from_mixed_float16"
        )

    def test_get_invalid_policy(self):
        with pytest.raises(ValueError, match="Cannot convert"):
            get("mixed_bfloat15")
        with pytest.raises(ValueError, match="Cannot interpret `dtype` argument."):
            get(123)

    def test_get_invalid_policy_quantized(self):
        with pytest.raises(ValueError, match="Cannot convert"):
            get("int8_from_mixed_bfloat15")
        with pytest.raises(ValueError, match="Cannot convert"):
            get("int8_from_")
        with pytest.raises(ValueError, match="Cannot convert `policy` into a valid pair"):
            get("int8_abc_")


class TestDTypePolicyEdgeCasesTest:
    def test_empty_name(self):
        with pytest.raises(ValueError, match="Cannot convert"):
            DTypePolicy("")

    def test_special_character_name(self):
        with pytest.raises(ValueError, match="Cannot convert"):
            DTypePolicy("@mixed_float16!")

    def test_very_long_name(self):
        with pytest.raises(ValueError, match="Cannot convert"):
            DTypePolicy("mixed_float16" * 100)

    def test_almost_valid_name(self):
        with pytest.raises(ValueError, match="Cannot convert"):
            DTypePolicy("mixed_float15")


class TestQuantizedDTypePolicyEdgeCasesTest:
    @pytest.mark.parametrize(
        "source_name",
        [
            "",
            "@int8_from_mixed_bfloat16!",
            "int8_from_mixed_bfloat16" * 100,
            "int7_from_mixed_bfloat16",
        ],
        ids=[
            "test_empty_name",
            "test_special_character_name",
            "test_very_long_name",
            "test_almost_valid_name",
        ],
    )
    def test_invalid_source(self, source_name):
        with pytest.raises(ValueError, match="Cannot convert"):
            QuantizedDTypePolicy(mode="int8", source_name=source_name)


class TestDTypePolicyGlobalFunctionsEdgeCasesTest:
    @pytest.fixture(autouse=True)
    def _float32(self):
        set_dtype_policy("float32")

    def test_set_policy_multiple_times(self):
        set_dtype_policy("mixed_float16")
        assert dtype_policy().name == "mixed_float16"
        set_dtype_policy("float32")
        assert dtype_policy().name == "float32"

    def test_set_policy_none(self):
        with pytest.raises(ValueError, match="Invalid `policy` argument"):
            set_dtype_policy(None)


class TestGPTQConfigErrorHandlingTest:
    @pytest.mark.parametrize(
        "kwargs, message",
        [
            ({"weight_bits": 5}, "Unsupported weight_bits"),
            ({"num_samples": -10}, "num_samples must be a positive integer."),
            ({"sequence_length": 0}, "sequence_length must be a positive integer."),
            ({"hessian_damping": 1.5}, "hessian_damping must be between 0 and 1."),
            ({"group_size": 0}, "Invalid group_size. Supported values are -1"),
        ],
        ids=[
            "test_invalid_weight_bits",
            "test_negative_num_samples",
            "test_zero_sequence_length",
            "test_invalid_hessian_damping",
            "test_invalid_group_size",
        ],
    )
    def test_gptq_config_errors(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            quantizers.GPTQConfig(dataset=None, tokenizer=None, **kwargs)


class TestAWQDTypePolicyTest:
    def test_awq_dtype_policy_creation(self):
        policy = get("awq/4/128_from_float32")
        assert (policy.weight_bits, policy.group_size, policy.mode) == (4, 128, "awq")

    def test_awq_dtype_policy_invalid_bits(self):
        with pytest.raises(ValueError, match="only supports 4-bit"):
            get("awq/8/128_from_float32")

    def test_awq_dtype_policy_invalid_format(self):
        with pytest.raises(ValueError, match="Invalid mode"):
            get("awq/4_from_float32")
