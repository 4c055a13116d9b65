"""The calibration seam (`quantization.calibration`), exercised with the toy
calibrated mode `toyact` (scale from each input channel's mean |x|):
statistics see exactly the inputs each weight sees, block by block, through
the quantized earlier blocks; targets outside the structure are skipped;
a failure or an interrupt part-way leaves the model bit-for-bit unchanged."""

from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

import dtype_policies
from dtype_policies import apply_policy, layers
from dtype_policies.quantization.attach import quantization_of

from .everywhere import quietly
from .toy import TOYACT, MeanAbsolute, ToyActConfig, ToyActScheme, _per_row_int8, registered


@pytest.fixture(autouse=True)
def toyact():
    MeanAbsolute.fail_after, MeanAbsolute.updates = None, 0
    with registered(TOYACT):
        yield
    MeanAbsolute.fail_after, MeanAbsolute.updates = None, 0


def batches(count=3, rows=5, features=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, features, generator=generator) for _ in range(count)]


def blocks_model(count=3, width=16):
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(
            stem=nn.Linear(width, width),
            **{
                f"block{i}": nn.Sequential(nn.Linear(width, width), nn.ReLU()) for i in range(count)
            },
        )
    )


def toy_dequantized(weight, mean):
    q, step = _per_row_int8(weight.detach().float() * mean[None, :])
    return q.float() * step[:, None] / mean[None, :]


def snapshot(model):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {name: id(p) for name, p in model.named_parameters()},
        [m.training for m in model.modules()],
        [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()],
        [quantization_of(m) for m in model.modules()],
        [type(m) for m in model.modules()],
    )


def assert_unchanged(model, before):
    tensors, ids, training, hooks, quantized, classes = before
    after = model.state_dict()
    assert list(after) == list(tensors)
    assert all(torch.equal(after[k], tensors[k]) for k in tensors)
    assert {name: id(p) for name, p in model.named_parameters()} == ids
    assert [m.training for m in model.modules()] == training
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()] == hooks
    assert [quantization_of(m) for m in model.modules()] == quantized
    assert [type(m) for m in model.modules()] == classes


def test_a_layer_calibrates_on_its_own_inputs():
    dense = layers.Dense(8)
    dense.build((None, 16))
    kernel = dense.kernel.detach().clone()
    data = batches()
    dense.quantize("toyact", ToyActConfig(dataset=data))
    rows = torch.cat(data)
    expected_mean = rows.abs().mean(0)
    assert torch.allclose(dense.kernel_toyact_mean, expected_mean, atol=1e-6)
    assert dense.dtype_policy.name == "toyact_from_float32"
    with torch.no_grad():
        out = dense(rows)
    reference = rows @ kernel + dense.bias
    assert float((out - reference).norm() / reference.norm()) < 0.02


def test_blocks_calibrate_one_at_a_time_through_the_quantized_earlier_blocks():
    model = blocks_model()
    data = batches()
    float_blocks = [model.get_submodule(f"block{i}")[0] for i in range(3)]
    weights = [(b.weight.detach().clone(), b.bias.detach().clone()) for b in float_blocks]
    stem_out = [model.stem(x).detach() for x in data]
    config = ToyActConfig(dataset=data, quantization_layer_structure=["block0", "block1", "block2"])
    report = quietly(dtype_policies.quantize, model, config=config)
    assert [p for p, *_ in report.quantized] == ["block0/0", "block1/0", "block2/0"]
    assert report.skipped_by_reason("outside quantization structure") == ["stem"]
    assert quantization_of(model.stem) is None
    inputs = stem_out
    for block, (weight, bias) in zip(float_blocks, weights):
        mean = torch.cat(inputs).abs().mean(0)
        assert torch.allclose(block.weight_toyact_mean, mean, rtol=1e-5, atol=1e-6)
        w = toy_dequantized(weight, block.weight_toyact_mean)
        inputs = [torch.relu(x @ w.t() + bias) for x in inputs]


def test_a_scheme_may_propagate_float_outputs(monkeypatch):
    monkeypatch.setattr(ToyActScheme, "calibrated_on_quantized_outputs", False)
    model = blocks_model(count=2)
    data = batches()
    with torch.no_grad():
        hidden = [model.block0(model.stem(x)) for x in data]
    config = ToyActConfig(
        dataset=data, quantization_layer_structure={"sequential_blocks": ["block0", "block1"]}
    )
    quietly(dtype_policies.quantize, model, config=config)
    expected = torch.cat(hidden).abs().mean(0)
    assert torch.allclose(model.block1[0].weight_toyact_mean, expected, rtol=1e-5, atol=1e-6)


def test_each_block_runs_once_per_batch_for_statistics_and_once_for_the_next_inputs():
    model = blocks_model()
    calls = {name: 0 for name in ("stem", "block0", "block1", "block2")}
    for name in calls:
        model.get_submodule(name).register_forward_hook(
            lambda m, a, o, name=name: calls.__setitem__(name, calls[name] + 1)
        )
    config = ToyActConfig(
        dataset=batches(count=4),
        quantization_layer_structure=[model.block0, model.block1, model.block2],
    )
    quietly(dtype_policies.quantize, model, config=config)
    # the chain check runs the first batch up to the last block once; then the stem runs once
    # per batch (capture); each block's statistics run the first batch to the end and stop
    # the others at the block's last target (no forward hook then); blocks 0-1 then compute
    # the next block's inputs, once per batch
    assert calls == {"stem": 1 + 4, "block0": 1 + 1 + 4, "block1": 1 + 1 + 4, "block2": 1 + 1}


