"""LossScaleOptimizer and maybe_wrap: Keras 3 dynamic loss scaling for torch optimizers."""

import copy
import io
import itertools
import math
import warnings
from unittest import mock

import pytest
import torch
import torch.nn as nn

import dtype_policies
from dtype_policies import CPUFloat16Warning, DTypePolicy, DTypePolicyMap, apply_policy, layers
from dtype_policies.optimizers import LossScaleOptimizer, maybe_wrap

INF = float("inf")


def set_grads(params, grads):
    for param, grad in zip(params, grads):
        param.grad = torch.as_tensor(grad, dtype=param.dtype).clone()


def small_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def batches(count, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(5, 6, generator=generator), torch.randn(5, 2, generator=generator))
        for _ in range(count)
    ]


def mse(model, x, y):
    return (model(x) - y).square().mean()


def assert_same_params(a, b):
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


# ---------------------------------------------------------------- Keras arithmetic


def test_downscaling_from_400_gives_25_after_four_inf_steps():
    weight = nn.Parameter(torch.ones(2))
    optimizer = LossScaleOptimizer(torch.optim.SGD([weight], lr=1.0), initial_scale=400.0)
    for expected in (200.0, 100.0, 50.0, 25.0):
        set_grads([weight], [[INF, 1.0]])
        optimizer.step()
        assert optimizer.dynamic_scale == expected
        assert optimizer.last_step_skipped
    assert optimizer.iterations == 0 and optimizer.step_counter == 0
    assert torch.equal(weight, torch.ones(2))


def test_upscaling_from_2_with_growth_2_gives_32_after_eight_finite_steps():
    weight = nn.Parameter(torch.ones(2))
    optimizer = LossScaleOptimizer(
        torch.optim.SGD([weight], lr=1.0), initial_scale=2.0, dynamic_growth_steps=2
    )
    scales, counters = [], []
    for _ in range(8):
        set_grads([weight], [[0.0, 0.0]])
        optimizer.step()
        scales.append(optimizer.dynamic_scale)
        counters.append(optimizer.step_counter)
    assert scales == [2.0, 4.0, 4.0, 8.0, 8.0, 16.0, 16.0, 32.0]
    assert counters == [1, 0, 1, 0, 1, 0, 1, 0]
    assert optimizer.iterations == 8 and not optimizer.last_step_skipped


def test_nan_resets_the_growth_counter():
    weight = nn.Parameter(torch.ones(1))
    optimizer = LossScaleOptimizer(
        torch.optim.SGD([weight], lr=1.0), initial_scale=8, dynamic_growth_steps=3
    )
    for grad in ([0.0], [0.0], [math.nan], [0.0], [0.0], [0.0]):
        set_grads([weight], [grad])
        optimizer.step()
    assert optimizer.dynamic_scale == 8.0  # 8 -> 4 (NaN) -> 8 after three finite steps
    assert optimizer.iterations == 5


