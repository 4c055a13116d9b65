"""What each weight's statistics are built from, in a Hugging Face decoder:
the rows of its inputs in the block (row count, values), and the attention
sink's rows weighted up in the queries', keys' and values' statistics only
(the defect behind GPTQ losing to round to nearest on SmolLM2-135M: unweighted,
GPTQ moved rounding error onto the first token, which every token attends to),
and massive rows capped in every other weight's."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtype_policies import quantize
from dtype_policies.quantization import calibration
from dtype_policies.quantization.schemes import calibrated_int
from dtype_policies.quantization.schemes.gptq import GPTQScheme
from dtype_policies.quantizers import GPTQConfig

from .test_models import llama, token_data

transformers = pytest.importorskip("transformers")

SAMPLES, LENGTH = 4, 16


def _pipeline_hessians(model, monkeypatch):
    """The Hessian each weight of the first block was quantized from."""
    seen = {}
    original = GPTQScheme.quantize_calibrated

    def recording(self, weight, spec, config, statistics):
        seen[id(weight)] = (statistics.hessian.clone(), statistics.rows)
        return original(self, weight, spec, config, statistics)

    monkeypatch.setattr(GPTQScheme, "quantize_calibrated", recording)
    config = GPTQConfig(
        token_data(), None, num_samples=SAMPLES, sequence_length=LENGTH, group_size=32
    )
    config.quantization_layer_structure = [model.model.layers[0]]
    weights = {
        name: module.weight
        for name, module in model.model.layers[0].named_modules()
        if isinstance(module, torch.nn.Linear)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        quantize(model, config=config, progress=False)
    return {name: seen[id(w)] for name, w in weights.items()}


def _hooked_inputs(model):
    """Each linear's float32 inputs in the first block, from a plain forward."""
    inputs = {}
    hooks = [
        module.register_forward_pre_hook(lambda m, a, name=name: inputs.__setitem__(name, a[0]))
        for name, module in model.model.layers[0].named_modules()
        if isinstance(module, torch.nn.Linear)
    ]
    windows = calibration_windows()
    with torch.no_grad():
        model(input_ids=windows, use_cache=False)
    for hook in hooks:
        hook.remove()
    return inputs


def calibration_windows():
    from dtype_policies.quantizers.calibration_data import token_windows

    return token_windows(token_data(), None, SAMPLES, LENGTH)


def test_each_weight_gets_its_own_rows_and_the_sink_counts_only_for_attention_inputs(
    monkeypatch,
):
    model = llama(layers_count=2)
    reference = _hooked_inputs(llama(layers_count=2))
    hessians = _pipeline_hessians(model, monkeypatch)
    assert set(hessians) == set(reference)
    for name, x in reference.items():
        rows = x.reshape(-1, x.shape[-1])
        hessian, count = hessians[name]
        assert count == SAMPLES * LENGTH, name
        expected = _weighted_hessian(rows, _sink_weights(name))
        torch.testing.assert_close(hessian, expected, rtol=1e-4, atol=1e-6, msg=name)


def _sink_weights(name: str) -> torch.Tensor:
    """The row weights of weight `name`'s statistics before any cap: the first
    position's rows `SINK_ROW_WEIGHT` for an attention's input projections."""
    weights = torch.ones(SAMPLES, LENGTH)
    if name.split(".")[-1] in ("q_proj", "k_proj", "v_proj"):
        weights[:, 0] = calibration.SINK_ROW_WEIGHT
    return weights.reshape(-1)


def _weighted_hessian(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return 2 * (rows * weights[:, None]).T @ rows / weights.sum()


def _planting_a_massive_row(model, factor: float = 1000.0):
    """The first position's input of block 0's MLP down projection scaled by
    `factor` (energy `factor**2` times its own), as the attention sink's is in
    trained decoders."""

    def plant(module, args):
        x = args[0].clone()
        x[:, 0] *= factor
        return (x, *args[1:])

    model.model.layers[0].mlp.down_proj.register_forward_pre_hook(plant)
    return model


def test_a_massive_row_counts_at_most_the_cap_times_the_typical_rows_energy(monkeypatch):
    model = _planting_a_massive_row(llama(layers_count=2))
    reference = _hooked_inputs(_planting_a_massive_row(llama(layers_count=2)))
    hessians = _pipeline_hessians(model, monkeypatch)
    for name, x in reference.items():
        rows = x.reshape(-1, x.shape[-1])
        weights = _sink_weights(name)
        if name.endswith("down_proj"):
            energy = rows.double().square().sum(1)
            typical = energy.median()
            massive = energy > calibration.MASSIVE_ROW_CAP * typical
            assert massive.sum() == SAMPLES  # the planted rows, and only they
            weights[massive] = (calibration.MASSIVE_ROW_CAP * typical / energy[massive]).float()
            assert bool((weights[massive] < 1e-3).all())
        expected = _weighted_hessian(rows, weights)
        torch.testing.assert_close(hessians[name][0], expected, rtol=1e-4, atol=1e-6, msg=name)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40),
    features=st.integers(1, 12),
    seed=st.integers(0, 2**16),
    massive=st.lists(st.floats(1.0, 1e6), max_size=5),
    zero_rows=st.integers(0, 5),
)
def test_capped_row_weights_bound_every_row_and_leave_typical_rows_whole(
    rows, features, seed, massive, zero_rows
):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=generator)
    for i, factor in enumerate(massive[:rows]):
        x[i] *= factor
    x[rows - min(zero_rows, rows) :] = 0
    weights = calibration._capped_row_weights(x)
    energy = x.double().square().sum(1)
    nonzero = energy[energy > 0]
    if nonzero.numel() == 0:
        assert weights is None
        return
    bound = calibration.MASSIVE_ROW_CAP * float(nonzero.median())
    if weights is None:
        assert float(energy.max()) <= bound * (1 + 1e-5)
        return
    assert weights.shape == (rows,) and weights.dtype == torch.float32
    assert bool((weights <= 1).all()) and bool((weights > 0).all())
    assert bool((weights.double() * energy <= bound * (1 + 1e-4)).all())
    typical = energy <= bound * (1 - 1e-4)
    assert bool((weights[typical] == 1).all())
    massive_rows = energy > bound * (1 + 1e-4)
    torch.testing.assert_close(
        weights.double()[massive_rows] * energy[massive_rows],
        torch.full((int(massive_rows.sum()),), bound, dtype=torch.float64),
        rtol=1e-4,
        atol=0,
    )


