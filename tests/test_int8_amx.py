"""The AMX copy of the blocked int8 kernels (`int8_mm_q8b_amx`,
`int8_mm_q8_amx`, `_csrc/int8_amx.inc`): the VNNI copy's values bit for bit
over awkward shapes; the AMX operators chosen on AMX CPUs only, their tiles
from `AMX_MIN_ROWS` rows (chosen inside the operator, so compiled graphs hold
no guard on the rows)."""

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
        amx = getattr(ops, f"{name}_amx")(x, packed, step, bias, n, bf16_out, 0)  # tiles
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


@needs_kernel
@pytest.mark.parametrize("min_rows", [0, 64], ids=["tiles", "below their rows"])
def test_the_amx_operators_refuse_what_the_vnni_copies_refuse(min_rows):
    """Under their own names, whichever copy the rows choose (the VNNI copy
    where the tiles do not run: any CPU with the kernel)."""
    x, packed, block_step, _, _ = _operands(40, 24, 64, seed=0)
    ops = torch.ops.dtype_policies
    with pytest.raises(RuntimeError, match="int8_mm_q8b_amx: block_step must be"):
        ops.int8_mm_q8b_amx(x, packed, block_step[:, :16], None, 24, False, min_rows)
    with pytest.raises(RuntimeError, match="int8_mm_q8_amx: x has K=60"):
        ops.int8_mm_q8_amx(x[:, :60], packed, block_step, None, 24, False, min_rows)
    with pytest.raises(RuntimeError, match="int8_mm_q8b_amx: x must be a 2-D bfloat16"):
        ops.int8_mm_q8b_amx(x[0], packed, block_step, None, 24, False, min_rows)


@needs_amx
@pytest.mark.parametrize("operator", ["int8_mm_q8b", "int8_mm_q8"])
def test_the_amx_operators_run_their_tiles_from_min_rows_only(operator):
    """Below `min_rows` the VNNI copy (no tile product in the profile), from
    it the tiles; the values of the VNNI operator either way."""
    x, packed, block_step, column_step, bias = _operands(20, 48, 64, seed=5, nan_row=False)
    step = block_step if operator == "int8_mm_q8b" else column_step
    amx = getattr(torch.ops.dtype_policies, f"{operator}_amx")
    vnni = getattr(torch.ops.dtype_policies, f"{operator}_vnni")
    for rows, min_rows, tiles in ((20, 8, True), (7, 8, False), (20, 21, False), (1, 0, True)):
        with torch.profiler.profile() as profile:
            got = amx(x[:rows], packed, step, bias, 48, False, min_rows)
        names = [event.name for event in profile.events()]
        assert ("dtype_policies::amx_tiles" in names) == tiles, (rows, min_rows)
        _assert_same(vnni(x[:rows], packed, step, bias, 48, False), got)


@pytest.mark.parametrize(
    "choose, least",
    [
        (int8_native.blocked_suffix, int8_native.AMX_MIN_ROWS),
        (int4_native.q8_suffix, int4_native.Q8_AMX_MIN_ROWS),
    ],
    ids=["int8 blocked", "int4 W4A8"],
)
def test_the_amx_operator_is_chosen_on_amx_only(choose, least):
    assert least > 1  # the tiles' threshold, passed to the operator
    amx = replace(_cpu.processor(), features=_cpu.CPU_CLASSES["amx"])
    assert choose(amx) == "amx"
    for smaller in ("avx512_bf16", "avx512_vnni"):
        emulated = replace(_cpu.processor(), features=_cpu.CPU_CLASSES[smaller])
        assert choose(emulated) == "vnni"
    for smaller in ("avx2", "avx2_vnni", "avx512"):
        emulated = replace(_cpu.processor(), features=_cpu.CPU_CLASSES[smaller])
        assert choose(emulated) == "avx2"
    with _cpu.emulate("avx512_bf16"):  # or less, where the process runs capped
        assert choose() == native.operator_suffix() != "amx"


def _tiles_ran(call) -> bool:
    """Whether `call()` ran an AMX tile product (the operators' profiler scope)."""
    with torch.profiler.profile() as profile:
        call()
    return "dtype_policies::amx_tiles" in [event.name for event in profile.events()]


def _tiles_here() -> bool:
    """The AMX operators run here and reach their tiles (the possibly emulated
    class has AMX)."""
    return "amx" in _cpu.processor().features


@needs_kernel
def test_eager_calls_run_the_operator_of_the_class_and_tiles_by_rows():
    """`int8_native.int8_mm_q8b` here: the (possibly emulated) class's
    operator at any rows; its tiles from `AMX_MIN_ROWS` rows only."""
    operands = _operands(int8_native.AMX_MIN_ROWS, 48, 64, seed=3, nan_row=False)
    x, packed, block_step, _, bias = operands
    with torch.profiler.profile() as profile:
        many = int8_native.int8_mm_q8b(x, packed, block_step, bias, 48, True)
        one = int8_native.int8_mm_q8b(x[:1], packed, block_step, bias, 48, True)
    names = [event.name for event in profile.events()]
    assert names.count(f"dtype_policies::int8_mm_q8b_{int8_native.blocked_suffix()}") == 2
    assert names.count("dtype_policies::amx_tiles") == (1 if _tiles_here() else 0)
    assert not _tiles_here() or AMX_HERE  # the class never has AMX the machine lacks
    _assert_same(many[:1], one)


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("mode", ["int8", "int4 W4A8"])
def test_a_dynamic_compiled_graph_crosses_the_tiles_rows_without_recompiling(mode):
    """Compiled at many rows, then again (automatic dynamic shapes) at other
    rows above the tiles' threshold; the rows then below it run the same graph
    (the choice is the operator's, not a guard), on the VNNI copy: each call
    the eager values bit for bit (W4A8: one layer, as around a GELU compiled
    and eager bfloat16 differ anyway)."""
    from unittest import mock

    import torch.nn as nn
    from torch._dynamo.utils import counters
    from torch._inductor.graph import GraphLowering

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
        codes: list[str] = []
        # (torch's `run_and_get_code` resets Dynamo, forgetting the first shape)
        with mock.patch.object(GraphLowering, "save_output_code", codes.append):
            for rows in (4 * least, 2 * least):
                x = torch.randn(rows, 96)
                assert torch.equal(compiled_model(x), model(x))
                assert any(f"{operator}_{choose()}" in code for code in codes), rows
                codes.clear()
        graphs = counters["stats"]["unique_graphs"]
        for rows in (least - 1, 2):
            x = torch.randn(rows, 96)
            tiles = _tiles_ran(lambda: compiled_model(x))  # noqa: B023
            assert not tiles
            assert torch.equal(compiled_model(x), model(x))
        assert counters["stats"]["unique_graphs"] == graphs
        x = torch.randn(3 * least, 96)
        assert _tiles_ran(lambda: compiled_model(x)) == _tiles_here()
        assert counters["stats"]["unique_graphs"] == graphs
