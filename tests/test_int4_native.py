"""This library's AVX2 int4 kernels (`kernels/int4_native.py`, `_csrc/int4_avx2.cpp`):
weight-only, and W4A8 (`Int4QuantizationConfig(activation_block_size=32)`: the
inputs rounded to int8 in blocks of 32, the W4A8 kernel, its decoded path for
many rows, and the plain-ops path everywhere else, all computing the
weight-only product of the rounded inputs; at the end of this file).

It runs on any x86 CPU with AVX2 and FMA (AVX-512 ones included), so these
cases call it directly wherever it can be built; which kernel the policies
choose is the processor's business (`int4.cpu_kernel`), tested at the end.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dtype_policies import _cpu, apply_policy, quantize, saving
from dtype_policies import _native as native
from dtype_policies._core.module_state import quantization_of
from dtype_policies.apply.kernel_report import kernel_of
from dtype_policies.quantization import Int4QuantizationConfig
from dtype_policies.quantization.kernels import epilogues, int4_native
from dtype_policies.quantization.kernels import int4 as int4_kernels
from dtype_policies.quantization.schemes.base import WeightSpec
from dtype_policies.quantization.schemes.int4 import Int4Scheme
from dtype_policies.quantizers.math import unpack_int4
from native_kernels import RUNS_HERE, VNNI_HERE, needs_kernel, needs_vnni


def _weights(n: int, k: int, block: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    groups = -(-k // block) if block > 0 else 1
    q = torch.randint(-8, 8, (n, k), generator=generator, dtype=torch.int32)
    scale = torch.rand(groups, n, generator=generator) * 0.05 + 0.01
    zero = torch.randn(groups, n, generator=generator) * 2
    if block <= 0:  # per channel: weights q / scale, no offset
        return q, 1.0 / scale[0], None
    return q, scale, zero


def _plans(q, scale, zero, block):
    native_plan = int4_kernels._pack(q, scale, zero, block, None, "native")
    torch_plan = int4_kernels._pack(q, scale, zero, block, None, "packed")
    return native_plan, torch_plan


def _reference(x, weight):
    """float64 product of the bfloat16-rounded activations with a kernel's
    (N, K) weight, and the bound of float32 summation-order differences."""
    weight = weight.double()
    xb = x.bfloat16().double()
    return xb @ weight.t(), xb.abs() @ weight.abs().t()


@needs_kernel
@pytest.mark.parametrize(
    ("n", "k", "block"),
    [
        (48, 64, 32),  # one 64-input word group, two scale groups
        (17, 96, 32),  # K not a multiple of 64: a zero-weight tail; N odd
        (40, 576, 128),  # block 128 over K = 576: kernel groups of 64, repeated scales
        (24, 576, 64),
        (33, 200, 40),  # blocks padded to 64, activations spread
        (16, 384, -1),  # per channel
        (1, 2048, 256),
    ],
)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_native_kernel_and_torchs_compute_their_weights(n, k, block, rows):
    """The native kernel multiplies by `kernel_weight` (float32 scales and
    offsets), torch's by the same formula with its bfloat16 ones."""
    q, scale, zero = _weights(n, k, block, seed=n * k + rows)
    native_plan, torch_plan = _plans(q, scale, zero, block)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    ours = int4_kernels._packed(x, native_plan, n, None, torch.float32)
    theirs = int4_kernels._packed(x, torch_plan, n, None, torch.float32)
    assert ours.dtype == torch.float32 and ours.shape == (rows, n)
    # both round a float32 sum to bfloat16: within one bfloat16 step of the
    # exact value, plus float32 rounding of the sum
    for y, weight in (
        (ours, int4_kernels.kernel_weight(q, scale, zero, block)),
        (theirs, int4_kernels.kernel_weight(q, scale, zero, block, bfloat16_pairs=True)),
    ):
        reference, magnitude = _reference(x, weight)
        bound = 2.0**-8 * reference.abs() + 2.0**-20 * k * magnitude + 1e-30
        assert ((y.double() - reference).abs() <= bound).all()
    # many rows: the weight decoded once per call, one float32 GEMM, same values
    decoded = int4_kernels._packed(x, native_plan, n, None, torch.float32, decoded=True)
    reference, magnitude = _reference(x, int4_kernels.kernel_weight(q, scale, zero, block))
    bound = 2.0**-8 * reference.abs() + 2.0**-20 * k * magnitude + 1e-30
    assert ((decoded.double() - reference).abs() <= bound).all()


