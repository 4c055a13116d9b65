"""int8 W8A8 with the inputs rounded per block of 32 (`Int8QuantizationConfig(
activation_block_size=32)`), the weights per channel or per block of inputs
(`block_size=32`: with both, the default int8): the config, the AVX2 kernels
(`int8_native.int8_mm_q8` and `int8_mm_q8b`, `_csrc/int8_avx2.cpp`), the
floating-point path every other device takes, and the layers, compiled graphs
and training on them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from dtype_policies import _cpu, apply_policy, quantize
from dtype_policies import _native as native
from dtype_policies._core.module_state import quantization_of
from dtype_policies.apply.kernel_report import kernel_of
from dtype_policies.quantization import Int4QuantizationConfig, Int8QuantizationConfig
from dtype_policies.quantization.kernels import epilogues, int8_native
from dtype_policies.quantization.kernels import int8 as int8_kernels
from dtype_policies.quantizers import AbsMaxQuantizer, abs_max_quantize
from dtype_policies.quantizers.math import abs_max_quantize_blocks, expand_blocks
from native_kernels import RUNS_HERE, needs_kernel, needs_vnni


def _reference(x, q_nk, column_step, bias):
    """The product in float64: per-block integer sums of the rounded inputs."""
    rounded = epilogues.round_activation_blocks(x.float()).double()
    y = rounded @ q_nk.double().t() * column_step.double()
    return y if bias is None else y + bias.double()


def _reference_weight_blocks(x, q_nk, block_step, block_size, bias):
    """The same with a step per weight block: (N, blocks) `block_step`."""
    rounded = epilogues.round_activation_blocks(x.float()).double()
    weight = q_nk.double() * expand_blocks(block_step.double(), block_size, q_nk.shape[1])
    y = rounded @ weight.t()
    return y if bias is None else y + bias.double()


PER_CHANNEL = Int8QuantizationConfig(activation_block_size=32)
PER_BLOCK = Int8QuantizationConfig(activation_block_size=32, block_size=32)
CONFIGS = pytest.mark.parametrize("config", [PER_CHANNEL, PER_BLOCK], ids=["per_channel", "q8_0"])


# --- the config ---


def test_the_default_int8_is_q8_0_inputs_and_weights_per_block_of_32():
    model = nn.Sequential(nn.Linear(64, 32))
    quantize(model, "int8")
    config = quantization_of(model[0]).config
    assert config == PER_BLOCK and not config.weight_only
    assert config.get_config()["activation_block_size"] == 32
    assert config.get_config()["block_size"] == 32
    assert model[0].weight_scale.shape == (32, 2) and model[0].weight_int8.shape == (32, 64)


def test_config_round_trips_and_compares_by_block():
    blocked = Int8QuantizationConfig(activation_block_size=32)
    assert Int8QuantizationConfig.from_config(blocked.get_config()) == blocked
    assert blocked != Int8QuantizationConfig()  # per row computes differently
    assert Int8QuantizationConfig.from_config(PER_BLOCK.get_config()) == PER_BLOCK
    assert PER_BLOCK != blocked  # the weights' steps differ
    assert Int8QuantizationConfig(activation_block_size=32, block_size=-1) == blocked
    assert Int8QuantizationConfig(activation_block_size=32, block_size=64).block_size == 64
    keras_keys = Int8QuantizationConfig().get_config()
    assert "activation_block_size" not in keras_keys and "block_size" not in keras_keys


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"activation_block_size": 16}, "activation_block_size=16"),
        ({"activation_block_size": True}, "activation_block_size=True"),
        ({"activation_block_size": "32"}, "activation_block_size='32'"),
        ({"activation_quantizer": None, "activation_block_size": 32}, "activation_quantizer=None"),
        ({"block_size": 32}, "block_size=32, activation_block_size=None"),
        ({"block_size": 48, "activation_block_size": 32}, "block_size=48"),
        ({"block_size": 0, "activation_block_size": 32}, "block_size=0"),
        ({"block_size": True, "activation_block_size": 32}, "block_size=True"),
        ({"block_size": 32.0, "activation_block_size": 32}, "block_size=32.0"),
        (
            {"activation_quantizer": AbsMaxQuantizer(value_range=(-100, 100)),
             "activation_block_size": 32},
            "-100",
        ),
    ],
)  # fmt: skip
def test_config_errors_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Int8QuantizationConfig(**kwargs)


# --- the kernel ---


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 64, 130])
@pytest.mark.parametrize(("n", "k"), [(1, 4), (16, 32), (17, 33), (40, 100), (200, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_the_float64_product_of_the_rounded_inputs(rows, n, k, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + n * 7 + k)
    x = (torch.randn(rows, k, generator=generator) * 3).bfloat16()
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
    step = torch.rand(n, generator=generator) * 0.01
    bias = torch.randn(n, generator=generator) if with_bias else None
    y = int8_native.int8_mm_q8(x, int8_native.pack(q), step, bias, n, False)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    expected = _reference(x, q, step, bias)
    scale = expected.abs().max().item() + 1e-30
    assert (y.double() - expected).abs().max().item() / scale < 1e-6
    y16 = int8_native.int8_mm_q8(x, int8_native.pack(q), step, bias, n, True)
    assert y16.dtype == torch.bfloat16
    assert torch.equal(y16, y.bfloat16())  # rounded once, to nearest even


@needs_kernel
def test_kernel_rounds_inputs_exactly_as_round_activation_blocks():
    """With an identity weight each output is one input as the kernel rounded it."""
    k = 100  # 3 whole blocks and a partial one
    x = (torch.randn(7, k) * torch.logspace(-3, 3, k)).bfloat16()
    x[2, 32:64] = 0  # a block of zeros stays zero
    x[3, 5] = 1e-30  # far below the block's step: rounds to zero
    eye = torch.eye(k, dtype=torch.int8)
    y = int8_native.int8_mm_q8(x, int8_native.pack(eye), torch.ones(k), None, k, False)
    assert torch.equal(y, epilogues.round_activation_blocks(x.float()))


@needs_kernel
def test_extreme_blocks_do_not_saturate():
    k = 1536
    x = torch.full((3, k), -5.0).bfloat16()  # every input rounds to -127
    for weight in (127, -128):
        q = torch.full((20, k), weight, dtype=torch.int8)
        y = int8_native.int8_mm_q8(x, int8_native.pack(q), torch.ones(20), None, 20, False)
        expected = (5.0 / 127) * (-127 * weight) * k  # step 5 / 127, inputs -127
        torch.testing.assert_close(y, torch.full((3, 20), expected), rtol=1e-6, atol=0)


@needs_kernel
def test_rows_with_nan_or_inf_give_nan_rows_and_leave_the_others():
    x = torch.randn(4, 64).bfloat16()
    x[1, 3], x[2, 40] = float("nan"), float("-inf")
    q = torch.randint(-127, 128, (24, 64), dtype=torch.int8)
    packed = int8_native.pack(q)
    for bf16_out in (False, True):
        y = int8_native.int8_mm_q8(x, packed, torch.ones(24), None, 24, bf16_out)
        assert y[1].isnan().all() and y[2].isnan().all()
        assert y[0].isfinite().all() and y[3].isfinite().all()
    alone = int8_native.int8_mm_q8(x[[0, 3]], packed, torch.ones(24), None, 24, False)
    together = int8_native.int8_mm_q8(x, packed, torch.ones(24), None, 24, False)
    assert torch.equal(alone, together[[0, 3]])


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(0, 40),
    n=st.integers(1, 50),
    k=st.integers(1, 200),
    seed=st.integers(0, 2**16),
)
def test_any_shape_matches_the_reference(rows, n, k, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
    y = int8_native.int8_mm_q8(x, int8_native.pack(q), torch.ones(n), None, n, False)
    assert y.shape == (rows, n)
    expected = _reference(x, q, torch.ones(n), None)
    largest = expected.abs().max().item() if rows else 0.0
    assert torch.allclose(y.double(), expected, rtol=1e-6, atol=1e-6 * largest + 1e-9)


@needs_kernel
def test_operator_errors_name_what_is_wrong():
    q = torch.zeros(16, 32, dtype=torch.int8)
    packed = int8_native.pack(q)
    x = torch.zeros(2, 32).bfloat16()
    with pytest.raises(RuntimeError, match="x must be a 2-D bfloat16 tensor, got Float"):
        int8_native.int8_mm_q8(torch.zeros(2, 32), packed, torch.ones(16), None, 16, False)
    with pytest.raises(RuntimeError, match="column_step must be a \\(16,\\) float32 tensor"):
        int8_native.int8_mm_q8(x, packed, torch.ones(8), None, 16, False)
    with pytest.raises(RuntimeError, match="bias must be a \\(16,\\) float32 tensor, got BFloat16"):
        bias = torch.ones(16).bfloat16()
        int8_native.int8_mm_q8(x, packed, torch.ones(16), bias, 16, False)
    with pytest.raises(RuntimeError, match="x has K=40 inputs; the packed weight holds Kp=32"):
        wide = torch.zeros(2, 40).bfloat16()
        int8_native.int8_mm_q8(wide, packed, torch.ones(16), None, 16, False)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 64])
@pytest.mark.parametrize(
    ("n", "k", "block_size"),
    [(1, 4, 32), (16, 32, 32), (17, 33, 32), (40, 100, 64), (200, 576, 32), (33, 200, 96)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_weight_blocks_kernel_matches_the_float64_product(rows, n, k, block_size, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + n * 7 + k)
    x = (torch.randn(rows, k, generator=generator) * 3).bfloat16()
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
    step = torch.rand(n, -(-k // block_size), generator=generator) * 0.01
    bias = torch.randn(n, generator=generator) if with_bias else None
    packed_steps = int8_native.pack_block_steps(step, block_size, k)
    y = int8_native.int8_mm_q8b(x, int8_native.pack(q), packed_steps, bias, n, False)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    expected = _reference_weight_blocks(x, q, step, block_size, bias)
    scale = expected.abs().max().item() + 1e-30
    assert (y.double() - expected).abs().max().item() / scale < 1e-6
    y16 = int8_native.int8_mm_q8b(x, int8_native.pack(q), packed_steps, bias, n, True)
    assert torch.equal(y16, y.bfloat16())


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(0, 20),
    n=st.integers(1, 40),
    k=st.integers(1, 160),
    block_size=st.sampled_from([32, 64, 128]),
    seed=st.integers(0, 2**16),
)
def test_weight_blocks_any_shape_matches_the_reference(rows, n, k, block_size, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    w = torch.randn(n, k, generator=generator)
    q, scale = abs_max_quantize_blocks(w, block_size)
    assert scale.shape == (n, -(-k // block_size))
    dequantized = q.float() / expand_blocks(scale, block_size, k)
    torch.testing.assert_close(dequantized, w, atol=0.03, rtol=0)
    packed_steps = int8_native.pack_block_steps(1 / scale, block_size, k)
    y = int8_native.int8_mm_q8b(x, int8_native.pack(q), packed_steps, None, n, False)
    expected = _reference_weight_blocks(x, q, 1 / scale, block_size, None)
    # float32 sums of the blocks: errors relative to the sum of the terms' magnitudes
    magnitude = _reference_weight_blocks(x.abs(), q.abs(), 1 / scale, block_size, None)
    assert ((y.double() - expected).abs() <= 1e-6 * magnitude + 1e-12).all()


@needs_vnni
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 70),
    n=st.integers(1, 50),
    k=st.integers(1, 200),
    extreme=st.booleans(),
    with_bias=st.booleans(),
    bf16_out=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_vnni_copies_give_the_avx2_values_bit_for_bit(
    rows, n, k, extreme, with_bias, bf16_out, seed
):
    """`vpdpbusd` on inputs offset by 128, minus 128 x the column sums: the
    same exact integers as the AVX2 pair sums, so the same floats."""
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=generator) * 5).bfloat16()
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
    if extreme:  # every input rounds to +-127, every weight is -128 or 127
        x = torch.where(torch.rand(rows, k, generator=generator) < 0.5, -1.0, 1.0).bfloat16()
        q = torch.where(torch.rand(n, k, generator=generator) < 0.5, -128, 127).to(torch.int8)
    if rows > 2:
        x[1, k // 2] = float("nan")
    packed = int8_native.pack(q)
    bias = torch.randn(n, generator=generator) if with_bias else None
    steps = int8_native.pack_block_steps(torch.rand(n, -(-k // 32), generator=generator), 32, k)
    column_step = torch.rand(n, generator=generator)
    ops = torch.ops.dtype_policies
    for name, step in (("int8_mm_q8b", steps), ("int8_mm_q8", column_step)):
        avx2 = getattr(ops, f"{name}_avx2")(x, packed, step, bias, n, bf16_out)
        vnni = getattr(ops, f"{name}_vnni")(x, packed, step, bias, n, bf16_out)
        assert avx2.dtype == vnni.dtype == (torch.bfloat16 if bf16_out else torch.float32)
        assert torch.equal(avx2.isnan(), vnni.isnan())
        assert torch.equal(avx2.nan_to_num(), vnni.nan_to_num())


def test_the_build_is_keyed_on_every_included_file(tmp_path):
    import shutil

    copy_dir = tmp_path / "csrc"
    shutil.copytree(native.SOURCES, copy_dir)
    before = native.sources_digest(copy_dir)
    assert before == native.sources_digest(native.SOURCES)
    included = copy_dir / "int8_panels.inc"  # included by int8_avx2.cpp, not compiled alone
    assert "int8_panels.inc" not in native.KERNELS["avx2"].sources
    included.write_text(included.read_text() + "\n// changed\n")
    assert native.sources_digest(copy_dir) != before


def test_the_copy_that_runs_follows_the_processor_class():
    with _cpu.emulate("avx2"):
        assert native.operator_suffix() == "avx2"
    if "avx512_vnni" in _cpu.processor().features:
        assert native.operator_suffix() == "vnni"
        with _cpu.emulate("avx512"):  # AVX-512 without VNNI
            assert native.operator_suffix() == "avx2"


@needs_kernel
def test_weight_blocks_nan_rows_and_errors():
    q = torch.randint(-127, 128, (24, 64), dtype=torch.int8)
    packed = int8_native.pack(q)
    steps = int8_native.pack_block_steps(torch.rand(24, 2), 32, 64)
    assert steps.shape == (2, 2 * 16)  # 2 panels, 2 blocks of 16 steps each
    x = torch.randn(3, 64).bfloat16()
    x[1, 0] = float("inf")
    y = int8_native.int8_mm_q8b(x, packed, steps, None, 24, True)
    assert y[1].isnan().all() and y[[0, 2]].isfinite().all()
    with pytest.raises(RuntimeError, match=r"block_step must be a contiguous \(2, 32\) float32"):
        int8_native.int8_mm_q8b(x, packed, steps[:, :16].contiguous(), None, 24, False)
    with pytest.raises(RuntimeError, match=r"block_step must be a contiguous .* got Double"):
        int8_native.int8_mm_q8b(x, packed, steps.double(), None, 24, False)


# --- the paths and the layers ---


def _runtime(n: int, k: int, seed: int, block_size: int | None) -> int8_kernels.Int8Runtime:
    torch.manual_seed(seed)
    w = torch.randn(n, k) * 0.05
    if block_size is None:
        q, scale = abs_max_quantize(w, axis=1)
        scale = scale[:, 0]
    else:
        q, scale = abs_max_quantize_blocks(w, block_size)
    runtime = int8_kernels.Int8Runtime()
    runtime.refresh(q, scale, lambda data: data, False, True, block_size)
    return runtime


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [None, 32, 64])
def test_kernel_and_float_paths_agree(rows, dtype, block_size):
    runtime = _runtime(96, 200, rows, block_size)
    assert int8_kernels.blocked_paths(runtime) == ("native_q8", "q8_float")
    x = torch.randn(rows, 200).to(dtype)
    bias = torch.randn(96).to(dtype)
    kernel = int8_kernels.int8_blocked_linear(x, runtime, bias, dtype)
    floating = int8_kernels.int8_blocked_linear(x, runtime, bias, dtype, "q8_float")
    assert kernel.dtype == floating.dtype == dtype
    # both sum in float32 and round to `dtype` once (bfloat16 products of the
    # rounded activations were up to 1e-2 off where they are native)
    tolerance = 1e-5 if dtype is torch.float32 else 2**-7  # one bfloat16 step
    torch.testing.assert_close(kernel, floating, rtol=tolerance, atol=1e-5)


@CONFIGS
@pytest.mark.parametrize("source", ["float32", "mixed_bfloat16"])
def test_blocked_int8_layers_are_close_to_float_and_to_weight_only(source, config):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 160), nn.GELU(), nn.Linear(160, 48))
    x = torch.randn(6, 96)
    reference = model(x).detach()
    weight_only = copy.deepcopy(model)
    apply_policy(model, source)
    apply_policy(weight_only, source)
    quantize(model, "int8", config)
    quantize(weight_only, "int8", Int8QuantizationConfig(activation_quantizer=None))
    with torch.no_grad():
        y, y_weight_only = model(x), weight_only(x)
    expected_dtype = torch.float32 if source == "float32" else torch.bfloat16
    assert y.dtype == expected_dtype
    error = ((y.float() - reference).norm() / reference.norm()).item()
    assert 0 < error < 0.03
    assert ((y.float() - y_weight_only.float()).norm() / reference.norm()).item() < 0.03


@CONFIGS
def test_empty_rows_and_three_dimensional_inputs(config):
    model = nn.Linear(64, 24)
    quantize(model, "int8", config)
    with torch.no_grad():
        assert model(torch.randn(0, 64)).shape == (0, 24)
        batched = model(torch.randn(2, 3, 64))
    assert batched.shape == (2, 3, 24) and batched.isfinite().all()


def test_kernel_report_names_the_path():
    model = nn.Linear(64, 24)
    quantize(model, "int8")
    isa = "AVX-512 VNNI" if native.operator_suffix() == "vnni" else "AVX2"
    expected = f"int8 {isa} kernel" if RUNS_HERE else "times the int8 weight in floating point"
    assert expected in kernel_of(model) and "weight steps per 32" in kernel_of(model)
    per_channel = nn.Linear(64, 24)
    quantize(per_channel, "int8", PER_CHANNEL)
    assert expected in kernel_of(per_channel) and "weight steps" not in kernel_of(per_channel)


@CONFIGS
def test_without_native_kernels_the_float_path_gives_the_values(monkeypatch, config):
    torch.manual_seed(3)
    model = nn.Linear(80, 40)
    quantize(model, "int8", config)
    x = torch.randn(4, 80)
    with torch.no_grad():
        y = model(x)
    monkeypatch.setenv(native.DISABLE_VARIABLE, "0")
    assert not int8_kernels.blocked_kernel_applies(torch.device("cpu"))
    other = copy.deepcopy(model)
    with torch.no_grad():
        y_float = other(x)
    assert quantization_of(other).runtime.native is None
    torch.testing.assert_close(y_float, y, rtol=1e-5, atol=1e-5)


@CONFIGS
def test_training_passes_gradients_straight_through_the_rounding(config):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    quantize(model[2], "int8", config)
    x = torch.randn(5, 64)
    model(x).square().sum().backward()
    assert model[0].weight.grad is not None and model[0].weight.grad.abs().sum() > 0


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize(
    ("config", "operator"),
    [(PER_CHANNEL, "int8_mm_q8"), (PER_BLOCK, "int8_mm_q8b")],
    ids=["per_channel", "q8_0"],
)
def test_frozen_compiled_graph_runs_the_kernel_with_the_eager_values(config, operator):
    from torch._inductor.utils import run_and_get_code

    from dtype_policies import compile_for_inference

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 64), nn.GELU(), nn.Linear(64, 40)).eval()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int8", config)
    x = torch.randn(5, 96)
    with torch.inference_mode():
        eager = model(x)
        torch._dynamo.reset()
        compiled_model = compile_for_inference(model, autotune=False)
        compiled, codes = run_and_get_code(compiled_model, x)
    # the processor's operator (on AMX CPUs the AMX one, its VNNI copy at 5 rows)
    chosen = f"{operator}_{int8_native.blocked_suffix()}"
    assert any(chosen in code for code in codes)
    torch.testing.assert_close(compiled, eager, rtol=1e-2, atol=1e-2)


def test_a_tied_head_of_int4_gets_the_default_int8():
    config = Int4QuantizationConfig(block_size=32).tied_embeddings_config()
    assert config == PER_BLOCK


def test_a_table_per_block_looks_up_its_dequantized_rows_and_stays_tied_to_its_head():
    torch.manual_seed(6)

    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 40)  # 40 inputs: a whole block and a partial one
            self.head = nn.Linear(40, 50, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.embed(ids))

    model = TiedLM()
    table = model.embed.weight.detach().clone()
    quantize(model, "int8")
    assert model.head.weight_int8 is model.embed.weight_int8
    assert model.embed.weight_scale.shape == (50, 2)
    ids = torch.tensor([[0, 7, 49], [3, 3, 1]])
    with torch.no_grad():
        rows = model.embed(ids)
    q, scale = model.embed.weight_int8, model.embed.weight_scale
    expected = q[ids].float() / expand_blocks(scale, 32, 40)[ids]
    assert torch.equal(rows, expected)
    assert (rows - table[ids]).abs().max() <= table.abs().max() / 127
    assert model(ids).shape == (2, 3, 50)


def test_dense_stores_block_steps_in_its_own_layout_and_computes_as_a_linear():
    from dtype_policies import layers

    torch.manual_seed(7)
    dense = layers.Dense(24, dtype="float32")
    dense.build((None, 80))
    linear = nn.Linear(80, 24)
    with torch.no_grad():
        linear.weight.copy_(dense.kernel.t())
        linear.bias.copy_(dense.bias)
    dense.quantize("int8")
    quantize(linear, "int8")
    assert dense.kernel_int8.shape == (80, 24) and dense.kernel_scale.shape == (3, 24)
    assert linear.weight_scale.shape == (24, 3)
    assert torch.equal(dense.kernel_scale, linear.weight_scale.t())
    x = torch.randn(4, 80)
    with torch.no_grad():
        assert torch.equal(dense(x), linear(x))


def test_a_per_channel_checkpoint_does_not_load_into_blocks_and_changes_nothing():
    torch.manual_seed(8)
    old = nn.Linear(64, 16)
    quantize(old, "int8", PER_CHANNEL)
    new = nn.Linear(64, 16)
    quantize(new, "int8")
    before = {k: v.clone() for k, v in new.state_dict().items()}
    with pytest.raises(ValueError, match=r"weight_scale': \(16,\).*expected \(16, 2\)"):
        new.load_state_dict(old.state_dict())
    assert all(torch.equal(before[k], v) for k, v in new.state_dict().items())
