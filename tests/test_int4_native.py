"""This library's AVX2 int4 kernel (`kernels/int4_native.py`, `csrc/int4_avx2.cpp`).

It runs on any x86 CPU with AVX2 and FMA (AVX-512 ones included), so these
cases call it directly wherever it can be built; which kernel the policies
choose is the processor's business (`int4.cpu_kernel`), tested at the end.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

from dtype_policies import _cpu, quantize
from dtype_policies._core.module_state import quantization_of
from dtype_policies.quantization import Int4QuantizationConfig
from dtype_policies.quantization.kernels import int4 as int4_kernels
from dtype_policies.quantization.kernels import int4_native, native

RUNS_HERE = (
    _cpu.processor().architecture == "x86_64"
    and {"avx2", "fma"} <= _cpu.hardware_flags()
    and native.enabled()
    and native.library(int4_native.KERNEL) is not None
)
needs_kernel = pytest.mark.skipif(not RUNS_HERE, reason="needs x86 AVX2+FMA and a C++ compiler")


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


def _reference(x, q, scale, zero, block):
    """float64 product of the bfloat16-rounded activations with the kernel's
    weights, and the bound of float32 summation-order differences."""
    weight = int4_kernels.kernel_weight(q, scale, zero, block).double()
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
def test_native_kernel_computes_torchs_values(n, k, block, rows):
    q, scale, zero = _weights(n, k, block, seed=n * k + rows)
    native_plan, torch_plan = _plans(q, scale, zero, block)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    ours = int4_kernels._packed(x, native_plan, n, None, torch.float32)
    theirs = int4_kernels._packed(x, torch_plan, n, None, torch.float32)
    reference, magnitude = _reference(x, q, scale, zero, block)
    assert ours.dtype == torch.float32 and ours.shape == (rows, n)
    # both round a float32 sum to bfloat16: within one bfloat16 step of the
    # exact value, plus float32 rounding of the sum
    bound = 2.0**-8 * reference.abs() + 2.0**-20 * k * magnitude + 1e-30
    assert ((ours.double() - reference).abs() <= bound).all()
    assert ((theirs.double() - reference).abs() <= bound).all()
    # many rows: the weight decoded once per call, one float32 GEMM, same values
    decoded = int4_kernels._packed(x, native_plan, n, None, torch.float32, decoded=True)
    assert ((decoded.double() - reference).abs() <= bound).all()


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
    pairs = torch.zeros(4, 3, 2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"Kp=96, group=32"):
        int4_native.int4_mm(torch.zeros(1, 96, dtype=torch.bfloat16), packed, pairs, 32, 4)


@needs_kernel
def test_native_kernel_runs_in_a_frozen_compiled_graph():
    """Under `torch.compile` with frozen weights the product is the custom op
    `dtype_policies::int4_mm_avx2`, with the eager values."""
    from torch._inductor import config as inductor_config

    q, scale, zero = _weights(64, 192, 64, seed=3)
    plan, _ = _plans(q, scale, zero, 64)

    class Product(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("q", q)
            self.register_buffer("scale", scale)
            self.register_buffer("zero", zero)

        def forward(self, x):
            return int4_kernels.int4_linear_traced(
                x, self.q, self.scale, self.zero, 64, None, torch.float32, _runtime(plan)
            )

    module = Product().eval()
    x = torch.randn(2, 192, generator=torch.Generator().manual_seed(3))
    eager = int4_kernels._packed(x, plan, 64, None, torch.float32)
    torch._dynamo.reset()
    with inductor_config.patch(freezing=True), torch.no_grad():
        compiled = torch.compile(module)(x)
    assert torch.equal(compiled, eager)


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
    with pytest.warns(RuntimeWarning, match="int4_avx2.*could not be built"):
        assert native.library("int4_avx2") is None
    assert not native.available("int4_avx2")  # decided: no second build, no second warning
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind


def test_packing_is_ops_on_the_stored_tensors_only():
    """A frozen compiled graph folds the packing into constants only when every
    op of it reads a stored tensor (a tensor constructor stops the folding, and
    the packing then runs on every call)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q, scale, zero = _weights(32, 96, 32, seed=5)
    graph = make_fx(lambda q, s, z: int4_native.pack(q, s, z, 32))(
        q, scale.bfloat16(), zero.bfloat16()
    )
    calls = [node for node in graph.graph.nodes if node.op == "call_function"]
    assert calls
    for node in calls:
        inputs = [a for a in node.all_input_nodes if a.op in ("placeholder", "call_function")]
        assert inputs, f"{node.target} builds a tensor from nothing"