def _zero_column_and_far_groups(n: int, k: int, block: int):
    """Quantized weights (the default grid, zero points not refined, so that
    a weight of 0 in a group on both sides of 0 dequantizes to exactly 0) of
    which the first half of the rows is trained-like with input column 5
    exactly 0, and the second half lies around 100 with a spread of 0.01;
    and their dequantized (N, K) float64 weight."""
    generator = torch.Generator().manual_seed(k + block)
    w = torch.randn(n, k, generator=generator) * 0.02
    w[:, 5] = 0.0
    w[n // 2 :] = 100 + 0.01 * torch.randn(n - n // 2, k, generator=generator)
    spec = WeightSpec("w", "out_in", "linear", k, n, float_shape=(n, k))
    config = Int4QuantizationConfig(block_size=block, refine_zero_points=False)
    stored = Int4Scheme().quantize(w, spec, config)
    q = unpack_int4(stored["w_int4"], k, axis=-1).to(torch.int32)
    scale, zero = stored["w_scale"].t(), stored["w_zero"].t()  # (G, N)
    group = torch.arange(k) // block
    dequantized = (q.double() - zero.double()[group].t()) * scale.double()[group].t()
    return q, scale, zero, dequantized


@needs_kernel
@pytest.mark.parametrize("w4a8", [False, True])
@pytest.mark.parametrize("block", [32, 128])
def test_kernels_keep_the_float32_scales_and_offsets(block, w4a8):
    """Every path of this library's packings, and the traced product where
    they run, multiply by Keras's `(q - zero) * scale` up to float32
    rounding: a weight of exactly 0 contributes nothing however large its
    input, and groups centred at 100 keep their own quantization error. (With
    the offsets rounded to bfloat16 the zero column gave 1.6e-3 of its input
    and the far groups moved by up to 0.5, 200x their quantization error.)
    W4A8 keeps such a weight's scales and offsets in float32: float16 would
    move its far groups by far more than 1/64 of their step."""
    n, k = 16, 256
    q, scale, zero, dequantized = _zero_column_and_far_groups(n, k, block)
    assert (dequantized[: n // 2, 5] == 0).all()
    activation_block_size = 32 if w4a8 else None
    runtime = int4_kernels.Int4Runtime()
    runtime.refresh(q, scale, zero, block, (q,), activation_block_size=activation_block_size,
                    kernel="native_q8" if w4a8 else "native")  # fmt: skip
    plan = runtime.plan
    assert not plan.half_pairs and plan.scales_and_zeros.dtype == torch.float32
    decoded_weight = int4_native.decode(
        plan.packed, plan.scales_and_zeros, plan.layout.group, q8=w4a8
    )
    weight_error = (decoded_weight[:n, :k].double() - dequantized).abs()
    # (the W4A8 layout adds u * s, u in [0, 15], and z - 8 s: float32 rounding of both)
    assert (weight_error <= 2**-22 * (dequantized.abs() + 16 * scale.max())).all()

    def product(x: torch.Tensor, path: str) -> torch.Tensor:
        if path == "traced":
            y = int4_kernels.int4_linear_traced(
                x, q, scale, zero, block, None, torch.float32, None, None, activation_block_size
            )
        else:
            y = int4_kernels.int4_linear(
                x, q, scale, zero, block, None, torch.float32, runtime, path, None,
                activation_block_size,
            )  # fmt: skip
        return y.double()

    one_hot = torch.zeros(3, k)
    one_hot[:, 5] = torch.tensor([1e4, -3.0, 1.0])
    signs = (1 - 2 * (torch.arange(k) // block % 2)).float()  # +1, -1 by group
    alternating = torch.stack([signs, -signs, 0.5 * signs])
    xr = alternating.bfloat16().double()
    if w4a8:
        xr = epilogues.round_activation_blocks(alternating.bfloat16()).double()
    far = dequantized[n // 2 :]
    exact, magnitude = xr @ far.t(), xr.abs() @ far.abs().t()
    paths = [path for path in int4_kernels.paths(runtime) if path != "dequantized"]
    if not int4_kernels.torch_kernel_here(activation_block_size):
        paths.append("traced")
    for path in paths:
        # the zero column: nothing, but float32 rounding of the offsets
        zero_rows = product(one_hot, path)[:, : n // 2].abs()
        assert (zero_rows <= 2**-22 * 1e4 * 16 * scale[:, : n // 2].max()).all(), (path, zero_rows)
        # the far groups: their dequantized weights, the output rounded to bfloat16
        error = (product(alternating, path)[:, n // 2 :] - exact).abs()
        bound = 2**-8 * exact.abs() + (k + 2) * 2**-24 * magnitude
        assert (error <= bound).all(), (path, error.max())


@needs_kernel
def test_native_kernel_is_deterministic_and_thread_safe():
    q, scale, zero = _weights(96, 576, 64, seed=1)
    plan, _ = _plans(q, scale, zero, 64)
    inputs = [torch.randn(r, 576, generator=torch.Generator().manual_seed(r)) for r in (1, 2, 7)]
    expected = [int4_kernels._packed(x, plan, 96, None, torch.bfloat16) for x in inputs]
    results: list[list[torch.Tensor]] = [[], []]

    def work(slot: int) -> None:
        for _ in range(20):
            results[slot].extend(
                int4_kernels._packed(x, plan, 96, None, torch.bfloat16) for x in inputs
            )

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for got in results:
        assert len(got) == 60
        for i, y in enumerate(got):
            assert torch.equal(y, expected[i % 3])


@needs_kernel
def test_native_kernel_special_values():
    """A NaN or an infinity in the activations reaches only its own rows."""
    q, scale, zero = _weights(32, 128, 64, seed=2)
    plan, _ = _plans(q, scale, zero, 64)
    x = torch.randn(3, 128)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    y = int4_kernels._packed(x, plan, 32, None, torch.float32)
    assert y[0].isfinite().all()
    assert y[1].isnan().all()
    assert not y[2].isfinite().any()
    empty = int4_kernels.int4_linear(
        torch.zeros(0, 128), None, scale, zero, 64, None, torch.float32, _runtime(plan)
    )
    assert empty.shape == (0, 32)


def _runtime(plan):
    runtime = int4_kernels.Int4Runtime()
    runtime._state = ((), plan)
    return runtime


@needs_kernel
def test_native_kernel_rejects_a_layout_it_cannot_read():
    packed = torch.zeros(4, 48, dtype=torch.uint8)  # Kp = 96: not a multiple of 64
    pairs = torch.zeros(4, 3, 2)
    with pytest.raises(RuntimeError, match=r"Kp=96, group=32"):
        int4_native.int4_mm(torch.zeros(1, 96, dtype=torch.bfloat16), packed, pairs, 32, 4)


@pytest.mark.slow
@needs_kernel
def test_native_kernel_runs_in_a_frozen_compiled_graph():
    """Under `torch.compile` with frozen weights the product is the custom op
    `dtype_policies::int4_mm_avx2`, with the eager values."""

    q, scale, zero = _weights(64, 192, 64, seed=3)
    plan, _ = _plans(q, scale, zero, 64)
    x = torch.randn(2, 192, generator=torch.Generator().manual_seed(3))
    eager = int4_kernels._packed(x, plan, 64, None, torch.float32)
    assert torch.equal(_frozen_compiled_product(q, scale, zero, plan, x), eager)


def _frozen_compiled_product(q, scale, zero, plan, x, activation_block_size=None):
    """`int4_linear_traced` on stored tensors, compiled with frozen weights."""
    from torch._inductor import config as inductor_config

    class Product(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("q", q)
            self.register_buffer("scale", scale)
            self.register_buffer("zero", zero)

        def forward(self, x):
            return int4_kernels.int4_linear_traced(
                x, self.q, self.scale, self.zero, 64, None, torch.float32, _runtime(plan),
                None, activation_block_size,
            )  # fmt: skip

    torch._dynamo.reset()
    with inductor_config.patch(freezing=True), torch.no_grad():
        return torch.compile(Product().eval())(x)


@needs_kernel
def test_many_rows_decode_the_weight_once_per_call():
    q, scale, zero = _weights(40, 576, 128, seed=4)
    runtime = int4_kernels.Int4Runtime()
    runtime.refresh(q, scale, zero, 128, (q,), kernel="native")
    rows = int4_kernels.NATIVE_DECODED_MIN_ROWS
    assert int4_kernels.int4_path(runtime, rows - 1, 128) == "native"
    assert int4_kernels.int4_path(runtime, rows, 128) == "decoded"
    assert int4_kernels.paths(runtime) == ["native", "decoded", "dequantized"]
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(4))
    y = int4_kernels.int4_linear(x, None, scale, zero, 128, None, torch.bfloat16, runtime)
    kernel = int4_kernels.int4_linear(
        x, None, scale, zero, 128, None, torch.bfloat16, runtime, "native"
    )
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 40)
    torch.testing.assert_close(y.float(), kernel.float(), rtol=2**-7, atol=1e-3)
    with pytest.raises(ValueError, match="'packed' does not apply to a weight packed for 'native'"):
        int4_kernels.int4_linear(x, None, scale, zero, 128, None, torch.float32, runtime, "packed")


@needs_kernel
@pytest.mark.parametrize("q8", [False, True])
@pytest.mark.parametrize(("n", "k"), [(40, 576), (1100, 576), (300, 1536)])
def test_the_decoded_operator_is_one_gemm_per_chunk_of_the_decoded_weight(q8, n, k):
    """`decoded_mm` (one operator, eager and compiled) gives the float32
    GEMMs of its chunks of decoded output rows, bit for bit: a single chunk,
    and weights of several chunks (1 MiB of float32 each)."""
    q, scale, zero = _weights(n, k, 64, seed=n)
    plan = (
        _q8_plan(q, scale, zero, 64)
        if q8
        else int4_kernels._pack(q, scale, zero, 64, None, "native")
    )
    x = torch.randn(130, k, generator=torch.Generator().manual_seed(k))
    weight = int4_native.decode(plan.packed, plan.scales_and_zeros, 64, q8=q8)
    kp = weight.shape[1]
    per_row = 8 if q8 else 1
    rows = max(16, (1 << 18) // kp) // per_row * per_row
    expected = torch.cat(
        [
            F.linear(x, weight[start : start + rows, :k])
            for start in range(0, weight.shape[0], rows)
        ],
        dim=1,
    )
    got = int4_native.decoded_mm(x, plan.packed, plan.scales_and_zeros, 64, q8=q8)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="x must be a 2-D float32 tensor"):
        int4_native.decoded_mm(x.bfloat16(), plan.packed, plan.scales_and_zeros, 64, q8=q8)


def test_policies_choose_the_native_kernel_exactly_where_it_applies(monkeypatch):
    """The AVX2 class (natively or emulated) without AVX-512 packs for the
    native kernel; `DTYPE_POLICIES_NATIVE_KERNELS=0` keeps torch's."""
    cpu = _cpu.processor()
    expected = "native" if RUNS_HERE and "avx512" not in cpu.features else "packed"
    assert int4_kernels.cpu_kernel() == expected
    monkeypatch.setenv(native.DISABLE_VARIABLE, "0")
    assert int4_kernels.cpu_kernel() == "packed"
    model = nn.Sequential(nn.Linear(576, 64))
    quantize(model, "int4", Int4QuantizationConfig(block_size=64))
    with torch.inference_mode():
        y = model(torch.randn(2, 576))
    assert y.shape == (2, 64)
    assert quantization_of(model[0]).runtime.plan.kernel == "packed"


def test_a_failed_build_warns_once_and_keeps_torchs_kernel(monkeypatch, tmp_path):
    monkeypatch.setenv(native.CACHE_VARIABLE, str(tmp_path))
    monkeypatch.setattr(native, "_compiler", lambda: "/bin/false")
    monkeypatch.setattr(native, "_loaded", {})
    with pytest.warns(RuntimeWarning, match="'avx2'.*could not be built"):
        assert native.library("avx2") is None
    assert not native.available("avx2")  # decided: no second build, no second warning
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind


@pytest.mark.parametrize(
    "pack",
    [
        int4_native.pack,
        functools.partial(int4_native.pack_q8, half=False),
        functools.partial(int4_native.pack_q8, half=True),
    ],
)
def test_packing_is_ops_on_the_stored_tensors_only(pack):
    """A frozen compiled graph folds the packing into constants only when every
    op of it reads a stored tensor (a tensor constructor stops the folding, and
    the packing then runs on every call). A traced W4A8 packing is told the
    eager plan's choice of float16 pairs (deciding it reads the values)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q, scale, zero = _weights(30, 96, 32, seed=5)  # N not a multiple of 8 (W4A8 pads it)
    graph = make_fx(lambda q, s, z: pack(q, s, z, 32))(q, scale, zero)
    calls = [node for node in graph.graph.nodes if node.op == "call_function"]
    assert calls
    for node in calls:
        inputs = [a for a in node.all_input_nodes if a.op in ("placeholder", "call_function")]
        assert inputs, f"{node.target} builds a tensor from nothing"


# --- W4A8 ---

W4A8 = dict(activation_block_size=32)


def _rounded_reference(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """The rounding rule in float64, one block at a time."""
    xb = x.bfloat16().double()
    out = torch.zeros_like(xb)
    for start in range(0, x.shape[1], block):
        part = xb[:, start : start + block]
        step = part.abs().amax(dim=1, keepdim=True).float() / 127.0  # float32, as the rule
        q = torch.where(step > 0, torch.round(part.float() / step), 0.0).clamp(-127, 127)
        out[:, start : start + block] = (q * step).double()
    return out


@pytest.mark.parametrize("k", [32, 64, 100, 576])
def test_rounding_is_llama_cpp_q8_0_per_block(k):
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(k)) * 4
    x[1, :32] = 0.0  # a block of zeros stays zero
    rounded = epilogues.round_activation_blocks(x)
    assert rounded.dtype == torch.float32 and rounded.shape == x.shape
    torch.testing.assert_close(rounded.double(), _rounded_reference(x), rtol=0, atol=0)
    assert torch.all(rounded[1, :32] == 0)
    # each block's largest magnitude is kept exactly (it is 127 steps)
    blocks = x.bfloat16().float()[:, : k // 32 * 32].reshape(3, -1, 32).abs().amax(-1)
    kept = rounded[:, : k // 32 * 32].reshape(3, -1, 32).abs().amax(-1)
    torch.testing.assert_close(kept, blocks, rtol=2**-22, atol=0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=80))
def test_rounding_error_is_at_most_half_a_step(values):
    x = torch.tensor([values])
    rounded = epilogues.round_activation_blocks(x).double()
    xb = x.bfloat16().double()
    for start in range(0, x.shape[1], 32):
        part, got = xb[:, start : start + 32], rounded[:, start : start + 32]
        step = part.abs().max() / 127
        assert torch.all((got - part).abs() <= step / 2 * (1 + 1e-6) + 1e-30)


def _q8_plan(q, scale, zero, block):
    return int4_kernels._pack(q, scale, zero, block, None, "native_q8")


@needs_kernel
@pytest.mark.parametrize(
    ("n", "k", "block"),
    [(48, 64, 32), (17, 96, 32), (40, 576, 128), (24, 576, 64), (9, 1536, 32), (5, 100, 32)],
)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 130])
def test_w4a8_kernel_and_decoded_path_compute_the_rounded_product(n, k, block, rows):
    q, scale, zero = _weights(n, k, block, seed=n + k + rows)
    plan = _q8_plan(q, scale, zero, block)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    weight = int4_kernels.kernel_weight(q, scale, zero, block).double()
    exact = _rounded_reference(x) @ weight.t()
    magnitude = _rounded_reference(x).abs() @ weight.abs().t()
    bound = 2.0**-8 * exact.abs() + 2.0**-18 * k * magnitude + 1e-30
    for decoded in (False, True):
        y = int4_kernels._packed(x, plan, n, None, torch.float32, decoded=decoded)
        assert y.dtype == torch.float32 and y.shape == (rows, n)
        error = (y.double() - exact).abs()
        assert torch.all(error <= bound), (decoded, error.max())


@needs_kernel
def test_w4a8_rows_with_nan_or_infinity_are_nan_and_leave_the_others_alone():
    n, k, block = 20, 128, 32
    q, scale, zero = _weights(n, k, block, seed=3)
    plan = _q8_plan(q, scale, zero, block)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(0))
    x[1, 70] = float("nan")
    x[2, 3] = float("inf")
    y = int4_kernels._packed(x, plan, n, None, torch.float32)
    weight = int4_kernels.kernel_weight(q, scale, zero, block)
    reference = int4_kernels.int4_linear_traceable(x, weight, None, torch.float32, 32)
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all()
    assert torch.isnan(reference[1]).all() and torch.isnan(reference[2]).all()
    torch.testing.assert_close(y[[0, 3]], reference[[0, 3]], rtol=2**-7, atol=1e-3)


@needs_kernel
def test_the_w4a8_operator_names_bad_arguments():
    q, scale, zero = _weights(16, 64, 32, seed=1)
    plan = _q8_plan(q, scale, zero, 32)
    with pytest.raises(RuntimeError, match="x must be a 2-D bfloat16 tensor, got Float"):
        int4_native.int4_mm_q8(torch.zeros(1, 64), plan.packed, plan.scales_and_zeros, 32, 16)
    with pytest.raises(RuntimeError, match="K=96 inputs, more than the weight's Kp=64"):
        int4_native.int4_mm_q8(
            torch.zeros(1, 96, dtype=torch.bfloat16), plan.packed, plan.scales_and_zeros, 32, 16
        )
    with pytest.raises(RuntimeError, match="group=48"):
        int4_native.int4_mm_q8(
            torch.zeros(1, 64, dtype=torch.bfloat16), plan.packed, plan.scales_and_zeros, 48, 16
        )


def _model(block: int = 64, **options) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(576, 96), nn.GELU(), nn.Linear(96, 40))
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int4", Int4QuantizationConfig(block_size=block, **options))
    return model


def test_w4a8_layers_choose_the_kernel_and_match_the_plain_ops_path(monkeypatch):
    model = _model(**W4A8)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        y = model(x)
    plan = quantization_of(model[0]).runtime.plan
    described = kernel_of(model[0])
    assert "inputs rounded to int8 per 32" in described
    if RUNS_HERE:
        vnni = native.operator_suffix() == "vnni"
        isa = "AVX-512 VNNI" if vnni else "AVX2"
        assert described.startswith(f"int4 {isa} W4A8 kernel (this library's), group 64")
        assert "rows decoded into float32 GEMMs" not in described  # the kernel at any rows
        assert plan.kernel == "native_q8"
        assert int4_kernels.paths(quantization_of(model[0]).runtime) == [
            "native_q8",
            "decoded_q8",
            "dequantized",
        ]
    monkeypatch.setenv(native.DISABLE_VARIABLE, "0")  # the plain-ops path
    assert int4_kernels.cpu_kernel(32) is None
    reference = _model(**W4A8)
    with torch.inference_mode():
        expected = reference(x)
    assert quantization_of(reference[0]).runtime.plan is None
    assert y.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected.float(), rtol=2**-7, atol=2e-3)
    # and it is not the weight-only product
    weight_only = _model()
    with torch.inference_mode():
        other = weight_only(x)
    assert (other.float() - y.float()).abs().max() > 1e-3


def test_w4a8_is_stored_with_the_model_and_reloads_bit_for_bit(tmp_path):
    model = _model(**W4A8)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        before = model(x)
    saving.save(model, tmp_path / "m.safetensors")
    fresh = nn.Sequential(nn.Linear(576, 96), nn.GELU(), nn.Linear(96, 40))
    saving.load(fresh, tmp_path / "m.safetensors")
    config = quantization_of(fresh[0]).config
    assert config.activation_block_size == 32 and config.block_size == 64
    with torch.inference_mode():
        after = fresh(x)
    assert torch.equal(before, after)


@pytest.mark.slow
@needs_kernel
def test_w4a8_kernel_runs_in_a_frozen_compiled_graph():
    """Under `torch.compile` with frozen weights the W4A8 product is the
    operator `dtype_policies::int4_mm_q8_avx2`, with the eager values; a whole
    compiled model gives the eager model's values."""
    from dtype_policies import compile_for_inference

    q, scale, zero = _weights(64, 192, 64, seed=3)
    plan = _q8_plan(q, scale, zero, 64)
    x = torch.randn(2, 192, generator=torch.Generator().manual_seed(3))
    eager = int4_kernels._packed(x, plan, 64, None, torch.float32)
    assert torch.equal(_frozen_compiled_product(q, scale, zero, plan, x, 32), eager)

    model = nn.Sequential(nn.Linear(576, 96))
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int4", Int4QuantizationConfig(block_size=64, activation_block_size=32))
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = model.eval()(x)
        out = compile_for_inference(model, autotune=False)(x)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("n", [200, 8])
def test_per_channel_int4_of_any_width_compiles_with_frozen_weights(n):
    """A per-channel weight whose outputs are not a multiple of 16 (torch's
    packing pads them) compiles and gives the eager values (Inductor's
    lowering of torch's product raised on it)."""
    from dtype_policies import compile_for_inference

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, n))
    quantize(model, "int4", Int4QuantizationConfig(block_size=-1))
    x = torch.randn(4, 64)
    with torch.inference_mode():
        eager = model(x)
        compiled = compile_for_inference(model, autotune=False)(x)
    assert torch.equal(compiled, eager)


@needs_kernel
@pytest.mark.parametrize("to_far_groups", [True, False])
def test_a_frozen_graph_compiled_after_new_weights_takes_their_pairs(to_far_groups):
    """The plan's float16-or-float32 choice is the new values', not the last
    eager call's: an eager call, then a `load_state_dict` between a
    trained-like weight (float16 pairs) and one whose groups lie around
    1000 (float32 pairs), then `compile_for_inference`. (With the old plan's
    float16 pairs, the far groups' outputs were off by 10 on values of 6.)"""
    from dtype_policies import compile_for_inference

    def w4a8_model(far: bool) -> nn.Module:
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(64, 16, bias=False))
        if far:
            with torch.no_grad():
                model[0].weight[:, :32] = 1000.3 + 0.01 * torch.randn(16, 32)
                model[0].weight[:, 32:] = -1000.1 + 0.01 * torch.randn(16, 32)
        quantize(model, "int4", Int4QuantizationConfig(block_size=32, activation_block_size=32))
        return model

    model, other = w4a8_model(not to_far_groups), w4a8_model(to_far_groups)
    x = torch.ones(1, 64)  # the far groups' large terms cancel
    with torch.no_grad():
        model(x)  # a plan of the first weight
        model.load_state_dict(other.state_dict())
        compiled = compile_for_inference(model, autotune=False)(x)
        eager = model(x)
        assert torch.equal(eager, other(x))
    assert torch.equal(compiled, eager)


def test_w4a8_trains_straight_through_the_rounding():
    model = _model(**W4A8)
    model.train()
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(4), requires_grad=True)
    model(x).float().pow(2).mean().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(block_size=-1, activation_block_size=32), "needs grouped int4"),
        (dict(block_size=None, activation_block_size=32), "needs grouped int4"),
        (dict(block_size=48, activation_block_size=32), "block_size=48"),
        (dict(block_size=64, activation_block_size=16), "activation_block_size=16"),
        (dict(block_size=64, activation_block_size=True), "activation_block_size=True"),
    ],
)
def test_w4a8_config_errors_name_the_value(options, message):
    with pytest.raises(ValueError, match=message):
        Int4QuantizationConfig(**options)


def test_w4a8_config_round_trips_and_is_part_of_the_identity():
    config = Int4QuantizationConfig(block_size=64, activation_block_size=32)
    assert config.get_config() == {
        "weight_quantizer": None,
        "activation_quantizer": None,
        "block_size": 64,
        "activation_block_size": 32,
    }
    assert Int4QuantizationConfig.from_config(config.get_config()) == config
    assert config != Int4QuantizationConfig(block_size=64)
    assert "activation_block_size" not in Int4QuantizationConfig(block_size=64).get_config()


@needs_vnni
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 70),
    n=st.integers(1, 40),
    k=st.integers(1, 200),
    group=st.sampled_from([32, 64, 128]),
    seed=st.integers(0, 2**16),
    half=st.booleans(),
)
def test_the_w4a8_vnni_copy_gives_the_avx2_values_bit_for_bit(rows, n, k, group, seed, half):
    """vpdpbusd on the unsigned nibbles, 4 rows per weight load: the same
    integer sums, the same float operations in the same order; with float32
    or float16 scales and offsets."""
    q, scale, zero = _weights(n, k, group, seed)
    packed, pairs = int4_native.pack_q8(q, scale, zero, group, half)
    assert pairs.dtype == (torch.float16 if half else torch.float32)
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=generator) * 4).bfloat16()
    if rows > 3:
        x[2, k // 2] = float("inf")
    ops = torch.ops.dtype_policies
    avx2 = ops.int4_mm_q8_avx2(x, packed, pairs, group, n)
    vnni = ops.int4_mm_q8_vnni(x, packed, pairs, group, n)
    assert avx2.dtype == vnni.dtype == torch.bfloat16 and vnni.shape == (rows, n)
    assert torch.equal(avx2.isnan(), vnni.isnan())
    assert torch.equal(avx2.nan_to_num(), vnni.nan_to_num())


@needs_kernel
@pytest.mark.parametrize(("n", "k", "block"), [(40, 576, 32), (24, 1536, 32), (17, 576, 128)])
def test_w4a8_float16_pairs_compute_their_values_within_a_64th_of_a_step(n, k, block):
    """Trained-like grids take float16 scales and offsets; the products are
    bit for bit those of float32 pairs holding the same values (every copy,
    every row count), and no weight moves by more than 1/64 of its group's
    step from Keras's `(q - zero) * scale`."""
    q, scale, zero = _weights(n, k, block, seed=n + k)
    plan = _q8_plan(q, scale, zero, block)
    assert plan.half_pairs and plan.scales_and_zeros.dtype == torch.float16
    wide = int4_kernels._pack(q, scale, zero, block, None, "native_q8", half_pairs=False)
    assert wide.scales_and_zeros.dtype == torch.float32
    assert torch.equal(wide.packed, plan.packed)
    ops = torch.ops.dtype_policies
    suffixes = ["avx2", "vnni"] if VNNI_HERE else ["avx2"]
    pairs32 = plan.scales_and_zeros.float()
    for rows in (1, 3, 5, 130):
        x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3).bfloat16()
        for suffix in suffixes:
            product = getattr(ops, f"int4_mm_q8_{suffix}")
            half = product(x, plan.packed, plan.scales_and_zeros, plan.layout.group, n)
            assert torch.equal(half, product(x, plan.packed, pairs32, plan.layout.group, n))
    group = plan.layout.group
    decoded = int4_native.decode(plan.packed, plan.scales_and_zeros, group, q8=True)[:n, :k]
    exact = int4_native.decode(wide.packed, wide.scales_and_zeros, group, q8=True)[:n, :k]
    step = scale.double()[torch.arange(k) // block].t()
    moved = (decoded.double() - exact.double()).abs()
    assert (moved <= step / 64).all() and moved.max() > 0


@needs_kernel
def test_a_pruned_row_keeps_w4a8_on_float16_pairs():
    """A row of zeros (its groups' steps a quantizer's epsilon, below
    float16's range) does not send the whole weight to float32 pairs; its
    outputs stay within float16's smallest steps of 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 64, bias=False))
    with torch.no_grad():
        model[0].weight[5] = 0
    quantize(model, "int4", Int4QuantizationConfig(block_size=32, activation_block_size=32))
    x = torch.randn(3, 256)
    with torch.no_grad():
        y = model(x)
    plan = quantization_of(model[0]).runtime.plan
    assert plan.kernel == "native_q8" and plan.half_pairs
    assert (y[:, 5].abs() <= 2**-20 * x.abs().sum(dim=1)).all()


def test_w4a8_is_named_in_reports_and_a_lookup_keeps_no_plan_when_compiled():
    """`summary` tells W4A8 from weight-only int4 (as int8's variants); an
    int4 embedding table, read by lookups, gets no packed copy when a
    compiled model makes its kernels' plans current."""
    from dtype_policies import compile_for_inference, summary

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(300, 64), nn.Linear(64, 8))
    quantize(model, "int4", Int4QuantizationConfig(block_size=32, activation_block_size=32))
    assert "int4/32 W4A8" in str(summary(model))
    ids = torch.randint(0, 300, (2, 5))
    with torch.no_grad():
        eager = model(ids)
        compiled = compile_for_inference(model, autotune=False)(ids)
    assert torch.equal(compiled, eager)
    runtime = quantization_of(model[0]).runtime
    assert runtime is None or runtime.plan is None


@needs_kernel
def test_many_w4a8_rows_stay_on_the_kernel_on_every_class():
    """The W4A8 kernel's integer products beat the decoded float32 GEMMs at
    every row count, in its AVX2 and its VNNI copy; the weight-only kernel is
    decoded from NATIVE_DECODED_MIN_ROWS rows. Both paths give the same values
    up to the order of the float32 sums."""
    q, scale, zero = _weights(40, 576, 64, seed=5)
    runtime = int4_kernels.Int4Runtime()
    runtime.refresh(q, scale, zero, 64, (q,), kernel="native_q8")
    rows = int4_kernels.NATIVE_DECODED_MIN_ROWS
    for name in ("avx2", None):
        with _cpu.emulate(name) if name else contextlib.nullcontext():
            assert int4_kernels.decoded_min_rows("native_q8") is None
            assert int4_kernels.decoded_min_rows("native") == rows
            assert int4_kernels.int4_path(runtime, rows, 64) == "native_q8"
            assert int4_kernels.int4_path(runtime, 4 * rows, 64) == "native_q8"
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(5))
    y = int4_kernels.int4_linear(x, None, scale, zero, 64, None, torch.bfloat16, runtime)
    decoded = int4_kernels.int4_linear(
        x, None, scale, zero, 64, None, torch.bfloat16, runtime, "decoded_q8"
    )
    torch.testing.assert_close(y.float(), decoded.float(), rtol=2**-7, atol=1e-3)