def test_keras_finite_step_sgd():
    # keras/src/optimizers/loss_scale_optimizer_test.py::test_finite_step
    weight = nn.Parameter(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    optimizer = LossScaleOptimizer(torch.optim.SGD([weight], lr=0.5))
    set_grads([weight], [torch.tensor([1.0, 6.0, 7.0, 2.0]) * optimizer.initial_scale])
    optimizer.step()
    assert torch.equal(weight.detach(), torch.tensor([0.5, -1.0, -0.5, 3.0]))
    assert optimizer.iterations == 1


def test_no_lower_bound_and_growth_stops_below_inf():
    weight = nn.Parameter(torch.ones(1))
    optimizer = LossScaleOptimizer(torch.optim.SGD([weight], lr=1.0), initial_scale=2.0**-140)
    for _ in range(20):  # Keras's float32 variable underflows to 0: no lower bound
        set_grads([weight], [[INF]])
        optimizer.step()
    assert optimizer.dynamic_scale == 0.0
    big = LossScaleOptimizer(
        torch.optim.SGD([weight], lr=1.0), initial_scale=2.0**126, dynamic_growth_steps=1
    )
    for _ in range(5):  # gradients exactly 0 (a hinge loss at 0): finite steps
        set_grads([weight], [[0.0]])
        big.step()
    # float32's range as Keras's variable, but never inf (inf / 2 is inf: every
    # later step would be skipped); GradScaler's rule
    assert big.dynamic_scale == 2.0**127 and big.step_counter == 0
    set_grads([weight], [[INF]])
    big.step()
    assert big.dynamic_scale == 2.0**126
    set_grads([weight], [[2.0**126]])
    big.step()
    assert not big.last_step_skipped and weight.item() == 0.0  # 1 - 1.0 * 1


def test_a_failed_inner_step_leaves_the_gradients_unscaled_once():
    """The inner step raised after the gradients were divided: the retry must
    not divide them again (GradScaler keeps the same record)."""

    class FailsOnce(torch.optim.SGD):
        failures = 1

        def step(self, closure=None):
            if FailsOnce.failures:
                FailsOnce.failures -= 1
                raise RuntimeError("inner step failed")
            return super().step(closure)

    weight = nn.Parameter(torch.zeros(2))
    optimizer = LossScaleOptimizer(FailsOnce([weight], lr=1.0), initial_scale=4.0)
    set_grads([weight], [[8.0, -4.0]])
    with pytest.raises(RuntimeError, match="inner step failed"):
        optimizer.step()
    assert weight.grad.tolist() == [2.0, -1.0]  # divided once
    optimizer.step()
    assert weight.grad.tolist() == [2.0, -1.0]  # not again
    assert weight.tolist() == [-2.0, 1.0] and optimizer.iterations == 1
    set_grads([weight], [[4.0, 4.0]])
    optimizer.step()  # the next step unscales its own gradients
    assert weight.tolist() == [-3.0, 0.0]


def test_serialization_as_keras():
    """Keras's `test_serialization`: a config of four keys, and `from_config`
    (a torch inner optimizer is rebuilt on the parameters given)."""
    weight = nn.Parameter(torch.ones(2))
    inner = torch.optim.Adam([weight], lr=0.5, betas=(0.8, 0.9))
    optimizer = LossScaleOptimizer(
        inner, initial_scale=3.0, dynamic_growth_steps=2, name="test_opt"
    )
    config = optimizer.get_config()
    assert len(config) == 4
    assert config["name"] == "test_opt"
    assert config["initial_scale"] == 3.0
    assert config["dynamic_growth_steps"] == 2
    assert config["inner_optimizer"]["class_name"] == "torch.optim.adam.Adam"
    again = LossScaleOptimizer.from_config(config, params=[weight])
    assert type(again.inner_optimizer) is torch.optim.Adam
    assert again.inner_optimizer.defaults == inner.defaults
    assert (again.name, again.initial_scale, again.dynamic_growth_steps) == ("test_opt", 3.0, 2)
    given = LossScaleOptimizer.from_config({**config, "inner_optimizer": inner})
    assert given.inner_optimizer is inner
    assert optimizer.learning_rate == 0.5
    optimizer.learning_rate = 0.25
    assert inner.param_groups[0]["lr"] == 0.25
    with pytest.raises(TypeError, match="needs `params`"):
        LossScaleOptimizer.from_config(config)
    for bad in ("os.system", "torch.nn.Linear", "nowhere.Adam"):
        described = {**config, "inner_optimizer": {"class_name": bad, "config": {}}}
        with pytest.raises(ValueError, match=r"names no torch\.optim\.Optimizer subclass"):
            LossScaleOptimizer.from_config(described, params=[weight])
    with pytest.raises(ValueError, match="'inner_optimizer' must be"):
        LossScaleOptimizer.from_config({**config, "inner_optimizer": "adam"}, params=[weight])
    with pytest.raises(ValueError, match="from_config\\(\\) expects"):
        LossScaleOptimizer.from_config({"name": "x"})


_TORCH_OPTIMIZERS = sorted(
    (
        cls
        for cls in vars(torch.optim).values()
        if isinstance(cls, type)
        and issubclass(cls, torch.optim.Optimizer)
        and cls not in (torch.optim.Optimizer, torch.optim.LBFGS)  # LBFGS: refused
    ),
    key=lambda cls: cls.__name__,
)


@pytest.mark.parametrize("cls", _TORCH_OPTIMIZERS, ids=lambda cls: cls.__name__)
def test_every_torch_optimizer_round_trips_through_its_config_unchanged(cls):
    """AdamW's `defaults` hold `decoupled_weight_decay`, which `AdamW()` refuses;
    wrapping added `differentiable` to the inner optimizer's own `defaults`,
    which SparseAdam and Adafactor refuse: both broke `from_config`."""
    weight = nn.Parameter(torch.ones(3, 2))  # Muon takes matrices only
    inner = cls([weight], lr=0.25)
    defaults = copy.deepcopy(inner.defaults)
    optimizer = LossScaleOptimizer(inner)
    assert inner.defaults == defaults  # wrapping changed nothing of the inner optimizer
    again = LossScaleOptimizer.from_config(optimizer.get_config(), params=[weight])
    assert type(again.inner_optimizer) is cls
    assert again.inner_optimizer.defaults == defaults
    # A copy's inner optimizer is torch's copy (which may add `differentiable`).
    assert copy.deepcopy(optimizer).inner_optimizer.defaults == copy.deepcopy(inner).defaults


def test_a_tensor_learning_rate_stays_one_tensor_per_group():
    """One tensor in every group: a scheduler's in-place update of one group's
    rate (torch's schedulers `fill_` tensor rates) reached every group."""
    first, second = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    optimizer = LossScaleOptimizer(
        torch.optim.SGD([{"params": [first]}, {"params": [second]}], lr=0.1)
    )
    optimizer.learning_rate = torch.tensor(0.1)
    rates = [group["lr"] for group in optimizer.param_groups]
    assert rates[0] is not rates[1] and all(isinstance(r, torch.Tensor) for r in rates)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda e: 1.0, lambda e: 0.01])
    set_grads([first, second], [[1.0, 1.0], [1.0, 1.0]])
    optimizer.scale_loss(torch.tensor(1.0))
    optimizer.step()
    scheduler.step()
    assert [group["lr"].item() for group in optimizer.param_groups] == pytest.approx([0.1, 0.001])
    optimizer.learning_rate = 0.5  # into each group's own tensor
    assert [group["lr"] for group in optimizer.param_groups] == rates
    assert [r.item() for r in rates] == [0.5, 0.5] and rates[0] is not rates[1]


def test_an_optimizer_whose_step_needs_a_closure_is_refused():
    weight = nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match="cannot wrap LBFGS: its step\\(\\) needs a closure"):
        LossScaleOptimizer(torch.optim.LBFGS([weight]))


def test_scale_is_float32_valued():
    optimizer = LossScaleOptimizer(
        torch.optim.SGD([nn.Parameter(torch.ones(1))]), initial_scale=0.1
    )
    assert optimizer.dynamic_scale == torch.tensor(0.1, dtype=torch.float32).item()
    assert isinstance(optimizer.dynamic_scale, float)
    assert optimizer.scale_loss(torch.tensor(10.0)).dtype == torch.float32
    assert optimizer.scale_loss(torch.tensor(1.0, dtype=torch.float16)).dtype == torch.float16


# ---------------------------------------------------------- skipped and finite steps


