"""GPTQ's and AWQ's math (`quantizers.gptq`, `quantizers.awq`) and the input
statistics they are fed: Keras's own test cases as a model (streaming equals
one batch, the closed form of the Hessian, an identity inverse Hessian is
round to nearest, activation order undone), plus the properties the library
relies on (never worse than round to nearest on the calibration inputs)."""

import pytest
import torch

from dtype_policies.quantization.schemes.calibrated_int import InputStatistics
from dtype_policies.quantizers import awq, gptq


def correlated_inputs(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    mixing = torch.randn(k, k, generator=generator) / k**0.5 + torch.eye(k)
    scales = torch.rand(k, generator=generator) * 3 + 0.1
    return torch.randn(rows, k, generator=generator) @ mixing * scales


def output_error(x: torch.Tensor, w: torch.Tensor, approx: torch.Tensor) -> float:
    return float(((x @ (w - approx).T) ** 2).mean())


# -- statistics (Keras's GPTQ tests: test_update_hessian, test_streaming_equals_big_batch, ...)


def test_streaming_equals_one_batch_and_the_closed_form():
    x = torch.randn(100, 7)
    one, streamed = InputStatistics(7), InputStatistics(7)
    one.update(x)
    streamed.update(x[:50])
    streamed.update(x[50:])
    assert torch.allclose(one.hessian, streamed.hessian, rtol=1e-6, atol=1e-6)
    assert torch.allclose(one.hessian, 2 * x.T @ x / 100, rtol=1e-6, atol=1e-6)
    assert streamed.rows == 100 and torch.equal(one.hessian, one.hessian.T)


def test_statistics_of_magnitudes_and_errors():
    x = torch.tensor([[1.0, -4.0], [-3.0, 2.0]])
    stats = InputStatistics(2, gram=False, mean_abs=True, max_abs=True)
    stats.update(x)
    assert stats.gram is None
    assert torch.equal(stats.mean_abs, torch.tensor([2.0, 3.0]))
    assert torch.equal(stats.abs_max, torch.tensor([3.0, 4.0]))
    with pytest.raises(ValueError, match="do not match input features"):
        stats.update(torch.randn(3, 5))


def test_rows_fed_twice_share_one_product():
    x = torch.randn(64, 16)
    first, second = InputStatistics(16), InputStatistics(16)
    first.update(x)
    second.update(x)  # the same object: the product is reused
    assert torch.equal(first.gram, second.gram)
    x.mul_(2)  # written in place: recomputed
    second.update(x)
    assert torch.allclose(second.gram, first.gram * 5, rtol=1e-5)


def test_bfloat16_rows_give_the_float32_hessian_closely():
    x = correlated_inputs(2048, 64).bfloat16()
    low, exact = InputStatistics(64), InputStatistics(64)
    low.update(x)
    exact.update(x.float())
    relative = (low.hessian - exact.hessian).norm() / exact.hessian.norm()
    assert float(relative) < 2e-3


# -- GPTQ


def test_an_identity_inverse_hessian_is_round_to_nearest():
    """Keras's test_identity_inv_hessian_matches_direct_quantization."""
    w = torch.linspace(-0.9, 1.1, 16 * 8).reshape(8, 16)
    q, scale, zero, g_idx = gptq.gptq_quantize_matrix(w, torch.eye(16), group_size=4)
    expected = gptq.quantize_rtn(w, bits=4, group_size=4)
    for got, want in zip((q, scale, zero, g_idx), expected):
        assert torch.equal(got, want)


def test_activation_order_with_a_diagonal_hessian_changes_nothing():
    """Keras's test_activation_order_produces_equivalent_weights."""
    w = torch.randn(6, 8)
    hessian = torch.diag(torch.linspace(10.0, 1.0, 8)[torch.randperm(8)])
    plain = gptq.gptq_quantize(w, hessian, group_size=-1)
    ordered = gptq.gptq_quantize(w, hessian, group_size=-1, activation_order=True)
    assert torch.equal(gptq.dequantize_with_sz_map(*plain), gptq.dequantize_with_sz_map(*ordered))


ALGORITHMS = [("cholesky", "refined"), ("cholesky", "keras"), ("keras", "keras")]


@pytest.mark.parametrize("inverse, grid", ALGORITHMS)
@pytest.mark.parametrize("bits, group", [(4, 32), (3, 16), (2, 32), (8, -1), (4, -1)])
def test_gptq_lowers_the_output_error_on_its_inputs(inverse, grid, bits, group):
    x = correlated_inputs(1024, 96, seed=bits)
    w = torch.randn(40, 96)
    hessian = 2 * x.T @ x / x.shape[0]
    ours = gptq.dequantize_with_sz_map(
        *gptq.gptq_quantize(w, hessian, bits=bits, group_size=group, inverse=inverse, grid=grid)
    )
    rtn = gptq.dequantize_with_sz_map(*gptq.quantize_rtn(w, bits=bits, group_size=group))
    assert output_error(x, w, ours) < output_error(x, w, rtn)


def test_the_cholesky_factor_beats_the_plain_inverse():
    """The reference's matrix is the right conditional inverse; Keras's is not."""
    wins = 0
    for seed in range(4):
        x = correlated_inputs(1024, 128, seed=seed)
        w = torch.randn(32, 128, generator=torch.Generator().manual_seed(seed))
        hessian = 2 * x.T @ x / x.shape[0]
        errors = {
            inverse: output_error(
                x,
                w,
                gptq.dequantize_with_sz_map(
                    *gptq.gptq_quantize(w, hessian, inverse=inverse, grid="keras")
                ),
            )
            for inverse in gptq.INVERSES
        }
        wins += errors["cholesky"] < errors["keras"]
    assert wins == 4


def test_activation_order_groups_and_levels_on_keras_grids():
    x = correlated_inputs(512, 64)
    w = torch.randn(16, 64)
    q, scale, _, g_idx = gptq.gptq_quantize(
        w, 2 * x.T @ x / 512, bits=3, group_size=16, activation_order=True, grid="keras"
    )
    assert torch.equal(g_idx.sort().values, torch.arange(64) // 16)
    assert not torch.equal(g_idx, torch.arange(64) // 16)
    assert int(q.min()) >= 0 and int(q.max()) <= 7 and scale.shape == (16, 4)
    # the groups hold the columns quantized together: by decreasing Hessian diagonal
    diagonal = torch.diagonal(x.T @ x)
    first_group = g_idx == 0
    assert diagonal[first_group].min() >= diagonal[~first_group].max()


@pytest.mark.parametrize("algorithm", ["gptq", "awq"])
def test_inputs_silent_in_calibration_keep_their_weights(algorithm):
    # an input silent on the calibration data may not be silent later: its weights come back
    # as close as the others'. Before: GPTQ's re-fit moved them by up to 2 steps of their grid;
    # AWQ gave them a scale near 0 and errors 2,000 times the others'.
    worst = 0.0
    for seed in range(20):
        x = correlated_inputs(256, 32, seed=seed)
        x[:, :4] = 0
        w = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed))
        w[:, :4] *= 3
        hessian = 2 * x.T @ x / 256
        if algorithm == "gptq":
            q, scale, zero, g_idx = gptq.gptq_quantize(w, hessian, group_size=16)
            restored = gptq.dequantize_with_sz_map(q, scale, zero, g_idx)
        else:
            q, scale, zero, scales, g_idx = awq.awq_quantize_output(
                w, hessian, x.abs().mean(0), group_size=16
            )
            restored = gptq.dequantize_with_sz_map(q, scale, zero, g_idx) / scales
        error = (restored - w).abs()
        worst = max(worst, float(error[:, :4].max() / error[:, 4:16].max()))
    assert 0.0 < worst <= 1.25


def test_dead_inputs_and_a_singular_hessian():
    x = correlated_inputs(256, 32)
    x[:, 5] = 0  # an input that never fires
    x[:, 7] = x[:, 6]  # and two identical ones: H is singular without damping
    w = torch.randn(8, 32)
    hessian = 2 * x.T @ x / 256
    q, scale, zero, g_idx = gptq.gptq_quantize(w, hessian, group_size=16, damping=0.0, grid="keras")
    restored = gptq.dequantize_with_sz_map(q, scale, zero, g_idx)
    assert torch.isfinite(restored).all() and torch.equal(restored[:, 5], torch.zeros(8))
    # the refined grids keep a silent input's weight, rounded to nearest
    q, scale, zero, g_idx = gptq.gptq_quantize(w, hessian, group_size=16, damping=0.0)
    restored = gptq.dequantize_with_sz_map(q, scale, zero, g_idx)
    assert torch.isfinite(restored).all()
    assert ((restored[:, 5] - w[:, 5]).abs() <= scale[:, 0] / 2 + 1e-6).all()
    with pytest.raises(ValueError, match="not positive definite"):
        gptq.gptq_quantize(w, torch.full((32, 32), float("nan")), group_size=16)
    with pytest.raises(ValueError, match="`inverse` must be one of"):
        gptq.gptq_quantize(w, hessian, inverse="lu")
    with pytest.raises(
        ValueError, match=r"`grid` must be one of \('refined', 'keras'\). Received: 'minmax'"
    ):
        gptq.gptq_quantize(w, hessian, grid="minmax")
    with pytest.raises(ValueError, match="needs the reference inverse"):
        gptq.gptq_quantize(w, hessian, inverse="keras")


def q4_1_weight(n: int, k: int, block: int, seed: int = 0) -> torch.Tensor:
    """A weight already on a grid: per block of `block` inputs a step and a
    minimum (GGUF's Q4_1), levels 0..15 with both ends used."""
    generator = torch.Generator().manual_seed(seed)
    levels = torch.randint(0, 16, (n, k), generator=generator).float()
    levels[:, ::block] = 0
    levels[:, 1::block] = 15
    steps = (torch.rand(n, k // block, generator=generator) + 0.5) * 0.01
    minimum = -torch.rand(n, k // block, generator=generator) * 0.1
    return levels * steps.repeat_interleave(block, 1) + minimum.repeat_interleave(block, 1)


@pytest.mark.parametrize("activation_order", [False, True])
def test_refined_grids_reproduce_a_weight_already_on_a_grid(activation_order):
    """Whatever the Hessian: each level's error is 0, so nothing is
    compensated; Keras's grids (a rounded zero point, recomputed from the
    compensated columns) lose such a weight."""
    w = q4_1_weight(24, 96, 32)
    x = correlated_inputs(512, 96, seed=3)
    hessian = 2 * x.T @ x / 512
    restored = gptq.dequantize_with_sz_map(
        *gptq.gptq_quantize(w, hessian, group_size=32, activation_order=activation_order)
    )
    assert torch.allclose(restored, w, rtol=0, atol=1e-6)
    keras = gptq.gptq_quantize(w, hessian, group_size=32, grid="keras")
    assert (gptq.dequantize_with_sz_map(*keras) - w).abs().max() > 1e-3


def test_refined_grids_keep_natural_groups_under_activation_order():
    x = correlated_inputs(512, 64)
    w = torch.randn(16, 64)
    hessian = 2 * x.T @ x / 512
    plain = gptq.gptq_quantize(w, hessian, bits=3, group_size=16)
    ordered = gptq.gptq_quantize(w, hessian, bits=3, group_size=16, activation_order=True)
    assert torch.equal(ordered[3], torch.arange(64) // 16)
    assert int(ordered[0].min()) >= 0 and int(ordered[0].max()) <= 7
    assert not torch.equal(plain[0], ordered[0])
    # ordered by decreasing diagonal: on these inputs the order lowers the error
    errors = [output_error(x, w, gptq.dequantize_with_sz_map(*r)) for r in (plain, ordered)]
    assert errors[1] < errors[0]


def test_refitting_the_grid_lowers_every_rows_error_or_keeps_it():
    x = correlated_inputs(1024, 96, seed=5)
    w = torch.randn(40, 96)
    hessian = 2 * x.T @ x / 1024
    scale, zero, maxq = gptq.refined_grid(w, bits=4, group_size=32)
    g_idx = torch.arange(96) // 32
    q = gptq.quantize_with_zero_point(w, scale[:, g_idx], zero[:, g_idx], maxq).to(torch.int32)
    new_scale, new_zero = gptq.refit_grid(w, q, scale, zero, g_idx, hessian)
    before = gptq.output_error(w - gptq.dequantize_with_sz_map(q, scale, zero, g_idx), hessian)
    after = gptq.output_error(
        w - gptq.dequantize_with_sz_map(q, new_scale, new_zero, g_idx), hessian
    )
    assert (after <= before).all() and float(after.sum()) < 0.95 * float(before.sum())
    assert (new_scale > 0).all() and new_scale.shape == scale.shape
    # a row whose levels are all equal has no 2-value fit per group: it keeps its grid
    q[0] = 7
    kept_scale, kept_zero = gptq.refit_grid(w, q, scale, zero, g_idx, hessian)
    assert torch.equal(kept_scale[0], scale[0]) and torch.equal(kept_zero[0], zero[0])


def test_the_grid_keeps_a_real_zero_point_and_may_leave_it_unrounded():
    w = torch.tensor([[0.5, 0.6, 0.9, 1.3], [-1.0, 0.2, 0.4, 0.8]])
    _, zero, maxq = gptq.compute_quantization_parameters(w, bits=4, per_channel=True)
    assert maxq == 15 and zero[0, 0] == -9  # round(-0.5 / (0.8 / 15)): below 0, not wrapped
    exact, real_zero, _ = gptq.compute_quantization_parameters(
        w, bits=4, per_channel=True, round_zero=False
    )
    levels = gptq.quantize_with_zero_point(w, exact, real_zero, maxq)
    restored = gptq.dequantize_with_zero_point(levels, exact, real_zero)
    assert torch.allclose(restored.amin(1), w.amin(1)) and torch.allclose(
        restored.amax(1), w.amax(1)
    )
    _, center, _ = gptq.compute_quantization_parameters(w, bits=4, per_channel=True, symmetric=True)
    assert torch.equal(center, torch.full((2, 1), 8.0))
    per_tensor, _, _ = gptq.compute_quantization_parameters(w, bits=4)
    assert per_tensor.shape == (2, 1) and per_tensor[0, 0] == per_tensor[1, 0]


# -- AWQ (Keras's AWQ tests: shapes, positive finite scales, near-zero activations)


@pytest.mark.parametrize("group", [-1, 8, 32])
def test_keras_search_shapes_and_scales(group):
    w = torch.randn(64, 32)
    activations = torch.rand(32) + 0.1
    activations[:5] = 1e-10
    q, scale, zero, scales, g_idx = awq.awq_quantize_matrix(
        w, activations, num_grid_points=5, group_size=group
    )
    groups = 1 if group == -1 else 32 // group
    assert q.shape == (64, 32) and scale.shape == zero.shape == (64, groups)
    assert scales.shape == g_idx.shape == (32,)
    assert torch.isfinite(scales).all() and (scales > 0).all()
    assert int(g_idx.max()) == groups - 1


@pytest.mark.parametrize("group", [-1, 16])
def test_the_output_search_never_loses_to_round_to_nearest(group):
    x = correlated_inputs(1024, 64, seed=group + 3)
    w = torch.randn(24, 64)
    hessian = x.T @ x / x.shape[0]
    scales = awq.awq_search_output(w, hessian, x.abs().mean(0), group_size=group, grid="keras")
    size = 64 if group == -1 else group
    searched = gptq.dequantize_with_sz_map(*gptq.quantize_rtn(w * scales, group_size=size)) / scales
    rtn = gptq.dequantize_with_sz_map(*gptq.quantize_rtn(w, group_size=size))
    assert output_error(x, w, searched) <= output_error(x, w, rtn)


def test_clipping_lowers_the_error_further_and_keeps_the_scales():
    x = correlated_inputs(2048, 64, seed=11)
    w = torch.randn(32, 64) * (1 + 5 * (torch.rand(32, 64) > 0.98))  # a few outliers
    hessian = x.T @ x / x.shape[0]
    mean = x.abs().mean(0)
    clipped = awq.awq_quantize_output(w, hessian, mean, group_size=16, grid="keras")
    plain = awq.awq_quantize_output(w, hessian, mean, group_size=16, clip=False, grid="keras")
    assert torch.equal(clipped[3], plain[3])

    def restored(result):
        q, scale, zero, scales, g_idx = result
        return gptq.dequantize_with_sz_map(q, scale, zero, g_idx) / scales

    assert output_error(x, w, restored(clipped)) < output_error(x, w, restored(plain))


def awq_restored(result):
    q, scale, zero, scales, g_idx = result
    return gptq.dequantize_with_sz_map(q, scale, zero, g_idx) / scales


@pytest.mark.parametrize("group", [-1, 16])
def test_refined_awq_beats_the_rule_it_starts_from(group):
    x = correlated_inputs(1024, 64, seed=group + 5)
    w = torch.randn(24, 64)
    hessian = x.T @ x / x.shape[0]
    size = 64 if group == -1 else group
    ours = awq_restored(awq.awq_quantize_output(w, hessian, x.abs().mean(0), group_size=group))
    rule = awq._rule_round_trip(w, size)
    assert output_error(x, w, ours) < output_error(x, w, rule)


def test_refined_awq_keeps_a_weight_already_on_a_grid():
    """`s = 1` reproduces it (no error), so no other scale wins and the refit
    keeps the grid."""
    w = q4_1_weight(16, 64, 32, seed=2)
    x = correlated_inputs(512, 64, seed=7)
    result = awq.awq_quantize_output(w, x.T @ x / 512, x.abs().mean(0), group_size=32)
    assert torch.equal(result[3], torch.ones(64))
    assert torch.allclose(awq_restored(result), w, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="`grid` must be one of"):
        awq.awq_quantize_output(w, x.T @ x, x.abs().mean(0), grid="hqq")


def test_round_to_nearest_on_the_refined_grid_keeps_a_weight_on_a_grid():
    """What a calibrated mode stores without calibration data."""
    w = q4_1_weight(8, 64, 32, seed=4)
    refined = gptq.dequantize_with_sz_map(*gptq.quantize_rtn(w, group_size=32, grid="refined"))
    keras = gptq.dequantize_with_sz_map(*gptq.quantize_rtn(w, group_size=32, grid="keras"))
    assert torch.allclose(refined, w, rtol=0, atol=1e-6)
    assert (keras - w).abs().max() > 1e-3
    with pytest.raises(ValueError, match="`grid` must be one of"):
        gptq.quantize_rtn(w, grid="nearest")


@pytest.mark.parametrize("symmetric, per_channel", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("activation_order", [False, True])
def test_refined_grids_symmetric_and_per_tensor(symmetric, per_channel, activation_order):
    """Keras's grid of each group's columns, fixed from the float weights."""
    x = correlated_inputs(512, 64, seed=9)
    w = torch.randn(12, 64)
    hessian = 2 * x.T @ x / 512
    q, scale, zero, g_idx = gptq.gptq_quantize(
        w,
        hessian,
        group_size=16,
        symmetric=symmetric,
        per_channel=per_channel,
        activation_order=activation_order,
    )
    assert scale.shape == zero.shape == (12, 4) and torch.equal(g_idx, torch.arange(64) // 16)
    if symmetric:
        assert torch.equal(zero, torch.full_like(zero, 8.0))
    if not per_channel:  # one grid per group for every row
        assert torch.equal(scale, scale[:1].expand(12, 4))
    restored = gptq.dequantize_with_sz_map(q, scale, zero, g_idx)
    rtn = gptq.dequantize_with_sz_map(
        *gptq.quantize_rtn(
            w, group_size=16, symmetric=symmetric, per_channel=per_channel, grid="refined"
        )
    )
    assert output_error(x, w, restored) < output_error(x, w, rtn)


def test_configs_take_numpy_numbers_as_keras_does_and_refuse_nan_damping():
    import numpy as np

    from dtype_policies.quantizers import AWQConfig, GPTQConfig

    config = GPTQConfig(
        None,
        None,
        weight_bits=np.int64(4),
        group_size=np.int32(64),
        num_samples=np.int64(8),
        hessian_damping=np.float32(0.05),
        activation_order=np.True_,
    )
    assert (config.weight_bits, config.group_size, config.num_samples) == (4, 64, 8)
    assert type(config.group_size) is int and config.activation_order is True
    assert AWQConfig(None, None, num_grid_points=np.int64(10)).num_grid_points == 10
    with pytest.raises(ValueError, match=r"hessian_damping must be between 0 and 1. Received: nan"):
        GPTQConfig(None, None, hessian_damping=float("nan"))
    with pytest.raises(ValueError, match=r"group_size must be an integer. Received: group_"):
        GPTQConfig(None, None, group_size=True)
    # Keras's checks (`weight_bits in [2, 3, 4, 8]`, `group_size < -1`) take a
    # float holding an integer; the config keeps the integer
    floats = GPTQConfig(None, None, weight_bits=4.0, group_size=np.float64(64.0))
    assert (floats.weight_bits, floats.group_size) == (4, 64)
    assert type(floats.weight_bits) is int and floats == GPTQConfig(None, None, group_size=64)
    assert AWQConfig(None, None, num_grid_points=10.0).num_grid_points == 10
    for bad in (64.5, float("inf"), float("nan")):
        expected = rf"group_size must be an integer. Received: group_size={bad}"
        with pytest.raises(ValueError, match=expected):
            GPTQConfig(None, None, group_size=bad)


@pytest.mark.parametrize("structure", ["model.layers", 5, [3], {"sequential_blocks": "a.b"}])
def test_a_structure_of_another_form_is_refused_when_the_config_is_made(structure):
    from dtype_policies.quantizers import GPTQConfig

    with pytest.raises(ValueError, match=r"quantization_layer_structure.*(Received|holds)"):
        GPTQConfig(None, None, quantization_layer_structure=structure)


def test_a_structure_holding_modules_is_not_serialized_and_the_model_saves(tmp_path):
    import warnings

    import torch.nn as nn

    from dtype_policies import quantize, saving
    from dtype_policies.quantizers import GPTQConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Sequential(nn.Linear(16, 16)), nn.Linear(16, 4))
    structure = {"pre_block_layers": [model[0]], "sequential_blocks": [model[1]]}
    config = GPTQConfig([torch.randn(8, 16) for _ in range(2)], None, group_size=16)
    config.quantization_layer_structure = structure
    assert config.get_config()["quantization_layer_structure"] is None
    paths = GPTQConfig(None, None, quantization_layer_structure={"sequential_blocks": ("1",)})
    assert paths.get_config()["quantization_layer_structure"] == {"sequential_blocks": ["1"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize(model, config=config, progress=False)
    saving.save(model, tmp_path / "model")


@pytest.mark.parametrize("mode", ["gptq", "awq"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e20])
def test_non_finite_calibration_inputs_are_refused_naming_the_module(mode, value):
    """AWQ fell back to scales of 1 on them without a word; GPTQ blamed its
    Hessian. Both now say what is wrong, before anything changes."""
    import torch.nn as nn

    from dtype_policies import quantize
    from dtype_policies.quantizers import AWQConfig, GPTQConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = [torch.full((4, 64), value) if value != 1e20 else torch.randn(4, 64) * value]
    config = (GPTQConfig if mode == "gptq" else AWQConfig)(data, None, group_size=32)
    with pytest.raises(ValueError, match=r"module '0': its calibration inputs hold inf or NaN"):
        quantize(model, config=config, progress=False)
    state = model.state_dict()
    assert state.keys() == before.keys() and all(torch.equal(state[k], before[k]) for k in state)


def test_a_refit_on_few_calibration_rows_does_not_fit_the_weights_to_them():
    # a rarely routed expert: 12 rows for 256 inputs (H of rank 12)
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    rows = torch.randn(12, 256)
    held_out = torch.randn(512, 256)
    scale, zero, maxq = gptq.refined_grid(w, bits=4, group_size=32)
    g_idx = torch.arange(256) // 32
    q = gptq.quantize_with_zero_point(w, scale[:, g_idx], zero[:, g_idx], maxq).to(torch.int32)
    hessian = 2 * rows.T @ rows / 12

    def held_out_error(new_grid):
        weights = gptq.dequantize_with_sz_map(q, *new_grid, g_idx)
        return float((held_out @ (weights - w).T).norm() / (held_out @ w.T).norm())

    rtn = held_out_error((scale, zero))
    assert held_out_error(gptq.refit_grid(w, q, scale, zero, g_idx, hessian, samples=12)) < rtn
    # told nothing of the rows (and undamped): fitted to them
    unshrunk = held_out_error(gptq.refit_grid(w, q, scale, zero, g_idx, hessian, damping=0))
    assert unshrunk > 3 * rtn


def test_a_refit_on_many_calibration_rows_is_the_plain_fit():
    # a dense layer's 65,536 calibration rows: the shrinkage vanishes, and no
    # damping is added to it (which cost SmolLM2 gptq/4/128 2% perplexity)
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    rows = torch.randn(4096, 256) * torch.linspace(0.01, 3.0, 256)  # quiet and loud inputs
    scale, zero, maxq = gptq.refined_grid(w, bits=4, group_size=32)
    g_idx = torch.arange(256) // 32
    q = gptq.quantize_with_zero_point(w, scale[:, g_idx], zero[:, g_idx], maxq).to(torch.int32)
    hessian = 2 * rows.T @ rows / len(rows)
    plain = gptq.refit_grid(w, q, scale, zero, g_idx, hessian, damping=0)
    many = gptq.refit_grid(w, q, scale, zero, g_idx, hessian, damping=0.01, samples=10**9)
    for ours, theirs in zip(many, plain):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
