"""The AMX copy of the W4A8 kernel (`int4_mm_q8_amx`, `_csrc/int4_amx.inc`):
the values of the W4A8 operator's other copies bit for bit over awkward
shapes; chosen on AMX CPUs only, its tiles from `Q8_AMX_MIN_ROWS` rows."""

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
    tiles = {"amx": (0,)}  # the AMX operator's tiles at any rows
    return {
        name: getattr(ops, f"int4_mm_q8_{name}")(x, packed, pairs, group, n, *tiles.get(name, ()))
        for name in names
    }


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
@pytest.mark.parametrize("min_rows", [0, 64], ids=["tiles", "below their rows"])
def test_the_amx_operator_refuses_what_the_others_refuse(min_rows):
    """(It runs the VNNI copy where the tiles do not run: on any CPU with
    AVX-512 VNNI; its checks are the operators' own, on any CPU, under its
    name whichever copy the rows choose.)"""
    x, packed, pairs, group = _operands(40, 24, 64, 32, seed=0)
    amx = torch.ops.dtype_policies.int4_mm_q8_amx
    with pytest.raises(RuntimeError, match="int4_mm_q8_amx: x has K=96"):
        amx(torch.cat([x, x[:, :32]], 1), packed, pairs, group, 24, min_rows)
    with pytest.raises(RuntimeError, match="int4_mm_q8_amx: pairs must be"):
        amx(x, packed, pairs[:, :1], group, 24, min_rows)


@needs_amx
def test_the_amx_operator_runs_its_tiles_from_min_rows_only():
    """Below `min_rows` the VNNI copy (no tile product in the profile), from
    it the tiles; the VNNI operator's values either way, float16 pairs too."""
    x, packed, pairs, group = _operands(20, 48, 64, 32, seed=5)
    ops = torch.ops.dtype_policies
    for case_pairs in (pairs, pairs.half()):
        for rows, min_rows, tiles in ((20, 16, True), (15, 16, False), (1, 0, True)):
            with torch.profiler.profile() as profile:
                got = ops.int4_mm_q8_amx(x[:rows], packed, case_pairs, group, 48, min_rows)
            names = [event.name for event in profile.events()]
            assert ("dtype_policies::amx_tiles" in names) == tiles, (rows, min_rows)
            expected = ops.int4_mm_q8_vnni(x[:rows], packed, case_pairs, group, 48)
            _assert_same_bits(expected, got)


# Which copy runs by rows: tests/test_int8_amx.py, for both choosers.


@needs_kernel
def test_eager_calls_run_the_operator_of_the_class_and_tiles_by_rows():
    """`int4_native.int4_mm_q8` here: the (possibly emulated) class's
    operator at any rows, its tiles from `Q8_AMX_MIN_ROWS` rows only; the
    same values either way."""
    rows = int4_native.Q8_AMX_MIN_ROWS
    x, packed, pairs, group = _operands(rows, 48, 64, 32, seed=3, special_rows=False)
    with torch.profiler.profile() as profile:
        y_many = int4_native.int4_mm_q8(x, packed, pairs, group, 48)
        y_one = int4_native.int4_mm_q8(x[:1], packed, pairs, group, 48)
    names = [event.name for event in profile.events()]
    tiles_here = "amx" in _cpu.processor().features
    assert names.count(f"dtype_policies::int4_mm_q8_{int4_native.q8_suffix()}") == 2
    assert names.count("dtype_policies::amx_tiles") == (1 if tiles_here else 0)
    assert int4_native.q8_suffix() == ("amx" if tiles_here else native.operator_suffix())
    assert not tiles_here or AMX_HERE  # the class never has AMX the machine lacks
    _assert_same_bits(y_many[:1], y_one)


# Compiled graphs by rows: tests/test_int8_amx.py, for int8 and W4A8.
