"""The AMX copy of the blocked int8 kernels (`int8_mm_q8b_amx`,
`int8_mm_q8_amx`, `_csrc/int8_amx.inc`): the VNNI copy's values bit for bit
over awkward shapes, and chosen on AMX CPUs from `AMX_MIN_ROWS` rows only."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from dtype_policies import _cpu
from dtype_policies import _native as native
from dtype_policies.quantization.kernels import int4_native, int8_native
from native_kernels import AMX_HERE, needs_amx, needs_kernel, on_one_and_several_threads

ROWS = (1, 5, 31, 33, 100, 257)


def _operands(rows, n, k, seed, extreme=False, zero_blocks=False, nan_row=True, bias=True):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=generator) * 5).bfloat16()
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
    if extreme:  # every input rounds to +-127, every weight is -128 or 127
        x = torch.where(torch.rand(rows, k, generator=generator) < 0.5, -1.0, 1.0).bfloat16()
        q = torch.where(torch.rand(n, k, generator=generator) < 0.5, -128, 127).to(torch.int8)
    if zero_blocks:  # a row's first block of inputs, every column's first block of weights
        x[0, : min(k, 32)] = 0
        q[:, : min(k, 32)] = 0
    if nan_row and rows > 3:
        x[2, k // 2] = float("nan")
    block_step = torch.rand(n, -(-k // 32), generator=generator)
    return (
        x,
        int8_native.pack(q),
        int8_native.pack_block_steps(block_step, 32, k),
        torch.rand(n, generator=generator),
        torch.randn(n, generator=generator) if bias else None,
    )


def _assert_same(expected, actual):
    assert expected.dtype == actual.dtype and expected.shape == actual.shape
    assert torch.equal(expected.isnan(), actual.isnan())
    assert torch.equal(expected.nan_to_num(), actual.nan_to_num())


def _both_copies(operands, n, bf16_out):
    """(the VNNI copy's outputs, the AMX copy's) of both operators."""
    x, packed, block_step, column_step, bias = operands
    ops = torch.ops.dtype_policies
    pairs = []
    for name, step in (("int8_mm_q8b", block_step), ("int8_mm_q8", column_step)):
        vnni = getattr(ops, f"{name}_vnni")(x, packed, step, bias, n, bf16_out)
        amx = getattr(ops, f"{name}_amx")(x, packed, step, bias, n, bf16_out)
        pairs.append((vnni, amx))
    return pairs


@needs_amx
@pytest.mark.parametrize("n", [16, 24, 192, 576, 1000])
@pytest.mark.parametrize("k", [32, 96, 100, 384, 576, 1536])
def test_the_amx_copies_give_the_vnni_values_bit_for_bit(k, n):
    """Every row tail (1-16 rows of a tile), column tail (a panel of 8) and
    input tail (K = 100: a last block of 4 inputs), with and without bias,
    float32 and bfloat16 outputs, extreme and zero blocks, a NaN row."""
    for case, rows in enumerate(ROWS):
        operands = _operands(
            rows,
            n,
            k,
            seed=case,
            extreme=case % 3 == 1,
            zero_blocks=case % 3 == 2,
            bias=case % 2 == 0,
        )
        for vnni, amx in _both_copies(operands, n, bf16_out=case % 2 == 1):
            _assert_same(vnni, amx)


@needs_amx
def test_the_amx_copies_agree_on_one_and_several_threads_and_from_two_threads():
    n, k = 576, 384
    operands = _operands(257, n, k, seed=7)
    expected = _both_copies(operands, n, False)
    one, several = on_one_and_several_threads(lambda: _both_copies(operands, n, False))
    for got in (one, several):
        for (vnni, _), (_, amx) in zip(expected, got):
            _assert_same(vnni, amx)
    results: list = [None, None]

    def run(slot: int) -> None:
        results[slot] = [_both_copies(operands, n, False) for _ in range(5)]

    threads = [threading.Thread(target=run, args=(slot,)) for slot in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for runs in results:
        assert runs is not None
        for pairs in runs:
            for (vnni, _), (_, amx) in zip(expected, pairs):
                _assert_same(vnni, amx)


@needs_amx
def test_the_amx_copies_refuse_what_the_vnni_copies_refuse():
    x, packed, block_step, _, _ = _operands(40, 24, 64, seed=0)
    with pytest.raises(RuntimeError, match="int8_mm_q8b_amx: block_step must be"):
        torch.ops.dtype_policies.int8_mm_q8b_amx(x, packed, block_step[:, :16], None, 24, False)
    with pytest.raises(RuntimeError, match="int8_mm_q8_amx: x has K=60"):
        torch.ops.dtype_policies.int8_mm_q8_amx(x[:, :60], packed, block_step, None, 24, False)


@pytest.mark.parametrize(
    "choose, least",
    [
        (int8_native.blocked_suffix, int8_native.AMX_MIN_ROWS),
        (int4_native.q8_suffix, int4_native.Q8_AMX_MIN_ROWS),
    ],
    ids=["int8 blocked", "int4 W4A8"],
)
def test_the_amx_copy_is_chosen_from_enough_rows_on_amx_only(choose, least):
    many = 4 * least
    amx = replace(_cpu.processor(), features=_cpu.CPU_CLASSES["amx"])
    assert choose(many, amx) == "amx"
    assert choose(least, amx) == "amx"
    assert choose(least - 1, amx) == "vnni"
    assert choose(1, amx) == "vnni"
    for smaller in ("avx512_bf16", "avx512_vnni"):
        emulated = replace(_cpu.processor(), features=_cpu.CPU_CLASSES[smaller])
        assert choose(many, emulated) == "vnni"
    for smaller in ("avx2", "avx2_vnni", "avx512"):
        emulated = replace(_cpu.processor(), features=_cpu.CPU_CLASSES[smaller])
        assert choose(many, emulated) == "avx2"
    with _cpu.emulate("avx512_bf16"):  # or less, where the process runs capped
        assert choose(many) == native.operator_suffix() != "amx"


@needs_kernel
def test_eager_calls_run_the_copy_of_the_class_by_rows():
    """`int8_native.int8_mm_q8b` here: the AMX copy at many rows where the
    (possibly emulated) class has AMX, else the class's copy, as at 1 row."""
    operands = _operands(int8_native.AMX_MIN_ROWS, 48, 64, seed=3, nan_row=False)
    x, packed, block_step, _, bias = operands
    with torch.profiler.profile() as profile:
        int8_native.int8_mm_q8b(x, packed, block_step, bias, 48, True)
        int8_native.int8_mm_q8b(x[:1], packed, block_step, bias, 48, True)
    names = [event.name for event in profile.events()]
    few = native.operator_suffix()
    many = "amx" if "amx" in _cpu.processor().features else few
    assert f"dtype_policies::int8_mm_q8b_{many}" in names
    assert f"dtype_policies::int8_mm_q8b_{few}" in names
    assert many != "amx" or AMX_HERE  # the class never has AMX the machine lacks


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("mode", ["int8", "int4 W4A8"])
def test_a_frozen_compiled_graph_runs_the_copy_eager_runs_by_rows(mode):
    """Compiled at many rows then at one (a guard on the rows, as the other
    row-dependent choices): each graph calls the copy the eager call runs,
    with the eager values bit for bit (W4A8: one layer, as around a GELU
    compiled and eager bfloat16 differ anyway)."""
    import torch.nn as nn
    from torch._inductor.utils import run_and_get_code

    from dtype_policies import apply_policy, compile_for_inference, quantize
    from dtype_policies.quantization import Int4QuantizationConfig

    torch.manual_seed(0)
    if mode == "int8":
        model = nn.Sequential(nn.Linear(96, 64), nn.GELU(), nn.Linear(64, 40)).eval()
        config, least = None, int8_native.AMX_MIN_ROWS
        operator, choose = "int8_mm_q8b", int8_native.blocked_suffix
    else:
        model = nn.Sequential(nn.Linear(96, 40)).eval()
        config = Int4QuantizationConfig(block_size=32, activation_block_size=32)
        least = int4_native.Q8_AMX_MIN_ROWS
        operator, choose = "int4_mm_q8", int4_native.q8_suffix
    apply_policy(model, "mixed_bfloat16")
    quantize(model, mode.split()[0], config)
    with torch.inference_mode():
        torch._dynamo.reset()
        compiled_model = compile_for_inference(model, autotune=False)
        for rows in (4 * least, 1):
            x = torch.randn(rows, 96)
            eager = model(x)
            compiled, codes = run_and_get_code(compiled_model, x)
            assert any(f"{operator}_{choose(rows)}" in c for c in codes)
            assert torch.equal(compiled, eager)
