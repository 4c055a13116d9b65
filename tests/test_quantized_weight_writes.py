"""Writes to a quantized module's weight that its forward would never see
(assigning, deleting, registering, pruning) raise a `TypeError` naming the
weight and leave the module exactly as it was; the library's own writes
(loading, `.to()`, float8's float weight) keep working."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

from dtype_policies import layers, quantize
from dtype_policies.quantizers import Int4QuantizationConfig

WRITES = {
    "assign a parameter": lambda m: setattr(m, "weight", nn.Parameter(torch.randn(16, 32))),
    "assign a tensor": lambda m: setattr(m, "weight", torch.randn(16, 32)),
    "assign None": lambda m: setattr(m, "weight", None),
    "register_parameter": lambda m: m.register_parameter(
        "weight", nn.Parameter(torch.randn(16, 32))
    ),
    "register_buffer": lambda m: m.register_buffer("weight", torch.randn(16, 32)),
    "del": lambda m: delattr(m, "weight"),
    "prune": lambda m: prune.l1_unstructured(m, "weight", 0.3),
}
FLOAT8_REFUSED = ("assign a tensor", "assign None", "register_buffer", "del", "prune")


def _quantized_linear(mode: str) -> nn.Linear:
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    quantize(linear, mode)
    return linear


def _snapshot(module: nn.Module) -> tuple:
    tensors = {k: v.clone() for k, v in module.state_dict(keep_vars=True).items()}
    return type(module), dict(module.__dict__), tensors, dict(module._forward_pre_hooks)


def _assert_unchanged(module: nn.Module, snapshot: tuple) -> None:
    cls, attributes, tensors, hooks = snapshot
    assert type(module) is cls
    assert module.__dict__.keys() == attributes.keys()
    now = module.state_dict(keep_vars=True)
    assert now.keys() == tensors.keys()
    for key, value in tensors.items():
        assert now[key].dtype == value.dtype and torch.equal(now[key], value), key
    assert dict(module._forward_pre_hooks) == hooks


@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("mode", ["int8", "int4", "float8"])
def test_a_write_the_forward_would_not_see_is_refused(mode: str, write: str) -> None:
    if mode == "float8" and write not in FLOAT8_REFUSED:
        pytest.skip("float8 keeps its float weight as a parameter and reads a new one")
    linear = _quantized_linear(mode)
    x = torch.randn(4, 32)
    expected = linear(x)
    snapshot = _snapshot(linear)
    with pytest.raises(TypeError, match=rf"{mode}-quantized Linear.*'weight'.*Nothing was changed"):
        WRITES[write](linear)
    _assert_unchanged(linear, snapshot)
    assert torch.equal(linear(x), expected)


@pytest.mark.parametrize("write", ["assign a parameter", "register_parameter"])
def test_float8_takes_a_new_float_weight_and_computes_with_it(write: str) -> None:
    linear = _quantized_linear("float8")
    x = torch.randn(4, 32)
    before = linear(x)
    WRITES[write](linear)
    assert not torch.equal(linear(x), before)


@pytest.mark.parametrize("mode", ["int8", "float8"])
def test_a_quantized_dense_refuses_to_lose_its_kernel(mode: str) -> None:
    dense = layers.Dense(8)
    dense.build((None, 4))
    dense.quantize(mode)
    snapshot = _snapshot(dense)
    with pytest.raises(TypeError, match=r"Dense 'dense.*'kernel'"):
        del dense.kernel
    _assert_unchanged(dense, snapshot)


@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("mode", ["int8", "int4", "float8"])
def test_loading_and_moving_still_write_the_stored_tensors(mode: str, assign: bool) -> None:
    source, target = _quantized_linear(mode), nn.Linear(32, 16)
    quantize(target, mode)
    target.load_state_dict(source.state_dict(), assign=assign)
    target.to("cpu").float()
    loaded, expected = target.state_dict(), source.state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[key], expected[key]) for key in expected)


def test_a_float_checkpoint_loads_into_an_int8_linear() -> None:
    float_linear = nn.Linear(32, 16)
    linear = _quantized_linear("int8")
    linear.load_state_dict(float_linear.state_dict())
    reference = nn.Linear(32, 16)
    reference.load_state_dict(float_linear.state_dict())
    quantize(reference, "int8")
    x = torch.randn(4, 32)
    assert torch.equal(linear(x), reference(x))


def _quantized_stack(kind: str, mode: str, config, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "dense":
        model = layers.Dense(40)
        model.build((None, 72))
        model.quantize(mode, config=config)
        return model.eval()
    model = nn.Sequential(nn.Linear(72, 96), nn.GELU(), nn.Linear(96, 40)).eval()
    quantize(model, mode, config)
    return model


@pytest.mark.parametrize("kind", ["torch", "dense"])
@pytest.mark.parametrize(
    ("mode", "config"),
    [
        ("int8", None),
        ("int4", None),
        ("int4", Int4QuantizationConfig(block_size=32)),
        ("int4", Int4QuantizationConfig(block_size=32, activation_block_size=32)),
    ],
    ids=["int8", "int4", "int4/32", "W4A8"],
)
def test_a_load_into_inference_tensors_is_seen_by_the_kernels(kind, mode, config) -> None:
    """Stored tensors loaded under inference_mode with `assign=True` are
    inference tensors, without version counters: a second load writes them
    in place unseen by a key of versions; the packed plans are dropped."""
    first, second = (_quantized_stack(kind, mode, config, seed) for seed in (1, 2))
    x = torch.randn(4, 72, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        first_state = {k: v.clone() for k, v in first.state_dict().items()}
        second_state = {k: v.clone() for k, v in second.state_dict().items()}
        model = _quantized_stack(kind, mode, config, 0)
        model.load_state_dict(first_state, assign=True)
        assert torch.equal(model(x), first(x))
        model.load_state_dict(second_state)
        assert torch.equal(model(x), second(x))
