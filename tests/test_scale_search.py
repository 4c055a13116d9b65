"""Searched int4 scales: the stored format is exactly min/max's, the squared
error never exceeds min/max's per group (column), the search is deterministic
and refuses non-finite weights; `Int4QuantizationConfig(scale_search=True)`
serializes, quantizes with it, and its checkpoints load anywhere."""

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from dtype_policies import quantize, saving
from dtype_policies.quantization import Int4QuantizationConfig
from dtype_policies.quantization.kernels import int4 as kernels
from dtype_policies.quantizers import (
    abs_max_quantize,
    dequantize_grouped,
    grouped_quantize_with_zero_point,
    search_grouped_int4,
    search_per_channel_int4,
)
from dtype_policies.quantizers.math import EPSILON

# float32 rounding: the search compares errors computed in another order than
# here, and a dequantized value is only exact to a few float32 ulps.
RTOL = 1e-4
ULPS = 4 * 2.0**-23


def _group_sums(squared, block_size):
    rows, columns = squared.shape
    groups = -(-rows // block_size)
    padded = torch.zeros(groups * block_size, columns, dtype=torch.float64)
    padded[:rows] = squared
    return padded.reshape(groups, block_size, columns).sum(1)


def _group_errors(w, q, scale, zero, block_size):
    """Per-(group, column) squared error, float64."""
    restored = dequantize_grouped(q, scale, zero, block_size).double()
    return _group_sums((restored - w.double()) ** 2, block_size)


def _channel_errors(w, q, scale):
    return ((q.double() / scale.double().reshape(1, -1) - w.double()) ** 2).sum(0)


def _rounding_floor(w, block_size):
    """Squared error a few float32 ulps of each value would give."""
    return _group_sums((w.double() * ULPS) ** 2, block_size)


def _assert_grouped_format(q, scale, zero, rows, columns, block_size):
    groups = -(-rows // block_size)
    assert q.shape == (rows, columns) and q.dtype == torch.int8
    assert scale.shape == (groups, columns) and scale.dtype == torch.float32
    assert zero.shape == (groups, columns) and zero.dtype == torch.int8
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    assert int(zero.min()) >= -8 and int(zero.max()) <= 7
    assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())


def _assert_channel_format(q, scale, rows, columns):
    assert q.shape == (rows, columns) and q.dtype == torch.int8
    assert scale.shape == (columns,) and scale.dtype == torch.float32
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())


def _assert_not_worse(new, old, floor):
    assert bool(torch.isfinite(new).all())
    old = torch.nan_to_num(old, nan=float("inf"))  # min/max overflows near float32's max
    assert bool((new <= old * (1 + RTOL) + floor).all()), (new - old - floor).max()


def _check_grouped(w, block_size, **options):
    rows, columns = w.shape
    q, scale, zero = search_grouped_int4(w, block_size, **options)
    _assert_grouped_format(q, scale, zero, rows, columns, block_size)
    old = _group_errors(w, *grouped_quantize_with_zero_point(w, block_size), block_size)
    new = _group_errors(w, q, scale, zero, block_size)
    _assert_not_worse(new, old, _rounding_floor(w, block_size))
    return q, scale, zero, new, old


def _check_channel(w, **options):
    rows, columns = w.shape
    q, scale = search_per_channel_int4(w, **options)
    _assert_channel_format(q, scale, rows, columns)
    old_q, old_scale = abs_max_quantize(w, 0, (-8, 7))
    old = _channel_errors(w, old_q, old_scale)
    new = _channel_errors(w, q, scale)
    _assert_not_worse(new, old, _rounding_floor(w, w.shape[0])[0])
    return q, scale, new, old


DISTRIBUTIONS = ["normal", "uniform", "laplace", "student_t", "positive", "negative", "sparse"]


