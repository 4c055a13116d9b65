"""The quantized products compute the same values on one thread and on
several: the kernels split their work among torch's threads (columns or
units of rows and panels), never the sums of one output."""

import pytest
import torch
from torch import nn

from dtype_policies import apply_policy, quantize
from dtype_policies.quantizers import Int4QuantizationConfig, Int8QuantizationConfig
from native_kernels import on_one_and_several_threads

# (mode, config, rows): the integer products at every row count (their sums are
# exact, whatever the split); int4 weight-only at the few rows its kernels take
# on every class (from more rows some classes decode it into torch's GEMMs).
CASES = {
    "int8": ("int8", None, (1, 3, 40)),
    "int8 W8A8 per token": ("int8", Int8QuantizationConfig(), (1, 3, 40)),
    "int4/32 W4A8": (
        "int4",
        Int4QuantizationConfig(block_size=32, activation_block_size=32),
        (1, 3, 40),
    ),
    "int4/128": ("int4", Int4QuantizationConfig(block_size=128), (1, 3)),
    "int4 per channel": ("int4", Int4QuantizationConfig(block_size=-1), (1, 3)),
}


@pytest.mark.parametrize(
    ("case", "rows"), [(case, rows) for case, (*_, counts) in CASES.items() for rows in counts]
)
def test_one_thread_and_several_give_the_same_values(case, rows):
    mode, config, _ = CASES[case]
    torch.manual_seed(0)
    model = nn.Linear(1024, 1000)  # large enough for every kernel to go parallel
    apply_policy(model, "mixed_bfloat16")
    quantize(model, mode, config)
    x = torch.randn(rows, 1024)
    with torch.inference_mode():
        one, several = on_one_and_several_threads(lambda: model(x))
    assert one.dtype == several.dtype == torch.bfloat16
    assert torch.equal(one, several), case
