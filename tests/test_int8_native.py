"""This library's AVX2 s8 x s8 kernel (`kernels/int8_native.py`,
`_csrc/int8_avx2.cpp`): exact integer accumulators on CPUs without VNNI, the
W8A8 path there (`Int8Runtime`, eager and in frozen compiled graphs).

It runs on any x86 CPU with AVX2 and FMA, so the kernel cases call it directly
wherever it can be built; where the policies use it is the processor's
business (`int8.native_applies`), tested at the end."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from dtype_policies import _cpu, quantize
from dtype_policies import _native as native
from dtype_policies._core.module_state import quantization_of
from dtype_policies.apply.kernel_report import kernel_of
from dtype_policies.quantization import Int8QuantizationConfig
from dtype_policies.quantization.kernels import int8 as int8_kernels
from dtype_policies.quantization.kernels import int8_native
from dtype_policies.quantizers import abs_max_quantize
from native_kernels import RUNS_HERE, needs_kernel


def _exact(xq: torch.Tensor, q_nk: torch.Tensor) -> torch.Tensor:
    return xq.long() @ q_nk.long().t()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 64, 67, 130])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (8, 4), (17, 7), (16, 576), (33, 130), (200, 1536)])
def test_products_are_the_exact_integer_sums(rows, n, k):
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
    xq = torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=generator)
    y = int8_native.int8_mm(xq, int8_native.pack(q), n)
    assert y.dtype == torch.int32 and y.shape == (rows, n)
    assert torch.equal(y.long(), _exact(xq, q))


@needs_kernel
@pytest.mark.parametrize("weight", [127, -127, -128])
@pytest.mark.parametrize("sign", [1, -1])
def test_extreme_values_do_not_saturate(weight, sign):
    """Every pair of products at its largest magnitude: what saturates u8 x s8
    pair sums without VNNI (and the -128 weight, whose magnitude is 128)."""
    k = 1536
    q = torch.full((24, k), weight, dtype=torch.int8)
    xq = torch.full((5, k), 127 * sign, dtype=torch.int8)
    y = int8_native.int8_mm(xq, int8_native.pack(q), 24)
    assert torch.equal(y.long(), torch.full((5, 24), 127 * sign * weight * k))


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 9),
    n=st.integers(1, 40),
    k=st.integers(1, 70),
    seed=st.integers(0, 2**16),
)
def test_any_shape_is_exact(rows, n, k, seed):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
    xq = torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=generator)
    assert torch.equal(int8_native.int8_mm(xq, int8_native.pack(q), n).long(), _exact(xq, q))


@needs_kernel
def test_strided_inputs_and_empty_rows():
    q = torch.randint(-128, 128, (20, 64), dtype=torch.int8)
    wide = torch.randint(-127, 128, (6, 128), dtype=torch.int8)
    xq = wide[:, ::2]  # not contiguous
    assert torch.equal(int8_native.int8_mm(xq, int8_native.pack(q), 20).long(), _exact(xq, q))
    assert int8_native.int8_mm(wide[:0, :64], int8_native.pack(q), 20).shape == (0, 20)


@needs_kernel
def test_operator_errors_name_what_is_wrong():
    q = torch.randint(-128, 128, (20, 64), dtype=torch.int8)
    packed = int8_native.pack(q)
    xq = torch.zeros(2, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="holds -128"):
        int8_native.int8_mm(torch.full((2, 64), -128, dtype=torch.int8), packed, 20)
    with pytest.raises(RuntimeError, match="xq must be a 2-D int8 tensor, got Float"):
        int8_native.int8_mm(xq.float(), packed, 20)
    with pytest.raises(RuntimeError, match="for n=40"):
        int8_native.int8_mm(xq, packed, 40)
    with pytest.raises(RuntimeError, match="xq has K=60 inputs; the packed weight holds Kp=64"):
        int8_native.int8_mm(xq[:, :60], packed, 20)


def test_packing_is_ops_on_the_stored_tensors_only():
    """A frozen compiled graph folds the packing into a constant only when
    every op of it reads the stored tensor."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q = torch.randint(-128, 128, (30, 70), dtype=torch.int8)
    graph = make_fx(int8_native.pack)(q)
    calls = [node for node in graph.graph.nodes if node.op == "call_function"]
    assert calls
    for node in calls:
        inputs = [a for a in node.all_input_nodes if a.op in ("placeholder", "call_function")]
        assert inputs, f"{node.target} builds a tensor from nothing"


