"""Kernel paths: each fast path agrees with the exact reference, compiled or not."""

import pytest
import torch

from dtype_policies.quantization import kernels
from dtype_policies.quantization.quantizers import (
    abs_max_quantize,
    dequantize_grouped,
    grouped_quantize_with_zero_point,
)


@pytest.fixture
def compiled_epilogues():
    kernels.set_compile_epilogues(True)
    yield
    kernels.set_compile_epilogues(False)


def _int8_reference(x, q_nk, scale, bias):
    xq, xs = abs_max_quantize(x, axis=-1)
    return (xq.float() @ q_nk.float().t()) / (xs * scale) + bias


@pytest.mark.parametrize("rows", [1, 3, 16, 40])  # below and above the oneDNN threshold
def test_int8_linear_paths_are_exact(rows):
    torch.manual_seed(rows)
    weight = torch.randn(96, 80) * 0.05
    q, scale = abs_max_quantize(weight, axis=1)
    scale = scale[:, 0]
    bias = torch.randn(96)
    x = torch.randn(rows, 80)
    runtime = kernels.Int8Runtime()
    out = kernels.int8_linear(x, q, 1 / scale, bias, torch.float32, runtime)
    torch.testing.assert_close(out, _int8_reference(x, q, scale, bias), atol=1e-4, rtol=1e-5)
    assert (runtime.packed is not None) == kernels._onednn_available()


def test_int8_linear_3d_input_and_bfloat16_output():
    weight = torch.randn(32, 24)
    q, scale = abs_max_quantize(weight, axis=1)
    x = torch.randn(2, 20, 24)
    out = kernels.int8_linear(
        x.bfloat16(), q, 1 / scale[:, 0], None, torch.bfloat16, kernels.Int8Runtime()
    )
    assert out.shape == (2, 20, 32) and out.dtype == torch.bfloat16
    reference = _int8_reference(x.bfloat16().float().reshape(-1, 24), q, scale[:, 0], 0)
    torch.testing.assert_close(out.float().reshape(-1, 32), reference, atol=0.05, rtol=0.02)


def test_int8_runtime_follows_weight_changes():
    q = torch.randint(-127, 128, (16, 32), dtype=torch.int8)
    scale = torch.rand(16) + 0.5
    runtime = kernels.Int8Runtime()
    x = torch.randn(20, 32)
    first = kernels.int8_linear(x, q, 1 / scale, None, torch.float32, runtime)
    q.mul_(-1)
    second = kernels.int8_linear(x, q, 1 / scale, None, torch.float32, runtime)
    torch.testing.assert_close(second, -first)


@pytest.mark.parametrize(
    ("rows", "dtype"),
    [(1, torch.bfloat16), (4, torch.bfloat16), (64, torch.bfloat16), (3, torch.float32)],
)
def test_int8_weight_only(rows, dtype):
    weight = torch.randn(48, 64)
    q, scale = abs_max_quantize(weight, axis=1)
    x = torch.randn(rows, 64).to(dtype)
    out = kernels.int8_weight_only_linear(x, q, 1 / scale[:, 0], torch.ones(48), dtype)
    reference = x.float() @ (q.float() / scale).t() + 1
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(out.float(), reference, atol=tolerance, rtol=0.02)


@pytest.mark.parametrize(
    ("n", "k", "block"), [(64, 256, 128), (64, 256, 32), (48, 200, 40), (30, 256, 128)]
)
def test_int4_kernel_and_fallback_agree(n, k, block):
    torch.manual_seed(n + k)
    w_kn = torch.randn(k, n) * 0.05
    q, scale, zero = grouped_quantize_with_zero_point(w_kn, block)
    dense = dequantize_grouped(q, scale, zero, block)  # (K, N)
    x = torch.randn(3, k)
    runtime = kernels.Int4Runtime()
    out = kernels.int4_linear(
        x.bfloat16(), lambda: q.t(), (q,), scale, zero, block, n, None, torch.bfloat16, runtime
    )
    kernel_applies = n % 16 == 0 and block in (32, 64, 128, 256) and k % block == 0
    assert (runtime.packed is not None) == kernel_applies
    reference = x.bfloat16().float() @ dense
    assert ((out.float() - reference).norm() / reference.norm()).item() < 0.01
    exact = kernels.int4_linear(
        x, lambda: q.t(), (q,), scale, zero, block, n, None, torch.float32, kernels.Int4Runtime()
    )
    torch.testing.assert_close(exact, x @ dense, atol=1e-4, rtol=1e-4)


def test_int4_per_channel_kernel():
    w = torch.randn(64, 96) * 0.05
    q, scale = abs_max_quantize(w, axis=1, value_range=(-8, 7))
    runtime = kernels.Int4Runtime()
    x = torch.randn(2, 96)
    out = kernels.int4_linear(
        x.bfloat16(), lambda: q, (q,), scale[:, 0], None, -1, 64, None, torch.bfloat16, runtime
    )
    assert runtime.packed is not None and runtime.group_size == 32
    reference = x @ (q.float() / scale).t()
    assert ((out.float() - reference).norm() / reference.norm()).item() < 0.01


def test_compiled_epilogues_match_eager(compiled_epilogues):
    torch.manual_seed(0)
    weight = torch.randn(64, 64) * 0.05
    q, scale = abs_max_quantize(weight, axis=1)
    x = torch.randn(32, 64)
    bias = torch.randn(64)
    compiled = kernels.int8_linear(
        x, q, 1 / scale[:, 0], bias, torch.float32, kernels.Int8Runtime()
    )
    kernels.set_compile_epilogues(False)
    eager = kernels.int8_linear(x, q, 1 / scale[:, 0], bias, torch.float32, kernels.Int8Runtime())
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