def _packed_runtime(q, scale, zero, block, g_idx=None):
    runtime = int4_kernels.Int4Runtime()
    runtime.refresh(q, scale, zero, block, (q,), g_idx, kernel="packed")
    return runtime


@needs_kernel
def test_torch_packing_is_read_for_the_capability_torch_runs():
    """The probe finds the column block of torch's packing in this process:
    64 where its kernels run AVX-512, 32 under AVX2, none for its scalar
    layout (which this library's decoder does not read)."""
    expected = {"AVX512": 64, "AVX2": 32}.get(torch.backends.cpu.get_cpu_capability())
    assert int4_native.torch_packing_block() == expected


@needs_kernel
@pytest.mark.parametrize(
    ("n", "k", "block", "permuted"),
    [
        (64, 256, 128, False),
        (112, 576, 64, False),  # a whole column block of 64 and a last one of 48
        (30, 256, 128, False),  # N padded to 32: one last block of 32
        (48, 200, 40, False),  # padded blocks: the activations spread
        (24, 576, 128, True),  # kernel groups of 64, activation order folded in
        (20, 100, -1, False),  # per channel, K padded
    ],
)
def test_torch_packing_decodes_into_bfloat16_gemms_with_the_kernels_values(n, k, block, permuted):
    """From many rows torch's packed weight is decoded chunk by chunk into
    bfloat16 and multiplied by bfloat16 GEMMs: the product of the kernel's
    weights `q * s + z`, each rounded once to bfloat16, with float32 sums; the
    kernel's own result within that rounding, eager and in a frozen graph."""
    if int4_native.torch_packing_block() is None:
        pytest.skip("torch's int4 packing in this process is not one the decoder reads")
    from torch._inductor import config

    q, scale, zero = _weights(n, k, block, seed=n + k)
    g_idx = None
    if block > 0:
        g_idx = (torch.arange(k) // block).float()
        if permuted:
            g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(k))]
    runtime = _packed_runtime(q, scale, zero, block, g_idx)
    assert int4_kernels.paths(runtime) == ["packed", "decoded_bf16", "dequantized"]
    rows = int4_kernels.PACKED_DECODED_MIN_ROWS  # the path of these small weights
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).bfloat16()

    def product(path):
        return int4_kernels.int4_linear(
            x, q, scale, zero, block, None, torch.bfloat16, runtime, path, g_idx
        ).double()

    decoded, kernel = product("decoded_bf16"), product("packed")
    weight = int4_kernels.kernel_weight(
        q, scale, zero, block, g_idx, bfloat16_pairs=True
    )  # (N, K) float32
    exact = x.double() @ weight.bfloat16().double().t()
    magnitude = x.double().abs() @ weight.double().abs().t()
    assert decoded.shape == (rows, n)
    assert ((decoded - exact).abs() <= 2**-8 * exact.abs() + 1e-6 * magnitude).all()
    assert ((decoded - kernel).abs() <= 2**-8 * (magnitude + kernel.abs())).all()
    assert ((decoded - kernel).norm() / kernel.norm()).item() < 2**-8
    if int4_kernels.int4_path(runtime, rows, block) == "decoded_bf16":
        with config.patch(freezing=True):
            frozen = int4_kernels.int4_linear_traced(
                x, q, scale, zero, block, None, torch.bfloat16, runtime, g_idx
            )
        assert torch.equal(frozen.double(), decoded)


