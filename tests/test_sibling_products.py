"""Sibling products merged (`quantization.kernels.siblings`): calls of this
library's packed operators on one input become one call on the concatenated
weights, bit for bit, in the graphs `compile_for_generation` and
`compile_for_inference` compile; groups that cannot merge are left alone."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dtype_policies.quantization.kernels import int4_native, int8_native, siblings
from native_kernels import needs_kernel

pytestmark = needs_kernel

K = 96
WIDTHS = (96, 40, 40)  # 40: not a whole number of 16-column panels


def _ops():
    int8_native._ops()
    return torch.ops.dtype_policies


def _q8b_weights(n: int, seed: int, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, K), generator=g, dtype=torch.int8)
    steps = torch.rand(n, K // 32, generator=g) * 0.01 + 1e-3
    b = torch.randn(n, generator=g) if bias else None
    return int8_native.pack(q), int8_native.pack_block_steps(steps, 32, K), b


def _q8_weights(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, K), generator=g, dtype=torch.int8)
    return int8_native.pack(q), torch.rand(n, generator=g) * 0.01, torch.randn(n, generator=g)


def _int4_weights(n: int, seed: int, q8: bool):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, K), generator=g, dtype=torch.int32)
    scale = (torch.rand(K // 32, n, generator=g) * 0.1 + 0.01).bfloat16()
    offset = (torch.randn(K // 32, n, generator=g) * 0.01).bfloat16()
    return (int4_native.pack_q8 if q8 else int4_native.pack)(q, scale, offset, 32)


def _traced(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def _calls(gm: torch.fx.GraphModule) -> int:
    return sum(1 for node in gm.graph.nodes if siblings._spec_of(node) is not None)


def _merged_equals_original(fn, *args, expect_removed: int) -> None:
    gm = _traced(fn, *args)
    before = gm(*args)
    calls = _calls(gm)
    assert siblings.merge_sibling_products(gm.graph) == expect_removed
    gm.recompile()
    assert _calls(gm) == calls - expect_removed
    after = gm(*args)
    for a, b in zip(before, after, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


@pytest.mark.parametrize("rows", [1, 5])
def test_int8_q8b_siblings_merge_bit_for_bit(rows):
    ops = _ops()
    weights = [_q8b_weights(n, seed) for seed, n in enumerate(WIDTHS)]
    x = torch.randn(rows, K).bfloat16()

    def fn(x, *flat):
        outs = []
        for i, n in enumerate(WIDTHS):
            # Each product views its input and computes its weights on its
            # own, just before it, as a model's layers do (the merged call
            # needs the graph ordered again).
            packed, steps = flat[2 * i], flat[2 * i + 1] * 1.0
            outs.append(ops.int8_mm_q8b_avx2(x.view(-1, K), packed, steps, None, n, True))
        return outs

    flat = [t for packed, steps, _ in weights for t in (packed, steps)]
    _merged_equals_original(fn, x, *flat, expect_removed=2)


def test_int8_q8_siblings_with_biases_merge_bit_for_bit():
    ops = _ops()
    weights = [_q8_weights(n, seed) for seed, n in enumerate(WIDTHS)]
    x = torch.randn(3, K).bfloat16()

    def fn(x, *flat):
        return [
            ops.int8_mm_q8_avx2(x, flat[3 * i], flat[3 * i + 1], flat[3 * i + 2], n, False)
            for i, n in enumerate(WIDTHS)
        ]

    _merged_equals_original(fn, x, *[t for w in weights for t in w], expect_removed=2)


@pytest.mark.parametrize("q8", [False, True], ids=["weight-only", "w4a8"])
def test_int4_siblings_merge_bit_for_bit(q8):
    ops = _ops()
    widths = (96, 40)
    weights = [_int4_weights(n, seed, q8) for seed, n in enumerate(widths)]
    op = ops.int4_mm_q8_avx2 if q8 else ops.int4_mm_avx2
    x = torch.randn(2, K).bfloat16()

    def fn(x, *flat):
        return [op(x, flat[2 * i], flat[2 * i + 1], 32, n) for i, n in enumerate(widths)]

    _merged_equals_original(fn, x, *[t for w in weights for t in w], expect_removed=1)


@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_siblings_merge_bit_for_bit(bias):
    # the AVX2 bfloat16 product of `_core.products` (plain (N, K) weights)
    ops = _ops()
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(n, K, generator=g).bfloat16() for n in (96, 40, 41)]
    biases = [torch.randn(w.shape[0], generator=g).bfloat16() for w in weights]
    x = torch.randn(1, K).bfloat16()

    def fn(x, *flat):
        return [
            ops.bf16_mm_avx2(x.view(-1, K), flat[2 * i], flat[2 * i + 1] if bias else None)
            for i in range(3)
        ]

    flat = [t for pair in zip(weights, biases, strict=True) for t in pair]
    _merged_equals_original(fn, x, *flat, expect_removed=2)


def test_groups_that_cannot_merge_are_left_alone():
    ops = _ops()
    (p1, s1, b1), (p2, s2, _) = _q8b_weights(96, 0, bias=True), _q8b_weights(40, 1)
    x, y = torch.randn(3, K).bfloat16(), torch.randn(3, K).bfloat16()

    def fn(x, y, p1, s1, b1, p2, s2):
        return [
            # a bias on one sibling only
            ops.int8_mm_q8b_avx2(x, p1, s1, b1, 96, True),
            ops.int8_mm_q8b_avx2(x, p2, s2, None, 40, True),
            # other settings (float32 output), or another input
            ops.int8_mm_q8b_avx2(x, p2, s2, None, 40, False),
            ops.int8_mm_q8b_avx2(y, p1, s1, None, 96, True),
        ]

    _merged_equals_original(fn, x, y, p1, s1, b1, p2, s2, expect_removed=0)


def test_a_sibling_whose_weights_come_after_the_first_keeps_its_own_call():
    """The merged call would stand where the first sibling is: a weight
    computed from the first product's output cannot be concatenated there."""
    ops = _ops()
    (p1, s1, _), (p2, s2, _) = _q8b_weights(96, 0), _q8b_weights(96, 1)

    def fn(x, p1, s1, p2, s2):
        a = ops.int8_mm_q8b_avx2(x, p1, s1, None, 96, True)
        later_steps = s2 * (1 + a.float().sum() * 0)
        return a, ops.int8_mm_q8b_avx2(x, p2, later_steps, None, 96, True)

    _merged_equals_original(fn, torch.randn(2, K).bfloat16(), p1, s1, p2, s2, expect_removed=0)


def test_an_output_viewed_across_rows_keeps_its_own_call():
    """A column slice of the merged output cannot be viewed as one row:
    those siblings stay separate (at one row they merge)."""
    ops = _ops()
    (p1, s1, _), (p2, s2, _) = _q8b_weights(96, 0), _q8b_weights(40, 1)

    def fn(x, p1, s1, p2, s2):
        a = ops.int8_mm_q8b_avx2(x, p1, s1, None, 96, True)
        b = ops.int8_mm_q8b_avx2(x, p2, s2, None, 40, True)
        return a.view(-1), b * 2

    _merged_equals_original(fn, torch.randn(3, K).bfloat16(), p1, s1, p2, s2, expect_removed=0)
    _merged_equals_original(fn, torch.randn(1, K).bfloat16(), p1, s1, p2, s2, expect_removed=1)


def test_the_pass_keys_inductors_cache_on_its_source():
    first, second = siblings.SiblingProducts(), siblings.SiblingProducts()
    assert first.uuid() == second.uuid() and len(first.uuid()) == 64
