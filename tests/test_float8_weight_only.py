"""float8 weight-only: the kernel rounded to float8_e4m3fn with a scale per
output channel, inputs and gradients untouched, the delayed state unused; the
same values with and without autograd, in every layer kind, and the setting
carried by configs, policies and checkpoints."""

import copy

import pytest
import torch
import torch.nn as nn

from dtype_policies import QuantizedFloat8DTypePolicy, apply_policy, layers, quantize, saving
from dtype_policies._core.module_state import quantization_of
from dtype_policies.quantization import Float8QuantizationConfig

E4M3 = torch.float8_e4m3fn
WEIGHT_ONLY = Float8QuantizationConfig(scaling="weight_only")


def _per_channel_oracle(w_nk):
    scale = w_nk.abs().amax(dim=1, keepdim=True) / torch.finfo(E4M3).max
    return (w_nk / scale).to(E4M3).float() * scale


def test_forward_is_the_float_product_with_a_per_channel_float8_kernel():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 24))
    with torch.no_grad():
        model[0].weight[3] *= 1000.0  # one loud channel must not coarsen the others
    float_model = copy.deepcopy(model)
    quantize(model, "float8", WEIGHT_ONLY)
    x = torch.randn(5, 64)
    expected = nn.functional.linear(
        x, _per_channel_oracle(float_model[0].weight.detach()), float_model[0].bias
    )
    with torch.no_grad():
        eager_no_grad = model(x)
    with_grad = model(x)
    torch.testing.assert_close(eager_no_grad, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(with_grad.detach(), expected, rtol=1e-5, atol=1e-5)
    quiet_rows = [i for i in range(24) if i != 3]
    error = eager_no_grad - nn.functional.linear(x, float_model[0].weight, float_model[0].bias)
    assert error[:, quiet_rows].abs().max() < 0.05 * expected[:, quiet_rows].abs().max()


def test_gradients_pass_straight_through_and_the_state_is_not_used():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 8))
    quantize(model, "float8", WEIGHT_ONLY)
    layer = model[0]
    state = {name: buffer.clone() for name, buffer in layer.named_buffers()}
    x = torch.randn(4, 32, requires_grad=True)
    out = model(x)
    out.square().sum().backward()
    kernel = _per_channel_oracle(layer.weight.detach())
    expected_grad_x = (2 * out.detach()) @ kernel
    torch.testing.assert_close(x.grad, expected_grad_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad, (2 * out.detach()).t() @ x.detach())
    for name, buffer in layer.named_buffers():
        assert torch.equal(buffer, state[name]), name


@pytest.mark.parametrize("kind", ["dense", "einsum", "embedding_free"])
def test_keras_layers_agree_with_and_without_grad(kind):
    torch.manual_seed(2)
    if kind == "dense":
        layer = layers.Dense(12, dtype="float32")
        layer.build((None, 20))
    elif kind == "einsum":
        layer = layers.EinsumDense("ab,bc->ac", output_shape=12, dtype="float32")
        layer.build((None, 20))
    else:
        layer = nn.Sequential(nn.Linear(20, 12, bias=False))
    quantize(layer, "float8", WEIGHT_ONLY)
    x = torch.randn(3, 20)
    with torch.no_grad():
        cached = layer(x)
    traced = layer(x)
    torch.testing.assert_close(cached, traced.detach(), rtol=1e-5, atol=1e-5)


def test_mixed_bfloat16_keeps_bfloat16_outputs_and_follows_weight_updates():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "float8", WEIGHT_ONLY)
    x = torch.randn(6, 32)
    with torch.no_grad():
        before = model(x)
        model[0].weight.mul_(-1.0)  # the kept kernel follows an in-place write
        after = model(x)
    assert before.dtype == torch.bfloat16 and after.dtype == torch.bfloat16
    assert not torch.equal(before, after)


def test_config_policy_and_checkpoint_carry_weight_only(tmp_path):
    assert Float8QuantizationConfig.from_config(WEIGHT_ONLY.get_config()).scaling == "weight_only"
    policy = QuantizedFloat8DTypePolicy("float8", "mixed_bfloat16", scaling="weight_only")
    assert QuantizedFloat8DTypePolicy.from_config(policy.get_config()) == policy
    assert policy.get_config()["scaling"] == "weight_only"
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(16, 8))
    quantize(model, "float8", WEIGHT_ONLY)
    path = tmp_path / "model.pt"
    saving.save(model, path)
    loaded = saving.load(nn.Sequential(nn.Linear(16, 8)), path)
    x = torch.randn(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))


def test_an_unknown_scaling_names_what_is_accepted():
    with pytest.raises(ValueError, match=r"weight_only.*Received: scaling='per_row'"):
        Float8QuantizationConfig(scaling="per_row")


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.relu(self.body(self.embed(ids))))


def test_a_tied_table_and_head_are_the_default_int8_and_stay_tied():
    torch.manual_seed(5)
    model = _TiedLM()
    report = quantize(model, "float8", WEIGHT_ONLY)
    modes = {path: mode for path, mode, _ in report.quantized}
    assert modes == {"body": "float8", "embed": "int8", "head": "int8"}
    assert model.head.weight_int8 is model.embed.weight_int8
    assert quantization_of(model.head).config.activation_block_size == 32
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 40)


@pytest.mark.parametrize("scaling", ["delayed", "dynamic"])
def test_training_scalings_leave_the_tied_head_float8(scaling):
    model = _TiedLM()
    report = quantize(model, "float8", Float8QuantizationConfig(scaling=scaling))
    assert {path: mode for path, mode, _ in report.quantized} == {
        "body": "float8",
        "head": "float8",
    }
