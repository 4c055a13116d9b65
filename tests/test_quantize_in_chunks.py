"""Large weights are quantized a chunk of outputs at a time
(`schemes.base.quantize_by_outputs`): the stored tensors must be the ones
the whole weight gives, for every module kind and layout, every config.
int4's zero-point solver judges chunks of outputs by their own error, so
its chunks are a multiple of those (`Scheme.output_chunk`)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dtype_policies import layers, quantize
from dtype_policies._modes import mode_record
from dtype_policies.quantization import Int4QuantizationConfig, Int8QuantizationConfig
from dtype_policies.quantization.schemes import base
from dtype_policies.quantizers import zero_points

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "int8": None,
    "int8 per channel": Int8QuantizationConfig(),
    "int8 weight-only": Int8QuantizationConfig(activation_quantizer=None),
    "int8 blocks of 64 (not dividing K = 80)": Int8QuantizationConfig(
        block_size=64, activation_block_size=32
    ),
    "int4": None,
    "int4/32": Int4QuantizationConfig(block_size=32),
    "int4/48 (not dividing K)": Int4QuantizationConfig(block_size=48),
    "int4 per channel": Int4QuantizationConfig(block_size=-1),
    "int4/32 scale search": Int4QuantizationConfig(block_size=32, scale_search=True),
    "int4/64 W4A8": Int4QuantizationConfig(block_size=64, activation_block_size=32),
}


class Holder(nn.Module):
    """One of each kind of quantizable weight, several chunks of outputs each."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(80, 333)
        self.table = nn.Embedding(301, 80)
        self.conv1d = transformers.pytorch_utils.Conv1D(270, 80)  # (in, out) layout
        self.dense = layers.Dense(333)
        self.dense.build((None, 80))
        self.einsum = layers.EinsumDense("abc,cde->abde", (None, 5, 66), bias_axes="de")
        self.einsum.build((None, None, 80))


@pytest.mark.parametrize("label", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_quantized_in_chunks_stores_what_the_whole_weight_does(label, dtype, monkeypatch):
    torch.manual_seed(0)
    model = Holder().to(dtype)
    with torch.no_grad():
        model.table.weight[7].mul_(100.0)  # rows of very different ranges
        model.linear.weight[:, 3].mul_(30.0)
    mode = label.split("/")[0].split(" ")[0]
    # the solver's chunks of outputs 4-64 wide here (a multiple of 64: several chunks)
    monkeypatch.setattr(zero_points, "_CHUNK_ELEMENTS", 1 << 10)
    whole, chunked = copy.deepcopy(model), copy.deepcopy(model)
    quantize(whole, mode, CONFIGS[label])
    monkeypatch.setattr(base, "CHUNK_BYTES", 64 * 4 * 80)  # 64 outputs of 80 inputs
    scheme_class = type(mode_record(mode).scheme)
    outputs = []
    whole_quantize = scheme_class.quantize

    def counting(self, weight, spec, config):
        outputs.append(spec.out_features)
        return whole_quantize(self, weight, spec, config)

    monkeypatch.setattr(scheme_class, "quantize", counting)
    quantize(chunked, mode, CONFIGS[label])
    if "/48" in label:  # the solver's spans of 48 and 32 rows: chunks of 1344 outputs
        assert len(outputs) == 5
    else:  # five weights of 270 to 333 outputs, each in chunks of 64 (int4: 192)
        assert len(outputs) >= 10 and max(outputs) <= 192
    expected, got = whole.state_dict(), chunked.state_dict()
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