def test_torch_packing_is_decoded_only_where_bfloat16_gemms_are_native():
    """The decoded bfloat16 path is chosen from `PACKED_DECODED_MIN_ROWS`
    rows (fewer for large weights) on CPUs with native bfloat16 products, and
    never elsewhere: emulated bfloat16 GEMMs do not beat the kernel."""
    import dataclasses

    native_bf16 = dataclasses.replace(_cpu.processor(), native_bf16=True)
    emulated = dataclasses.replace(_cpu.processor(), native_bf16=False)
    assert int4_kernels.decoded_min_rows("packed", emulated) is None
    with _cpu.emulate("avx2"):
        assert int4_kernels.decoded_min_rows("packed") is None
    large, small = 2048 * 1536, 576 * 1536
    if int4_native.torch_packing_block() is None:
        assert int4_kernels.decoded_min_rows("packed", native_bf16, large) is None
        return
    expected = {
        large: int4_kernels.PACKED_DECODED_LARGE_MIN_ROWS,
        small: int4_kernels.PACKED_DECODED_MIN_ROWS,
        None: int4_kernels.PACKED_DECODED_MIN_ROWS,
    }
    for elements, rows in expected.items():
        assert int4_kernels.decoded_min_rows("packed", native_bf16, elements) == rows
    q, scale, zero = _weights(1536, 576, 128, seed=6)
    runtime = _packed_runtime(q, scale, zero, 128)
    from_rows = int4_kernels.decoded_min_rows("packed", elements=1536 * 576)
    if from_rows is None:  # this CPU's bfloat16 is emulated
        assert int4_kernels.int4_path(runtime, 4096, 128) == "packed"
    else:
        assert int4_kernels.int4_path(runtime, from_rows - 1, 128) == "packed"
        assert int4_kernels.int4_path(runtime, from_rows, 128) == "decoded_bf16"


