"""A mode registered in test code alone appears everywhere it must (the test
of the design: adding a mode is its record, its scheme and its config), and
disappears with its record."""

import warnings

import pytest
import torch

import dtype_policies
from dtype_policies import layers
from dtype_policies._modes import quantized_suffixes

from .everywhere import INPUTS, assert_everywhere, cli_quantize_choices, linear_model, quietly
from .toy import TOY8, TOYACT, ToyActConfig, ToyConfig, registered


@pytest.fixture
def toys():
    with registered(TOY8, TOYACT):
        yield


def test_a_plain_mode_from_test_code_appears_everywhere(toys, tmp_path):
    assert_everywhere(TOY8, ToyConfig(), tmp_path, tolerance=0.05)


def test_a_calibrated_mode_from_test_code_appears_everywhere(toys, tmp_path):
    assert_everywhere(TOYACT, ToyActConfig(dataset=[INPUTS]), tmp_path, tolerance=0.05)


def test_a_mode_unregistered_is_unknown_everywhere(tmp_path):
    with registered(TOY8):
        assert "toy8" in dtype_policies.QUANTIZATION_MODES
        assert "toy8" in cli_quantize_choices()
        policy = dtype_policies.get("toy8_from_float32")
        assert type(policy.quantization_config) is ToyConfig
    with pytest.raises(ValueError, match="Invalid quantization mode"):
        _ = policy.quantization_config  # never another mode's config
    assert "toy8" not in dtype_policies.QUANTIZATION_MODES
    assert "_toy8" not in quantized_suffixes()
    assert "toy8" not in cli_quantize_choices()
    with pytest.raises(ValueError, match="Invalid quantization mode"):
        dtype_policies.QuantizedDTypePolicy("toy8", "float32")
    with pytest.raises(ValueError, match="Cannot convert 'toy8_from_float32'"):
        dtype_policies.get("toy8_from_float32")  # no longer a mode: read as a dtype name
    with pytest.raises(ValueError, match="Invalid quantization mode"):
        quietly(dtype_policies.quantize, linear_model(), "toy8")


def test_a_linear_only_mode_leaves_embeddings_alone(toys):
    model = torch.nn.Sequential(torch.nn.Embedding(10, 16), torch.nn.Linear(16, 4))
    report = quietly(dtype_policies.quantize, model, "toy8")
    assert report.quantized == [("1", "toy8", "toy8_from_float32")]
    assert report.skipped == [("0", "not in the mode: embedding weights take int8, int4")]
    embedding = layers.Embedding(10, 4)
    embedding.build()
    with pytest.raises(NotImplementedError, match="Expected one of \\('int8', 'int4'\\)"):
        embedding.quantize("toy8")


def test_a_linear_tied_to_an_embedding_the_mode_leaves_float_stays_float_quietly(toys):
    embedding, head = torch.nn.Embedding(10, 16), torch.nn.Linear(16, 10, bias=False)
    head.weight = embedding.weight
    model = torch.nn.Sequential(embedding, torch.nn.Linear(16, 16), head)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the mode's scope: nothing to warn about
        report = dtype_policies.quantize(model, "toy8")
    assert report.quantized == [("1", "toy8", "toy8_from_float32")]
    assert dict(report.skipped)["2"] == (
        "not in the mode: its weight is shared with '0', which keeps it in floating point"
    )
    assert model[2].weight is model[0].weight


def test_layers_built_with_a_toy_policy(toys):
    dense = layers.Dense(8, dtype="toy8_from_mixed_bfloat16")
    out = dense(torch.randn(2, 16))
    assert out.dtype == torch.bfloat16 and dense.quantization_mode == "toy8"
    assert dense.kernel_toy8.dtype == torch.int8 and dense.kernel_toystep.shape == (8,)
    # a calibrated mode: placeholder tensors (Keras's loading path), filled by loading
    calibrated = layers.Dense(8, dtype="toyact_from_float32")
    calibrated.build((None, 16))
    assert calibrated.quantization_mode == "toyact"
    assert not calibrated.kernel_toyact.any() and bool((calibrated.kernel_toyact_mean == 1).all())
    # until then a call raises (it computed with the zeros: -sum(x) in every column)
    with pytest.raises(RuntimeError, match="holds no calibrated TOYACT weights yet"):
        calibrated(torch.randn(2, 16))
    source = layers.Dense(8)
    source.build((None, 16))
    source.quantize("toyact", ToyActConfig(dataset=[torch.randn(4, 16)]))
    calibrated.load_state_dict(source.state_dict())
    x = torch.randn(2, 16)
    assert torch.equal(calibrated(x), source(x))
