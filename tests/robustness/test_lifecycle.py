"""Module lifecycle: dtype conversions, copies, pickling, state dicts,
handles (remove, nesting), slicing."""

import copy
import io
import pickle
import warnings

import pytest
import torch
import torch.nn as nn

import dtype_policies
from dtype_policies import DTypePolicyMap, apply_policy, layers, quantize


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def mlp():
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))


@pytest.mark.parametrize("mode", ["int8", "int4", "float8"])
@pytest.mark.parametrize("conversion", ["half", "bfloat16", "double", "to_float16"])
def test_dtype_conversions_keep_the_quantized_state(mode, conversion):
    torch.manual_seed(0)
    model = mlp()
    with torch.no_grad():
        model[0].weight.mul_(1e-4)  # tiny weights: a float16 int8 scale would overflow
    quantize(model, mode)
    x = torch.randn(4, 32)
    before = model(x)
    dtypes = {k: v.dtype for k, v in model.named_buffers()}
    if conversion == "to_float16":
        model.to(torch.float16)
    else:
        getattr(model, conversion)()
    assert {k: v.dtype for k, v in model.named_buffers()} == dtypes
    out = model(x)
    assert out.dtype == before.dtype  # the policy decides the compute dtype
    assert torch.isfinite(out).all()
    assert ((out.float() - before.float()).norm() / before.float().norm()) < 0.02


@pytest.mark.parametrize("mode", [None, "int8", "int4", "float8"])
def test_copies_and_pickles_after_forward_and_backward(mode):
    torch.manual_seed(0)
    model = mlp()
    apply_policy(model, "mixed_bfloat16")
    if mode:
        quantize(model, mode)
    x = torch.randn(4, 32)
    model(x).float().sum().backward()
    with torch.no_grad():
        expected = model(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for clone in (
        copy.deepcopy(model),
        pickle.loads(pickle.dumps(model)),
        torch.load(buffer, weights_only=False),
    ):
        with torch.no_grad():
            assert torch.equal(clone(x), expected)
        assert clone[0].dtype_policy == model[0].dtype_policy


def test_layers_model_pickles_after_training():
    model = layers.Sequential(
        [layers.Dense(16, activation="relu", dtype="mixed_bfloat16"), layers.Dense(4)]
    )
    x = torch.randn(3, 8)
    model(x).float().sum().backward()
    clone = pickle.loads(pickle.dumps(model))
    assert torch.equal(clone(x), model(x))


def test_load_state_dict_float_into_quantized_requantizes_and_quantized_into_float_refuses():
    torch.manual_seed(0)
    source = mlp()
    quantized = mlp()
    quantize(quantized, "int8")
    quantized.load_state_dict(source.state_dict())  # strict
    expected = copy.deepcopy(source)
    quantize(expected, "int8")
    x = torch.randn(4, 32)
    assert torch.equal(quantized(x), expected(x))

    float_model = mlp()
    weights = {k: v.clone() for k, v in float_model.state_dict().items()}
    with pytest.raises(RuntimeError, match="weight_int8"):
        float_model.load_state_dict(quantized.state_dict())
    report = float_model.load_state_dict(quantized.state_dict(), strict=False)
    assert "0.weight_int8" in report.unexpected_keys and "0.weight" in report.missing_keys
    assert all(  # the float weights are untouched (only the biases matched)
        torch.equal(float_model.state_dict()[k], weights[k]) for k in weights if "weight" in k
    )

    policied = mlp()
    apply_policy(policied, "mixed_bfloat16")
    dense = layers.Dense(32)
    dense.build((None, 32))
    dense_q = layers.Dense(32)
    dense_q.build((None, 32))
    dense_q.quantize("int8")
    with pytest.raises(ValueError, match="kernel_int8"):
        dense.load_state_dict(dense_q.state_dict(), strict=False)

    int4_model = mlp()
    quantize(int4_model, "int4")
    with pytest.raises(ValueError, match=r"'0\.weight_int8'.*mode 'int4'"):
        int4_model.load_state_dict(quantized.state_dict())


def test_load_state_dict_assign_sees_new_values():
    model = mlp()
    apply_policy(model, "mixed_bfloat16")
    x = torch.randn(2, 32)
    with torch.no_grad():
        model(x)
        other = mlp()
        model.load_state_dict(other.state_dict(), assign=True)
        reference = copy.deepcopy(other)
        apply_policy(reference, "mixed_bfloat16")
        assert torch.equal(model(x), reference(x))


def test_nested_handles_compose_in_both_orders():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)))
    x = torch.randn(2, 8)
    outer = apply_policy(model, "mixed_bfloat16")
    inner = apply_policy(model[1], "float32")
    assert model[1][0].dtype_policy.name == "float32" and model[0].dtype_policy.name == (
        "mixed_bfloat16"
    )
    assert model(x).dtype == torch.float32
    inner.remove()
    assert model[1][0].dtype_policy.name == "mixed_bfloat16" and model(x).dtype == torch.bfloat16
    outer.remove()
    assert all(type(m) in (nn.Sequential, nn.Linear) for m in model.modules())

    inner = apply_policy(model[1], "float32")
    outer = apply_policy(model, "mixed_bfloat16")
    assert model[1][0].dtype_policy.name == "mixed_bfloat16"  # the latest wins
    outer.remove()
    assert model[1][0].dtype_policy.name == "float32" and type(model[0]) is nn.Linear
    inner.remove()
    assert type(model[1][0]) is nn.Linear