def _sample(kind, shape, generator):
    if kind == "uniform":
        return torch.rand(shape, generator=generator) * 2 - 1
    if kind == "laplace":
        u = torch.rand(shape, generator=generator) - 0.5
        return -torch.sign(u) * torch.log1p(-2 * u.abs())
    if kind == "student_t":
        normal = torch.randn(shape, generator=generator)
        chi = torch.randn((3, *shape), generator=generator).pow(2).sum(0)
        return normal / (chi / 3).sqrt()
    if kind == "positive":
        return torch.rand(shape, generator=generator) + 0.5
    if kind == "negative":
        return -torch.rand(shape, generator=generator) - 0.5
    if kind == "sparse":
        values = torch.randn(shape, generator=generator)
        return values * (torch.rand(shape, generator=generator) < 0.1)
    return torch.randn(shape, generator=generator)


weights = st.builds(
    lambda rows, columns, kind, exponent, outliers, seed: _weight(
        rows, columns, kind, exponent, outliers, seed
    ),
    st.integers(1, 80),
    st.integers(1, 12),
    st.sampled_from(DISTRIBUTIONS),
    st.sampled_from([-30, -8, -3, 0, 3, 30]),
    st.integers(0, 3),
    st.integers(0, 2**31 - 1),
)


def _weight(rows, columns, kind, exponent, outliers, seed):
    generator = torch.Generator().manual_seed(seed)
    w = _sample(kind, (rows, columns), generator) * 10.0**exponent
    flat = w.view(-1)
    for _ in range(outliers):
        index = int(torch.randint(flat.numel(), (1,), generator=generator))
        flat[index] = flat[index] * 100 + 10.0**exponent
    return w


@settings(max_examples=150, deadline=None)
@given(weights, st.sampled_from([1, 2, 3, 8, 32, 128]), st.booleans())
def test_grouped_format_and_never_worse_than_min_max(w, block_size, balance):
    _check_grouped(w, block_size, balance=balance)


@settings(max_examples=100, deadline=None)
@given(weights, st.booleans())
def test_per_channel_format_and_never_worse_than_abs_max(w, balance):
    _check_channel(w, balance=balance)


@settings(max_examples=25, deadline=None)
@given(weights, st.sampled_from([1, 4, 32]), st.integers(1, 200))
def test_column_slabs_do_not_change_the_error(w, block_size, chunk_elements):
    whole = search_grouped_int4(w, block_size)
    sliced = search_grouped_int4(w, block_size, chunk_elements=chunk_elements)
    # Slabs change the order of float sums: values near a rounding boundary may
    # round the other way, which only shows for groups at the epsilon floor
    # (step EPSILON / 15): allow 1% of one floor step squared per value.
    floor_step = EPSILON / 15
    torch.testing.assert_close(
        _group_errors(w, *sliced, block_size).sum(),
        _group_errors(w, *whole, block_size).sum(),
        rtol=1e-3,
        atol=0.01 * floor_step**2 * w.numel(),
    )
    q, scale = search_per_channel_int4(w, chunk_elements=chunk_elements)
    _assert_channel_format(q, scale, *w.shape)


@pytest.mark.parametrize(
    "kind", ["normal", "uniform", "laplace", "student_t", "positive", "sparse"]
)
def test_search_lowers_the_error_of_realistic_weights(kind):
    w = _sample(kind, (512, 64), torch.Generator().manual_seed(1))
    *_, new, old = _check_grouped(w, 128)
    assert new.sum() < 0.97 * old.sum()
    *_, new, old = _check_channel(w)
    assert new.sum() < 0.9 * old.sum()


def test_search_is_deterministic():
    w = torch.randn(300, 40, generator=torch.Generator().manual_seed(2))
    first, second = search_grouped_int4(w, 64), search_grouped_int4(w, 64)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    first, second = search_per_channel_int4(w), search_per_channel_int4(w)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_without_candidates_the_result_is_min_max_exactly():
    w = torch.randn(256, 16, generator=torch.Generator().manual_seed(3))
    searched = search_grouped_int4(w, 64, ratios=(), refine_steps=0, balance=False)
    for a, b in zip(searched, grouped_quantize_with_zero_point(w, 64)):
        assert torch.equal(a, b)
    q, scale = search_per_channel_int4(w, ratios=(), refine_steps=0, balance=False)
    old_q, old_scale = abs_max_quantize(w, 0, (-8, 7))
    assert torch.equal(q, old_q) and torch.equal(scale, old_scale.reshape(-1))