def test_calibration_runs_in_eval_mode_and_restores_the_modes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 8))
    model.train()
    running = model[1].running_mean.clone()
    data = batches()
    with torch.no_grad():
        model.eval()
        hidden = [model[2](model[1](model[0](x))) for x in data]
        model.train()
    quietly(
        dtype_policies.quantize,
        model,
        config=ToyActConfig(dataset=data, quantization_layer_structure=None),
    )
    assert all(m.training for m in model.modules())
    assert torch.equal(model[1].running_mean, running)
    # no dropout while calibrating; the first linear's quantized output feeds the BatchNorm
    assert model[3].weight_toyact_mean.shape == (16,)
    assert torch.isfinite(model[3].weight_toyact_mean).all()
    assert torch.allclose(model[0].weight_toyact_mean, torch.cat(data).abs().mean(0), atol=1e-6)
    del hidden


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("after_updates", [0, 4, 7])
def test_an_interruption_part_way_leaves_the_model_unchanged(failure, after_updates):
    model = blocks_model()
    model.train()
    before = snapshot(model)
    MeanAbsolute.fail_after, MeanAbsolute.failure = after_updates, failure
    config = ToyActConfig(
        dataset=batches(), quantization_layer_structure=["block0", "block1", "block2"]
    )
    with pytest.raises(failure, match="stopped part-way"):
        quietly(dtype_policies.quantize, model, config=config)
    assert_unchanged(model, before)
    MeanAbsolute.fail_after = None
    report = quietly(dtype_policies.quantize, model, config=config)  # and it still works
    assert len(report.quantized) == 3


def test_a_failing_scheme_after_statistics_leaves_the_model_unchanged(monkeypatch):
    model = blocks_model()
    before = snapshot(model)
    seen = []

    def fail_on_third(self, weight, spec, config, statistics):
        seen.append(spec)
        if len(seen) == 3:
            raise RuntimeError("the third weight cannot be quantized")
        return original(self, weight, spec, config, statistics)

    original = ToyActScheme.quantize_calibrated
    monkeypatch.setattr(ToyActScheme, "quantize_calibrated", fail_on_third)
    config = ToyActConfig(
        dataset=batches(), quantization_layer_structure=["block0", "block1", "block2"]
    )
    with pytest.raises(RuntimeError, match="third weight"):
        quietly(dtype_policies.quantize, model, config=config)
    assert_unchanged(model, before)


def test_batches_may_be_argument_tuples_or_keyword_dicts():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.left, self.right = nn.Linear(16, 8), nn.Linear(16, 8)

        def forward(self, a, b=None):
            return self.left(a) + self.right(b)

    data = batches(count=2)
    for dataset in ([(x, 2 * x) for x in data], [{"a": x, "b": 2 * x} for x in data]):
        torch.manual_seed(0)
        model = TwoInputs()
        quietly(dtype_policies.quantize, model, config=ToyActConfig(dataset=dataset))
        expected = torch.cat(data).abs().mean(0)
        assert torch.allclose(model.left.weight_toyact_mean, expected, atol=1e-6)
        assert torch.allclose(model.right.weight_toyact_mean, 2 * expected, atol=1e-6)


class Holder(nn.Module):
    """Holds a block its forward never runs."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(16, 16)
        self.spare = nn.Sequential(nn.Linear(16, 16))

    def forward(self, x):
        return self.used(x)


def test_misuse_is_refused_before_anything_runs():
    model = blocks_model()
    before = snapshot(model)
    with pytest.raises(ValueError, match="must pass a `ToyActConfig`"):
        dtype_policies.quantize(model, "toyact")
    with pytest.raises(ValueError, match="no calibration `dataset`"):
        quietly(dtype_policies.quantize, model, config=ToyActConfig())
    with pytest.raises(ValueError, match="No module at 'nowhere'"):
        quietly(
            dtype_policies.quantize,
            model,
            config=ToyActConfig(batches(), quantization_layer_structure=["nowhere"]),
        )
    with pytest.raises(ValueError, match="must be a module of the model"):
        quietly(
            dtype_policies.quantize,
            model,
            config=ToyActConfig(batches(), quantization_layer_structure=[nn.Linear(2, 2)]),
        )
    holder = Holder()
    held = snapshot(holder)
    with pytest.raises(ValueError, match="never reached the first block"):
        quietly(
            dtype_policies.quantize,
            holder,
            config=ToyActConfig(batches(), quantization_layer_structure=["spare"]),
        )
    assert_unchanged(holder, held)
    assert_unchanged(model, before)


def test_policies_cannot_quantize_a_calibrated_mode_implicitly():
    dense = layers.Dense(8)
    dense.build((None, 16))
    before = snapshot(dense)
    with pytest.raises(ValueError, match="Implicitly enabling TOYACT quantization"):
        dense.dtype_policy = "toyact_from_float32"
    assert dense.dtype_policy.name == "float32"
    assert_unchanged(dense, before)
    model = nn.Sequential(nn.Linear(16, 8))
    before = snapshot(model)
    with pytest.raises(ValueError, match="calibration data"):
        apply_policy(model, "toyact_from_float32")
    assert_unchanged(model, before)
