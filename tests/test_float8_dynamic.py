"""float8 dynamic scaling: scales from the current tensors in every call (the
forward's inputs and kernel, the backward's output gradient), the delayed
state untouched, and the setting carried by configs, policies and checkpoints."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import dtype_policies
from dtype_policies import QuantizedFloat8DTypePolicy, apply_policy, layers, quantize, saving
from dtype_policies.quantization import Float8QuantizationConfig

STATE = tuple(
    f"{tensor}_{kind}"
    for tensor in ("inputs", "kernel", "outputs_grad")
    for kind in ("scale", "amax_history")
)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _qdq(x, fmt):
    """The oracle: quantize-dequantize with the tensor's own scale."""
    scale = x.abs().max() / torch.finfo(fmt).max
    return (x / scale).to(fmt).float() * scale


def _relative(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _linear(scaling, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 16))
    quantize(model, "float8", Float8QuantizationConfig(scaling=scaling))
    return model


def _state(module):
    return {name: module.get_buffer(name).clone() for name in STATE}


@pytest.mark.parametrize("magnitude", [1e-5, 1e4])
def test_uncalibrated_dynamic_error_is_far_below_delayed_first_call(magnitude):
    reference = _linear("delayed")
    float_model = copy.deepcopy(reference[0])
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)) * magnitude
    dynamic = _linear("dynamic")
    with torch.no_grad():
        expected = nn.functional.linear(x, float_model.weight)  # bias is tiny next to 1e4
        if magnitude < 1:
            expected = nn.functional.linear(x, float_model.weight, float_model.bias)
        delayed_error = _relative(reference(x), expected)
        dynamic_error = _relative(dynamic(x), expected)
    assert dynamic_error < 0.05
    assert delayed_error > 5 * dynamic_error


def test_forward_and_backward_match_the_oracle_and_leave_the_state_alone():
    model = _linear("dynamic")
    linear = model[0]
    before = _state(linear)
    weight = linear.weight.detach().clone()
    generator = torch.Generator().manual_seed(2)
    for step in range(3):
        x = (torch.randn(4, 32, generator=generator) * 10**step).requires_grad_()
        upstream = torch.randn(4, 16, generator=generator) * 1e6  # above e5m2's 57344
        model.train()
        y = model(x)
        x_q, w_q = _qdq(x.detach(), E4M3), _qdq(weight, E4M3)
        torch.testing.assert_close(y, x_q @ w_q.t() + linear.bias, rtol=1e-5, atol=1e-4)
        linear.weight.grad = None
        y.backward(upstream)
        g_q = _qdq(upstream, E5M2)
        torch.testing.assert_close(x.grad, g_q @ w_q, rtol=1e-5, atol=1e-2)
        torch.testing.assert_close(linear.weight.grad, g_q.t() @ x_q, rtol=1e-5, atol=1e-2)
        assert _relative(x.grad, upstream @ weight) < 0.2  # the gradient did not clip
    after = _state(linear)
    assert all(torch.equal(after[name], before[name]) for name in STATE)
    assert after["inputs_scale"].dtype == torch.float32


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_works_without_grad(mode):
    model = _linear("dynamic").eval()
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(3)) * 100
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        out = model(x)
    expected = _qdq(x, E4M3) @ _qdq(model[0].weight.detach(), E4M3).t() + model[0].bias
    torch.testing.assert_close(out, expected.detach(), rtol=1e-5, atol=1e-3)


def test_zero_and_empty_inputs_give_finite_outputs():
    model = _linear("dynamic")
    with torch.no_grad():
        zero = model(torch.zeros(3, 32))
        empty = model(torch.zeros(0, 32))
    torch.testing.assert_close(zero, model[0].bias.detach().expand(3, 16))
    assert empty.shape == (0, 16)


@pytest.mark.parametrize("magnitude", [1e-4, 1e3])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_value_leaves_the_other_rows_their_own_scale(magnitude, bad):
    """The scale is taken over the finite values: one NaN or inf in a batch
    changes no other row (a scale of 1 flushed rows near 1e-4 to zero and
    clipped rows near 1e3 at 448); a NaN row stays NaN."""
    model = _linear("dynamic")
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1)) * magnitude
    spoiled = x.clone()
    spoiled[0, 0] = bad
    with torch.no_grad():
        clean, y = model(x), model(spoiled)
    torch.testing.assert_close(y[1:], clean[1:], atol=0, rtol=0)
    assert y[0].isnan().all() == (bad != bad)