def test_skipped_step_leaves_params_and_adam_state_bit_identical():
    model = small_model()
    optimizer = LossScaleOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    (x, y), (x2, y2) = batches(2)
    optimizer.scale_loss(mse(model, x, y)).backward()
    optimizer.step()
    optimizer.zero_grad()
    params_before = [p.detach().clone() for p in model.parameters()]
    state_before = copy.deepcopy(optimizer.inner_optimizer.state_dict())
    optimizer.scale_loss(mse(model, x2, y2)).backward()
    first = next(model.parameters())
    first.grad[0, 0] = INF
    optimizer.step()
    assert optimizer.last_step_skipped and optimizer.iterations == 1
    assert optimizer.dynamic_scale == 2.0**14
    for before, after in zip(params_before, model.parameters()):
        assert torch.equal(before, after)
    state_after = optimizer.inner_optimizer.state_dict()["state"]
    assert state_after.keys() == state_before["state"].keys()
    for index, entry in state_before["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[key], state_after[index][key]), (index, key)
        assert state_after[index]["step"].item() == 1.0
    # The gradients are left unscaled, holding the inf, until zero_grad().
    assert first.grad[0, 0].item() == INF
    assert torch.isfinite(first.grad.flatten()[1:]).all()


@pytest.mark.parametrize(
    "make_inner",
    [
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        lambda params: torch.optim.Adam(params, lr=1e-2),
        lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=False),
    ],
    ids=["sgd-momentum", "adam", "adamw-single-tensor"],
)
def test_finite_steps_equal_the_inner_optimizer_on_unscaled_grads(make_inner):
    plain_model, scaled_model = small_model(), small_model()
    plain = make_inner(plain_model.parameters())
    scaled = LossScaleOptimizer(make_inner(scaled_model.parameters()))
    for x, y in batches(4):
        plain.zero_grad()
        mse(plain_model, x, y).backward()
        plain.step()
        scaled.zero_grad()
        scaled.scale_loss(mse(scaled_model, x, y)).backward()
        scaled.step()
        assert not scaled.last_step_skipped
    assert_same_params(plain_model, scaled_model)  # scaling by 2**15 is exact
    assert scaled.iterations == 4 and scaled.dynamic_scale == 2.0**15


def test_step_with_no_gradients_runs_the_inner_step_and_counts_nothing():
    weight = nn.Parameter(torch.ones(2))
    inner = torch.optim.SGD([weight], lr=1.0)
    optimizer = LossScaleOptimizer(inner)
    with mock.patch.object(inner, "step", wraps=inner.step) as step:
        optimizer.step()
    assert step.call_count == 1  # torch's own step skips parameters without gradients
    assert optimizer.iterations == 0 and torch.equal(weight, torch.ones(2))


def test_unscale_and_check_is_one_fused_pass_with_one_sync():
    params = [nn.Parameter(torch.randn(3)) for _ in range(60)]
    params += [nn.Parameter(torch.randn(2, dtype=torch.float64)) for _ in range(5)]
    for param in params:
        param.grad = torch.full_like(param, 4.0)
    originals = [param.detach().clone() for param in params]
    optimizer = LossScaleOptimizer(torch.optim.SGD(params, lr=1.0), initial_scale=4)
    kernel = torch._amp_foreach_non_finite_check_and_unscale_
    item = torch.Tensor.item
    calls = {"kernel": 0, "item": 0}

    def counting_kernel(*args):
        calls["kernel"] += 1
        return kernel(*args)

    def counting_item(self):
        calls["item"] += 1
        return item(self)

    with (
        mock.patch.object(torch, "_amp_foreach_non_finite_check_and_unscale_", counting_kernel),
        mock.patch.object(torch.Tensor, "item", counting_item),
    ):
        optimizer.step()
    assert calls["kernel"] == 2  # one per (device, dtype) group
    assert calls["item"] == 1  # one host sync, not one per parameter
    for param, original in zip(params, originals):
        assert torch.equal(param.grad, torch.ones_like(param))  # unscaled in place
        assert torch.equal(param.detach(), original - 1.0)


def test_float16_and_sparse_gradients_are_unscaled():
    dense = nn.Parameter(torch.zeros(3, dtype=torch.float16))
    embedding = nn.Embedding(4, 2, sparse=True)
    optimizer = LossScaleOptimizer(
        torch.optim.SGD([dense, *embedding.parameters()], lr=1.0), initial_scale=8
    )
    dense.grad = torch.full((3,), 16.0, dtype=torch.float16)
    optimizer.scale_loss(embedding(torch.tensor([1, 1])).sum()).backward()
    before = embedding.weight.detach().clone()
    optimizer.step()
    assert torch.equal(dense.detach(), torch.full((3,), -2.0, dtype=torch.float16))
    expected = before.clone()
    expected[1] -= 2.0
    assert torch.equal(embedding.weight.detach(), expected)


# ------------------------------------------------- unscale_, clipping, accumulation


def test_clipping_after_unscale_matches_plain_clipping():
    plain_model, scaled_model = small_model(), small_model()
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1)
    scaled = LossScaleOptimizer(torch.optim.SGD(scaled_model.parameters(), lr=0.1))
    norms = []
    for x, y in batches(3):
        plain.zero_grad()
        mse(plain_model, x, y).backward()
        plain_norm = nn.utils.clip_grad_norm_(plain_model.parameters(), max_norm=0.05)
        plain.step()
        scaled.zero_grad()
        scaled.scale_loss(mse(scaled_model, x, y)).backward()
        scaled.unscale_()
        norm = nn.utils.clip_grad_norm_(scaled_model.parameters(), max_norm=0.05)
        scaled.step()  # must not unscale a second time
        assert torch.equal(norm, plain_norm)
        norms.append(norm.item())
    assert all(norm > 0.05 for norm in norms)  # the clipping was active
    assert_same_params(plain_model, scaled_model)


def test_unscale_twice_raises_and_step_or_zero_grad_resets():
    weight = nn.Parameter(torch.ones(2))
    optimizer = LossScaleOptimizer(torch.optim.SGD([weight], lr=1.0), initial_scale=4)
    set_grads([weight], [[4.0, 8.0]])
    optimizer.unscale_()
    assert torch.equal(weight.grad, torch.tensor([1.0, 2.0]))
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
        optimizer.unscale_()
    optimizer.step()
    assert torch.equal(weight.detach(), torch.tensor([0.0, -1.0]))
    set_grads([weight], [[4.0, 4.0]])
    optimizer.unscale_()  # allowed again after step()
    optimizer.zero_grad()
    set_grads([weight], [[4.0, 4.0]])
    optimizer.unscale_()  # and after zero_grad()
    assert torch.equal(weight.grad, torch.ones(2))


