"""The AMX copy of the W4A8 kernel (`int4_mm_q8_amx`, `_csrc/int4_amx.inc`):
the values of the W4A8 operator's other copies bit for bit over awkward
shapes, and chosen on AMX CPUs from `Q8_AMX_MIN_ROWS` rows only."""

from __future__ import annotations

import threading

import pytest
import torch

from dtype_policies import _cpu
from dtype_policies import _native as native
from dtype_policies.quantization.kernels import int4_native
from native_kernels import AMX_HERE, needs_amx, needs_kernel, on_one_and_several_threads

ROWS = (1, 5, 31, 33, 100, 257)
ONE_GROUP = 0  # a group covering every input (per channel)


def _operands(rows, n, k, group, seed, extreme=False, special_rows=True):
    """(x, packed, pairs, group) of the W4A8 layout; K need not be a multiple
    of 32 (x then shorter than the weight's Kp)."""
    generator = torch.Generator().manual_seed(seed)
    kp = -(-k // 32) * 32
    group = group or 1 << max(5, (kp - 1).bit_length())
    groups = -(-kp // group)
    x = (torch.randn(rows, k, generator=generator) * 5).bfloat16()
    q = torch.randint(-8, 8, (n, k), generator=generator)
    scale = torch.rand(groups, n, generator=generator) * 0.2
    offset = torch.randn(groups, n, generator=generator) * 0.1
    if extreme:  # every input rounds to +-127, every weight to -8 or 7, wide scales
        x = torch.where(torch.rand(rows, k, generator=generator) < 0.5, -3e38, 3e38).bfloat16()
        q = torch.where(torch.rand(n, k, generator=generator) < 0.5, -8, 7)
        scale = torch.rand(groups, n, generator=generator) * 1e-30
        offset = torch.randn(groups, n, generator=generator) * 1e-28
    if special_rows and rows > 3:
        x[2, k // 2] = float("nan")
        x[3, 0] = float("inf")
        x[1, : min(k, 32)] = 0  # a zero block
    packed, pairs = int4_native.pack_q8(q, scale, offset, group)
    return x, packed, pairs, group


def _bits(y: torch.Tensor) -> torch.Tensor:
    return y.view(torch.int16)


def _copies(operands, n, names=("avx2", "vnni", "amx")):
    x, packed, pairs, group = operands
    ops = torch.ops.dtype_policies
    return {name: getattr(ops, f"int4_mm_q8_{name}")(x, packed, pairs, group, n) for name in names}


def _assert_same_bits(expected: torch.Tensor, actual: torch.Tensor) -> None:
    assert expected.dtype == actual.dtype == torch.bfloat16 and expected.shape == actual.shape
    assert torch.equal(_bits(expected), _bits(actual))


@needs_amx
@pytest.mark.parametrize("group", [32, 64, 128, ONE_GROUP])
@pytest.mark.parametrize("n", [8, 24, 192, 576, 1000])
@pytest.mark.parametrize("k", [32, 96, 100, 576, 1536])
def test_the_amx_copy_gives_the_w4a8_values_bit_for_bit(k, n, group):
    """Every row tail (1-16 rows of a tile), column tail (8 of a panel of 16,
    a missing half), input tail (K = 100), group sizes from one block to one
    group per row; NaN, infinite and zero rows, extreme values: the bits of
    the AVX2 and VNNI copies."""
    for case, rows in enumerate(ROWS):
        extreme = case % 3 == 1  # (sums that overflow to infinities and NaN too)
        operands = _operands(rows, n, k, group, seed=case, extreme=extreme)
        copies = _copies(operands, n)
        _assert_same_bits(copies["vnni"], copies["amx"])
        _assert_same_bits(copies["avx2"], copies["amx"])
        if rows > 3 and not extreme:
            assert copies["amx"][2:4].isnan().all() and not copies["amx"][4:].isnan().any()


@needs_amx
def test_the_amx_copy_agrees_on_one_and_several_threads_and_from_two_threads():
    n, k = 576, 384
    operands = _operands(257, n, k, 64, seed=7)
    expected = _copies(operands, n, ("vnni",))["vnni"]
    one, several = on_one_and_several_threads(lambda: _copies(operands, n, ("amx",))["amx"])
    _assert_same_bits(expected, one)
    _assert_same_bits(expected, several)
    results: list = [None, None]

    def run(slot: int) -> None:
        results[slot] = [_copies(operands, n, ("amx",))["amx"] for _ in range(5)]

    threads = [threading.Thread(target=run, args=(slot,)) for slot in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for runs in results:
        assert runs is not None
        for got in runs:
            _assert_same_bits(expected, got)


@needs_kernel
def test_the_amx_operator_refuses_what_the_others_refuse():
    """(It runs the VNNI copy where the tiles do not run: on any CPU with
    AVX-512 VNNI; its checks are the operators' own, on any CPU.)"""
    x, packed, pairs, group = _operands(40, 24, 64, 32, seed=0)
    with pytest.raises(RuntimeError, match="int4_mm_q8_amx: x has K=96"):
        torch.ops.dtype_policies.int4_mm_q8_amx(
            torch.cat([x, x[:, :32]], 1), packed, pairs, group, 24
        )
    with pytest.raises(RuntimeError, match="int4_mm_q8_amx: pairs must be"):
        torch.ops.dtype_policies.int4_mm_q8_amx(x, packed, pairs[:, :1], group, 24)


# Which copy runs by rows: tests/test_int8_amx.py, for both choosers.


@needs_kernel
def test_eager_calls_run_the_copy_of_the_class_by_rows():
    """`int4_native.int4_mm_q8` here: the AMX copy at many rows where the
    (possibly emulated) class has AMX, else the class's copy, as at 1 row;
    the same values either way."""
    rows = int4_native.Q8_AMX_MIN_ROWS
    x, packed, pairs, group = _operands(rows, 48, 64, 32, seed=3, special_rows=False)
    with torch.profiler.profile() as profile:
        y_many = int4_native.int4_mm_q8(x, packed, pairs, group, 48)
        y_one = int4_native.int4_mm_q8(x[:1], packed, pairs, group, 48)
    names = [event.name for event in profile.events()]
    few = native.operator_suffix()
    many = "amx" if "amx" in _cpu.processor().features else few
    assert f"dtype_policies::int4_mm_q8_{many}" in names
    assert f"dtype_policies::int4_mm_q8_{few}" in names
    assert many != "amx" or AMX_HERE  # the class never has AMX the machine lacks
    _assert_same_bits(y_many[:1], y_one)


# Compiled graphs by rows: tests/test_int8_amx.py, for int8 and W4A8.
