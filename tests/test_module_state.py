"""Contract (per-module state): everything this library keeps on a module is
one `ModuleState`, read through `state_of(module)`; `Layer`s and the torch
modules `apply_policy` prepares keep their applications on the same kind of
stack (top in force, any entry removable), and removing the last application
of a torch module leaves its `__dict__` as it was. Copies carry the state but
start with no kept casts."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn

import dtype_policies
from dtype_policies import apply_policy, layers, quantize
from dtype_policies._core.module_state import STATE_KEY, ModuleState, state_of


def _torch_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def _layers_model() -> nn.Module:
    torch.manual_seed(0)
    model = layers.Sequential([layers.Dense(16), layers.LayerNormalization(), layers.Dense(4)])
    model.build((None, 8))
    return model


def _library_keys(module: nn.Module) -> set[str]:
    """`__dict__` keys this library could have put on the module."""
    return {key for key in module.__dict__ if key.startswith(("_dp", "_dtype_policies"))}


@pytest.mark.parametrize("kind", ["torch", "layers"])
def test_one_state_object_per_module(kind):
    model = _torch_model() if kind == "torch" else _layers_model()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int8")
    with torch.no_grad():
        model(torch.randn(2, 8))
    for module in model.modules():
        assert _library_keys(module) == {STATE_KEY}
        state = state_of(module)
        assert isinstance(state, ModuleState) and state.call is not None
    assert state_of(model).handle is not None
    quantized = [m for m in model.modules() if state_of(m).quantization is not None]
    assert len(quantized) == 2


def test_removing_the_last_application_restores_the_dict():
    model = _torch_model()
    before = {name: dict(m.__dict__) for name, m in model.named_modules()}
    classes = [type(m) for m in model.modules()]
    outer = apply_policy(model, "mixed_bfloat16")
    inner = apply_policy(model[0], "float32")
    outer.remove()
    assert state_of(model[0]).call.policy.name == "float32"  # the inner one is left
    assert state_of(model) is None
    inner.remove()
    assert [type(m) for m in model.modules()] == classes
    for name, module in model.named_modules():
        assert module.__dict__.keys() == before[name].keys()


@pytest.mark.parametrize("kind", ["torch", "layers"])
@pytest.mark.parametrize("order", ["inner_first", "outer_first"])
def test_nested_applications_compose_alike_for_layers_and_torch_modules(kind, order):
    """The most recent application wins where two overlap; removing either
    (in any order) brings back the other, then the module's own policy."""
    model = _torch_model() if kind == "torch" else _layers_model()
    leaf = model[0]
    own = leaf.dtype_policy.name if kind == "layers" else None
    outer = apply_policy(model, "mixed_bfloat16")
    inner = apply_policy(leaf, "float16")
    assert leaf.dtype_policy.name == "float16"
    first, second = (inner, outer) if order == "inner_first" else (outer, inner)
    first.remove()
    assert leaf.dtype_policy.name == ("mixed_bfloat16" if first is inner else "float16")
    second.remove()
    if kind == "layers":
        assert leaf.dtype_policy.name == own
        assert [token for token, _ in state_of(leaf).applications] == [
            state_of(leaf).applications[0][0]
        ]
    else:
        assert state_of(leaf) is None and not hasattr(leaf, "dtype_policy")


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("kind", ["torch", "layers"])
def test_copies_carry_the_state_but_no_kept_casts(kind, how):
    model = _torch_model() if kind == "torch" else _layers_model()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int8", filters="2")
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
    kept = state_of(model[0]).casts
    assert kept.pair is not None or kept.entries
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    for original, copied in zip(model.modules(), twin.modules()):
        a, b = state_of(original), state_of(copied)
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert b is not a and b.call.policy == a.call.policy
        assert [type(e) for _, e in b.applications] == [type(e) for _, e in a.applications]
        assert (b.quantization is None) == (a.quantization is None)
        assert b.casts.pair is None and not b.casts.entries
    with torch.no_grad():
        assert torch.equal(twin(x), expected)
    state_of(twin).handle.remove()  # the copy's own application
    assert state_of(model).handle is not None and not state_of(model).handle.removed


def test_clear_cast_caches_reaches_every_module():
    model = _torch_model()
    apply_policy(model, "mixed_bfloat16")
    with torch.no_grad():
        model(torch.randn(2, 8))
    assert state_of(model[2]).casts.pair is not None
    dtype_policies.clear_cast_caches(model)
    assert all(
        state_of(m).casts.pair is None and not state_of(m).casts.entries for m in model.modules()
    )