def test_overflow_found_by_unscale_skips_the_step_even_after_clipping():
    weight = nn.Parameter(torch.ones(2))
    optimizer = LossScaleOptimizer(torch.optim.SGD([weight], lr=1.0), initial_scale=4)
    set_grads([weight], [[INF, 1.0]])
    optimizer.unscale_()
    nn.utils.clip_grad_norm_([weight], max_norm=1.0)  # turns the grads into NaN/0
    optimizer.step()
    assert optimizer.last_step_skipped and optimizer.dynamic_scale == 2.0
    assert torch.equal(weight.detach(), torch.ones(2))


def test_gradient_accumulation_matches_plain_accumulation():
    plain_model, scaled_model = small_model(), small_model()
    plain = torch.optim.Adam(plain_model.parameters(), lr=1e-2)
    scaled = LossScaleOptimizer(torch.optim.Adam(scaled_model.parameters(), lr=1e-2))
    data = batches(8)
    for start in (0, 4):
        plain.zero_grad()
        scaled.zero_grad()
        for x, y in data[start : start + 4]:
            (mse(plain_model, x, y) / 4).backward()
            scaled.scale_loss(mse(scaled_model, x, y) / 4).backward()
        plain.step()
        scaled.step()
    assert scaled.iterations == 2
    assert_same_params(plain_model, scaled_model)


def test_step_closure_raises():
    optimizer = LossScaleOptimizer(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0))
    with pytest.raises(RuntimeError, match="does not take a closure"):
        optimizer.step(lambda: torch.tensor(0.0))


# ------------------------------------------------------------- optimizer protocol


def test_is_an_optimizer_sharing_the_inner_state():
    model = small_model()
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    optimizer = LossScaleOptimizer(inner)
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert optimizer.param_groups is inner.param_groups
    assert optimizer.state is inner.state
    assert optimizer.defaults is inner.defaults
    extra = nn.Parameter(torch.ones(3))
    optimizer.add_param_group({"params": [extra], "lr": 0.5})
    assert len(inner.param_groups) == 2 and inner.param_groups[1]["lr"] == 0.5
    x, y = batches(1)[0]
    optimizer.scale_loss(mse(model, x, y) + extra.sum()).backward()
    optimizer.step()
    assert optimizer.state is inner.state and len(inner.state) == 5
    optimizer.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in [*model.parameters(), extra])
    optimizer.scale_loss(mse(model, x, y)).backward()
    optimizer.zero_grad(set_to_none=False)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    assert repr(optimizer).startswith("LossScaleOptimizer(dynamic_scale=32768.0")
    assert "Adam (" in repr(optimizer)


def test_step_hooks_run_on_the_wrapper():
    optimizer = LossScaleOptimizer(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0))
    seen = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(("pre", opt)))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: seen.append(("post", opt)))
    optimizer.step()
    assert seen == [("pre", optimizer), ("post", optimizer)]


def test_lr_schedulers_attach_and_drive_the_inner_learning_rate():
    model = small_model()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    optimizer = LossScaleOptimizer(inner)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        lrs = []
        for x, y in batches(6):
            optimizer.zero_grad()
            optimizer.scale_loss(mse(model, x, y)).backward()
            optimizer.step()
            scheduler.step()
            lrs.append(inner.param_groups[0]["lr"])
    assert lrs == [1.0, 0.5, 0.5, 0.25, 0.25, 0.125]
    assert scheduler.get_last_lr() == [0.125]
    other = torch.optim.lr_scheduler.LambdaLR(
        LossScaleOptimizer(torch.optim.Adam(model.parameters(), lr=0.1)), lambda epoch: 0.1
    )
    assert other.get_last_lr() == [pytest.approx(0.01)]


def test_state_dict_round_trip_continues_identically():
    model = small_model()
    optimizer = LossScaleOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2), initial_scale=2.0**10, dynamic_growth_steps=3
    )
    data = batches(10)
    for index, (x, y) in enumerate(data[:5]):
        optimizer.zero_grad()
        optimizer.scale_loss(mse(model, x, y)).backward()
        if index == 1:
            next(model.parameters()).grad[0, 0] = INF
        optimizer.step()
    state_dict = optimizer.state_dict()
    assert state_dict["loss_scale"] == {
        "scale": 2.0**10,
        "step_counter": 0,
        "iterations": 4,
        "dynamic_growth_steps": 3,
    }
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": state_dict}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)

    restored_model = small_model(seed=5)
    restored_model.load_state_dict(checkpoint["model"])
    restored = LossScaleOptimizer(torch.optim.Adam(restored_model.parameters(), lr=0.5))
    restored.load_state_dict(checkpoint["optimizer"])
    assert restored.dynamic_scale == 2.0**10 and restored.iterations == 4
    assert restored.dynamic_growth_steps == 3
    assert restored.param_groups[0]["lr"] == 1e-2
    for opt, mod in ((optimizer, model), (restored, restored_model)):
        for x, y in data[5:]:
            opt.zero_grad()
            opt.scale_loss(mse(mod, x, y)).backward()
            opt.step()
    assert_same_params(model, restored_model)
    assert restored.state_dict()["loss_scale"] == optimizer.state_dict()["loss_scale"]
    assert restored.dynamic_scale == 2.0**11 and restored.iterations == 9  # grew once

    # A plain optimizer reads the checkpoint, and a plain checkpoint loads into the wrapper.
    plain = torch.optim.Adam(small_model().parameters())
    plain.load_state_dict(checkpoint["optimizer"])
    assert plain.param_groups[0]["lr"] == 1e-2
    wrapper = LossScaleOptimizer(torch.optim.Adam(small_model().parameters()), initial_scale=4)
    wrapper.load_state_dict(plain.state_dict())
    assert wrapper.dynamic_scale == 4.0 and wrapper.param_groups[0]["lr"] == 1e-2


def test_load_state_dict_rejects_a_bad_loss_scale_entry():
    optimizer = LossScaleOptimizer(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0))
    state_dict = optimizer.state_dict()
    for bad in (
        {"scale": -1.0, "step_counter": 0, "iterations": 0, "dynamic_growth_steps": 2},
        {"scale": 2.0, "step_counter": -1, "iterations": 0, "dynamic_growth_steps": 2},
        {"scale": 2.0, "step_counter": 2, "iterations": 0, "dynamic_growth_steps": 2},
        {"scale": 2.0, "step_counter": 0, "iterations": 0, "dynamic_growth_steps": 0},
        {"scale": 2.0},
        3.0,
    ):
        with pytest.raises((ValueError, TypeError), match=r"scale|step_counter|growth"):
            optimizer.load_state_dict({**state_dict, "loss_scale": bad})
    assert optimizer.dynamic_scale == 2.0**15
    with pytest.raises(TypeError, match="expects a dict"):
        optimizer.load_state_dict([1, 2])