def test_torch_compile_matches_eager_forward_and_backward():
    model = _linear("dynamic")
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(4)) * 50
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    eager_x, compiled_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    model(eager_x).square().sum().backward()
    eager_grad = model[0].weight.grad.clone()
    model[0].weight.grad = None
    compiled(compiled_x).square().sum().backward()
    torch.testing.assert_close(compiled_x.grad, eager_x.grad)
    torch.testing.assert_close(model[0].weight.grad, eager_grad)


def _train(scaling):
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    apply_policy(model, "mixed_bfloat16")
    if scaling is not None:
        quantize(model, "float8", Float8QuantizationConfig(scaling=scaling))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(64, 16, generator=generator)
    target = torch.randn(4, 16, generator=generator)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = (model(x).float() - x @ target.t()).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    return losses


def test_mixed_bfloat16_training_tracks_the_float_run():
    reference, dynamic = _train(None), _train("dynamic")
    assert reference[-1] < 0.5 * reference[0]
    assert abs(dynamic[-1] - reference[-1]) < 0.05 * reference[0]


def test_config_and_policy_round_trip():
    config = Float8QuantizationConfig(amax_history_length=8, scaling="dynamic")
    assert config.get_config() == {"amax_history_length": 8, "scaling": "dynamic"}
    assert Float8QuantizationConfig.from_config(config.get_config()) == config
    assert Float8QuantizationConfig.from_config({"amax_history_length": 8}).scaling == "delayed"
    assert config != Float8QuantizationConfig(amax_history_length=8)
    policy = QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16", scaling="dynamic")
    assert policy.quantization_config.scaling == "dynamic"
    assert "scaling" not in QuantizedFloat8DTypePolicy("float8", "float32").get_config()
    restored = dtype_policies.deserialize(dtype_policies.serialize(policy))
    assert restored == policy and restored.scaling == "dynamic"
    assert restored != QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16")
    with pytest.raises(ValueError, match="scaling"):
        QuantizedFloat8DTypePolicy("float8", "float32", scaling="static")
    with pytest.raises(ValueError, match="scaling"):
        Float8QuantizationConfig(scaling="current")


def test_policy_route_quantizes_with_dynamic_scaling():
    policy = QuantizedFloat8DTypePolicy("float8", "float32", scaling="dynamic")
    layer = layers.Dense(16, dtype=policy)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(6)) * 1e4
    y = layer(x)
    assert layer.quantization_mode == "float8" and layer.dtype_policy.scaling == "dynamic"
    expected = _qdq(x, E4M3) @ _qdq(layer.kernel.detach(), E4M3) + layer.bias
    torch.testing.assert_close(y, expected.detach(), rtol=1e-5, atol=1e-1)
    restored = layers.Dense.from_config(layer.get_config())
    assert restored.dtype_policy == policy


def test_a_delayed_policy_over_a_dynamic_module_is_refused():
    model = _linear("dynamic")
    with pytest.raises(ValueError, match="quantized in mode 'float8'"):
        apply_policy(model, QuantizedFloat8DTypePolicy("float8", "float32"))


def test_checkpoint_round_trip_keeps_dynamic_scaling(tmp_path):
    model = _linear("dynamic")
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(7)) * 1e3
    with torch.no_grad():
        expected = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        path = saving.save(model, tmp_path / "checkpoint")
        torch.manual_seed(8)
        loaded = saving.load(nn.Sequential(nn.Linear(32, 16)), path)
    with torch.no_grad():
        assert torch.equal(loaded(x), expected)


def test_the_default_window_and_its_length_are_one_config():
    # what quantize(m, "float8") writes, and what a float8_from_* policy builds
    default, explicit = Float8QuantizationConfig(), Float8QuantizationConfig(1024)
    assert default == explicit and hash(default) == hash(explicit)
    assert default != Float8QuantizationConfig(16)
    assert default != Float8QuantizationConfig(scaling="dynamic")
    for wrong in (2.0, True, "16"):
        with pytest.raises(TypeError, match=repr(wrong).replace(".", r"\.")):
            Float8QuantizationConfig(wrong)
    with pytest.raises(ValueError, match="Received: 0"):
        Float8QuantizationConfig(0)