def test_all_zero_and_constant_groups():
    w = torch.zeros(64, 4)
    w[32:, 1] = 0.3  # a constant group
    w[32:, 2] = -5.0
    *_, new, _ = _check_grouped(w, 32)
    assert new[0].max() == 0  # all-zero groups are exact
    assert new.max() < 1e-10  # constant groups too (the value is a grid point)
    _, _, new, _ = _check_channel(w)
    assert new[0] == 0 and new[3] == 0


def test_one_outlier_and_same_sign_groups():
    generator = torch.Generator().manual_seed(4)
    w = torch.randn(128, 6, generator=generator) * 0.01
    w[5, 0] = 3.0
    w[:, 1] = w[:, 1].abs() + 1.0  # all positive: zero point at -8
    w[:, 2] = -w[:, 2].abs() - 1.0  # all negative: zero point at 7
    _, _, zero, _, _ = _check_grouped(w, 128)
    assert int(zero[0, 1]) == -8 and int(zero[0, 2]) == 7
    _check_channel(w)


@pytest.mark.parametrize("magnitude", [1e-30, 1e-38, 1e-45, 1e30, 3e38])
def test_extreme_magnitudes(magnitude):
    w = torch.randn(64, 8, generator=torch.Generator().manual_seed(5)).clamp(-1, 1) * magnitude
    _check_grouped(w, 32)
    _check_channel(w)
    if magnitude >= 1e30:  # representable: the relative error stays int4's
        q, scale, zero = search_grouped_int4(w, 32)
        restored = dequantize_grouped(q, scale, zero, 32).double()
        assert (restored - w.double()).norm() / w.double().norm() < 0.15


def test_tiny_and_huge_groups_in_one_kernel():
    w = torch.randn(64, 4, generator=torch.Generator().manual_seed(6))
    w[:32] *= 1e-30
    w[32:] *= 1e30
    _check_grouped(w, 32)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused(bad):
    w = torch.randn(32, 4)
    w[3, 2] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        search_grouped_int4(w, 8)
    with pytest.raises(ValueError, match="NaN or infinite"):
        search_per_channel_int4(w)


def test_argument_errors():
    w = torch.randn(16, 4)
    with pytest.raises(ValueError, match="block_size"):
        search_grouped_int4(w, 0)
    with pytest.raises(ValueError, match="2D"):
        search_grouped_int4(w.reshape(-1), 4)
    with pytest.raises(ValueError, match="floating-point"):
        search_per_channel_int4(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="ratios"):
        search_per_channel_int4(w, ratios=(0.5, 0.0))
    with pytest.raises(ValueError, match="refine_steps"):
        search_grouped_int4(w, 4, refine_steps=-1)


def test_half_precision_inputs_are_accepted():
    w = torch.randn(64, 8, generator=torch.Generator().manual_seed(7))
    for dtype in (torch.bfloat16, torch.float16):
        q, scale, zero = search_grouped_int4(w.to(dtype), 32)
        _assert_grouped_format(q, scale, zero, 64, 8, 32)
        q, scale = search_per_channel_int4(w.to(dtype))
        _assert_channel_format(q, scale, 64, 8)


def test_balance_bounds_each_column_error_sum():
    w = torch.randn(1024, 32, generator=torch.Generator().manual_seed(8))
    q, scale = search_per_channel_int4(w)
    in_steps = q.double() - w.double() * scale.double()
    assert in_steps.sum(0).abs().max() <= 0.5 + 1e-6
    q, scale = search_per_channel_int4(w, balance=False)
    assert (q.double() - w.double() * scale.double()).sum(0).abs().max() > 0.5
    q, scale, zero = search_grouped_int4(w, 128)
    step = scale.repeat_interleave(128, dim=0).double()
    in_steps = (dequantize_grouped(q, scale, zero, 128).double() - w.double()) / step
    assert in_steps.sum(0).abs().max() <= 0.5 + 1e-3


