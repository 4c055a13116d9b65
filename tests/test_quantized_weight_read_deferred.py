"""A read of a quantized torch module's weight (`module.weight`) answers its
layout (dtype, shape, device, ...) without dequantizing, and computes the
dequantized weight at its first other use, from the stored tensors as they
were at the read: the values an eager read gives, bit for bit, with the same
layout. `load_state_dict` after a read leaves it its values; an in-place
write to a stored tensor by any other route makes its use raise."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dtype_policies import layers, quantize, quantizers
from dtype_policies._compat import TORCH_VERSION
from dtype_policies._core.module_state import quantization_of
from dtype_policies.quantization.weight_copy import WeightCopy
from tiny_models import tiny_decoder


def _eager(module: nn.Module, dtype: torch.dtype | None = None) -> torch.Tensor:
    """What a read computes, by the scheme directly."""
    qw = quantization_of(module)
    weight = qw.spec.from_nk(qw.scheme.dequantize(module, qw))
    return weight.to(dtype or qw.float_dtype)


class _CountingDequantize:
    """Counts the dequantizations of the schemes of `modules` while active."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *modules: nn.Module) -> None:
        self.calls = 0
        for scheme_class in {type(quantization_of(m).scheme) for m in modules}:
            original = scheme_class.dequantize

            def counted(scheme, module, qw, _original=original):
                if not any(t.is_meta for t in module._buffers.values() if t is not None):
                    self.calls += 1  # a read's layout is computed on meta tensors
                return _original(scheme, module, qw)

            monkeypatch.setattr(scheme_class, "dequantize", counted)


def _linear(mode: str = "int8", config=None, in_features: int = 80) -> nn.Linear:
    """Large enough to be deferred (`DEFERRED_MIN_ELEMENTS`)."""
    torch.manual_seed(0)
    linear = nn.Linear(in_features, 4096)
    quantize(linear, mode, config)
    return linear


LAYOUT_READS = {
    "dtype": lambda w: w.dtype,
    "shape": lambda w: w.shape,
    "device": lambda w: w.device,
    "size()": lambda w: w.size(),
    "size(0)": lambda w: w.size(0),
    "dim()": lambda w: w.dim(),
    "ndim": lambda w: w.ndim,
    "numel()": lambda w: w.numel(),
    "stride()": lambda w: w.stride(),
    "requires_grad": lambda w: w.requires_grad,
    "is_floating_point()": lambda w: w.is_floating_point(),
    "element_size()": lambda w: w.element_size(),
    "is_contiguous()": lambda w: w.is_contiguous(),
    "len()": lambda w: len(w),
    "is_cuda": lambda w: w.is_cuda,
    "layout": lambda w: w.layout,
    "hash()": lambda w: hash(w),
}


@pytest.mark.parametrize("read", LAYOUT_READS)
def test_reading_the_layout_of_the_weight_dequantizes_nothing(read, monkeypatch) -> None:
    linear = _linear()
    expected = _eager(linear)
    counter = _CountingDequantize(monkeypatch, linear)
    weight = linear.weight
    answer = LAYOUT_READS[read](weight)
    assert counter.calls == 0
    if read != "hash()":
        assert answer == LAYOUT_READS[read](expected)
    assert torch.equal(weight, expected) and counter.calls == 1  # computed at its first use
    assert torch.equal(weight * 1, expected) and counter.calls == 1  # once


