"""Contract (policy misuse): clear errors that name the offending value or
path, raised before anything changes; warnings for map keys matching nothing."""

import re
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

import dtype_policies
from dtype_policies import (
    DTypePolicyMap,
    QuantizedFloat8DTypePolicy,
    apply_policy,
    layers,
    quantize,
)

from .helpers import (
    assert_unchanged,
    mlp,
    quantize_with,
    snapshot,
    snapshot_with_call_states,
    unchanged_with_call_states,
)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(
            encoder=nn.Sequential(
                OrderedDict(layers=nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)]))
            ),
            head=nn.Linear(16, 4),
        )
    )


def test_apply_policy_with_bare_int8():
    """`"int8"` is a plain (non-float) policy: refused with a pointer to the
    quantized policy name and to quantize(); nothing changes."""
    model = _model()
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        apply_policy(model, "int8")
    message = str(info.value)
    assert "int8_from_mixed_bfloat16" in message, message
    assert "quantize(" in message, message
    assert_unchanged(model, before)


@pytest.mark.parametrize("name", ["int4", "float8", "uint8", "int32"])
def test_apply_policy_with_other_non_float_names(name):
    model = _model()
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        apply_policy(model, name)
    assert_unchanged(model, before)
    for suggested in re.findall(r"'(\w+_from_\w+)'", str(info.value)):
        dtype_policies.get(suggested)  # every name it suggests exists


def test_apply_policy_int8_message_names_the_alternatives():
    with pytest.raises(ValueError, match=re.escape("int8_from_mixed_bfloat16")):
        apply_policy(_model(), "int8")


@pytest.mark.parametrize("via", ["policy", "map"])
@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("int8", "int4/128_from_mixed_bfloat16"),
        ("int4_128", "int8_from_mixed_bfloat16"),
        ("int8", "float8_from_mixed_bfloat16"),
    ],
)
def test_other_mode_policy_over_a_quantized_model(first, second, via):
    model = _model()
    apply_policy(model, "mixed_bfloat16")
    quantize_with(model, first)
    before = snapshot(model)
    policy = second if via == "policy" else DTypePolicyMap("mixed_bfloat16", {"head": second})
    with pytest.raises(ValueError) as info:
        apply_policy(model, policy)
    message = str(info.value)
    assert "head" in message, message
    first_mode = first[:4]
    second_mode = second.split("_")[0].split("/")[0]
    assert first_mode in message and second_mode in message, message
    assert_unchanged(model, before)
    assert model.head(torch.randn(2, 16)).dtype == torch.bfloat16  # still working


def test_other_mode_policy_over_a_quantized_layer():
    torch.manual_seed(0)
    layer = layers.Dense(8, dtype="int8_from_mixed_bfloat16", name="q_dense")
    layer.build((None, 16))
    model = nn.Sequential(OrderedDict(block=layer))
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        apply_policy(model, "int4/128_from_mixed_bfloat16")
    assert "block" in str(info.value).replace("q_dense", "")
    assert_unchanged(model, before)


@pytest.mark.parametrize("pattern", ["[", "(", "a{2,1}", "*x"])
def test_quantize_with_an_invalid_filter_regex(pattern):
    model = _model()
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        quantize(model, "int8", filters=pattern)
    assert pattern in str(info.value)
    assert_unchanged(model, before)


def test_quantize_with_an_invalid_filter_in_a_list():
    model = _model()
    before = snapshot(model)
    with pytest.raises(ValueError, match=re.escape("'['")):
        quantize(model, "int8", filters=["head", "["])
    assert_unchanged(model, before)


@pytest.mark.parametrize(
    "name",
    [
        "int8_from_",
        "int4/ 128_from_float32",
        "int4/+128_from_float32",
        "int4/128 _from_float32",
        "int4/_from_float32",
        "int4/1.5_from_float32",
        "int8_from_int8_from_float32",
        "float8_from_",
        "_from_float32",
    ],
)
def test_get_rejects_malformed_names(name):
    with pytest.raises(ValueError):
        dtype_policies.get(name)


def test_map_key_matching_no_module_warns():
    model = _model()
    with pytest.warns(UserWarning, match="decoder"):
        apply_policy(model, DTypePolicyMap("mixed_bfloat16", {"decoder": "float32"}))


