"""Quantization math: Keras's scale conventions, packing, float8 scaling."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtype_policies.quantizers.math import (
    FLOAT8_E4M3_MAX,
    FLOAT8_E5M2_MAX,
    abs_max_quantize,
    compute_float8_amax_history,
    compute_float8_scale,
    dequantize_grouped,
    grouped_quantize_with_zero_point,
    pack_int4,
    packed_int4,
    quantize_and_dequantize,
    unpack_int4,
    unpack_int4_rows,
)


def test_abs_max_convention_matches_keras():
    x = torch.tensor([[0.5, -1.0, 0.25], [3.0, 0.0, -1.5]])
    q, scale = abs_max_quantize(x, axis=-1)
    expected_scale = 127.0 / (x.abs().amax(-1, keepdim=True) + 1e-7)
    torch.testing.assert_close(scale, expected_scale)
    torch.testing.assert_close(q, torch.round(x * expected_scale).to(torch.int8))
    assert q.dtype == torch.int8 and q.abs().max() == 127
    torch.testing.assert_close(q / scale, x, atol=x.abs().max().item() / 254, rtol=0)


def test_abs_max_int4_range_and_axis():
    w = torch.randn(16, 5)
    q, scale = abs_max_quantize(w, axis=0, value_range=(-8, 7))
    assert scale.shape == (1, 5)
    assert q.min() >= -8 and q.max() <= 7
    torch.testing.assert_close(scale, 7.0 / (w.abs().amax(0, keepdim=True) + 1e-7))


@pytest.mark.parametrize(("rows", "block"), [(256, 128), (300, 128), (13, 4), (64, 64)])
def test_grouped_quantization_error_and_shapes(rows, block):
    torch.manual_seed(rows)
    w = torch.randn(rows, 6)
    q, scale, zero = grouped_quantize_with_zero_point(w, block)
    groups = -(-rows // block)
    assert q.shape == (rows, 6) and q.dtype == torch.int8
    assert scale.shape == (groups, 6) and zero.shape == (groups, 6) and zero.dtype == torch.float32
    assert q.min() >= -8 and q.max() <= 7
    restored = dequantize_grouped(q, scale, zero, block)
    step = scale.repeat_interleave(block, dim=0)[:rows]
    assert torch.all((restored - w).abs() <= step / 2 + 1e-5)


def test_grouped_quantization_same_sign_group_uses_its_whole_range():
    w = torch.linspace(0.5, 1.0, 16).reshape(16, 1)  # all positive, 16 evenly spaced values
    q, scale, zero = grouped_quantize_with_zero_point(w, 16)
    torch.testing.assert_close(scale, torch.tensor([[0.5 / 15]]))
    assert q.flatten().tolist() == list(range(-8, 8))  # every code used, none wasted on [0, 0.5)
    torch.testing.assert_close(dequantize_grouped(q, scale, zero, 16), w, rtol=0, atol=1e-7)


def test_grouped_quantization_two_sided_group_represents_zero_exactly():
    torch.manual_seed(3)
    w = torch.randn(128, 8)
    w[::7] = 0.0
    q, scale, zero = grouped_quantize_with_zero_point(w, 64)
    assert torch.equal(zero, zero.round())  # integer zero points
    restored = dequantize_grouped(q, scale, zero, 64)
    assert torch.equal(restored[::7], torch.zeros_like(restored[::7]))


@pytest.mark.parametrize("block", [32, 128])
def test_grouped_quantization_reproduces_q4_1_blocks(block):
    """Weights on a block-32 min/max grid (a GGUF's Q4_1: each block's min and max are
    codes 0 and 15) come back exactly at /32; at /128 they quantize like any weights."""
    torch.manual_seed(0)
    k, n = 256, 24
    d = torch.rand(k // 32, 1, n) * 0.02 + 1e-3
    m = -torch.rand(k // 32, 1, n) * 0.1
    codes = torch.randint(0, 16, (k // 32, 32, n)).float()
    codes[:, 0], codes[:, 1] = 0.0, 15.0
    w = (m + codes * d).reshape(k, n)
    q, scale, zero = grouped_quantize_with_zero_point(w, block)
    restored = dequantize_grouped(q, scale, zero, block)
    if block == 32:
        torch.testing.assert_close(restored, w, rtol=0, atol=1e-7)
    assert q.min() >= -8 and q.max() <= 7


def test_grouped_quantization_short_last_group_uses_its_own_values():
    w = torch.cat([torch.randn(8, 3), 5.0 + torch.rand(3, 3)])  # the last group: 3 rows, all > 5
    q, scale, zero = grouped_quantize_with_zero_point(w, 8)
    tail = w[8:]
    torch.testing.assert_close(scale[1], (tail.amax(0) - tail.amin(0)) / 15)
    restored = dequantize_grouped(q, scale, zero, 8)
    assert torch.all((restored[8:] - tail).abs() <= scale[1] / 2 + 1e-6)


def test_grouped_quantization_of_constant_groups_is_exact():
    w = torch.tensor([[0.0, 2.5, -1e-3]]).repeat(4, 1)
    q, scale, zero = grouped_quantize_with_zero_point(w, 4)
    torch.testing.assert_close(dequantize_grouped(q, scale, zero, 4), w, rtol=1e-6, atol=0)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 9),
    st.integers(1, 9),
    st.sampled_from([0, 1, -1]),
    st.integers(0, 2**31 - 1),
)
def test_pack_unpack_round_trip(rows, columns, axis, seed):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(-8, 8, (rows, columns), generator=generator, dtype=torch.int8)
    packed, packed_shape, length = pack_int4(values, axis=axis)
    assert packed_shape == tuple(packed.shape) and length == values.shape[axis]
    assert packed.shape[axis] == (length + 1) // 2 and packed.dtype == torch.int8
    torch.testing.assert_close(unpack_int4(packed, length, axis=axis), values)


def test_pack_layout_low_nibble_first_and_errors():
    packed, _, _ = pack_int4(torch.tensor([1, 2], dtype=torch.int8))
    assert packed.view(torch.uint8).item() == 0x21
    with pytest.raises(TypeError, match="Expected int8 tensor for packing"):
        pack_int4(torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="int8 or uint8"):
        unpack_int4(torch.tensor([1.0]), 2)


def test_compute_float8_scale():
    amax, scale = torch.tensor(224.0), torch.tensor(3.0)
    torch.testing.assert_close(
        compute_float8_scale(amax, scale, FLOAT8_E4M3_MAX), torch.tensor(224.0 / 448.0)
    )
    torch.testing.assert_close(compute_float8_scale(torch.tensor(0.0), scale, 448.0), scale)
    torch.testing.assert_close(
        compute_float8_scale(torch.tensor(float("inf")), scale, 448.0), scale
    )
    torch.testing.assert_close(
        compute_float8_scale(amax, scale, FLOAT8_E4M3_MAX, margin=1), torch.tensor(1.0)
    )


def test_compute_float8_amax_history_rolls_newest_first():
    history = torch.tensor([4.0, 3.0, 2.0, 1.0])
    new = compute_float8_amax_history(torch.tensor([-7.0, 5.0]), history)
    torch.testing.assert_close(new, torch.tensor([7.0, 2.0, 1.0, 4.0]))
    torch.testing.assert_close(new[1:], torch.roll(history, -1)[1:])
    assert history.tolist() == [4.0, 3.0, 2.0, 1.0]


def test_quantize_and_dequantize_formats():
    x = torch.linspace(-3, 3, 101)
    e4 = quantize_and_dequantize(x, torch.tensor(1.0), torch.float8_e4m3fn, torch.float32)
    # Half a unit in the last place: 3 mantissa bits (e4m3), 2 (e5m2), plus subnormals.
    assert torch.all((e4 - x).abs() <= x.abs() * 2**-4 + 2**-10)
    e5 = quantize_and_dequantize(x, torch.tensor(1.0), torch.float8_e5m2, torch.bfloat16)
    assert e5.dtype == torch.bfloat16
    assert torch.all((e5.float() - x).abs() <= x.abs() * 2**-3 + 2**-15)
    scaled = quantize_and_dequantize(
        x * 100, torch.tensor(100.0), torch.float8_e4m3fn, torch.float32
    )
    torch.testing.assert_close(scaled, e4 * 100)
    big = quantize_and_dequantize(
        torch.tensor([1e6]), torch.tensor(1.0), torch.float8_e5m2, torch.float32
    )
    assert big.item() == FLOAT8_E5M2_MAX  # clipped, not inf


def test_straight_through_keeps_an_infinite_input_as_rounded():
    """`x + (rounded - x)` is NaN where `x` is infinite: a +inf input row of
    int8 weight-only (or float8) gave all-NaN outputs with gradients on, ±inf
    without, on the CPU classes whose input rounding keeps inf."""
    from dtype_policies._core.casting import straight_through

    x = torch.tensor([1.3, float("inf"), -float("inf"), 2.6], requires_grad=True)
    rounded = torch.tensor([1.0, float("inf"), -448.0, 3.0])  # float8 saturates -inf
    out = straight_through(x, rounded)
    assert torch.equal(out, rounded)
    out.sum().backward()
    assert x.grad.tolist() == [1.0, 0.0, 0.0, 1.0]


def test_straight_through_sends_no_derivative_into_the_rounding():
    """A rounding computed from `x` (a block's scale from its maximum) gets no
    derivative, not even a zero one: Inductor's backward turned that zero
    into NaN through the scale, and int8 training under `torch.compile`
    ended in NaN at its second step."""
    from dtype_policies._core.casting import straight_through

    x = torch.tensor([[1.3, -0.2, 0.0, 2.6]], requires_grad=True)
    reached = []
    scale = x.abs().amax(-1, keepdim=True) / 127
    scale.register_hook(reached.append)
    rounded = torch.round(x / scale) * scale
    straight_through(x, rounded).sum().backward()
    assert reached == []
    assert x.grad.tolist() == [[1.0, 1.0, 1.0, 1.0]]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 4),
    length=st.integers(1, 41),
    unsigned=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_unpacking_rows_by_table_equals_unpacking_int4(rows, length, unsigned, seed):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(-8, 8, (rows, length), generator=generator, dtype=torch.int8)
    packed = packed_int4(values, axis=1, dtype="uint8" if unsigned else "int8")
    decoded = unpack_int4_rows(packed, length)
    assert decoded.dtype == torch.float32 and decoded.shape == (rows, length)
    assert torch.equal(decoded, unpack_int4(packed, length, axis=-1).float())
    assert torch.equal(decoded, values.float())


def test_unpacking_rows_builds_a_plain_table_inside_inference_mode():
    from dtype_policies.quantizers import math as qmath

    qmath._NIBBLE_VALUES.clear()
    packed = packed_int4(torch.tensor([[3, -4]], dtype=torch.int8), axis=1)
    with torch.inference_mode():
        assert unpack_int4_rows(packed, 2).tolist() == [[3.0, -4.0]]
    assert not qmath._NIBBLE_VALUES[torch.device("cpu")].is_inference()


@pytest.mark.slow
def test_float8_scales_compiled_equal_eager_on_zeros_nan_and_inf():
    """Under a compiler the float8 scales are written without constructors
    (so Inductor's freezing folds them for frozen weights); their values are
    the eager ones, including rows that are zero or hold NaN or inf."""
    from dtype_policies.quantizers.math import (
        compute_float8_channel_scale,
        compute_float8_dynamic_scale,
    )

    torch.manual_seed(0)
    w = torch.randn(6, 16) * 300
    w[1] = 0.0
    w[2, 3] = float("nan")
    w[3, 5] = float("inf")
    w[4, 0] = -float("inf")
    tensors = [w, torch.zeros(3, 4), torch.full((2, 2), float("nan")), w.bfloat16()]

    def scales(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            compute_float8_channel_scale(x, FLOAT8_E4M3_MAX),
            compute_float8_dynamic_scale(x, FLOAT8_E4M3_MAX),
        )

    compiled = torch.compile(scales, dynamic=False)
    for x in tensors:
        eager_channel, eager_tensor = scales(x.clone())
        channel, per_tensor = compiled(x.clone())
        assert torch.equal(channel, eager_channel), x
        assert torch.equal(per_tensor, eager_tensor), x
        assert per_tensor.dtype == channel.dtype == torch.float32
    assert eager_channel[1].item() == 1.0  # a zero row keeps scale 1