def test_deepcopy_and_pickle():
    model = small_model()
    optimizer = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), initial_scale=8)
    clone = copy.deepcopy(optimizer)
    assert clone.dynamic_scale == 8.0 and clone.inner_optimizer is not optimizer.inner_optimizer
    assert clone.param_groups is clone.inner_optimizer.param_groups
    for param in clone.inner_optimizer.param_groups[0]["params"]:
        param.grad = torch.ones_like(param)
    clone.step()
    assert clone.iterations == 1 and optimizer.iterations == 0


# --------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"initial_scale": 0}, ValueError, r"initial_scale=0\b"),
        ({"initial_scale": -2.0}, ValueError, "finite positive"),
        ({"initial_scale": INF}, ValueError, "initial_scale=inf"),
        ({"initial_scale": math.nan}, ValueError, "initial_scale=nan"),
        ({"initial_scale": 1e39}, ValueError, "float32"),
        ({"initial_scale": "2"}, TypeError, "of type str"),
        ({"initial_scale": True}, TypeError, "of type bool"),
        ({"dynamic_growth_steps": 0}, ValueError, "dynamic_growth_steps=0"),
        ({"dynamic_growth_steps": 1.5}, TypeError, "of type float"),
        ({"dynamic_growth_steps": True}, TypeError, "of type bool"),
        ({"dynamic_growth_steps": "10"}, TypeError, "of type str"),
        ({"initial_scale": 10**400}, ValueError, "representable in float32"),
        ({"name": 3}, TypeError, "name=3"),
        (
            {"dynamic": False},
            ValueError,
            r"LossScaleOptimizer no longer supports `dynamic=False`\. Instead, simply set "
            r"`loss_scale_factor` directly on the `inner_optimizer`\.",
        ),
        ({"dynamic": 0}, ValueError, r"no longer supports `dynamic=False`"),  # Keras: `not`
        (
            {"clipnorm": 1.0},
            ValueError,
            r"LossScaleOptimizer does not support `clipnorm`\. Instead, set `clipnorm` on "
            r"the `inner_optimizer`\. With torch optimizers, call `unscale_\(\)`",
        ),
        ({"weight_decay": 0.1}, ValueError, "does not support `weight_decay`"),
        ({"use_ema": True}, ValueError, "does not support `use_ema`"),
        (
            {"foo": 1, "bar": 2},
            ValueError,
            r"LossScaleOptimizer does not support arguments: `foo`, `bar`\.",
        ),
    ],
)
def test_argument_errors(kwargs, error, match):
    inner = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0)
    with pytest.raises(error, match=match):
        LossScaleOptimizer(inner, **kwargs)


def test_keras_compatible_arguments_are_accepted_at_defaults():
    inner = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0)
    optimizer = LossScaleOptimizer(
        inner,
        initial_scale=128,
        dynamic_growth_steps=10,
        name="lso",
        dynamic=True,
        weight_decay=None,
        clipnorm=None,
        use_ema=False,
        ema_momentum=0.99,
        gradient_accumulation_steps=None,
    )
    assert (optimizer.name, optimizer.initial_scale, optimizer.dynamic_growth_steps) == (
        "lso",
        128.0,
        10,
    )


def test_inner_optimizer_errors():
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer.*of type Linear"):
        LossScaleOptimizer(nn.Linear(2, 2))
    wrapped = LossScaleOptimizer(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0))
    with pytest.raises(ValueError, match="already a LossScaleOptimizer"):
        LossScaleOptimizer(wrapped)


# --------------------------------------------------------------------- maybe_wrap


def test_maybe_wrap_by_policy():
    def sgd():
        return torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0)

    assert isinstance(maybe_wrap(sgd(), "mixed_float16"), LossScaleOptimizer)
    assert isinstance(maybe_wrap(sgd(), DTypePolicy("mixed_float16")), LossScaleOptimizer)
    assert isinstance(
        maybe_wrap(sgd(), DTypePolicyMap(default_policy="mixed_float16")), LossScaleOptimizer
    )
    for policy in ("mixed_bfloat16", "float32", "float16", "float8_from_mixed_bfloat16", None):
        optimizer = sgd()
        assert maybe_wrap(optimizer, policy) is optimizer, policy
    with dtype_policies.policy_scope("mixed_float16"):
        assert isinstance(maybe_wrap(sgd(), None), LossScaleOptimizer)
    wrapped = LossScaleOptimizer(sgd())
    assert maybe_wrap(wrapped, "mixed_float16") is wrapped
    with pytest.raises(TypeError, match=r"expects a torch\.optim\.Optimizer"):
        maybe_wrap("sgd", "mixed_float16")
    with pytest.raises(TypeError, match=r"expects a torch\.nn\.Module"):
        maybe_wrap(sgd(), 16)


def test_maybe_wrap_by_module():
    dense = layers.Dense(3, dtype="mixed_float16")
    dense.build((1, 2))
    optimizer = maybe_wrap(torch.optim.SGD(dense.parameters(), lr=1.0), dense)
    assert isinstance(optimizer, LossScaleOptimizer)
    bf16 = layers.Dense(3, dtype="mixed_bfloat16")
    bf16.build((1, 2))
    plain = torch.optim.SGD(bf16.parameters(), lr=1.0)
    assert maybe_wrap(plain, bf16) is plain

    model = small_model()
    plain = torch.optim.SGD(model.parameters(), lr=1.0)
    assert maybe_wrap(plain, model) is plain  # no policy: the default (float32) decides
    with dtype_policies.policy_scope("mixed_float16"):
        assert isinstance(maybe_wrap(plain, model), LossScaleOptimizer)
    handle = apply_policy(model, "mixed_float16")
    assert isinstance(maybe_wrap(plain, model), LossScaleOptimizer)
    handle.remove()
    apply_policy(model, "mixed_bfloat16")
    assert maybe_wrap(plain, model) is plain