def test_row_weights_give_the_weighted_second_moment():
    torch.manual_seed(0)
    rows = torch.randn(50, 8)
    weights = torch.rand(50) * 4
    stats = calibrated_int.InputStatistics(8)
    stats.update(rows[:20], weights[:20])
    stats.update(rows[20:], weights[20:])
    expected = 2 * (rows * weights[:, None]).T @ rows / weights.sum()
    torch.testing.assert_close(stats.hessian, expected, rtol=1e-5, atol=1e-6)
    plain = calibrated_int.InputStatistics(8)
    plain.update(rows)
    torch.testing.assert_close(plain.hessian, 2 * rows.T @ rows / 50, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="Row weights of shape"):
        stats.update(rows, weights[:3])


def _calibrated_state(model, config, monkeypatch, stop_early: bool):
    if not stop_early:
        monkeypatch.setattr(calibration, "_record_order", lambda *args: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        quantize(model, config=config, progress=False)
    monkeypatch.undo()
    return model.state_dict()


@pytest.mark.parametrize("mode", ["gptq", "awq"])
def test_later_calls_stop_after_the_last_target_and_store_the_same_integers(mode, monkeypatch):
    """After a first whole call, the statistics pass stops each call at the
    block's last target (a decoder layer's down projection is not computed):
    the statistics, hence the stored integers, are those of whole calls."""
    from dtype_policies.quantizers import AWQConfig

    config_class = GPTQConfig if mode == "gptq" else AWQConfig

    def config():  # 3 batches of 8 windows
        return config_class(
            token_data(),
            None,
            num_samples=24,
            sequence_length=LENGTH,
            group_size=32,
            calibration_batch_size=8,
        )

    results, down_calls = [], []
    for stop_early in (True, False):
        model = llama(layers_count=2)
        count = [0]
        model.model.layers[0].mlp.down_proj.register_forward_hook(
            lambda *a, count=count: count.__setitem__(0, count[0] + 1)
        )
        results.append(_calibrated_state(model, config(), monkeypatch, stop_early))
        down_calls.append(count[0])
    # the chain check: 1; statistics: 1 whole call then 2 stopped (or 3 whole); next inputs: 3
    assert down_calls == [1 + 1 + 3, 1 + 3 + 3]
    stopped, whole = results
    assert stopped.keys() == whole.keys()
    assert all(torch.equal(stopped[key], whole[key]) for key in whole)


def test_a_target_called_twice_per_call_is_observed_in_every_call(monkeypatch):
    """A block calling one target twice (shared weights) never stops early:
    both calls' rows count, in every batch."""
    torch.manual_seed(0)

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = torch.nn.Linear(32, 32)
            self.out = torch.nn.Linear(32, 32)

        def forward(self, x):
            return x + self.out(torch.relu(self.shared(torch.relu(self.shared(x)))))

    blocks = torch.nn.Sequential(Twice(), Twice())
    data = [torch.randn(4, 32) for _ in range(3)]
    rows = []
    original = calibrated_int.InputStatistics.update

    def counting(self, x, row_weights=None):
        rows.append(x.shape[0])
        return original(self, x, row_weights)

    monkeypatch.setattr(calibrated_int.InputStatistics, "update", counting)
    config = GPTQConfig(data, None, group_size=16)
    config.quantization_layer_structure = list(blocks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        quantize(blocks, config=config, progress=False)
    # 3 batches x (2 calls of `shared` + 1 of `out`) x 2 blocks, 4 rows each
    assert rows == [4] * (3 * 3 * 2)


@pytest.mark.parametrize("k", [8, 575, 576, 1000, 1536])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gram_matrix_from_its_upper_blocks_is_the_whole_product(k, dtype):
    torch.manual_seed(0)
    x = torch.randn(300, k).to(dtype)
    gram = calibrated_int.symmetric_gram(x)
    assert gram.dtype == dtype and torch.equal(gram, gram.t())
    expected = x.t() @ x
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(gram.float(), expected.float(), rtol=tolerance, atol=tolerance * 30)
