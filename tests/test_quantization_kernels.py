"""Kernel paths: each fast path agrees with the exact reference, compiled or not."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtype_policies._cpu import processor
from dtype_policies.quantization.kernels import epilogues
from dtype_policies.quantization.kernels import int4 as int4_kernels
from dtype_policies.quantization.kernels import int8 as int8_kernels
from dtype_policies.quantizers import (
    abs_max_quantize,
    dequantize_grouped,
    grouped_quantize_with_zero_point,
)


@pytest.fixture
def compiled_epilogues():
    epilogues.set_compile_epilogues(True)
    yield
    epilogues.set_compile_epilogues(False)


def _int8_reference(x, q_nk, scale, bias):
    xq, xs = abs_max_quantize(x, axis=-1)
    return (xq.float() @ q_nk.float().t()) / (xs * scale) + bias


def _runtime(q_nk, scale, prepack=True):
    runtime = int8_kernels.Int8Runtime()
    runtime.refresh(q_nk, scale, lambda data: data, prepack)
    return runtime


@pytest.mark.parametrize("rows", [1, 3, 16, 40])  # below and above the oneDNN threshold
def test_int8_linear_paths_are_exact(rows):
    torch.manual_seed(rows)
    weight = torch.randn(96, 80) * 0.05
    q, scale = abs_max_quantize(weight, axis=1)
    scale = scale[:, 0]
    bias = torch.randn(96)
    x = torch.randn(rows, 80)
    runtime = _runtime(q, scale)
    out = int8_kernels.int8_linear(x, runtime, bias, torch.float32)
    torch.testing.assert_close(out, _int8_reference(x, q, scale, bias), atol=1e-4, rtol=1e-5)
    native = int8_kernels.native_applies(x.device, processor())
    assert (runtime.native is not None) == native
    assert (runtime.packed is not None) == (int8_kernels._onednn_available() and not native)


def test_int8_linear_bfloat16_output_and_empty_batch():
    weight = torch.randn(32, 24)
    q, scale = abs_max_quantize(weight, axis=1)
    x = torch.randn(40, 24)
    runtime = _runtime(q, scale[:, 0])
    out = int8_kernels.int8_linear(x.bfloat16(), runtime, None, torch.bfloat16)
    assert out.shape == (40, 32) and out.dtype == torch.bfloat16
    reference = _int8_reference(x.bfloat16().float(), q, scale[:, 0], 0)
    torch.testing.assert_close(out.float(), reference, atol=0.05, rtol=0.02)
    empty = int8_kernels.int8_linear(x[:0], runtime, None, torch.float32)
    assert empty.shape == (0, 32)


def test_int8_runtime_follows_weight_changes():
    q = torch.randint(-127, 128, (16, 32), dtype=torch.int8)
    scale = torch.rand(16) + 0.5
    x = torch.randn(20, 32)
    runtime = _runtime(q, scale)
    first = int8_kernels.int8_linear(x, runtime, None, torch.float32)
    q.mul_(-1)
    runtime.refresh(q, scale, lambda data: data, True)
    second = int8_kernels.int8_linear(x, runtime, None, torch.float32)
    torch.testing.assert_close(second, -first)


@pytest.mark.parametrize(
    ("rows", "dtype", "k"),
    [
        (1, torch.bfloat16, 64),
        (4, torch.bfloat16, 64),
        (64, torch.bfloat16, 64),
        (3, torch.float32, 64),  # the packed kernel on inputs rounded to bfloat16
        (16, torch.float32, 64),  # float32 products, or as bfloat16 inputs where those are native
        (40, torch.float32, 64),
        (2, torch.float32, 17),
        (2, torch.bfloat16, 17),  # shapes the packed kernel does not take
        (5, torch.bfloat16, 100),
    ],
)
def test_int8_weight_only(rows, dtype, k):
    weight = torch.randn(48, k)
    q, scale = abs_max_quantize(weight, axis=1)
    x = torch.randn(rows, k).to(dtype)
    runtime = _runtime(q, scale[:, 0], prepack=False)
    path = int8_kernels.weight_only_path(x, runtime)
    out = int8_kernels.int8_weight_only_linear(x, runtime, torch.ones(48), dtype)
    reference = x.float() @ (q.float() / scale).t() + 1
    rounded = dtype == torch.float32 and path in ("int8pack_bfloat16", "dequantized_bfloat16")
    if rounded:
        if path == "int8pack_bfloat16":
            assert rows <= int8_kernels.float32_int8pack_max_rows(x.device) and k % 16 == 0
        # exactly the products' rounding: inputs and integer sums in bfloat16,
        # the float32 scale and bias after (up to the summation order: 1 ulp)
        sums = (x.bfloat16().float() @ q.float().t()).bfloat16().float()
        torch.testing.assert_close(out, sums / scale.t() + 1, atol=1e-5, rtol=2**-8)
        assert ((out - reference).norm() / reference.norm()).item() < 2**-8
    else:
        assert dtype != torch.float32  # float32 activations are always rounded on a CPU
        tolerance = 1e-4 if dtype == torch.float32 else 0.1
        torch.testing.assert_close(out.float(), reference, atol=tolerance, rtol=0.02)


@pytest.mark.parametrize(
    ("n", "k", "block"),
    [
        (64, 256, 128),
        (64, 256, 32),
        (48, 200, 40),  # a block that is not a multiple of 32: padded blocks
        (30, 256, 128),  # N not a multiple of 16: padded rows
        (24, 576, 128),  # a block that does not divide K: kernel groups of 64
        (16, 100, 64),  # K not a multiple of 32: a padded tail
        (7, 17, 32),
    ],
)
def test_int4_kernel_runs_every_shape(n, k, block):
    torch.manual_seed(n + k)
    w_kn = torch.randn(k, n) * 0.05
    q, scale, zero = grouped_quantize_with_zero_point(w_kn, block)
    dense = dequantize_grouped(q, scale, zero, block)  # (K, N)
    runtime = int4_kernels.Int4Runtime()
    runtime.refresh(q.t(), scale, zero, block, (q,))
    assert runtime.packed is not None  # never a per-call dequantization on CPU
    layout = runtime.layout
    assert layout.padded_k % layout.group == 0 and layout.group in int4_kernels.KERNEL_GROUPS
    if math.gcd(k, block) % 32 == 0:
        assert layout.padded_k == k and not layout.spread  # exact: repeated scales
    for rows, dtype in ((1, torch.bfloat16), (3, torch.float32), (20, torch.float16)):
        x = torch.randn(rows, k)
        out = int4_kernels.int4_linear(x.to(dtype), None, scale, zero, block, None, dtype, runtime)
        assert out.dtype == dtype and out.shape == (rows, n)
        reference = x.to(dtype).float() @ dense
        # bfloat16 activations, scales and outputs around the kernel
        assert ((out.float() - reference).norm() / reference.norm()).item() < 0.01


@pytest.mark.parametrize(("n", "k", "block"), [(32, 256, 64), (48, 200, 40), (24, 576, 128)])
def test_int4_kernel_folds_a_permuted_g_idx(n, k, block):
    """GPTQ's activation order (a `g_idx` permuting `arange(K) // block`)
    stays on the packed kernel: columns packed by group, the activations
    gathered (or, with padded blocks, scattered) into that order per call."""
    torch.manual_seed(k)
    q = torch.randint(-8, 8, (k, n), dtype=torch.int8)  # (K, N)
    groups = -(-k // block)
    scale = torch.rand(groups, n) * 0.02 + 0.01
    zero = torch.randn(groups, n)
    g_idx = (torch.arange(k) // block)[torch.randperm(k)].float()
    dense = dequantize_grouped(q, scale, zero, block, g_idx)  # (K, N)
    runtime = int4_kernels.Int4Runtime()
    runtime.refresh(q.t(), scale, zero, block, (q,), g_idx)
    assert runtime.packed is not None
    assert int4_kernels.int4_path(runtime, 1, block) == int4_kernels.cpu_kernel()
    x = torch.randn(3, k)
    out = int4_kernels.int4_linear(x, None, scale, zero, block, None, torch.float32, runtime)
    reference = x @ dense
    assert ((out - reference).norm() / reference.norm()).item() < 0.01
    # a g_idx that does not give each block `block` inputs: the dequantized path
    uneven = torch.zeros(k)
    runtime.refresh(q.t(), scale, zero, block, (q,), uneven)
    assert runtime.packed is None


@pytest.mark.parametrize(
    ("n", "k", "block", "permuted"),
    [
        (32, 256, 64, False),
        (48, 200, 40, True),
        (24, 576, 128, False),
        (24, 576, 128, True),
        (20, 100, -1, False),
    ],
)
def test_int4_frozen_trace_packs_in_the_graph_and_gives_the_eager_values(n, k, block, permuted):
    """With frozen weights the traced product packs the stored tensors itself
    (folded once into a constant by Inductor) and calls the eager kernel: the
    same values as the eager path, bit for bit, for natural, permuted and
    padded layouts; without freezing, the plain-ops form."""
    from torch._inductor import config

    torch.manual_seed(k)
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    groups = -(-k // block) if block > 0 else 1
    scale = torch.rand(groups, n) * 0.02 + 0.01 if block > 0 else torch.rand(n) * 50 + 50
    zero = torch.randn(groups, n) if block > 0 else None
    g_idx = None
    if block > 0:
        g_idx = (torch.arange(k) // block).float()
        if permuted:
            g_idx = g_idx[torch.randperm(k)]
    runtime = int4_kernels.Int4Runtime()
    runtime.refresh(q, scale, zero, block, (q,), g_idx)
    x = torch.randn(2, k)
    eager = int4_kernels.int4_linear(x, q, scale, zero, block, None, torch.float32, runtime)
    with config.patch(freezing=True):
        frozen = int4_kernels.int4_linear_traced(
            x, q, scale, zero, block, None, torch.float32, runtime, g_idx
        )
    assert torch.equal(frozen, eager)
    plain = int4_kernels.int4_linear_traced(
        x, q, scale, zero, block, None, torch.float32, runtime, g_idx
    )
    assert ((plain - eager).norm() / eager.norm()).item() < 1e-2
    never_run = int4_kernels.int4_linear_traced(  # no eager plan: the plain-ops form
        x, q, scale, zero, block, None, torch.float32, None, g_idx
    )
    assert torch.equal(never_run, plain)


@pytest.mark.parametrize(("rows", "dtype"), [(1, torch.bfloat16), (3, torch.float32)])
def test_int8_weight_only_frozen_trace_runs_the_eager_kernel(rows, dtype):
    from torch._inductor import config

    torch.manual_seed(rows)
    q, scale = abs_max_quantize(torch.randn(48, 64), axis=1)
    x = torch.randn(rows, 64).to(dtype)
    eager = int8_kernels.int8_weight_only_linear(x, _runtime(q, scale[:, 0], False), None, dtype)
    with config.patch(freezing=True):
        frozen = int8_kernels.int8_linear_traceable(x, q, scale[:, 0], None, dtype, True)
    torch.testing.assert_close(frozen, eager, atol=0, rtol=0)


def test_int4_kernel_takes_real_valued_zero_points():
    """The kernel's offset is `-zero * scale`: a zero point need not be an integer."""
    torch.manual_seed(1)
    q = torch.randint(-8, 8, (32, 128), dtype=torch.int8)  # (N, K)
    scale = torch.rand(2, 32) * 0.02 + 0.01
    zero = torch.randn(2, 32) * 3  # real-valued
    dense = dequantize_grouped(q.t(), scale, zero, 64)
    runtime = int4_kernels.Int4Runtime()
    runtime.refresh(q, scale, zero, 64, (q,))
    x = torch.randn(4, 128)
    out = int4_kernels.int4_linear(x, None, scale, zero, 64, None, torch.float32, runtime)
    reference = x @ dense
    assert ((out - reference).norm() / reference.norm()).item() < 0.01


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 700), block=st.sampled_from([-1, 16, 32, 40, 64, 96, 128, 256, 300]))
def test_int4_layout_maps_every_input_inside_its_block(k, block):
    layout = int4_kernels.Int4Layout.plan(k, block)
    positions = layout.positions(k, block)
    assert positions.unique().numel() == k and int(positions.max()) < layout.padded_k
    assert layout.padded_k % layout.group == 0 and layout.stride % layout.group == 0
    # every kernel group reads the scale of the block its inputs belong to
    width = block if block > 0 else k
    blocks_of_groups = layout.block_of_groups()
    assert torch.equal(blocks_of_groups[positions // layout.group], torch.arange(k) // width)
    if not layout.spread:
        assert torch.equal(positions, torch.arange(k))


def test_int4_per_channel_kernel():
    w = torch.randn(64, 96) * 0.05
    q, scale = abs_max_quantize(w, axis=1, value_range=(-8, 7))
    runtime = int4_kernels.Int4Runtime()
    runtime.refresh(q, scale[:, 0], None, -1, (q,))
    x = torch.randn(2, 96)
    out = int4_kernels.int4_linear(
        x.bfloat16(), None, scale[:, 0], None, -1, None, torch.bfloat16, runtime
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
    compiled = int8_kernels.int8_linear(x, _runtime(q, scale[:, 0]), bias, torch.float32)
    epilogues.set_compile_epilogues(False)
    eager = int8_kernels.int8_linear(x, _runtime(q, scale[:, 0]), bias, torch.float32)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


def test_weight_only_int8_survives_misaligned_and_odd_shaped_activations():
    """`_weight_int8pack_mm` crashes on K % 16 != 0, misaligned inputs or
    misaligned weights: run in a subprocess so that a crash fails this test
    instead of killing pytest."""
    import subprocess
    import sys

    script = """
import torch
from dtype_policies.quantization.kernels import int8 as k
from dtype_policies.quantizers import abs_max_quantize
for K, w_offset in ((16, 0), (24, 0), (1000, 0), (1024, 0), (1020, 0), (17, 0), (64, 17), (64, 8)):
    w = torch.randn(32, K)
    q, s = abs_max_quantize(w, axis=1)
    # a weight at an odd address, as in a checkpoint loaded by mapping its file
    q = torch.cat([torch.zeros(w_offset, dtype=torch.int8), q.flatten()])[w_offset:].view(32, K)
    rt = k.Int8Runtime(); rt.refresh(q, s[:, 0], lambda d: d, False)
    for m, dtype in ((1, torch.bfloat16), (2, torch.bfloat16), (3, torch.float32),
                     (8, torch.float32), (16, torch.bfloat16)):
        for offset in (0, 1, 8):
            base = torch.randn(m * K + offset).to(dtype)
            x = base[offset:].view(m, K)
            out = k.int8_weight_only_linear(x, rt, None, dtype)
            ref = x.float() @ (q.float() / s).t()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            assert err < 0.02, (K, m, offset, err)
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-1500:]


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16, torch.float16])
def test_float8_arithmetic_rounding_matches_torch_conversion(compute):
    from dtype_policies.quantization.kernels.float8 import quantize_dequantize_e4m3
    from dtype_policies.quantizers.math import quantize_and_dequantize

    torch.manual_seed(0)
    special = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 448.0, 449.0, 464.0, 465.0]
    grid = [1e30, 2**-6, 2**-7, 2**-9, 2**-10, 3 * 2**-11, 1.5 * 2**-9, 2.5 * 2**-9]
    edges = torch.tensor([*special, *grid])
    values = [
        torch.randn(50_000) * 10 ** torch.empty(50_000).uniform_(-6, 4),
        torch.linspace(-500, 500, 400_001),  # every grid step and tie, many times over
        torch.linspace(-0.02, 0.02, 400_001),  # the subnormal range
        edges.repeat(600),
    ]
    for scale in (1.0, 0.0123, 3.7e-5, 250.0):
        scale = torch.tensor(scale)
        for x in values:
            x = (x * scale).to(compute)
            want = quantize_and_dequantize(x, scale, torch.float8_e4m3fn, compute)
            got = quantize_dequantize_e4m3(x, scale, compute)
            assert got.dtype == compute
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got[~got.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 20])
def test_int8_weight_only_cast_in_chunks(rows, dtype):
    """Weights larger than one chunk are cast and multiplied chunk by chunk."""
    torch.manual_seed(rows)
    n, k = 2500, 1024
    assert int8_kernels.CHUNK_BYTES // (k * torch.finfo(dtype).bits // 8) < n  # several chunks
    q, scale = abs_max_quantize(torch.randn(n, k), axis=1)
    runtime = _runtime(q, scale[:, 0], prepack=False)
    x = torch.randn(rows, k).to(dtype)
    paths = ("dequantized", "dequantized_float32", "dequantized_bfloat16")
    for path in paths[:2] if dtype == torch.bfloat16 else paths:
        out = int8_kernels.int8_weight_only_linear(x, runtime, None, dtype, path)
        reference = x.float() @ (q.float() / scale).t()
        rounded = dtype == torch.bfloat16 or path == "dequantized_bfloat16"
        tolerance = 0.02 if rounded else 1e-4
        assert out.dtype == dtype and out.shape == (rows, n)
        assert ((out.float() - reference).norm() / reference.norm()).item() < tolerance


def test_int8_weight_only_rounds_float32_inputs_the_same_on_every_class(monkeypatch):
    """Float32 activations of a weight-only int8 product are rounded to
    bfloat16, and so are its integer sums, at every row count and on every
    class: in bfloat16 products where those are native, in float32 ones of the
    rounded values elsewhere; `_weight_int8pack_mm` up to a class's row bound."""
    import dataclasses

    from dtype_policies import _cpu

    torch.manual_seed(1)
    q, scale = abs_max_quantize(torch.randn(48, 64), axis=1)
    runtime = _runtime(q, scale[:, 0], prepack=False)
    x = torch.randn(40, 64)
    sums = (x.bfloat16().double() @ q.double().t()).bfloat16().double()
    expected = sums / scale.t().double()
    rows_by_class = {
        True: {1: "int8pack_bfloat16", 16: "int8pack_bfloat16", 17: "dequantized_bfloat16"},
        False: {1: "int8pack_bfloat16", 8: "int8pack_bfloat16", 9: "dequantized_bfloat16"},
    }
    for native, by_rows in rows_by_class.items():
        cpu = dataclasses.replace(_cpu.processor(), native_bf16=native)
        monkeypatch.setattr(int8_kernels, "processor", lambda cpu=cpu: cpu)
        for rows, path in by_rows.items():
            assert int8_kernels.weight_only_path(x[:rows], runtime) == path
        for rows in (3, 40):
            out = int8_kernels.int8_weight_only_linear(x[:rows], runtime, None, torch.float32)
            assert out.dtype == torch.float32
            # a sum rounded the other way (summation order) is one bfloat16 step
            step = expected[:rows].abs() * 2**-7 + 1e-6
            assert ((out.double() - expected[:rows]).abs() <= step).all(), (native, rows)
            exact = (out.double() - expected[:rows]).abs() <= 1e-5 * expected[:rows].abs() + 1e-6
            assert exact.float().mean() > 0.99, (native, rows)


def test_per_channel_int4_runs_one_integer_gemm_only_with_amx():
    """From `DEQUANTIZED_MIN_ROWS` rows a small per-channel int4 weight is one
    GEMM on its integer values on CPUs with AMX; elsewhere, native bfloat16
    products without AMX included (AMD Zen 4: the kernel 2.9-3.4x faster at
    128 rows), the packed kernel stays at every row count. Both paths compute
    the same product."""
    import dataclasses

    from dtype_policies import _cpu

    amx = dataclasses.replace(_cpu.processor(), native_bf16=True, amx=True)
    bf16_only = dataclasses.replace(_cpu.processor(), native_bf16=True, amx=False)
    emulated = dataclasses.replace(_cpu.processor(), native_bf16=False, amx=False)
    small, large = 576 * 1536, int4_kernels.DEQUANTIZED_MAX_ELEMENTS
    assert int4_kernels.dequantized_min_rows(small, amx) == int4_kernels.DEQUANTIZED_MIN_ROWS
    assert int4_kernels.dequantized_min_rows(small, bf16_only) is None
    assert int4_kernels.dequantized_min_rows(small, emulated) is None
    assert int4_kernels.dequantized_min_rows(large, amx) is None
    without_onednn_bf16 = dataclasses.replace(amx, native_bf16=False)
    assert int4_kernels.dequantized_min_rows(small, without_onednn_bf16) is None

    torch.manual_seed(0)
    n, k = 64, 256
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    scale = torch.rand(n) * 50 + 50  # per channel: w = q / scale
    runtime = int4_kernels.Int4Runtime()
    runtime.refresh(q, scale, None, -1, (q,), None)
    rows = int4_kernels.DEQUANTIZED_MIN_ROWS
    integer_gemm = int4_kernels.dequantized_min_rows(n * k) is not None
    expected = "dequantized" if integer_gemm else int4_kernels.cpu_kernel()
    assert int4_kernels.int4_path(runtime, rows, -1) == expected
    assert int4_kernels.int4_path(runtime, rows - 1, -1) == int4_kernels.cpu_kernel()
    x = torch.randn(rows, k).bfloat16()
    outs = {
        path: int4_kernels.int4_linear(x, q, scale, None, -1, None, torch.float32, runtime, path)
        for path in int4_kernels.paths(runtime)
    }
    reference = x.float() @ (q.float() / scale[:, None]).t()
    for path, out in outs.items():
        assert out.dtype == torch.float32
        assert ((out - reference).norm() / reference.norm()).item() < 0.01, path


@pytest.mark.slow
@pytest.mark.parametrize(
    "quantize_rows",
    [epilogues.quantize_rows_uint8, epilogues.quantize_rows_split_uint8],
    ids=lambda f: f.__name__,
)
def test_compiled_unsigned_row_quantization_of_a_non_finite_row_is_eager(
    compiled_epilogues, quantize_rows
):
    """The unsigned twins of `quantize_rows_int8` (one compile each: slow)."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    x[2, 7] = float("nan")
    compiled, _ = epilogues.run(quantize_rows, x)
    assert torch.equal(compiled, quantize_rows(x)[0])


@pytest.mark.slow
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_compiled_row_quantization_of_a_non_finite_row_gives_a_nan_row_as_eager(
    compiled_epilogues, bad
):
    """A NaN cast to an integer is undefined (0 eager, -128 compiled): the
    quantized row must hold 0 there, so every kernel takes it and the row's
    non-finite step alone makes that output row NaN."""
    torch.manual_seed(0)
    q, scale = abs_max_quantize(torch.randn(32, 64) * 0.05, axis=1)
    x = torch.randn(4, 64)
    x[2, 7] = bad
    compiled, _ = epilogues.run(epilogues.quantize_rows_int8, x)
    assert torch.equal(compiled, epilogues.quantize_rows_int8(x)[0])
    xq, _ = epilogues.run(epilogues.quantize_rows_int8, x)
    assert xq[2].eq(0).all() and xq.ne(-128).all()
    runtime = _runtime(q, scale[:, 0])
    for path in runtime.w8a8_paths():
        y = int8_kernels.int8_linear(x, runtime, None, torch.float32, path)
        assert y[2].isnan().all() and y[[0, 1, 3]].isfinite().all(), path
