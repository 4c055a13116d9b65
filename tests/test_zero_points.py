"""Refined grouped int4 zero points (HQQ's solver): the format is min/max's
(codes consistent with the stored grid, steps unchanged), each chunk's mean
absolute error never rises and its l0.7 error falls on heavy-tailed weights,
grids that already fit (Q4_1 blocks, constants) are kept exactly, and the
setting is on by default, serialized when off, and refuses bad values."""

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from dtype_policies import quantize
from dtype_policies.quantization import Int4QuantizationConfig
from dtype_policies.quantizers import (
    dequantize_grouped,
    grouped_quantize_with_zero_point,
    refine_zero_points,
)

NO_QUANTIZERS = {"weight_quantizer": None, "activation_quantizer": None}  # Keras writes them


def _heavy_tailed(rows, columns, seed, scale=0.02):
    """Student-t(3) values, the shape of trained weights' tails."""
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(rows, columns, generator=generator)
    chi = torch.randn(3, rows, columns, generator=generator).pow(2).sum(0)
    return normal / (chi / 3).sqrt() * scale


def _errors(w, q, scale, zero, block_size):
    missed = (dequantize_grouped(q, scale, zero, block_size).double() - w.double()).abs()
    return float(missed.mean()), float(missed.pow(0.7).mean())


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 90),
    st.integers(1, 20),
    st.sampled_from([1, 3, 16, 32, 64]),
    st.sampled_from([1e-6, 0.02, 30.0]),
    st.integers(0, 2**31 - 1),
)
def test_format_and_the_mean_error_never_rises(rows, columns, block_size, magnitude, seed):
    w = _heavy_tailed(rows, columns, seed, magnitude)
    q, scale, zero = grouped_quantize_with_zero_point(w, block_size)
    new_q, new_zero = refine_zero_points(w, q, scale, zero, block_size)
    assert new_q.shape == q.shape and new_q.dtype == torch.int8
    assert new_zero.shape == zero.shape and new_zero.dtype == torch.float32
    assert int(new_q.min()) >= -8 and int(new_q.max()) <= 7
    assert bool(torch.isfinite(new_zero).all())
    # The codes are the stored grid's own rounding of the weights.
    groups = torch.arange(rows) // block_size
    expected = torch.round(w / scale[groups] + new_zero[groups]).clamp(-8, 7)
    assert torch.equal(new_q.float(), expected)
    before, _ = _errors(w, q, scale, zero, block_size)
    after, _ = _errors(w, new_q, scale, new_zero, block_size)
    assert after <= before * (1 + 1e-5) + 1e-12 * magnitude


@pytest.mark.parametrize("block_size", [32, 64, 128])
def test_the_lp_error_falls_on_heavy_tailed_weights(block_size):
    w = _heavy_tailed(576, 96, seed=block_size)
    q, scale, zero = grouped_quantize_with_zero_point(w, block_size)
    new_q, new_zero = refine_zero_points(w, q, scale, zero, block_size)
    mean_before, lp_before = _errors(w, q, scale, zero, block_size)
    mean_after, lp_after = _errors(w, new_q, scale, new_zero, block_size)
    assert lp_after < 0.99 * lp_before
    assert mean_after < mean_before
    assert not torch.equal(new_zero, zero)


def test_grids_that_already_fit_are_kept_exactly():
    generator = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (96, 8), generator=generator).float()
    codes[0::32], codes[1::32] = 0.0, 15.0  # each block spans its whole grid
    step = torch.rand(3, 8, generator=generator) * 0.01 + 1e-3
    low = -torch.rand(3, 8, generator=generator) * 0.05
    q41 = codes * step.repeat_interleave(32, 0) + low.repeat_interleave(32, 0)  # Q4_1 blocks
    constant = torch.full((32, 8), 0.25)
    for w, block_size in ((q41, 32), (constant, 32)):
        q, scale, zero = grouped_quantize_with_zero_point(w, block_size)
        new_q, new_zero = refine_zero_points(w, q, scale, zero, block_size)
        assert torch.equal(new_q, q) and torch.equal(new_zero, zero)
        restored = dequantize_grouped(new_q, scale, new_zero, block_size)
        torch.testing.assert_close(restored, w, rtol=0, atol=1e-6)