# --- the W8A8 path ---


def _runtime(n: int, k: int, seed: int):
    torch.manual_seed(seed)
    q, scale = abs_max_quantize(torch.randn(n, k) * 0.05, axis=1)
    runtime = int8_kernels.Int8Runtime()
    runtime.refresh(q, scale[:, 0], lambda data: data, True)
    return runtime


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 16, 64])
def test_native_path_gives_the_exact_paths_values_bit_for_bit(rows):
    with _cpu.emulate("avx2"):
        runtime = _runtime(96, 200, rows)
        assert runtime.w8a8_path(rows) == "native"
        x = torch.randn(rows, 200)
        bias = torch.randn(96)
        native_out = int8_kernels.int8_linear(x, runtime, bias, torch.float32)
        float_out = int8_kernels.int8_linear(x, runtime, bias, torch.float32, "float")
    assert torch.equal(native_out, float_out)


@pytest.mark.parametrize("rows", [1, 4, 9, 64])
def test_every_w8a8_path_of_a_large_weight_gives_the_exact_paths_values(rows):
    """oneDNN applied the column steps inside its product, then the row
    steps: the other paths multiply by the row steps first. A row's outputs
    then depended on how many rows shared its call (1-3 rows ran another
    path than 4 and more: 326 of 1,000 outputs a float32 bit apart)."""
    runtime = _runtime(1000, 577, rows)  # 2**18 elements and more: oneDNN's
    x = torch.randn(rows, 577)
    bias = torch.randn(1000)
    exact = int8_kernels.int8_linear(x, runtime, bias, torch.float32, "float")
    for path in runtime.w8a8_paths():
        out = int8_kernels.int8_linear(x, runtime, bias, torch.float32, path)
        assert torch.equal(out, exact), path
    for out_dtype in (torch.bfloat16, torch.float32):
        batched = int8_kernels.int8_linear(x, runtime, bias, out_dtype)
        alone = torch.cat(
            [int8_kernels.int8_linear(x[i : i + 1], runtime, bias, out_dtype) for i in range(rows)]
        )
        assert torch.equal(batched, alone)


@needs_kernel
def test_rows_with_nan_or_inf_give_nan_rows():
    with _cpu.emulate("avx2"):
        runtime = _runtime(32, 64, 0)
        x = torch.randn(4, 64)
        x[1, 3] = float("nan")
        x[2, 5] = float("inf")
        y = int8_kernels.int8_linear(x, runtime, None, torch.float32)
    assert y[1].isnan().all() and y[2].isnan().all()
    assert y[0].isfinite().all() and y[3].isfinite().all()


@pytest.mark.slow
@needs_kernel
def test_frozen_compiled_w8a8_runs_the_kernel_with_the_eager_values():
    from dtype_policies import compile_for_inference

    with _cpu.emulate("avx2"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(96, 64), nn.GELU(), nn.Linear(64, 40)).eval()
        quantize(model, "int8", Int8QuantizationConfig())
        assert kernel_of(model[0]).startswith("int8 AVX2 s8 x s8 kernel")
        x = torch.randn(5, 96)
        with torch.inference_mode():
            eager = model(x)
            torch._dynamo.reset()
            compiled = compile_for_inference(model, autotune=False)(x)
        assert quantization_of(model[0]).runtime.native is not None
    # The same integer sums; Inductor may fuse the rescale differently (float32 rounding).
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


def test_policies_use_the_kernel_exactly_where_int8_products_saturate(monkeypatch):
    for name in ("avx2", "avx512", "avx512_vnni", "amx"):
        with _cpu.emulate(name) as cpu:
            expected = RUNS_HERE and not cpu.exact_int8
            assert int8_kernels.native_applies(torch.device("cpu"), cpu) == expected, name
    monkeypatch.setenv(native.DISABLE_VARIABLE, "0")
    with _cpu.emulate("avx2") as cpu:
        assert not int8_kernels.native_applies(torch.device("cpu"), cpu)
        runtime = _runtime(16, 32, 1)
        assert runtime.native is None and runtime.w8a8_path(4) != "native"
