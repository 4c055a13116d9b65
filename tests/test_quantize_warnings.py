"""The one warning of `quantize()`: weights a user would expect quantized and
that stay in floating point, and nothing else (normalization scales, a
calibrated mode's embeddings and output head, what was filtered out)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import dtype_policies
from dtype_policies import quantize
from dtype_policies.quantizers import GPTQConfig


def quantize_recording(model: nn.Module, *args, **kwargs):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        report = quantize(model, *args, **kwargs)
    messages = [str(w.message) for w in seen if str(w.message).startswith("quantize()")]
    assert len(messages) <= 1
    return report, (messages[0] if messages else None)


def test_norms_and_scales_are_skipped_without_a_word():
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.RMSNorm(16), nn.Linear(16, 4))
    report, message = quantize_recording(model, "int8")
    assert message is None
    assert report.skipped == [("1", "no weight matrix"), ("2", "no weight matrix")]


def test_tensors_added_to_every_row_are_not_weight_matrices():
    class Embeddings(nn.Module):  # ViT's: a class token and position embeddings
        def __init__(self):
            super().__init__()
            self.cls_token = nn.Parameter(torch.zeros(1, 1, 16))
            self.position_embeddings = nn.Parameter(torch.zeros(1, 5, 16))

        def forward(self, x):
            return torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1) + (
                self.position_embeddings
            )

    model = nn.Sequential(Embeddings(), nn.Linear(16, 16))
    report, message = quantize_recording(model, "int8")
    assert message is None and report.skipped == [("0", "no weight matrix")]


def test_a_module_of_no_quantizable_kind_is_named_with_its_share_of_the_parameters():
    class Experts(nn.Module):  # transformers 5's mixture of experts: one 3-D weight
        def __init__(self):
            super().__init__()
            self.gate_up = nn.Parameter(torch.randn(4, 32, 16))

        def forward(self, x):
            return torch.einsum("bh,eoh->beo", x, self.gate_up).sum(1)

    model = nn.Sequential(nn.Linear(16, 16), Experts())
    report, message = quantize_recording(model, "int4")
    assert report.unsupported_parameters == 4 * 32 * 16
    assert report.total_parameters == 16 * 16 + 16 + 4 * 32 * 16
    assert "'1' (Experts, not a quantizable kind)" in message
    assert "88.3% of the model's parameters stay in floating point" in message


def test_parametrized_weights_are_reported_at_their_module_with_their_share():
    """`weight_norm` moves a weight into `<module>.parametrizations.weight`:
    its convolution was reported as having "no weight matrix" (false), and
    torch's internal `ParametrizationList` was named as a module of no
    quantizable kind instead of the user's layer."""
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    model = nn.Sequential(
        weight_norm(nn.Linear(96, 96)), weight_norm(nn.Conv1d(96, 96, 3, groups=4), dim=2),
        nn.Linear(96, 8),
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = quantize(model, "int8")
    assert dict(report.skipped) == {
        "0": "no quantize support: its weights are parametrized (torch.nn.utils.parametrize)",
        "1": "no quantize support: Conv1d, not a quantizable kind",
    }
    floating = sum(p.numel() for p in (*model[0].parameters(), *model[1].parameters()))
    assert report.unsupported_parameters == floating
    message = str(next(w.message for w in caught if "holding weight matrices" in str(w.message)))
    assert "2 module(s)" in message and "ParametrizationList" not in message


def test_quantizing_again_in_another_mode_says_that_nothing_changed():
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    quantize(model, "int8")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report, message = quantize_recording(model, "int4")
    assert report.num_quantized == 0 and report.other_modes == ["int8", "int8"]
    assert "2 module(s) already quantized in mode 'int8' were left as they are" in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    _, again = quantize_recording(model, "int8")  # the same mode: nothing to say
    assert again is None


def test_quantizing_again_in_the_same_mode_with_another_config_says_it_was_not_applied():
    from dtype_policies.quantizers import Int4QuantizationConfig

    model = nn.Sequential(nn.Linear(64, 16))
    quantize(model, "int4", config=Int4QuantizationConfig(block_size=32))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report, message = quantize_recording(
        model, "int4", config=Int4QuantizationConfig(block_size=-1)
    )
    assert report.num_quantized == 0 and report.other_configs and "'0' " not in message
    assert "already quantized in mode 'int4' with another configuration" in message
    assert "0 (Int4QuantizationConfig(" in message and "block_size=32" in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # the same config, or none given: quiet, as before
    for config in (Int4QuantizationConfig(block_size=32), None):
        assert quantize_recording(model, "int4", config=config)[1] is None


def test_quantizing_the_rest_in_another_mode_is_quiet():
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    quantize(model, "int4", filters="^0$")
    report, message = quantize_recording(model, "int8")
    assert [path for path, *_ in report.quantized] == ["2"]
    assert message is None


def test_linears_left_outside_the_calibrated_blocks_are_named():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4
    )
    model = transformers.T5ForConditionalGeneration(config).eval()
    data = [
        torch.randint(3, 100, (16,), generator=torch.Generator().manual_seed(i)) for i in range(2)
    ]
    gptq = GPTQConfig(data, None, weight_bits=4, num_samples=2, sequence_length=16, group_size=32)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        report = quantize(model, "gptq", config=gptq, progress=False)
    chain, message = [str(w.message) for w in seen if str(w.message).startswith("quantize()")]
    # T5's blocks 1 on take the position bias block 0 computes: no chain, so the
    # encoder (not the whole model, which needs decoder inputs) is calibrated as one block
    assert "takes another 'position_bias' than block 0" in chain
    assert "calibrating 'encoder' as one block" in chain
    assert report.quantized and all(path.startswith("encoder/") for path, *_ in report.quantized)
    assert report.outside_linears and all(p.startswith("decoder/") for p in report.outside_linears)
    assert "lm_head" not in report.outside_linears  # the output head: left float, as Keras
    assert (
        f"{len(report.outside_linears)} linear module(s) outside the calibrated blocks" in message
    )


def test_weights_read_by_their_parent_count_in_the_float_share():
    """`nn.TransformerEncoderLayer` reads its linears' weights itself (its fused
    fast path): none can be quantized, and the warning's share says so."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    with pytest.warns(UserWarning) as caught:
        report = quantize(layer, "int8")
    assert not report.quantized
    norms = sum(p.numel() for name, p in layer.named_parameters() if "norm" in name)
    total = sum(p.numel() for p in layer.parameters())
    assert report.unsupported_parameters == total - norms
    share = f"{100 * (total - norms) / total:.1f}% of the model's parameters stay in floating point"
    assert any(share in str(w.message) for w in caught)


def test_an_embedding_subclass_with_its_own_forward_gets_advice_that_works():
    class Scaled(torch.nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 2.0

    model = torch.nn.Sequential(Scaled(64, 8))
    with pytest.warns(UserWarning, match="not quantized"):
        report = dtype_policies.quantize(model, "int8")
    reason = " ".join(why for _, why in report.skipped)
    assert "nn.Embedding" in reason and "register_linear_kind" not in reason, reason
    with pytest.raises(TypeError, match=r"Scaled is an nn\.Embedding"):
        dtype_policies.quantization.register_linear_kind(Scaled)