@pytest.mark.parametrize("block_size", [32, 128, -1])
def test_the_int4_kernel_computes_with_searched_codes(block_size):
    generator = torch.Generator().manual_seed(9)
    w_kn = torch.randn(256, 32, generator=generator)
    x = torch.randn(8, 256, generator=generator).bfloat16()
    if block_size > 0:
        q, scale, zero = search_grouped_int4(w_kn, block_size)
    else:
        q, scale = search_per_channel_int4(w_kn)
        zero = None
        assert int(q.min()) == -8  # the code abs-max never uses
    q_nk = q.t().contiguous()
    tensors = (q_nk, scale) if zero is None else (q_nk, scale, zero)
    runtime = kernels.Int4Runtime()
    runtime.refresh(q_nk, scale, zero, block_size, tensors)
    y = kernels.int4_linear(x, q_nk, scale, zero, block_size, None, torch.float32, runtime)
    assert runtime.packed is not None  # the packed CPU kernel ran
    expected = x.float() @ kernels.dequantize_int4(q_nk, scale, zero, block_size).t()
    torch.testing.assert_close(y, expected, rtol=0.02, atol=0.05 * expected.abs().mean().item())


# ------------------------------------------------- Int4QuantizationConfig(scale_search=True)


def test_config_serializes_the_setting_and_old_configs_load():
    config = Int4QuantizationConfig(block_size=64, scale_search=True)
    assert config.get_config() == {"block_size": 64, "scale_search": True}
    restored = Int4QuantizationConfig.from_config(config.get_config())
    assert restored.scale_search is True and restored.block_size == 64
    assert Int4QuantizationConfig().get_config() == {"block_size": 128}  # Keras's keys
    old = Int4QuantizationConfig.from_config({"block_size": 32})
    assert old.scale_search is False and old.block_size == 32
    # A quantize-time setting: same stored format, so equal configs.
    assert config == Int4QuantizationConfig(block_size=64)
    assert hash(config) == hash(Int4QuantizationConfig(block_size=64))
    assert "scale_search=True" in repr(config)
    with pytest.raises(ValueError, match="scale_search"):
        Int4QuantizationConfig(scale_search="yes")
    with pytest.raises(ValueError, match="scale_search"):
        Int4QuantizationConfig.from_config({"block_size": 32, "scale_search": 1})


def _mlp_error(block_size, scale_search, batch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 128))
    with torch.no_grad():
        reference = model(batch)
    stored = {}
    quantize(
        model, "int4", Int4QuantizationConfig(block_size=block_size, scale_search=scale_search)
    )
    for key, value in model.state_dict().items():
        stored[key] = (tuple(value.shape), value.dtype)
    with torch.no_grad():
        out = model(batch)
    return ((out - reference).norm() / reference.norm()).item(), stored, model


@pytest.mark.parametrize("block_size", [128, -1])
def test_quantize_with_scale_search_keeps_the_format_and_lowers_the_error(block_size):
    batch = torch.randn(32, 256, generator=torch.Generator().manual_seed(10))
    plain, plain_stored, _ = _mlp_error(block_size, False, batch)
    searched, searched_stored, _ = _mlp_error(block_size, True, batch)
    assert searched_stored == plain_stored  # same keys, shapes and dtypes
    assert searched < 0.97 * plain


def test_checkpoint_quantized_with_search_loads_into_a_plain_quantized_model(tmp_path):
    import warnings

    batch = torch.randn(8, 256, generator=torch.Generator().manual_seed(11))
    _, _, searched = _mlp_error(64, True, batch)
    _, _, plain = _mlp_error(64, False, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        path = saving.save(searched, tmp_path / "checkpoint")
        saving.load(plain, path)
    with torch.no_grad():
        assert torch.equal(plain(batch), searched(batch))
