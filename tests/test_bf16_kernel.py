"""This library's AVX2 bfloat16 product at a few rows (`_csrc/bf16_avx2.cpp`,
chosen by `_core.products` where bfloat16 products are emulated): the values
of a bfloat16 product with float32 sums, rounded once; every shape, bias and
layout a linear leaf hands it; autograd and compilers see the rule around it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtype_policies import _cpu, apply_policy, compile_for_inference
from dtype_policies._core import products
from dtype_policies._core.module_state import STATE_KEY
from native_kernels import RUNS_HERE, needs_kernel, on_one_and_several_threads

pytestmark = needs_kernel


def _op(x, weight, bias=None):
    return torch.ops.dtype_policies.bf16_mm_avx2(x, weight, bias)


def _reference(x, weight, bias=None):
    out = x.double() @ weight.double().t()
    if bias is not None:
        out = out + bias.double()
    return out


@pytest.mark.parametrize(
    "rows, k, n",
    [
        (1, 576, 1536),
        (2, 576, 100),
        (3, 577, 33),
        (4, 17, 9),
        (5, 1536, 576),
        (8, 15, 7),
        (1, 1, 1),
    ],
)
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32])
def test_values_are_a_bfloat16_product_rounded_once(rows, k, n, bias_dtype):
    torch.manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k).bfloat16()
    weight = torch.randn(n, k).bfloat16()
    bias = None if bias_dtype is None else torch.randn(n).to(bias_dtype)
    out = _op(x, weight, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    exact = _reference(x, weight, bias)
    # float32 sums in another order, then one rounding: at most one bfloat16
    # step from the exactly rounded value
    step = exact.abs().clamp_min(2.0**-100) * 2.0**-7
    assert ((out.double() - exact).abs() <= step + k * 2.0**-20).all()
    exactly_rounded = exact.to(torch.bfloat16)
    assert (out == exactly_rounded).float().mean() > 0.95


def test_rows_are_independent_and_any_row_count_works():
    torch.manual_seed(0)
    x = torch.randn(11, 96).bfloat16()
    weight = torch.randn(40, 96).bfloat16()
    together = _op(x, weight)
    for r in range(11):
        assert torch.equal(_op(x[r : r + 1], weight), together[r : r + 1])
    assert _op(x[:0], weight).shape == (0, 40)


def test_non_finite_values_propagate():
    x = torch.ones(2, 32).bfloat16()
    x[1, 3] = float("nan")
    weight = torch.ones(3, 32).bfloat16()
    weight[2, 0] = float("inf")
    out = _op(x, weight)
    assert out[0, :2].tolist() == [32.0, 32.0] and out[0, 2] == float("inf")
    assert out[1].isnan().all()


def test_bad_arguments_name_the_value():
    x = torch.randn(2, 8).bfloat16()
    with pytest.raises(RuntimeError, match="x must be a 2-D bfloat16 tensor, got Float"):
        _op(x.float(), torch.randn(4, 8).bfloat16())
    with pytest.raises(RuntimeError, match="K=8 columns"):
        _op(x, torch.randn(4, 9).bfloat16())
    with pytest.raises(RuntimeError, match=r"bias must be a \(4,\) float32 or bfloat16"):
        _op(x, torch.randn(4, 8).bfloat16(), torch.randn(5))


def test_threads_split_columns_without_changing_values():
    torch.manual_seed(1)
    x = torch.randn(3, 1024).bfloat16()
    weight = torch.randn(1000, 1024).bfloat16()  # large enough to run in parallel
    one, many = on_one_and_several_threads(lambda: _op(x, weight))
    assert torch.equal(one, many)


@pytest.fixture
def avx2_class():
    with _cpu.emulate("avx2") as info:
        assert products.bf16_kernel(info) == RUNS_HERE
        yield info


def test_linear_uses_the_kernel_up_to_kernel_rows_then_float32(avx2_class):
    torch.manual_seed(2)
    model = nn.Linear(200, 300)
    rounded = model.weight.detach().bfloat16()
    bias = model.bias.detach().bfloat16()
    apply_policy(model, "mixed_bfloat16")
    x = torch.randn(products.KERNEL_ROWS + 1, 200)
    with torch.no_grad():
        few = model(x[: products.KERNEL_ROWS])
        product = model.__dict__[STATE_KEY].casts.pair[5]
        assert product.kernel and product._float32 is None  # no float32 copy made
        assert torch.equal(few, _op(x[: products.KERNEL_ROWS].bfloat16(), rounded, bias))
        many = model(x)
    assert product._float32 is not None
    reference = (x.bfloat16().float() @ rounded.float().t() + bias.float()).bfloat16()
    torch.testing.assert_close(many.float(), reference.float(), atol=1e-2, rtol=8e-3)


def test_sequences_and_strided_inputs(avx2_class):
    torch.manual_seed(3)
    model = nn.Linear(64, 48)
    apply_policy(model, "mixed_bfloat16")
    weight = model.weight.detach().bfloat16()
    bias = model.bias.detach().bfloat16()
    base = torch.randn(2, 5, 64)
    with torch.no_grad():
        for x in (base[:, -1], base[:1, ::2], base[0, :3], base[:, :1]):
            out = model(x)
            assert out.shape == (*x.shape[:-1], 48)
            expected = _op(x.reshape(-1, 64).bfloat16().contiguous(), weight, bias)
            assert torch.equal(out.reshape(-1, 48), expected)


def test_transposed_weight_is_copied_once_when_kept(avx2_class):
    # GPT-2's Conv1D holds its weight as (in, out): the kernel reads rows of
    # (out, in), so a kept cast is made contiguous once
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(4)
    conv = Conv1D(24, 40)  # nf=24 outputs, nx=40 inputs
    apply_policy(conv, "mixed_bfloat16")
    x = torch.randn(1, 40)
    with torch.no_grad():
        out = conv(x)
    weight = conv.weight.detach().bfloat16().t().contiguous()
    expected = _op(x.bfloat16(), weight, conv.bias.bfloat16())
    assert torch.equal(out, expected)


def test_gradients_take_the_rule_without_the_kernel(avx2_class):
    torch.manual_seed(5)
    model = nn.Linear(32, 16)
    apply_policy(model, "mixed_bfloat16")
    x = torch.randn(2, 32, requires_grad=True)
    model(x).float().sum().backward()
    expected = model.weight.detach().bfloat16().float().sum(0)
    torch.testing.assert_close(x.grad, expected.expand(2, -1), atol=5e-2, rtol=1e-2)
    assert model.weight.grad is not None and model.weight.grad.abs().sum() > 0


@pytest.fixture
def kernel_calls(monkeypatch):
    """The number of calls of the kernel so far (a list of one count)."""
    calls = [0]
    kernel = torch.ops.dtype_policies.bf16_mm_avx2

    def counted(*args):
        calls[0] += 1
        return kernel(*args)

    monkeypatch.setattr(torch.ops.dtype_policies, "bf16_mm_avx2", counted)
    return calls


@pytest.mark.parametrize("rows", [1, 2, products.KERNEL_ROWS])
def test_forward_mode_and_torch_func_take_the_rule_without_the_kernel(
    avx2_class, kernel_calls, rows
):
    """Forward mode and `torch.func` transforms set no `requires_grad`; the
    kernel (no forward-mode formula, no batching rule) is left to the rule
    there, with gradients enabled or not, and its tangents are the bfloat16
    weight's. Plain calls without gradients keep the kernel."""
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(8)
    model = nn.Linear(16, 4)
    apply_policy(model, "mixed_bfloat16")
    x, t = torch.randn(rows, 16), torch.randn(rows, 16)
    weight = model.weight.detach().bfloat16().float()
    expected = t.bfloat16().float() @ weight.t()

    def f(inputs):
        return model(inputs).float()

    def forward_ad(grad_enabled):
        with torch.set_grad_enabled(grad_enabled), fwAD.dual_level():
            return fwAD.unpack_dual(model(fwAD.make_dual(x, t))).tangent.float()

    values = x.bfloat16().float() @ weight.t() + model.bias.detach().bfloat16().float()
    with torch.no_grad():
        model(x)  # kept casts, as a warm inference model has them
    assert kernel_calls[0] == 1
    for grad_enabled in (True, False):
        with torch.set_grad_enabled(grad_enabled):
            _, tangent = torch.func.jvp(f, (x,), (t,))
            torch.testing.assert_close(tangent, expected, atol=1e-2, rtol=8e-3)
            jacobian = torch.func.jacfwd(f)(x[:1]).reshape(4, 16)
            assert torch.equal(jacobian, weight)
            per_row = torch.func.vmap(lambda row: model(row[None])[0])(x)
            torch.testing.assert_close(per_row.float(), values, atol=1e-2, rtol=8e-3)
        torch.testing.assert_close(forward_ad(grad_enabled), expected, atol=1e-2, rtol=8e-3)
    with torch.inference_mode():
        model(x)
    assert kernel_calls[0] == 2


