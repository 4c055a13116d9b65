"""`load_state_dict` checks a checkpoint against the whole tree once per call
(torch calls every module's `_load_from_state_dict`), and still refuses a bad
checkpoint before anything loads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtype_policies import apply_policy, quantize
from dtype_policies._core import checkpoints, policy_module
from dtype_policies._core.checkpoints import CheckpointError
from dtype_policies.layers import layer
from dtype_policies.quantization import modules as quantized_modules


def _deep_model(depth: int = 6) -> nn.Module:
    torch.manual_seed(0)
    block: nn.Module = nn.Linear(8, 8)
    for _ in range(depth):
        block = nn.Sequential(nn.Linear(8, 8), block)
    return block


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    prefixes: list[str] = []
    check = checkpoints.check_checkpoint

    def counting(root: nn.Module, state_dict: dict, prefix: str) -> None:
        prefixes.append(prefix)
        check(root, state_dict, prefix)

    for module in (checkpoints, policy_module, layer, quantized_modules):
        if getattr(module, "check_checkpoint", None) is check:  # imported by name
            monkeypatch.setattr(module, "check_checkpoint", counting)
    return prefixes


def test_a_policied_model_is_checked_once_per_load(checks: list[str]) -> None:
    model = _deep_model()
    apply_policy(model, "mixed_bfloat16")
    state = model.state_dict()
    model.load_state_dict(state)
    assert checks == [""]
    model.load_state_dict(state)  # a new call checks again
    assert checks == ["", ""]


def test_a_quantized_model_is_checked_once_per_load(checks: list[str]) -> None:
    model = _deep_model()
    quantize(model, "int8")
    model.load_state_dict(model.state_dict())
    assert checks == [""]


def test_a_submodule_loaded_alone_is_checked(checks: list[str]) -> None:
    model = _deep_model()
    apply_policy(model, "mixed_bfloat16")
    model[1].load_state_dict(model[1].state_dict())
    assert checks == [""]


def test_subtrees_no_enclosing_check_covers_are_each_checked(checks: list[str]) -> None:
    model = nn.Sequential(_deep_model(2), _deep_model(2))
    apply_policy(model[0], "mixed_bfloat16")
    apply_policy(model[1], "mixed_bfloat16")
    model.load_state_dict(model.state_dict())
    assert checks == ["0.", "1."]


def test_tensors_a_pre_hook_changed_are_checked_again(checks: list[str]) -> None:
    model = _deep_model(2)
    apply_policy(model, "mixed_bfloat16")

    def transposed(state_dict: dict, prefix: str, *_: object) -> None:
        key = prefix + "1.weight"
        state_dict[key] = state_dict[key].t().contiguous()

    model[1]._register_load_state_dict_pre_hook(transposed)
    model.load_state_dict(model.state_dict())
    assert checks[0] == "" and "1.1." in checks


def test_a_bad_checkpoint_is_still_refused_before_anything_loads() -> None:
    model = _deep_model()
    quantize(model, "int8")
    before = {key: value.clone() for key, value in model.state_dict().items()}
    bad = {key: torch.zeros_like(value) for key, value in before.items()}
    deepest = max((key for key in bad if key.endswith("weight_scale")), key=len)
    bad[deepest] = torch.zeros(3)
    with pytest.raises(CheckpointError, match="weight_scale"):
        model.load_state_dict(bad)
    after = model.state_dict()
    assert all(torch.equal(after[key], value) for key, value in before.items())


def test_a_quantized_checkpoint_into_an_unbuilt_layer_says_to_build_it():
    """A layer made by `from_config` of a quantized layer has its policy but
    no weights until built: the error says so (quantizing it, as the generic
    advice said, raises that it is not built)."""
    from dtype_policies import layers
    from dtype_policies.saving import CheckpointError

    dense = layers.Dense(4)
    dense.build((None, 8))
    dense.quantize("int8")
    for model, source in [
        (layers.Dense.from_config(dense.get_config()), dense),
        (
            torch.nn.Sequential(layers.Dense.from_config(dense.get_config())),
            torch.nn.Sequential(dense),
        ),
    ]:
        with pytest.raises(CheckpointError, match=r"are not built yet .*layer\.build"):
            model.load_state_dict(source.state_dict())
        built = model if isinstance(model, layers.Dense) else model[0]
        built.build((None, 8))
        model.load_state_dict(source.state_dict())
        x = torch.randn(2, 8)
        assert torch.equal(model(x), source(x))
