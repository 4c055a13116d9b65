"""Contract: `LossScaleOptimizer` never writes a non-finite value into a weight:
when the scale is so small that unscaling overflows, or the scale underflowed
to 0, the step is skipped."""

import math

import pytest
import torch
import torch.nn as nn

from dtype_policies import apply_policy
from dtype_policies.optimizers import LossScaleOptimizer

INNER = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
}


def _model(policy="mixed_float16"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    apply_policy(model, policy)
    return model


def _loss(model):
    torch.manual_seed(1)
    return model(torch.randn(4, 8)).float().square().mean()


def _params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_all_finite(model):
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), f"{name} holds a non-finite value"


def _assert_same(model, before):
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name


def _underflow_scale_to_zero(optimizer, model):
    """Overflowing steps until the scale reaches 0 (about 165 from 2**15)."""
    for _ in range(400):
        if optimizer.dynamic_scale == 0.0:
            return
        optimizer.zero_grad()
        for p in model.parameters():
            p.grad = torch.full_like(p, math.inf)
        optimizer.step()
        assert optimizer.last_step_skipped
    raise AssertionError(f"the scale never reached 0: {optimizer.dynamic_scale}")


@pytest.mark.parametrize("unscale_first", [False, True])
@pytest.mark.parametrize("inner", INNER)
def test_scale_underflowed_to_zero_then_a_normal_step(inner, unscale_first):
    model = _model()
    optimizer = LossScaleOptimizer(INNER[inner](model.parameters()))
    _underflow_scale_to_zero(optimizer, model)
    before = _params(model)
    optimizer.zero_grad()
    optimizer.scale_loss(_loss(model)).backward()  # a loss times 0: zero gradients
    if unscale_first:
        optimizer.unscale_()
    optimizer.step()
    _assert_all_finite(model)
    assert optimizer.last_step_skipped
    _assert_same(model, before)
    for state in optimizer.state.values():  # Adam's moments stay finite too
        for value in state.values():
            if isinstance(value, torch.Tensor):
                assert torch.isfinite(value).all()


@pytest.mark.parametrize("initial_scale", [1e-44, 2.0**-149])
@pytest.mark.parametrize("inner", INNER)
def test_denormal_initial_scale(inner, initial_scale):
    """1 / scale overflows float32 for a denormal scale: whatever the steps do,
    no weight (and no optimizer state) becomes non-finite."""
    model = _model()
    optimizer = LossScaleOptimizer(INNER[inner](model.parameters()), initial_scale=initial_scale)
    for _ in range(3):
        optimizer.zero_grad()
        optimizer.scale_loss(_loss(model)).backward()
        optimizer.step()
        _assert_all_finite(model)
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    assert torch.isfinite(value).all()


@pytest.mark.parametrize("unscale_first", [False, True])
def test_tiny_scale_unscaling_overflows(unscale_first):
    """Scale 1e-30 and gradients that are finite but overflow float32 once
    divided by it: the step is skipped, the weights stay finite."""
    model = _model()
    optimizer = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), initial_scale=1e-30)
    before = _params(model)
    optimizer.zero_grad()
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e10)  # finite; 1e10 / 1e-30 = 1e40 > float32 max
    if unscale_first:
        optimizer.unscale_()
    optimizer.step()
    _assert_all_finite(model)
    assert optimizer.last_step_skipped
    _assert_same(model, before)


@pytest.mark.parametrize("exponent", [-126, -127, -128, -140, -149])
@pytest.mark.parametrize("unscale_first", [False, True])
def test_a_scale_whose_reciprocal_overflows_float32_still_unscales(exponent, unscale_first):
    """Below 2**-126, `1 / scale` is inf in float32: every gradient became
    inf (0 * inf: NaN) and every step was skipped, for good (a run whose
    scale halved 143 times never trained again). Keras divides by the scale:
    the gradients come back as they were, and the step is applied."""
    weight = nn.Parameter(torch.ones(3))
    optimizer = LossScaleOptimizer(torch.optim.SGD([weight], lr=0.5), initial_scale=2.0**exponent)
    optimizer.scale_loss((weight * torch.tensor([1.0, 0.0, 2.0])).sum()).backward()
    if unscale_first:
        optimizer.unscale_()
    optimizer.step()
    assert not optimizer.last_step_skipped
    assert torch.equal(weight.detach(), torch.tensor([0.5, 1.0, 0.0]))


def test_tiny_scale_ordinary_training_stays_finite():
    """initial_scale=1e-30 on an ordinary loss: whatever is applied is finite."""
    model = _model()
    optimizer = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), initial_scale=1e-30)
    for _ in range(5):
        optimizer.zero_grad()
        optimizer.scale_loss(_loss(model)).backward()
        optimizer.step()
        _assert_all_finite(model)


def test_float16_gradients_huge_unscale_skip():
    """float16 parameters (`.half()` model), scale 2**-24: unscaling float16
    gradients by 2**24 overflows float16's 65504; the step must be skipped."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4).half()
    optimizer = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), initial_scale=2**-24
    )
    before = _params(model)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1.0)  # 1 * 2**24 = 1.7e7: inf in float16
    optimizer.step()
    _assert_all_finite(model)
    assert optimizer.last_step_skipped
    _assert_same(model, before)


def test_normal_steps_still_apply():
    """The guard must not skip ordinary steps (this passes today)."""
    model = _model()
    optimizer = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    before = _params(model)
    optimizer.zero_grad()
    optimizer.scale_loss(_loss(model)).backward()
    optimizer.step()
    assert not optimizer.last_step_skipped
    assert optimizer.iterations == 1
    assert any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    _assert_all_finite(model)


@pytest.mark.usefixtures("quiet")
def test_loss_scaling_never_writes_non_finite_values():
    for initial_scale in (1e-44, 1e-30, 2.0**15):
        weight = nn.Parameter(torch.ones(4))
        optimizer = LossScaleOptimizer(
            torch.optim.SGD([weight], lr=0.1), initial_scale=initial_scale
        )
        for step in range(200):
            loss = (weight * (1e30 if step < 150 else 1.0)).sum()
            optimizer.scale_loss(loss).backward()
            optimizer.step()
            optimizer.zero_grad()
            assert torch.isfinite(weight).all(), (initial_scale, step)