# ------------------------------------------------------ float16 underflow demo (CPU)


def _float16_run(scaled: bool, steps: int = 6):
    """Trains a tiny model whose forward computes in float16 on a loss weighted
    by 1e-8: its float16 gradients underflow to zero unless the loss is scaled."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    apply_policy(model, "mixed_float16")
    inner = torch.optim.SGD(model.parameters(), lr=0.1 / 1e-8)
    optimizer = maybe_wrap(inner, model) if scaled else inner
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=generator)
    y = torch.randn(16, 1, generator=generator)
    losses, grads = [], None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPUFloat16Warning)
        for _ in range(steps):
            optimizer.zero_grad()
            output = model(x)
            assert output.dtype == torch.float16
            loss = (output.float() - y).square().mean()
            losses.append(loss.item())
            weighted = loss * 1e-8
            if scaled:
                optimizer.scale_loss(weighted).backward()
            else:
                weighted.backward()
            if grads is None:
                grads = [p.grad.clone() for p in model.parameters()]
            optimizer.step()
    return model, optimizer, losses, grads


def test_float16_gradients_underflow_without_loss_scaling():
    model, _, losses, grads = _float16_run(scaled=False)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(g.dtype == torch.float32 for g in grads)
    assert all(torch.count_nonzero(g) == 0 for g in grads)  # everything underflowed
    assert losses[-1] == losses[0]  # nothing was learned


def test_loss_scaling_prevents_float16_underflow():
    _, optimizer, losses, grads = _float16_run(scaled=True)
    assert isinstance(optimizer, LossScaleOptimizer)
    assert all(g.dtype == torch.float32 for g in grads)
    # The first gradients, before step() unscales them: float16 values times 2**15.
    # Every parameter gets some, and (almost) no entry underflows any more.
    assert all(torch.count_nonzero(g) > 0 for g in grads)
    nonzero = sum(int(torch.count_nonzero(g)) for g in grads)
    assert nonzero >= 0.95 * sum(g.numel() for g in grads)
    assert optimizer.iterations == 6 and optimizer.dynamic_scale == 2.0**15
    assert losses[-1] < 0.9 * losses[0]
    assert all(b < a for a, b in itertools.pairwise(losses))


def test_a_state_dict_at_a_scale_of_zero_or_inf_reloads():
    """0 is a state a run reaches (skipped steps halve the scale to it); inf
    one that Keras's growth and this library's before 2026-12-03 reached, so
    a checkpoint may hold it: it loads, and the next overflow halves it from
    float32's largest value instead of staying inf."""
    weight = nn.Parameter(torch.ones(1))
    optimizer = LossScaleOptimizer(torch.optim.SGD([weight], lr=0.0), initial_scale=2.0**126)
    for _ in range(300):
        set_grads([weight], [[INF]])
        optimizer.step()
    assert optimizer.dynamic_scale == 0.0
    state = optimizer.state_dict()
    again = LossScaleOptimizer(torch.optim.SGD([weight], lr=0.0))
    again.load_state_dict(state)
    assert again.dynamic_scale == 0.0
    again.load_state_dict({**state, "loss_scale": {**state["loss_scale"], "scale": INF}})
    assert again.dynamic_scale == INF
    set_grads([weight], [[INF]])
    again.step()
    assert again.dynamic_scale == 2.0**127 and again.last_step_skipped
    with pytest.raises(ValueError, match=r"loss_scale\['scale'\] must be a number >= 0"):
        again.load_state_dict({**state, "loss_scale": {**state["loss_scale"], "scale": -1.0}})


def test_a_step_without_any_gradient_applies_and_counts_nothing():
    weight = nn.Parameter(torch.ones(2))
    optimizer = LossScaleOptimizer(
        torch.optim.SGD([weight], lr=1.0), initial_scale=4.0, dynamic_growth_steps=2
    )
    for _ in range(4):
        optimizer.zero_grad()
        optimizer.step()
    assert optimizer.iterations == 0 and optimizer.dynamic_scale == 4.0
    assert optimizer.step_counter == 0 and not optimizer.last_step_skipped
    assert torch.equal(weight.detach(), torch.ones(2))


def test_complex_gradients_are_unscaled_and_checked():
    real = nn.Parameter(torch.ones(2))
    complex_ = nn.Parameter(torch.ones(2, dtype=torch.complex64))
    optimizer = LossScaleOptimizer(torch.optim.SGD([complex_, real], lr=0.5), initial_scale=4.0)
    real.grad = torch.full((2,), 4.0)
    complex_.grad = torch.full((2,), 4.0 + 8.0j, dtype=torch.complex64)
    optimizer.step()
    assert torch.equal(complex_.grad, torch.full((2,), 1.0 + 2.0j, dtype=torch.complex64))
    assert torch.equal(real.detach(), torch.full((2,), 0.5))
    complex_.grad = torch.full((2,), complex(float("inf"), 0.0), dtype=torch.complex64)
    real.grad = torch.zeros(2)
    optimizer.step()
    assert optimizer.last_step_skipped and optimizer.dynamic_scale == 2.0


def test_gradients_that_cannot_be_written_in_place_are_unscaled_as_copies():
    """An expanded gradient (`torch.autograd.grad` of `p.sum()`: stride 0)
    and a lazily conjugated complex one: the fused in-place unscale raised
    part-way, after dividing the gradients before them, and a retried step
    divided those again. Plain SGD steps with such gradients; so does this."""
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(3, 3))
    b = nn.Parameter(torch.randn(4))
    c = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    coefficients = torch.randn(3, 3)
    plain = [p.detach().clone() for p in (a, b, c)]
    optimizer = LossScaleOptimizer(torch.optim.SGD([a, b, c], lr=0.1), initial_scale=8.0)
    loss = (a * coefficients).sum() + b.sum() + (c.conj() * (1 + 2j)).real.sum()
    grads = torch.autograd.grad(optimizer.scale_loss(loss), [a, b, c])
    assert grads[1].stride() == (0,) and grads[2].is_conj()
    expected = [g.resolve_conj() / 8.0 for g in grads]
    a.grad, b.grad, c.grad = grads
    optimizer.step()
    for parameter, before, grad in zip((a, b, c), plain, expected):
        torch.testing.assert_close(parameter.detach(), before - 0.1 * grad, atol=1e-6, rtol=0)
    assert not optimizer.last_step_skipped