class _ReadsItsChildsDtype(nn.Module):
    """As T5's feed-forward: casts its input to its child's weight dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.wo = nn.Linear(128, 2048)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.wo.weight.dtype and self.wo.weight.dtype != torch.int8:
            x = x.to(self.wo.weight.dtype)
        return self.wo(x)


@pytest.mark.parametrize("grad", ["inference_mode", "no_grad", "grad"])
def test_a_parent_reading_its_quantized_childs_dtype_in_forward_dequantizes_nothing(
    grad, monkeypatch
) -> None:
    torch.manual_seed(0)
    model = _ReadsItsChildsDtype()
    x = torch.randn(3, 128, dtype=torch.float64)
    quantize(model, "int8")
    counter = _CountingDequantize(monkeypatch, model.wo)
    context = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}.get(grad)
    with context() if context else torch.enable_grad():
        y = model(x)
    assert counter.calls == 0
    assert y.dtype == torch.float32 and torch.equal(y, model.wo(x.float()))


CONFIGS = {
    "int8": ("int8", None),
    "int8/32": (
        "int8",
        lambda: quantizers.Int8QuantizationConfig(block_size=32, activation_block_size=32),
    ),
    "int4": ("int4", None),
    "int4/32": ("int4", lambda: quantizers.Int4QuantizationConfig(block_size=32)),
    "int4/64": ("int4", lambda: quantizers.Int4QuantizationConfig(block_size=64)),
}


def _kinds(mode: str, make_config):
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    modules = {
        "Linear": nn.Linear(80, 4096),  # 80: 2.5 blocks of 32
        "Linear, no bias": nn.Linear(96, 4096, bias=False),
        "Embedding": nn.Embedding(4096, 64),
        "Conv1D (in, out)": Conv1D(4096, 80),
    }
    for module in modules.values():
        quantize(module, mode, make_config() if make_config else None)
    return modules


@pytest.mark.parametrize("name", CONFIGS)
def test_a_read_tells_the_layout_and_gives_the_values_an_eager_read_gives(name) -> None:
    pytest.importorskip("transformers")
    mode, make_config = CONFIGS[name]
    for kind, module in _kinds(mode, make_config).items():
        expected = _eager(module)
        weight = module.weight
        told = (weight.shape, weight.stride(), weight.dtype, weight.device)
        assert told == (expected.shape, expected.stride(), expected.dtype, expected.device), kind
        assert torch.equal(weight, expected), kind
        assert type(weight + 0) is torch.Tensor, kind


def test_reads_follow_the_modules_dtype() -> None:
    linear = _linear()
    linear.to(torch.bfloat16)
    weight = linear.weight
    assert weight.dtype == torch.bfloat16
    assert torch.equal(weight, _eager(linear, torch.bfloat16))


@pytest.mark.parametrize(
    "mode, activation_order", [("gptq", False), ("gptq", True), ("awq", False)]
)
def test_calibrated_weights_read_as_an_eager_read_gives(mode, activation_order) -> None:
    model = tiny_decoder("llama", layers=1)
    tokens = torch.randint(3, 128, (8, 12), generator=torch.Generator().manual_seed(1))
    config_class = quantizers.GPTQConfig if mode == "gptq" else quantizers.AWQConfig
    extra = {"activation_order": True} if activation_order else {}
    config = config_class(tokens, None, num_samples=8, sequence_length=12, group_size=32, **extra)
    with _quiet():
        quantize(model, config=config, progress=False)
    quantized = [m for m in model.modules() if quantization_of(m) is not None]
    assert quantized
    for module in quantized:
        expected = _eager(module)
        weight = module.weight
        assert (weight.shape, weight.stride(), weight.dtype) == (
            expected.shape,
            expected.stride(),
            expected.dtype,
        )
        assert torch.equal(weight, expected)


class _quiet:
    def __enter__(self) -> None:
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc: object) -> None:
        self._catch.__exit__(*exc)


def test_a_read_keeps_its_values_across_load_state_dict_and_to_and_outlives_its_module() -> None:
    linear = _linear()
    before = _eager(linear)
    other = _linear()
    torch.manual_seed(5)
    fresh = nn.Linear(80, 4096)
    quantize(fresh, "int8")
    new_state = fresh.state_dict()

    loaded_over = linear.weight
    linear.load_state_dict(new_state)  # writes the stored tensors in place
    assert torch.equal(loaded_over, before)
    assert torch.equal(linear.weight, _eager(fresh))

    moved_over = other.weight
    other_before = _eager(other)
    other.to(torch.float16)
    assert moved_over.dtype == torch.float32 and torch.equal(moved_over, other_before)

    outliving = other.weight
    del other  # the read holds the stored tensors, not the module
    assert torch.equal(outliving, other_before.to(torch.float16))


@pytest.mark.parametrize(
    "write",
    [
        lambda stored: stored.add_(1),
        lambda stored: stored.copy_(torch.zeros_like(stored)),
        lambda stored: stored[0].fill_(3),
    ],
)
def test_an_in_place_write_to_a_stored_tensor_after_a_read_makes_its_use_raise(write) -> None:
    linear = _linear()
    read = linear.weight
    assert read.shape == (4096, 80)  # the layout is still answered
    with torch.no_grad():
        write(linear.weight_int8)
    stale = r"int8-quantized Linear.*'weight_int8'.*Read the weight again"
    with pytest.raises(RuntimeError, match=stale):
        read.sum()
    with pytest.raises(RuntimeError):  # raises at every use, never a value
        torch.equal(read, read)
    assert torch.equal(linear.weight, _eager(linear))  # a new read: the values now


def test_a_read_cannot_become_a_parameter_itself_and_its_clone_can() -> None:
    quantized = _linear()
    stored = {k: v.clone() for k, v in quantized.state_dict().items()}
    with pytest.raises(TypeError, match=r"int8-quantized Linear.*weight.clone\(\)"):
        nn.Parameter(quantized.weight)
    trained = nn.Linear(80, 4096)
    trained.weight = nn.Parameter(quantized.weight.clone())
    x = torch.randn(4, 80)
    trained(x).square().sum().backward()
    torch.optim.SGD(trained.parameters(), lr=0.5).step()
    assert not torch.equal(trained.weight, _eager(quantized))
    for key, value in quantized.state_dict().items():
        assert torch.equal(value, stored[key]), key


def test_threads_using_one_read_get_one_value() -> None:
    linear = _linear(in_features=256)
    read = linear.weight
    results: list[torch.Tensor] = []
    barrier = threading.Barrier(4)

    def use() -> None:
        barrier.wait()
        results.append(read * 1)

    threads = [threading.Thread(target=use) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and all(torch.equal(r, _eager(linear)) for r in results)


def test_a_read_made_under_inference_mode_is_used_outside_it() -> None:
    linear = _linear()
    with torch.inference_mode():
        read = linear.weight
    h = torch.randn(2, 80, requires_grad=True)
    F.linear(h, read).sum().backward()
    assert torch.equal(h.grad, torch.ones(2, 4096) @ _eager(linear))


def test_ops_that_skip_torch_function_see_the_values() -> None:
    linear = _linear()
    expected = _eager(linear)
    if TORCH_VERSION >= (2, 13):
        assert torch.equal(linear.weight.as_subclass(torch.Tensor), expected)
    else:  # torch 2.6's `as_subclass` of a wrapper subclass (its own error; measured)
        with pytest.raises(RuntimeError, match="already associated to a python object"):
            linear.weight.as_subclass(torch.Tensor)
    with pytest.warns(UserWarning):  # torch's own, on copying a tensor with torch.tensor
        assert torch.equal(torch.tensor(linear.weight), expected)


def test_reads_handed_to_a_compiled_function_compute(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    linear = _linear()
    x = torch.randn(3, 80)
    compiled = torch.compile(lambda x, w: x @ w.t(), backend="eager")
    expected = x @ _eager(linear).t()
    assert torch.equal(compiled(x, linear.weight), expected)  # a pending read
    if TORCH_VERSION < (2, 13):
        return  # torch 2.6's Dynamo fails on a WeightCopy's `as_subclass` (measured)
    view = linear.weight.t()  # a computed one's view (a chain of bases before)
    assert torch.equal(compiled(x, view.t()), expected)
    dense = layers.Dense(24)
    dense.build((None, 80))
    dense.quantize("int8")
    kernel = dense.kernel  # a view of the stored integers (read at once, as Keras's)
    integer = torch.compile(lambda x, k: x @ k.float(), backend="eager")
    assert torch.equal(integer(x, kernel), x @ kernel.as_subclass(torch.Tensor).float())


def test_writes_through_a_detached_read_and_its_views_raise() -> None:
    linear = _linear()
    stored = {k: v.clone() for k, v in linear.state_dict().items()}
    read = linear.weight
    detached = read.detach()
    writes = (
        lambda: detached.zero_(),
        lambda: detached.data.mul_(2),
        lambda: detached.__setitem__(0, 0),
        lambda: detached[0].zero_(),
        lambda: detached.t().mul_(0),
        lambda: detached.view(-1).zero_(),
    )
    for write in writes:
        with torch.no_grad(), pytest.raises(TypeError, match="int8-quantized Linear"):
            write()
    with pytest.raises(TypeError, match="int8-quantized Linear"):
        torch._foreach_mul_([detached], 2)
    for key, value in linear.state_dict().items():
        assert torch.equal(value, stored[key]), key
    assert torch.equal(detached, _eager(linear)) and torch.equal(read, _eager(linear))
    assert type(detached * 1) is torch.Tensor
    assert np.array_equal(detached.cpu().numpy(), _eager(linear).numpy())


def test_loading_a_tied_table_leaves_reads_through_either_module_their_values() -> None:
    model = tiny_decoder("llama", layers=1, tie=True, vocab_size=4096)  # a table deferred
    other = tiny_decoder("llama", layers=1, tie=True, vocab_size=4096)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(0.5)
    quantize(model, "int8")
    quantize(other, "int8")
    head, table = model.lm_head.weight, model.model.embed_tokens.weight
    expected_head, expected_table = _eager(model.lm_head), _eager(model.model.embed_tokens)
    model.load_state_dict(other.state_dict())
    assert torch.equal(head, expected_head) and torch.equal(table, expected_table)
    assert not torch.equal(model.lm_head.weight, expected_head)  # new reads: the new values


@pytest.mark.parametrize("transform", ["inference_mode", "torch.func.grad"])
def test_a_read_first_used_inside_a_transform_is_a_plain_copy_after_it(transform) -> None:
    linear = _linear()
    read = linear.weight
    x = torch.randn(5, 80)
    if transform == "inference_mode":
        with torch.inference_mode():
            F.linear(x, read)
    else:
        torch.func.grad(lambda x: F.linear(x, read).sum())(x)
    assert not read.is_inference() and read.data_ptr() != 0
    h = x.clone().requires_grad_()
    F.linear(h, read).sum().backward()
    assert torch.equal(h.grad, torch.ones(5, 4096) @ _eager(linear))


def test_a_reads_hash_is_its_identity_before_and_after_its_first_use() -> None:
    read = _linear().weight
    cache = {read: "read"}
    read * 1
    assert hash(read) == id(read) and cache[read] == "read"


def test_stored_inference_tensors_and_small_weights_are_read_at_once(monkeypatch) -> None:
    linear = _linear()
    with torch.inference_mode():
        state = {key: value.clone() for key, value in linear.state_dict().items()}
        linear.load_state_dict(state, assign=True)
    assert linear.weight_scale.is_inference()
    expected = _eager(linear)
    read = linear.weight  # no version to tell a write by: computed now
    with torch.inference_mode():
        linear.weight_scale.mul_(2)
    assert torch.equal(read, expected)
    small = nn.Linear(16, 16)
    quantize(small, "int8")
    counter = _CountingDequantize(monkeypatch, small)
    assert type(small.weight) is WeightCopy and counter.calls == 1


def test_a_read_first_used_under_a_dispatch_mode_is_computed_outside_it() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Perturbing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            return result + 1 if func is torch.ops.aten.div.Tensor else result

    linear = _linear()
    read = linear.weight
    with Perturbing():
        read.sum()
    assert torch.equal(read, _eager(linear))  # as read before the mode