@needs_kernel
def test_decoding_torch_packing_refuses_a_layout_it_cannot_read():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    packed = torch.zeros(16 * 64 // 2, dtype=torch.uint8)
    pairs = torch.zeros(1, 16, 2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="block_n 32 or 64"):
        torch.ops.dtype_policies.int4_packed_decoded_mm(x, packed, pairs, 64, 48)
    with pytest.raises(RuntimeError, match="pairs must be"):
        torch.ops.dtype_policies.int4_packed_decoded_mm(x, packed, pairs[:, :, :1], 64, 64)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.dtype_policies.int4_packed_decoded_mm(x.float(), packed, pairs, 64, 64)


@pytest.mark.parametrize("mode", ["int4", "gptq"])
def test_a_load_landing_before_the_plan_key_leaves_no_mixed_plan(mode, monkeypatch):
    """Another thread's `load_state_dict(assign=True)` lands in a call just
    before its plan's key is taken (replayed here without threads): the plan
    is packed from scales read after the key, so later calls compute with
    the loaded weights (scales read before it once packed the new integers
    with the old scales, for good)."""
    import warnings

    from dtype_policies._core.module_state import STATE_KEY
    from dtype_policies.quantizers import GPTQConfig

    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(256, 64))
        if mode == "gptq":
            data = [torch.randn(8, 256) for _ in range(2)]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                quantize(
                    model, "gptq", config=GPTQConfig(data, None, group_size=32), progress=False
                )
        else:
            config = Int4QuantizationConfig(activation_quantizer=None, block_size=32)
            quantize(model, "int4", config=config, progress=False)
        return model

    model, other = make(0), make(1)
    x = torch.randn(1, 256)
    with torch.no_grad():
        model(x)  # the plan of the first weights
    stale_key = int4_kernels.Int4Runtime.stale_key

    def load_first(self, stored):
        monkeypatch.setattr(int4_kernels.Int4Runtime, "stale_key", stale_key)
        model.load_state_dict({k: v.clone() for k, v in other.state_dict().items()}, assign=True)
        names = model[0].__dict__[STATE_KEY].quantization.buffer_names
        buffers = model[0]._buffers
        return stale_key(self, tuple(buffers[n] for n in names if buffers.get(n) is not None))

    monkeypatch.setattr(int4_kernels.Int4Runtime, "stale_key", load_first)
    with torch.no_grad():
        model(x)  # the call the load lands in
        expected = other(x)
        for _ in range(2):
            assert torch.equal(model(x), expected)


@pytest.mark.parametrize("rows", [1, 8, 100, 130])
def test_a_compiled_int4_product_adds_its_bias_to_the_kernels_output_as_eager(rows):
    """The native kernel's bfloat16 output is stored as it returns it, so the
    compiled graph adds the bias to it without rounding it again in integer
    ops (a scalar pass as long as the product at 4096 x 1536): the values
    stay eager's, on both sides of the decoded paths' row thresholds (the
    graph runs the same path as eager: the decoded ones are one operator
    each)."""
    from dtype_policies import compile_for_inference

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 160))
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int4", Int4QuantizationConfig(block_size=32))
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        eager = model(x)
        compiled = compile_for_inference(model)(x)
    assert compiled.dtype == eager.dtype == torch.bfloat16
    assert torch.equal(compiled, eager)