@pytest.mark.parametrize("sharing", ["one tensor", "overlapping views", "disjoint views"])
def test_a_gradient_tensor_several_parameters_share_is_unscaled_once(sharing):
    """`torch.autograd.grad` of `((p + q) * x).sum()` returns one tensor for
    both; set by hand, it was unscaled once per parameter (divided by the
    scale squared), as were the common elements of overlapping views.
    Disjoint views of one buffer (DDP's bucket views) stay views."""
    p, q = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
    optimizer = LossScaleOptimizer(torch.optim.SGD([p, q], lr=1.0), initial_scale=8.0)
    if sharing == "one tensor":
        x = torch.tensor([1.0, 2.0, 3.0])
        p.grad, q.grad = torch.autograd.grad(optimizer.scale_loss(((p + q) * x).sum()), [p, q])
        assert p.grad is q.grad
        expected_p = expected_q = -x
    else:
        buffer = torch.arange(1.0, 7.0) * 8.0
        if sharing == "overlapping views":
            p.grad, q.grad = buffer[0:3], buffer[2:5]
            expected_p, expected_q = -torch.tensor([1.0, 2, 3]), -torch.tensor([3.0, 4, 5])
        else:
            p.grad, q.grad = buffer[0:3], buffer[3:6]
            expected_p, expected_q = -torch.tensor([1.0, 2, 3]), -torch.tensor([4.0, 5, 6])
    optimizer.step()
    assert torch.equal(p.detach(), expected_p) and torch.equal(q.detach(), expected_q)
    if sharing == "disjoint views":
        assert p.grad.data_ptr() == buffer.data_ptr()  # unscaled in place, still the views


@pytest.mark.parametrize("seed", range(5))
def test_views_of_one_flat_gradient_buffer_in_any_order_are_each_unscaled_once(seed):
    """Gradients that are views of one flat buffer (a contiguous gradient
    buffer, DDP's bucket views), set in a shuffled order, some repeated or
    overlapping their neighbours: each element is unscaled exactly once
    (the check is by sorted spans since 2026-12-06; it was quadratic)."""
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 5, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    buffer = torch.arange(1.0, 1.0 + sum(sizes)) * 4.0
    views = [(o, n) for o, n in zip(offsets, sizes)]
    views += [views[3], (offsets[10] + 1, sizes[10] + sizes[11])]  # the same; overlapping
    order = torch.randperm(len(views), generator=generator).tolist()
    parameters = [nn.Parameter(torch.zeros(views[i][1])) for i in order]
    for parameter, i in zip(parameters, order):
        start, size = views[i]
        parameter.grad = buffer[start : start + size]
    optimizer = LossScaleOptimizer(torch.optim.SGD(parameters, lr=1.0), initial_scale=4.0)
    optimizer.step()
    assert torch.equal(buffer, torch.arange(1.0, 1.0 + sum(sizes)))
    for parameter, i in zip(parameters, order):
        start, size = views[i]
        assert torch.equal(parameter.detach(), -torch.arange(1.0 + start, 1.0 + start + size))


def test_a_compiled_training_step_with_the_step_inside_compiles_each_frame_once():
    """`torch.compile` of zero_grad, forward, backward and `step()`: the
    overlap check of the gradients (storage addresses, strides) was traced,
    and each parameter's shape recompiled its frame until Dynamo's recompile
    limit. The unscaling runs eagerly; the values are eager's."""
    import logging

    limit_hit = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "_limit" in record.getMessage():  # recompile_limit (cache_size_limit on 2.6)
                limit_hit.append(record.getMessage())

    recorder = Recorder()
    dynamo_logger = logging.getLogger("torch._dynamo")
    dynamo_logger.addHandler(recorder)
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    try:
        with config.patch(**{name: 4}):
            compiled = _three_steps(compiled=True)
    finally:
        dynamo_logger.removeHandler(recorder)
    assert not limit_hit
    torch.testing.assert_close(compiled, _three_steps(compiled=False))


def test_an_optimizer_unpickled_in_a_fresh_process_unscales_eagerly_when_compiled(tmp_path):
    """The unscaling is made eager (`torch.compiler.disable`) when the first
    optimizer is made; an optimizer unpickled in a fresh process was never
    made there, and its compiled step recompiled per parameter shape."""
    import pickle
    import subprocess
    import sys

    optimizer = LossScaleOptimizer(torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1))
    path = tmp_path / "optimizer.pkl"
    path.write_bytes(pickle.dumps(optimizer))
    code = (
        "import pickle, sys; from dtype_policies.optimizers import LossScaleOptimizer; "
        f"pickle.loads(open({str(path)!r}, 'rb').read()); "
        "print(hasattr(LossScaleOptimizer._unscale_grads, '_torchdynamo_orig_callable'))"
    )
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert output.stdout.strip() == "True", output.stderr


def _three_steps(compiled: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 12), nn.Linear(12, 3))
    optimizer = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 12), torch.randn(8, 3)

    def step():
        optimizer.zero_grad()
        loss = (model(x) - y).square().mean()
        optimizer.scale_loss(loss).backward()
        optimizer.step()
        return loss.detach()

    run = torch.compile(step, backend="eager") if compiled else step
    losses = torch.stack([run() for _ in range(3)])
    assert optimizer.iterations == 3
    return losses