def test_argument_errors_name_the_value():
    w = torch.randn(8, 2)
    q, scale, zero = grouped_quantize_with_zero_point(w, 4)
    with pytest.raises(ValueError, match=r"block_size.*Received: 0"):
        refine_zero_points(w, q, scale, zero, 0)
    with pytest.raises(ValueError, match=r"lp_norm=1\.5"):
        refine_zero_points(w, q, scale, zero, 4, lp_norm=1.5)
    with pytest.raises(ValueError, match="iterations=-1"):
        refine_zero_points(w, q, scale, zero, 4, iterations=-1)
    untouched_q, untouched_zero = refine_zero_points(w, q, scale, zero, 4, iterations=0)
    assert torch.equal(untouched_q, q) and torch.equal(untouched_zero, zero)


def test_the_setting_is_on_by_default_and_serialized_when_off():
    assert Int4QuantizationConfig().refine_zero_points is True
    assert Int4QuantizationConfig().get_config() == {
        **NO_QUANTIZERS,
        "block_size": 128,
    }  # Keras's keys
    off = Int4QuantizationConfig(block_size=64, refine_zero_points=False)
    assert off.get_config() == {**NO_QUANTIZERS, "block_size": 64, "refine_zero_points": False}
    assert Int4QuantizationConfig.from_config(off.get_config()).refine_zero_points is False
    assert off == Int4QuantizationConfig(block_size=64)  # same stored format
    with pytest.raises(ValueError, match="refine_zero_points='no'"):
        Int4QuantizationConfig(refine_zero_points="no")


def test_quantize_refines_by_default_and_lowers_the_output_error():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(192, 384), nn.GELU(), nn.Linear(384, 96))
    with torch.no_grad():
        for layer in (reference[0], reference[2]):
            layer.weight.copy_(_heavy_tailed(*layer.weight.shape, seed=layer.in_features))
    batch = torch.randn(64, 192, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(batch)
    errors = {}
    for refine in (True, False):
        model = nn.Sequential(nn.Linear(192, 384), nn.GELU(), nn.Linear(384, 96))
        model.load_state_dict(reference.state_dict())
        config = Int4QuantizationConfig(block_size=64, refine_zero_points=refine)
        quantize(model, "int4", config)
        zero = model[0].weight_zero
        assert bool((zero != zero.round()).any()) is refine  # refined zeros are real-valued
        with torch.no_grad():
            errors[refine] = float((model(batch) - expected).norm() / expected.norm())
    assert errors[True] < errors[False]


@pytest.mark.parametrize(
    "settings",
    [{}, {"refine_zero_points": False}, {"scale_search": True}],
    ids=["default", "min/max", "scale search"],
)
def test_finite_weights_whose_range_exceeds_float32_stay_finite(settings):
    """A group holding -3e38 and 3e38 (finite) got `max - min` = inf: an
    infinite step, NaN weights and NaN outputs, without an error."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 4)
    big = torch.finfo(torch.float32).max
    with torch.no_grad():
        layer.weight[0, 5], layer.weight[0, 6] = 3e38, -3e38
        # a range that is not symmetric: the rounded zero point moved the grid past it
        layer.weight[1, 5], layer.weight[1, 6] = -big, 0.9 * big
    weight = layer.weight.detach().clone()
    quantize(layer, "int4", Int4QuantizationConfig(block_size=32, **settings))
    stored = layer.weight.detach()
    assert bool(torch.isfinite(stored).all()) and bool(torch.isfinite(layer.weight_scale).all())
    # the extremes are (near) grid values
    assert float(stored[0, 5]) == pytest.approx(3e38, rel=0.1)
    assert float(stored[0, 6]) == pytest.approx(-3e38, rel=0.1)
    assert float(stored[1, 5]) < -0.8 * big and float(stored[1, 6]) > 0.8 * big
    assert (stored[2:] - weight[2:]).abs().max() < 0.02  # the other rows as usual
    x = torch.zeros(2, 64)
    x[:, 5] = 1e-38  # the huge weights meet tiny inputs: a finite, exact-enough output
    with torch.no_grad():
        assert bool(torch.isfinite(layer(x)).all())


def test_the_solver_runs_on_one_thread_and_restores_the_count(monkeypatch):
    """Its chunks of 64K elements are too small to share: with 2 threads on a
    busy 2-core machine an 8192 x 2048 weight took 12.6-16.3 s against
    4.0-6.0 s on one (each op waiting for the other thread)."""
    from dtype_policies.quantizers import zero_points
    from dtype_policies.quantizers.math import grouped_quantize_with_zero_point

    seen = []
    solve = zero_points._solve

    def recording(*args):
        seen.append(torch.get_num_threads())
        return solve(*args)

    monkeypatch.setattr(zero_points, "_solve", recording)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        w = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
        q, scale, zero = grouped_quantize_with_zero_point(w, 64)
        zero_points.refine_zero_points(w, q, scale, zero, 64)
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
