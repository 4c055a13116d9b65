"""Contract: `quantize()` is atomic over the whole model: if any module raises,
no module changed (bit-for-bit state_dict, classes, policies), and the error
names the module path."""

import re
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

from dtype_policies import DTypePolicyMap, apply_policy, layers, quantize
from dtype_policies._core.module_state import state_of
from dtype_policies.quantization import Int8QuantizationConfig
from dtype_policies.quantization.schemes.base import NonFiniteWeightError

from .helpers import (
    assert_unchanged,
    quantize_with,
    snapshot,
    snapshot_with_call_states,
    unchanged_with_call_states,
)


def _three_linears():
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(
            first=nn.Linear(16, 32),
            act=nn.ReLU(),
            second=nn.Sequential(OrderedDict(inner=nn.Linear(32, 32))),
            third=nn.Linear(32, 8),
        )
    )


@pytest.mark.parametrize("config", [None, Int8QuantizationConfig(activation_quantizer=None)])
def test_int8_over_a_float16_module_changes_nothing(config):
    """int8 refuses a float16 compute dtype (Keras's rule). The module that
    refuses comes after one that could be quantized."""
    model = _three_linears()
    apply_policy(model, DTypePolicyMap("mixed_bfloat16", {"second/inner": "mixed_float16"}))
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        quantize(model, "int8", config)
    assert_unchanged(model, before)
    assert "second/inner" in str(info.value)
    out = model(torch.randn(2, 16))  # still the float model
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_int8_over_a_float16_layer_changes_nothing():
    torch.manual_seed(0)
    first = layers.Dense(32, dtype="mixed_bfloat16", name="ok_dense")
    second = layers.Dense(8, dtype="mixed_float16", name="fp16_dense")
    model = nn.Sequential(OrderedDict(a=first, b=second))
    model(torch.randn(2, 16))
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        quantize(model, "int8")
    assert_unchanged(model, before)
    assert "b" in str(info.value).replace("fp16_dense", "")  # the path "b", not only the name
    assert not first.is_quantized and not second.is_quantized


def test_unbuilt_layer_inside_a_model():
    """An unbuilt layer among built ones: either the whole call raises
    (naming the path, nothing changed) or the layer is skipped with a reason;
    never a half-quantized model that then crashes."""
    torch.manual_seed(0)
    built = layers.Dense(32, name="built_dense")
    built.build((None, 16))
    unbuilt = layers.Dense(8, name="unbuilt_dense")
    model = nn.Sequential(OrderedDict(built=built, later=unbuilt))
    before = snapshot(model)
    try:
        report = quantize(model, "int8")
    except ValueError as error:
        assert_unchanged(model, before)
        assert "later" in str(error).replace("unbuilt_dense", "")
        return
    assert "later" in dict(report.skipped), report.render()
    assert dict(report.skipped)["later"]
    out = model(torch.randn(2, 16))  # builds the skipped layer: float
    assert out.shape == (2, 8) and torch.isfinite(out).all()


def test_failing_third_party_kind_changes_nothing():
    """A registered linear kind whose weight is not a matrix: quantizing it
    fails, and the modules planned before it are left alone."""
    from dtype_policies.quantization import register_linear_kind

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 8, 2))

        def forward(self, x):
            return x @ self.weight.flatten(1).t()[: x.shape[-1]]

    register_linear_kind(Odd, weight="weight", layout="out_in", bias=None)
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(first=nn.Linear(16, 16), odd=Odd()))
    before = snapshot(model)
    try:
        report = quantize(model, "int8")
    except (ValueError, NotImplementedError) as error:
        assert_unchanged(model, before)
        assert "odd" in str(error)
        return
    assert "odd" in dict(report.skipped), report.render()
    assert torch.equal(model.odd.weight, before["state"]["odd.weight"])


def test_error_leaves_layers_policies_unchanged():
    """The layers' own policies (and the map they may share) are untouched."""
    torch.manual_seed(0)
    policy = DTypePolicyMap("mixed_bfloat16", {"model/1": "mixed_float16"})
    model = layers.Sequential(
        [layers.Dense(32, dtype=policy), layers.Dense(8, dtype=policy)], name="model"
    )
    model(torch.randn(2, 16))
    before = snapshot(model)
    config_before = policy.get_config()
    with pytest.raises(ValueError) as info:
        quantize(model, "int8")
    assert_unchanged(model, before)
    assert policy.get_config() == config_before
    assert "model/1" in str(info.value)