def test_scale_loss_called_inside_a_compiled_function_counts_as_called():
    """Dynamo drops attribute writes on an optimizer: a compiled
    forward-backward that scaled its loss left the flag unset, and step()
    warned that the loss was never scaled."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), initial_scale=64.0)

    @torch.compile(backend="eager")
    def forward_backward(x):
        optimizer.scale_loss(model(x).square().mean()).backward()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            optimizer.zero_grad()
            forward_backward(torch.randn(8, 4))
            optimizer.step()
    assert not [w for w in caught if "scale_loss() was not called" in str(w.message)]
    assert optimizer.iterations == 2


def test_a_step_after_backward_on_the_unscaled_loss_warns_once():
    """A loop that never calls scale_loss (Hugging Face's Trainer calls
    `backward()` on the loss itself) would train on gradients divided by the
    scale: said once; a loop that scales says nothing."""

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = LossScaleOptimizer(torch.optim.SGD([weight], lr=0.1), initial_scale=1024)
    with pytest.warns(UserWarning, match=r"scale_loss\(\) was not called since the last step"):
        (weight.square().sum()).backward()
        optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.zero_grad()
        weight.square().sum().backward()
        optimizer.step()  # once per optimizer
        optimizer.zero_grad()
        optimizer.scale_loss(weight.square().sum()).backward()
        optimizer.step()


def test_torch_checkpoint_helpers_state_creating_step_is_no_update():
    """`get_optimizer_state_dict` steps an optimizer without state (plain SGD,
    always) with zero gradients and learning rates set to 0: that counted as
    an iteration and as growth (the scale doubled twice as fast with a
    checkpoint per step) and used up the unscaled-loss warning."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), initial_scale=2.0, dynamic_growth_steps=2
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the helper's step warns of nothing
        for _ in range(4):
            optimizer.scale_loss(model(torch.randn(3, 4)).square().mean()).backward()
            optimizer.step()
            optimizer.zero_grad()
            get_optimizer_state_dict(model, optimizer)
    assert optimizer.iterations == 4
    assert optimizer.dynamic_scale == 8.0  # two growths in four updates
    assert all(p.grad is None for p in model.parameters())


def test_a_step_with_zero_learning_rates_after_a_scaled_loss_still_counts():
    weight = nn.Parameter(torch.ones(2))
    optimizer = LossScaleOptimizer(torch.optim.SGD([weight], lr=0.0), initial_scale=4.0)
    optimizer.scale_loss((weight * 0.0).sum()).backward()  # zero gradients, a scaled loss
    optimizer.step()
    assert optimizer.iterations == 1


def test_load_state_dict_between_unscale_and_step_keeps_the_unscale():
    weight = nn.Parameter(torch.zeros(1))
    optimizer = LossScaleOptimizer(torch.optim.SGD([weight], lr=1.0), initial_scale=8.0)
    saved = optimizer.state_dict()
    optimizer.scale_loss((weight - 1.0).sum()).backward()
    optimizer.unscale_()
    optimizer.load_state_dict(saved)
    optimizer.step()
    assert weight.item() == -1.0  # the gradient 1, divided once

    weight.grad = torch.full((1,), math.inf)
    optimizer.unscale_()
    torch.nn.utils.clip_grad_value_([weight], 1.0)  # the inf is gone from the gradient
    optimizer.load_state_dict(optimizer.state_dict())
    optimizer.step()
    assert optimizer.last_step_skipped and weight.item() == -1.0


def test_a_grad_scaler_state_is_refused_by_name_and_changes_nothing():
    weight = nn.Parameter(torch.zeros(1))
    optimizer = LossScaleOptimizer(torch.optim.SGD([weight], lr=1.0), initial_scale=8.0)
    before = optimizer.state_dict()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # creates its state
    with pytest.raises(ValueError, match=r"GradScaler's.*Nothing was changed"):
        optimizer.load_state_dict(scaler.state_dict())
    with pytest.raises(ValueError, match=r"keys \['loss_scale'\]"):
        optimizer.load_state_dict({"loss_scale": before["loss_scale"]})
    assert optimizer.state_dict() == before


def test_a_config_holds_copies_of_tensor_hyperparameters():
    weight = nn.Parameter(torch.zeros(1))
    optimizer = LossScaleOptimizer(
        torch.optim.Adam(
            [weight], lr=torch.tensor(0.01), betas=(torch.tensor(0.9), torch.tensor(0.999))
        )
    )
    config = optimizer.get_config()
    again = LossScaleOptimizer.from_config(config, params=[nn.Parameter(torch.zeros(1))])
    assert again.param_groups[0]["lr"] is not optimizer.param_groups[0]["lr"]
    again.param_groups[0]["lr"].fill_(1e-5)  # a scheduler on the copy
    assert optimizer.param_groups[0]["lr"].item() == pytest.approx(0.01)
    assert config["inner_optimizer"]["config"]["lr"].item() == pytest.approx(0.01)
    assert config["inner_optimizer"]["config"]["betas"][0] is not optimizer.defaults["betas"][0]


@pytest.mark.parametrize("policy", ["float8_from_mixed_float16", "int4_from_mixed_float16"])
def test_maybe_wrap_judges_a_quantized_policy_by_its_source(policy):
    """A Dense of the policy, the policy itself and an `apply_policy` model
    of it all compute in float16: all three wrap (one path did, two not)."""
    dense = layers.Dense(4, dtype=policy)
    dense.build((None, 4))
    model = nn.Sequential(nn.Linear(4, 4))
    apply_policy(model, policy)
    for judged in (dense, policy, model):
        wrapped = maybe_wrap(torch.optim.SGD(dense.parameters(), lr=0.1), judged)
        assert isinstance(wrapped, LossScaleOptimizer), judged
    assert not isinstance(
        maybe_wrap(torch.optim.SGD(dense.parameters()), "int8_from_mixed_bfloat16"),
        LossScaleOptimizer,
    )


def test_maybe_wrap_sees_through_data_parallel_and_compile_wrappers():
    model = nn.Sequential(nn.Linear(4, 4))
    apply_policy(model, "mixed_float16")
    for wrapper in (
        nn.DataParallel(model),
        torch.compile(model),
        torch.compile(nn.DataParallel(model)),  # compile outside the replication
        nn.DataParallel(torch.compile(model)),
    ):
        wrapped = maybe_wrap(torch.optim.SGD(model.parameters()), wrapper)
        assert isinstance(wrapped, LossScaleOptimizer), wrapper
