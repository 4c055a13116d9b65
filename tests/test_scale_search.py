"""Searched int4 grids: the stored format is exactly min/max's, the (weighted)
squared error never exceeds min/max's per group (column), no value is clipped
by more than half a step, grouped grids keep 0 exact where min/max does, the
search is deterministic and refuses non-finite weights;
`Int4QuantizationConfig(scale_search=True)` serializes, quantizes with it, and
its checkpoints load anywhere."""

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

NO_QUANTIZERS = {"weight_quantizer": None, "activation_quantizer": None}  # Keras writes them

RTOL = 1e-4  # float32 rounding: errors summed in another order than the search's


def _groups(rows, block_size):
    return torch.arange(rows) // block_size


def _group_errors(w, q, scale, zero, block_size, importance=None):
    """Per-(group, column) weighted squared error, float64."""
    restored = dequantize_grouped(q, scale, zero, block_size).double()
    squared = (restored - w.double()) ** 2
    if importance is not None:
        squared = squared * importance.double()[:, None]
    groups = -(-w.shape[0] // block_size)
    return torch.zeros(groups, w.shape[1], dtype=torch.float64).index_add_(
        0, _groups(w.shape[0], block_size), squared
    )


def _assert_not_worse(new, old, w):
    floor = (w.double().abs().amax() * 2.0**-22) ** 2 * w.shape[0]
    assert bool((new <= old * (1 + RTOL) + floor).all()), (new - old).max()


def _check_grouped(w, block_size, importance=None):
    rows, columns = w.shape
    q, scale, zero = search_grouped_int4(w, block_size, importance=importance)
    groups = -(-rows // block_size)
    assert q.shape == (rows, columns) and q.dtype == torch.int8
    assert scale.shape == zero.shape == (groups, columns)
    assert scale.dtype == zero.dtype == torch.float32
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())
    plain = grouped_quantize_with_zero_point(w, block_size)
    old = _group_errors(w, *plain, block_size, importance)
    new = _group_errors(w, q, scale, zero, block_size, importance)
    _assert_not_worse(new, old, w)
    # Never clipped: each value within half a step of its own (or of min/max's error).
    step = scale[_groups(rows, block_size)].double()
    missed = (dequantize_grouped(q, scale, zero, block_size).double() - w.double()).abs()
    old_missed = (dequantize_grouped(*plain, block_size).double() - w.double()).abs()
    assert bool((missed <= torch.maximum(0.5001 * step, old_missed + 1e-6 * step)).all())
    # 0 stays exact where min/max keeps it exact (integer zero points).
    integer = plain[2] == plain[2].round()
    changed = ~torch.isclose(zero, plain[2])
    assert bool((zero[integer & changed] == zero[integer & changed].round()).all())
    return q, scale, zero, new, old


def _check_channel(w, importance=None):
    rows, columns = w.shape
    q, scale = search_per_channel_int4(w, importance=importance)
    assert q.shape == (rows, columns) and q.dtype == torch.int8
    assert scale.shape == (columns,) and scale.dtype == torch.float32
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    old_q, old_scale = abs_max_quantize(w, 0, (-8, 7))
    weights = torch.ones(rows) if importance is None else importance

    def errors(codes, inverse):
        squared = (codes.double() / inverse.double().reshape(1, -1) - w.double()) ** 2
        return (squared * weights.double()[:, None]).sum(0)

    new, old = errors(q, scale), errors(old_q, old_scale)
    _assert_not_worse(new, old, w)
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


@settings(max_examples=60, deadline=None)
@given(weights, st.sampled_from([1, 3, 8, 32, 128]))
def test_grouped_format_never_worse_and_never_clipping(w, block_size):
    _check_grouped(w, block_size)


@settings(max_examples=60, deadline=None)
@given(weights)
def test_per_channel_format_and_never_worse_than_abs_max(w):
    _check_channel(w)


@pytest.mark.parametrize("kind", ["normal", "laplace", "student_t"])
def test_search_lowers_the_error_of_realistic_weights(kind):
    w = _sample(kind, (512, 64), torch.Generator().manual_seed(1))
    *_, new, old = _check_grouped(w, 128)
    assert new.sum() < old.sum()  # a little: min/max is near the best non-clipping grid here
    *_, new, old = _check_channel(w)
    assert new.sum() < 0.95 * old.sum()  # the code -8 and wider steps


def test_importance_weights_the_error_where_it_is_given():
    generator = torch.Generator().manual_seed(2)
    w = torch.randn(256, 32, generator=generator)
    importance = torch.ones(256)
    importance[::16] = 100.0  # a few inputs that matter much more
    plain_q, plain_scale, plain_zero = search_grouped_int4(w, 64)
    _q, _scale, _zero, new, _ = _check_grouped(w, 64, importance)
    weighted_plain = _group_errors(w, plain_q, plain_scale, plain_zero, 64, importance)
    assert new.sum() < weighted_plain.sum()
    _check_channel(w, importance)


def test_search_is_deterministic():
    w = torch.randn(300, 20, generator=torch.Generator().manual_seed(3))
    first, second = search_grouped_int4(w, 64), search_grouped_int4(w, 64)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert all(
        torch.equal(a, b) for a, b in zip(search_per_channel_int4(w), search_per_channel_int4(w))
    )


def test_without_candidates_the_result_is_min_max_exactly():
    w = torch.randn(64, 8, generator=torch.Generator().manual_seed(4))
    searched = search_grouped_int4(w, 32, ratios=())
    for a, b in zip(searched, grouped_quantize_with_zero_point(w, 32)):
        assert torch.equal(a, b)
    q, scale = search_per_channel_int4(w, ratios=())
    reference_q, reference_scale = abs_max_quantize(w, 0, (-8, 7))
    assert torch.equal(q, reference_q) and torch.equal(scale, reference_scale.reshape(-1))


def test_q4_1_blocks_stay_exact():
    generator = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (4, 32, 6), generator=generator).float()
    codes[:, 0], codes[:, 1] = 0.0, 15.0
    w = (-torch.rand(4, 1, 6, generator=generator) * 0.1 + codes * 0.01).reshape(128, 6)
    q, scale, zero = search_grouped_int4(w, 32)
    torch.testing.assert_close(dequantize_grouped(q, scale, zero, 32), w, rtol=0, atol=1e-7)