def test_non_matmul_einsum_is_skipped_with_a_reason():
    """int8 on an EinsumDense whose equation is not a matrix product is not an
    error: it is skipped and reported, the rest is quantized."""
    torch.manual_seed(0)
    odd = layers.EinsumDense("abc,cb->ab", output_shape=(3,), name="odd_einsum")
    model = nn.Sequential(OrderedDict(first=nn.Linear(12, 12), reshape=nn.Unflatten(1, (3, 4))))
    model.add_module("odd", odd)
    x = torch.randn(2, 12)
    with torch.no_grad():
        reference = model(x)
    odd_before = {k: v.clone() for k, v in odd.state_dict().items()}
    report = quantize_with(model, "int8")
    assert "odd" in dict(report.skipped) and dict(report.skipped)["odd"]
    assert [path for path, *_ in report.quantized] == ["first"]
    for key, value in odd_before.items():
        assert torch.equal(odd.state_dict()[key], value), key
    with torch.no_grad():
        out = model(x)
    assert ((out - reference).norm() / reference.norm()) < 0.05


@pytest.mark.usefixtures("quiet")
def test_quantize_is_atomic_and_names_the_failing_module():
    model = nn.Sequential(
        nn.Linear(32, 32),
        layers.Dense(16, dtype="mixed_float16"),  # int8 with float16 compute is refused
        nn.Linear(16, 8),
    )
    model[1].build((None, 32))
    before = snapshot_with_call_states(model)
    with pytest.raises(ValueError, match=r"module '1'.*float16"):
        quantize(model, "int8")
    assert unchanged_with_call_states(model, before)
    assert getattr(state_of(model[0]), "quantization", None) is None


