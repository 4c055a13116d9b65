"""Keras's forms where this library used to differ silently: errors that name
what the user wrote, `quantize()`'s filters (layer names, one-argument
callables), unbuilt models, unknown keywords, filters that match nothing, the
meaning of `"int4_from_X"`, `MultiHeadAttention(use_gate=True)`."""

import math
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

import dtype_policies
from dtype_policies import layers, quantize
from dtype_policies.quantizers import Int4QuantizationConfig


def quiet(function, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return function(*args, **kwargs)


def named_sequential():
    model = layers.Sequential(
        [layers.Dense(8, name="body"), layers.Dense(8, name="neck"), layers.Dense(2, name="head")],
        name="sequential",
    )
    model(torch.ones(1, 4))
    return model


@pytest.mark.parametrize(
    "policy, written",
    [
        ("int8_from_", "''"),
        ("int8_from_float99", "'float99'"),
        ("int4/0_from_float32", "int4/0_from_float32"),
        ("int8x_from_float32", "int8x_from_float32"),
    ],
)
def test_errors_name_the_policy_as_written(policy, written):
    with pytest.raises(ValueError) as error:
        dtype_policies.get(policy)
    assert policy in str(error.value) and written in str(error.value)


def test_string_filters_match_layer_names_inside_a_sequential():
    model = named_sequential()
    report = quiet(quantize, model, "int8", filters="head")
    assert [path for path, *_ in report.quantized] == ["sequential/2"]
    assert model.layers[2].is_quantized and not model.layers[0].is_quantized
    torch_model = nn.Sequential(OrderedDict(body=nn.Linear(4, 4), head=nn.Linear(4, 2)))
    report = quiet(quantize, torch_model, "int8", filters=["^head$"])  # torch paths still work
    assert [path for path, *_ in report.quantized] == ["head"]


def test_filter_callables_take_keras_form_or_path_and_module():
    model = named_sequential()
    quiet(quantize, model, "int8", filters=lambda layer: layer.name.startswith("b"))
    assert [layer.is_quantized for layer in model.layers] == [True, False, False]
    model = named_sequential()
    quiet(quantize, model, "int8", filters=lambda path, module: path.endswith("/1"))
    assert [layer.is_quantized for layer in model.layers] == [False, True, False]
    with pytest.raises(TypeError, match="must take \\(module\\)"):
        quantize(named_sequential(), "int8", filters=lambda: True)


def test_a_filter_that_matches_nothing_warns_naming_it():
    model = named_sequential()
    with pytest.warns(UserWarning, match="the filter 'tail' matched no quantizable module") as seen:
        report = quantize(model, "int8", filters=["tail", "neck"])
    assert [path for path, *_ in report.quantized] == ["sequential/1"]
    assert not any("'neck'" in str(w.message) and "matched no" in str(w.message) for w in seen)
    never = lambda layer: False  # noqa: E731
    with pytest.warns(UserWarning, match="matched no quantizable module"):
        quantize(named_sequential(), "int8", filters=never)


def test_an_unbuilt_model_raises_naming_the_layer_and_changes_nothing():
    class Model(layers.Layer):
        def __init__(self):
            super().__init__(name="model")
            self.first = layers.Dense(4)
            self.second = layers.Dense(2)

        def call(self, x):
            return self.second(self.first(x))

    model = Model()
    model.first.build((None, 3))  # one layer built, the other not
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"model/second.*isn't yet built"):
        quantize(model, "int8")
    assert not model.first.is_quantized
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    model(torch.ones(1, 3))
    assert len(quiet(quantize, model, "int8").quantized) == 2


def test_lazy_modules_are_skipped_with_their_own_reason():
    model = nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(2))
    with pytest.warns(UserWarning, match="not initialized yet") as seen:
        report = quantize(model, "int8")
    assert report.skipped_by_reason("not initialized yet") == ["1"]
    assert not any("do not support quantization" in str(w.message) for w in seen)


def test_unknown_keywords_are_a_value_error_as_in_keras():
    with pytest.raises(ValueError, match=r"Unrecognized keyword arguments.*typecheck"):
        quantize(nn.Linear(2, 2), "int8", typecheck=False)


def test_int4_from_a_name_means_what_it_means_in_keras():
    """A layer built under `"int4_from_X"` is per channel (Keras's loading
    path); a built layer given it is quantized as `quantize("int4")`: block 128."""
    built_with = layers.Dense(4, dtype="int4_from_float32")
    built_with.build((None, 256))
    assert built_with.quantization_config is None  # Keras's: the policy's implied config
    assert built_with._quantized.config.group_size == -1
    assert tuple(built_with.kernel_scale.shape) == (4,)
    given = layers.Dense(4)
    given.build((None, 256))
    given.dtype_policy = "int4_from_float32"
    assert given.dtype_policy.name == "int4_from_float32"
    assert given.quantization_config == Int4QuantizationConfig()  # block 128
    assert tuple(given.kernel_scale.shape) == (2, 4)
    own_block = layers.Dense(4)
    own_block.build((None, 256))
    own_block.dtype_policy = "int4/64_from_float32"  # its own block size
    assert tuple(own_block.kernel_scale.shape) == (math.ceil(256 / 64), 4)


def test_a_failing_policy_quantization_leaves_the_layer_and_its_policy_unchanged():
    layer = layers.EinsumDense("ab,ab->a", output_shape=())  # not a matrix product
    layer.build((2, 4))
    kernel = layer.kernel.detach().clone()
    with pytest.raises(NotImplementedError, match="not a matrix product"):
        layer.dtype_policy = "int8_from_float32"
    assert layer.dtype_policy.name == "float32" and not layer.is_quantized
    assert torch.equal(layer.kernel, kernel)
    # built under such a policy, the layer computes with its float source, and says so
    fallback = layers.EinsumDense("ab,ab->a", output_shape=(), dtype="int8_from_mixed_bfloat16")
    with pytest.warns(UserWarning, match=r"cannot take its policy 'int8_from_mixed_bfloat16'"):
        assert fallback(torch.ones(2, 4)).dtype == torch.bfloat16
    assert not fallback.is_quantized
    with dtype_policies.policy_scope("int8_from_mixed_bfloat16"), warnings.catch_warnings():
        warnings.simplefilter("error")  # a quantized default policy: quietly float
        by_default = layers.EinsumDense("ab,ab->a", output_shape=())
        assert by_default(torch.ones(2, 4)).dtype == torch.bfloat16


def test_gated_attention_multiplies_each_head_by_the_sigmoid_gate():
    torch.manual_seed(0)
    mha = layers.MultiHeadAttention(num_heads=2, key_dim=4, use_gate=True, name="mha")
    query, value = torch.randn(3, 5, 8), torch.randn(3, 6, 8)
    out = mha(query, value)
    assert mha.gate.path == "mha/gate" and mha.gate.kernel.shape == (8, 2, 4)
    q, k, v = (
        p(x).transpose(1, 2) for p, x in ((mha.query, query), (mha.key, value), (mha.value, value))
    )
    weights = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1)
    gate = torch.sigmoid(torch.einsum("abc,cde->abde", query, mha.gate.kernel) + mha.gate.bias)
    expected = mha.attention_output((weights @ v).transpose(1, 2) * gate)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    plain = layers.MultiHeadAttention(num_heads=2, key_dim=4)
    plain(query, value)
    assert not hasattr(plain, "gate") and plain.get_config()["use_gate"] is False