def test_all_zero_and_constant_groups():
    w = torch.zeros(64, 4)
    w[:, 1] = 3.0
    w[:32, 2] = -2.0
    q, scale, zero = search_grouped_int4(w, 32)
    torch.testing.assert_close(dequantize_grouped(q, scale, zero, 32), w, rtol=1e-6, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused(bad):
    w = torch.randn(16, 4)
    w[3, 2] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        search_grouped_int4(w, 8)
    with pytest.raises(ValueError, match="NaN or infinite"):
        search_per_channel_int4(w)


def test_argument_errors():
    w = torch.randn(16, 4)
    with pytest.raises(ValueError, match="block_size"):
        search_grouped_int4(w, 0)
    with pytest.raises(ValueError, match="no clipping"):
        search_grouped_int4(w, 8, ratios=(0.9,))
    with pytest.raises(ValueError, match="importance"):
        search_grouped_int4(w, 8, importance=torch.ones(3))
    with pytest.raises(ValueError, match="importance"):
        search_per_channel_int4(w, importance=-torch.ones(16))
    with pytest.raises(ValueError, match="2D"):
        search_grouped_int4(torch.randn(16), 8)


def test_half_precision_inputs_are_accepted():
    w = torch.randn(64, 8, generator=torch.Generator().manual_seed(6))
    for dtype in (torch.bfloat16, torch.float16):
        q, scale, _zero = search_grouped_int4(w.to(dtype), 32)
        assert scale.dtype == torch.float32 and q.dtype == torch.int8


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
    assert config.get_config() == {**NO_QUANTIZERS, "block_size": 64, "scale_search": True}
    restored = Int4QuantizationConfig.from_config(config.get_config())
    assert restored.scale_search is True and restored.block_size == 64
    assert Int4QuantizationConfig().get_config() == {
        **NO_QUANTIZERS,
        "block_size": 128,
    }  # Keras's keys
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
    if block_size == -1:
        assert searched < plain


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