@pytest.mark.parametrize("mode", ["int8", "int4", "float8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weight_is_refused_and_changes_nothing(mode, bad):
    """A scale derived from a range holding NaN or infinity would silently
    poison its whole row or group: refused, naming the module and the value,
    before any module (even an earlier, finite one) is quantized."""
    model = _three_linears()
    with torch.no_grad():
        model.third.weight[5, 7] = bad
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        quantize(model, mode)
    assert_unchanged(model, before)
    message = str(info.value)
    assert "'third'" in message and "1 non-finite" in message
    assert f"{bad} at index [5, 7]" in message


@pytest.mark.parametrize("mode", ["int8", "int4", "gptq"])
def test_a_non_finite_last_weight_fails_before_any_module_is_planned(mode, monkeypatch):
    """Planning quantizes each weight (minutes for a large model; a
    calibration first runs the model on its data): a NaN in the last layer
    was reported only after every layer before it was planned."""
    from dtype_policies.quantization import GPTQConfig, api

    model = _three_linears()
    with torch.no_grad():
        model.third.weight[1, 2] = float("nan")
    planned: list[str] = []
    real_plan = api.plan
    monkeypatch.setattr(
        api,
        "plan",
        lambda module, *a, **k: planned.append(k.get("path")) or real_plan(module, *a, **k),
    )
    real_calibration = api.plan_calibrated
    monkeypatch.setattr(
        api,
        "plan_calibrated",
        lambda *a, **k: planned.append("calibration") or real_calibration(*a, **k),
    )
    config = GPTQConfig(dataset=[torch.randn(2, 16)], tokenizer=None) if mode == "gptq" else None
    before = snapshot(model)
    with pytest.raises(NonFiniteWeightError, match=r"module 'third'.*1 non-finite"):
        quantize(model, mode, config=config)
    assert planned == []
    assert_unchanged(model, before)


@pytest.mark.parametrize("policy", ["int8_from_float32", "int4/32_from_mixed_bfloat16"])
def test_apply_policy_refuses_a_non_finite_last_weight_before_planning_any(policy, monkeypatch):
    """`apply_policy` planned module by module, so a NaN in the last layer
    was found only after every layer before it was rounded (as `quantize()`
    did before it checked every weight first)."""
    from dtype_policies.quantization import attach

    model = _three_linears()
    with torch.no_grad():
        model.third.weight[3, 4] = float("nan")
    planned: list[str] = []
    real_plan = attach.plan
    monkeypatch.setattr(
        attach,
        "plan",
        lambda module, *a, **k: planned.append(k.get("path")) or real_plan(module, *a, **k),
    )
    before = snapshot(model)
    with pytest.raises(NonFiniteWeightError, match=r"module 'third'.*nan at index \[3, 4\]"):
        apply_policy(model, policy)
    assert planned == []
    assert_unchanged(model, before)
    policy_map = DTypePolicyMap(default_policy=policy)
    policy_map["third"] = "float32"  # the bad module left float: the others are planned
    apply_policy(model, policy_map)
    assert sorted(planned) == ["first", "second/inner"]


@pytest.mark.parametrize(
    "how", ["apply_policy", "layer.quantize", "layer.dtype_policy", "embedding.quantize"]
)
def test_non_finite_weight_is_refused_by_every_route(how):
    """Each route names the module: `quantize()` and `apply_policy` by its
    path, a layer's own routes by its name (a model of many alike layers)."""
    torch.manual_seed(0)
    if how != "apply_policy":
        model = layers.Sequential(
            [layers.Dense(8, name="encoder_proj"), layers.Dense(4, name="head")]
        )
        model(torch.randn(2, 8))
        layer = model.layers[1]
        weight = layer.kernel
        if how == "embedding.quantize":
            layer = layers.Embedding(10, 4, name="table")
            layer(torch.tensor([1]))
            weight = layer.embeddings
        with torch.no_grad():
            weight[2, 1] = float("nan")
        before = snapshot(layer)
        expected = (
            re.escape(f"Layer '{layer.name}': its weight")
            + ".*"
            + re.escape("1 non-finite value(s) (first: nan at index [2, 1])")
        )
        with pytest.raises(ValueError, match=expected):
            if how == "layer.dtype_policy":
                layer.dtype_policy = "int8_from_float32"
            else:
                layer.quantize("int8")
        assert_unchanged(layer, before)
        assert layer.dtype_policy.name == "float32"
        return
    model = _three_linears()
    with torch.no_grad():
        model.first.weight[0, 0] = float("inf")
    before = snapshot(model)
    with pytest.raises(NonFiniteWeightError, match=r"first.*non-finite"):
        apply_policy(model, "int8_from_float32")
    assert_unchanged(model, before)


@pytest.mark.parametrize("where", ["the model", "a child"])
def test_a_data_parallel_wrapper_in_the_tree_is_refused_and_changes_nothing(where):
    """DDP's (and DataParallel's) gradient buckets hold the float weights that
    quantization replaces: quantizing under it made the ranks drift apart,
    then a step failed with DDP's unused-parameters error."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    wrapper = nn.DataParallel(inner)  # the same class check covers DDP
    model = wrapper if where == "the model" else nn.Sequential(wrapper, nn.Linear(2, 2))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"is a DataParallel.*Quantize the module before"):
        quantize(model, "int8")
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_apply_policy_quantizing_under_a_data_parallel_wrapper_is_refused():
    torch.manual_seed(0)
    wrapper = nn.DataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
    before = {name: t.clone() for name, t in wrapper.state_dict().items()}
    with pytest.raises(ValueError, match=r"apply_policy\(\) with a quantized policy.*DataParallel"):
        apply_policy(wrapper, "int8_from_float32")
    after = wrapper.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    apply_policy(wrapper, "mixed_bfloat16")  # a float policy stays welcome
    assert wrapper(torch.randn(2, 8)).dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [(4, 0), (0, 4)])
@pytest.mark.parametrize("mode", ["int8", "int4", "float8"])
def test_an_empty_weight_is_left_float_with_its_reason(mode, shape):
    """Some modes took a zero-size linear and every call then failed in a
    kernel (or quantize raised a raw torch error)."""
    model = nn.Sequential(nn.Linear(*shape))
    report = quantize(model, mode)
    assert report.num_quantized == 0
    assert any("its weight is empty" in reason for _, reason in report.skipped)
    x = torch.randn(2, shape[0])
    assert model(x).shape == (2, shape[1])


@pytest.mark.parametrize(
    ("mode", "taken"),
    [("int8", "weight_scale"), ("int4", "weight_int4"), ("float8", "inputs_scale")],
)
@pytest.mark.parametrize("how", ["buffer", "parameter", "attribute"])
def test_a_name_the_quantized_tensors_take_is_refused_before_anything_changes(mode, taken, how):
    """A module already holding a tensor (or attribute) under a name its
    quantized tensors take: storing them would overwrite a buffer, or hide a
    parameter from `state_dict` behind a buffer of the same name."""
    model = _three_linears()
    holder = model.second.inner
    if how == "buffer":
        holder.register_buffer(taken, torch.tensor([3.0]))
    elif how == "parameter":
        holder.register_parameter(taken, nn.Parameter(torch.tensor([3.0])))
    else:
        setattr(holder, taken, 3.0)
    before = snapshot(model)
    with pytest.raises(ValueError, match=rf"'second/inner'.*'{taken}'.*Nothing was changed"):
        quantize(model, mode)
    assert_unchanged(model, before)
    with pytest.raises(ValueError, match=rf"'{taken}'"):
        apply_policy(model, f"{mode}_from_float32")
    assert_unchanged(model, before)
    assert float(getattr(holder, taken)) == 3.0