def test_remove_after_float8_is_exact_and_int8_warns():
    model = mlp()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    handle = apply_policy(model, "float8_from_mixed_bfloat16")
    model(torch.randn(2, 32)).float().sum().backward()
    handle.remove()
    assert all(type(m) in (nn.Sequential, nn.Linear, nn.ReLU) for m in model.modules())
    assert list(model.state_dict()) == list(state)
    handle = apply_policy(model, "int8_from_mixed_bfloat16")
    with pytest.warns(UserWarning, match="stay quantized"):
        handle.remove()
    assert model[0].weight_int8.dtype == torch.int8


def test_slicing_a_policied_sequential():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    apply_policy(model, "mixed_bfloat16")
    head = model[:2]
    assert head(torch.randn(2, 8)).dtype == torch.bfloat16


def test_functional_call_and_func_grad():
    model = mlp()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int8", filters="^2$")
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = torch.randn(3, 32)
    out = torch.func.functional_call(model, params, (x,))
    assert out.dtype == torch.bfloat16

    def loss(p):
        return torch.func.functional_call(model, p, (x,)).float().square().sum()

    grads = torch.func.grad(loss)(params)
    assert set(grads) == set(params) and all(torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("mode", [None, "int8", "int4"])
def test_jit_trace_and_export(mode):
    model = mlp()
    apply_policy(model, "mixed_bfloat16")
    if mode:
        quantize(model, mode)
    x = torch.randn(20, 32)
    with torch.no_grad():
        expected = model(x)
        traced = torch.jit.trace(model, x)
        assert torch.allclose(traced(x).float(), expected.float(), atol=1e-2)
    for strict in (False, True):  # torch 2.6 defaults to strict, 2.13 to non-strict
        exported = torch.export.export(model, (x,), strict=strict)
        assert torch.allclose(exported.module()(x).float(), expected.float(), atol=2e-2), strict


def test_weight_changes_are_seen_by_kept_casts():
    model = mlp()
    apply_policy(model, "mixed_bfloat16")
    x = torch.randn(4, 32)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)

    def same():
        with torch.no_grad():
            return torch.equal(model(x), reference(x))

    assert same()
    for m, opt in ((model, optimizer), (reference, reference_optimizer)):
        m(x).float().sum().backward()
        opt.step()
    assert same()
    with torch.no_grad():
        for m in (model, reference):
            m[0].weight.mul_(0.5).add_(m[2].bias.mean())  # an EMA-style update
    assert same()
    new = torch.randn(32, 32)
    model[0].weight.data = new.clone()
    reference[0].weight.data = new.clone()
    assert same()
    with torch.no_grad():
        model[0].weight.data.mul_(3)  # invisible to torch's version counter
        reference[0].weight.data.mul_(3)
    dtype_policies.clear_cast_caches(model)
    dtype_policies.clear_cast_caches(reference)  # a policied copy: its kept casts too
    assert same()
    uncached = mlp()
    apply_policy(uncached, "mixed_bfloat16", weight_cache=False)
    with torch.no_grad():
        first = uncached(x)
        uncached[0].weight.data.zero_()
        assert not torch.equal(uncached(x), first)


def test_batchnorm_statistics_keep_updating_under_any_policy():
    for policy, kwargs in (
        (DTypePolicyMap("mixed_bfloat16", {"1": "bfloat16"}), {}),
        ("mixed_bfloat16", {"float32_modules": ()}),
        ("mixed_bfloat16", {"float32_modules": (), "cast_buffers": False}),
    ):
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).train()
        reference = copy.deepcopy(model)
        apply_policy(model, policy, **kwargs)
        x = torch.randn(2, 3, 8, 8)
        model(x)
        reference(x)
        assert model[1].running_mean.dtype == torch.float32
        torch.testing.assert_close(
            model[1].running_mean, reference[1].running_mean, atol=1e-2, rtol=0.05
        )
        assert model[1].num_batches_tracked.item() == 1


def test_buffers_updated_in_place_by_a_forward_are_written_back():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.register_buffer("total", torch.zeros(4))

        def forward(self, x):
            self.total.add_(x.detach().sum(0))
            return self.linear(x)

    module = Counter()
    apply_policy(module, "mixed_bfloat16")
    module(torch.ones(2, 4))
    module(torch.ones(2, 4))
    assert module.total.dtype == torch.float32
    assert torch.equal(module.total, torch.full((4,), 4.0))