def test_escaped_dotted_key_matching_nothing_warns():
    """r"encoder\\.layers\\.0" matches no path: paths use "/"."""
    key = r"encoder\.layers\.0"
    model = _model()
    with pytest.warns(UserWarning) as record:
        apply_policy(model, DTypePolicyMap("mixed_bfloat16", {key: "float32"}))
    # Named as Python prints it (repr), like every key in these warnings.
    assert any(repr(key) in str(w.message) for w in record), [str(w.message) for w in record]
    # And indeed nothing took the entry.
    assert model.encoder.layers[0].dtype_policy.name == "mixed_bfloat16"


def test_matching_keys_do_not_warn():
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        apply_policy(
            model,
            DTypePolicyMap("mixed_bfloat16", {"encoder.layers.0": "float32", "head": "bfloat16"}),
        )
    assert model.encoder.layers[0].dtype_policy.name == "float32"


def test_unknown_quantization_mode_in_quantize():
    model = _model()
    before = snapshot(model)
    with pytest.raises(ValueError, match="Invalid quantization mode"):
        quantize(model, "int7")
    assert_unchanged(model, before)


@pytest.mark.usefixtures("quiet")
def test_policy_misuse_errors_name_the_value_and_change_nothing():
    model = mlp()
    before = snapshot_with_call_states(model)
    with pytest.raises(ValueError, match=r"'int8'.*int8_from_mixed_bfloat16.*quantize"):
        apply_policy(model, "int8")
    with pytest.raises(ValueError, match=r"Invalid regex in `filters`: '\['"):
        quantize(model, "int8", filters="[")
    assert unchanged_with_call_states(model, before)
    quantize(model, "int8")
    before = snapshot_with_call_states(model)
    with pytest.raises(ValueError, match=r"'0'.*mode 'int8'.*int4/128_from_float32"):
        apply_policy(model, "int4/128_from_float32")
    assert unchanged_with_call_states(model, before)
    for name in (
        "int8_from_",
        "int4/ 128_from_float32",
        "int4/+128_from_float32",
        "int4/1.5_from_float32",
    ):
        with pytest.raises(ValueError):
            dtype_policies.get(name)
    with pytest.raises(ValueError, match=r"Invalid quantization mode.*int7"):
        QuantizedFloat8DTypePolicy(mode="int7")


@pytest.mark.usefixtures("quiet")
def test_map_keys_matching_nothing_warn_by_name():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)))
    with pytest.warns(UserWarning, match=r"'encoder\\\\\.layers\\\\\.0' matches no module path"):
        apply_policy(model, DTypePolicyMap("float32", {r"encoder\.layers\.0": "bfloat16"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_policy(model, DTypePolicyMap("float32", {"1.0": "bfloat16"}))  # dotted: matches
    assert model[1][0].dtype_policy.name == "bfloat16"


@pytest.mark.parametrize("mode", ["int8", "int8 weight-only", "int4", "float8"])
@pytest.mark.parametrize("width", [200, 255, 257, 512])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_a_quantized_linear_refuses_an_input_of_another_width(mode, width, rows):
    """The kernels pad or cut an input to their packed width: an input of
    another width than the layer's must be refused, as torch's float product
    refuses it, not multiplied."""
    torch.manual_seed(0)
    from dtype_policies.quantization import Int8QuantizationConfig

    layer = nn.Linear(256, 64)
    apply_policy(layer, "mixed_bfloat16")
    if mode == "int8 weight-only":
        quantize(layer, "int8", Int8QuantizationConfig(activation_quantizer=None))
    else:
        quantize(layer, mode)
    with torch.no_grad():
        layer(torch.randn(2, 256))  # packed at the right width
    with pytest.raises(
        RuntimeError, match=rf"256 input features got an input of shape \({rows}, {width}\)"
    ):
        layer(torch.randn(rows, width))
    with torch.no_grad(), pytest.raises(RuntimeError, match="its last axis must be 256"):
        layer(torch.randn(rows, width))


@pytest.mark.parametrize("mode", ["int8", "int8 weight-only", "int4", "float8"])
@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool, torch.int64, torch.uint8])
def test_a_quantized_linear_refuses_a_non_floating_input(mode, dtype):
    """torch's float product refuses integer, boolean and complex inputs; the
    kernels would convert them (a complex input losing its imaginary part)."""
    torch.manual_seed(0)
    from dtype_policies.quantization import Int8QuantizationConfig

    layer = nn.Linear(64, 16)
    if mode == "int8 weight-only":
        quantize(layer, "int8", Int8QuantizationConfig(activation_quantizer=None))
    else:
        quantize(layer, mode)
    before = snapshot(layer)
    x = torch.ones(3, 64).to(dtype)
    with pytest.raises(TypeError, match=rf"floating-point inputs; got an input of dtype {dtype}"):
        layer(x)
    assert_unchanged(layer, before)