def test_weights_updated_in_place_are_read_again(avx2_class):
    torch.manual_seed(6)
    model = nn.Linear(32, 16)
    apply_policy(model, "mixed_bfloat16")
    x = torch.randn(1, 32)
    with torch.no_grad():
        before = model(x)
        model.weight.mul_(2)
        model.bias.mul_(2)
        after = model(x)
    torch.testing.assert_close(after.float(), 2 * before.float(), atol=2e-2, rtol=1e-2)


@pytest.mark.slow
def test_compiled_graph_calls_the_kernel_with_eager_values(avx2_class):
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(96, 160), nn.GELU(), nn.Linear(160, 96)).eval()
    apply_policy(model, "mixed_bfloat16")
    x = torch.randn(1, 96)
    with torch.inference_mode():
        eager = model(x)
        compiled = compile_for_inference(model, autotune=False)(x)
    assert compiled.dtype == torch.bfloat16
    assert torch.equal(compiled, eager)


def test_native_kernels_off_keeps_torchs_products(avx2_class, monkeypatch):
    from dtype_policies import _native as native

    monkeypatch.setenv(native.DISABLE_VARIABLE, "0")
    assert not products.bf16_kernel(avx2_class)
    model = nn.Linear(64, 32)
    apply_policy(model, "mixed_bfloat16")
    with torch.no_grad():
        out = model(torch.randn(2, 64))
    product = model.__dict__[STATE_KEY].casts.pair[5]
    assert out.dtype == torch.bfloat16 and not product.kernel
    assert product._float32 is not None  # 2 rows: float32 products, as before the kernel
