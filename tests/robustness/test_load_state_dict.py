"""Contract: a quantized state dict never shares the float weight's key; float
checkpoints re-quantize into quantized modules (strict or not); quantized
checkpoints never load silently into float weights; a checkpoint of another
quantization mode raises naming the keys."""

import copy
import re

import pytest
import torch
import torch.nn as nn

import dtype_policies
from dtype_policies import apply_policy, layers, quantize

from .helpers import (
    INTEGER_MODES,
    assert_unchanged,
    mlp,
    quantize_with,
    relative_error,
    snapshot,
)

X = torch.randn(6, 32, generator=torch.Generator().manual_seed(3))


def _float_model(kind, seed):
    torch.manual_seed(seed)
    if kind == "torch":
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
        apply_policy(model, "mixed_bfloat16")
    else:
        model = layers.Sequential(
            [layers.Dense(64, activation="relu"), layers.Dense(16)], dtype="mixed_bfloat16"
        )
        model(X)
    return model


def _weight_keys(model):
    return [k for k in model.state_dict() if k.endswith(("weight", "kernel"))]


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("kind", ["torch", "layers"])
@pytest.mark.parametrize("mode", INTEGER_MODES)
def test_float_checkpoint_into_quantized_model_requantizes(mode, kind, strict):
    trained = _float_model(kind, seed=1)
    checkpoint = {k: v.clone() for k, v in trained.state_dict().items()}
    # What the result must be: a model quantized from that checkpoint.
    expected = copy.deepcopy(trained)
    quantize_with(expected, mode)

    target = _float_model(kind, seed=2)
    quantize_with(target, mode)  # same mode and config as `expected`
    result = target.load_state_dict(checkpoint, strict=strict)
    if not strict:
        assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    want = expected(X)
    got = target(X)
    assert torch.equal(got, want)
    for key, value in expected.state_dict().items():  # the stored tensors too
        assert torch.equal(target.state_dict()[key], value), key
    assert relative_error(got, trained(X)) < 0.25


@pytest.mark.parametrize("kind", ["torch", "layers"])
@pytest.mark.parametrize("mode", INTEGER_MODES)
def test_an_integer_weight_in_a_float_checkpoint_loads_as_a_float_model_would(mode, kind):
    """A checkpoint whose float weight was stored as integers: a float model
    casts it on copy; a quantized one failed with torch's missing/unexpected
    keys after loading the other modules' tensors. It quantizes the cast
    weight, as the float model's quantization would."""
    trained = _float_model(kind, seed=1)
    checkpoint = {k: v.clone() for k, v in trained.state_dict().items()}
    for key in _weight_keys(trained):
        checkpoint[key] = (checkpoint[key] * 100).round().to(torch.int32)
    expected = _float_model(kind, seed=2)
    expected.load_state_dict(checkpoint)  # torch casts the integers
    quantize_with(expected, mode)
    target = _float_model(kind, seed=2)
    quantize_with(target, mode)
    target.load_state_dict(checkpoint)
    assert torch.equal(target(X), expected(X))
    for key, value in expected.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key


@pytest.mark.parametrize("kind", ["torch", "layers"])
@pytest.mark.parametrize("mode", INTEGER_MODES)
def test_a_float_checkpoint_with_a_non_finite_weight_is_refused(mode, kind):
    """quantize() refuses NaN/inf weights; a float checkpoint loaded into a
    quantized model was quantized anyway (NaN rows, NaN outputs)."""
    checkpoint = {k: v.clone() for k, v in _float_model(kind, seed=1).state_dict().items()}
    key = _weight_keys(_float_model(kind, seed=1))[-1]
    checkpoint[key][3, 5] = float("nan")
    target = _float_model(kind, seed=2)
    quantize_with(target, mode)
    with pytest.raises(ValueError, match=r"Cannot load .* 1 non-finite value\(s\) \(first: nan"):
        target.load_state_dict(checkpoint)
    assert torch.isfinite(target(X)).all()


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("kind", ["torch", "layers"])
@pytest.mark.parametrize("mode", INTEGER_MODES)
def test_float_checkpoint_never_truncated_to_integers(mode, kind, strict):
    """Whatever else happens, the quantized model never ends with all-zero
    (or float-truncated-to-int) weights after loading a float checkpoint."""
    trained = _float_model(kind, seed=1)
    target = _float_model(kind, seed=2)
    quantize_with(target, mode)
    try:
        target.load_state_dict(trained.state_dict(), strict=strict)
    except (RuntimeError, ValueError):
        return  # refusing is acceptable here; re-quantizing is tested above
    out = target(X)
    assert out.float().abs().sum() > 0
    assert relative_error(out, trained(X)) < 0.25


def _quantized_checkpoint_and_float_target(mode, kind):
    source = _float_model("layers" if kind == "layers" else "torch", seed=1)
    quantize_with(source, mode)
    if kind == "plain":
        torch.manual_seed(2)
        target = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    else:
        target = _float_model(kind, seed=2)
    return source.state_dict(), target


@pytest.mark.parametrize("kind", ["plain", "torch", "layers"])
@pytest.mark.parametrize("mode", INTEGER_MODES)
def test_quantized_checkpoint_into_float_model_strict_raises(mode, kind):
    """Strict: an error naming the quantized keys. A model of ours (a Layer
    or under apply_policy) raises ValueError; a plain torch model raises
    torch's RuntimeError (its keys no longer match)."""
    checkpoint, target = _quantized_checkpoint_and_float_target(mode, kind)
    before = snapshot(target)
    quantized_keys = [k for k in checkpoint if k not in before["state"]]
    assert quantized_keys, "a quantized state dict shares every key with the float one"
    expected = (RuntimeError, ValueError) if kind == "plain" else ValueError
    with pytest.raises(expected) as info:
        target.load_state_dict(checkpoint, strict=True)
    assert any(key in str(info.value) for key in quantized_keys), str(info.value)
    for key in _weight_keys(target):  # never int8 values in a float weight
        assert torch.equal(target.state_dict()[key], before["state"][key]), key


@pytest.mark.parametrize("kind", ["torch", "layers"])
@pytest.mark.parametrize("mode", [*INTEGER_MODES, "float8"])
def test_quantized_checkpoint_into_float_model_strict_failure_changes_nothing(mode, kind):
    """Stricter than torch (whose failing strict load has already copied the
    matching keys): a model of ours refuses before loading anything, float8's
    state too (its float weights share the float model's keys)."""
    checkpoint, target = _quantized_checkpoint_and_float_target(mode, kind)
    before = snapshot(target)
    with pytest.raises((RuntimeError, ValueError)):
        target.load_state_dict(checkpoint, strict=True)
    assert_unchanged(target, before)


@pytest.mark.parametrize("kind", ["plain", "torch", "layers"])
@pytest.mark.parametrize("mode", INTEGER_MODES)
def test_quantized_checkpoint_into_float_model_non_strict(mode, kind):
    """Non-strict: the float weights are unchanged (never int8 values cast to
    float) and the quantized keys are reported (returned, or in a ValueError)."""
    checkpoint, target = _quantized_checkpoint_and_float_target(mode, kind)
    before = snapshot(target)
    weight_keys = _weight_keys(target)
    try:
        result = target.load_state_dict(checkpoint, strict=False)
    except ValueError as error:
        assert any(key in str(error) for key in checkpoint if key not in before["state"])
        assert_unchanged(target, before)
        return
    state = target.state_dict()
    for key in weight_keys:
        assert torch.equal(state[key], before["state"][key]), f"{key} was overwritten"
        assert state[key].dtype == before["state"][key].dtype
    reported = set(result.missing_keys) | set(result.unexpected_keys)
    assert set(weight_keys) <= set(result.missing_keys)
    assert {k for k in checkpoint if k not in before["state"]} <= reported


OTHER_MODE_CASES = [
    ("int4_128", "int8"),
    ("int8", "int4_128"),
    ("int4_pc", "int4_128"),
    ("int8", "int4_pc"),
    ("float8", "int8"),
    ("float8", "int4_128"),
]


def _other_mode_pair(saved, loaded):
    source = _float_model("torch", seed=1)
    quantize_with(source, saved)
    target = _float_model("torch", seed=2)
    quantize_with(target, loaded)
    return source.state_dict(), target


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize(("saved", "loaded"), OTHER_MODE_CASES)
def test_checkpoint_of_another_mode_raises(saved, loaded, strict):
    checkpoint, target = _other_mode_pair(saved, loaded)
    before = snapshot(target)
    with pytest.raises((RuntimeError, ValueError)) as info:
        target.load_state_dict(checkpoint, strict=strict)
    message = str(info.value)
    assert "0.weight" in message or "0/weight" in message, message  # names the keys
    for key, value in before["state"].items():  # the quantized data is intact
        if value.dtype == torch.int8:
            assert torch.equal(target.state_dict()[key], value), key


@pytest.mark.parametrize(("saved", "loaded"), OTHER_MODE_CASES)
def test_checkpoint_of_another_mode_changes_nothing(saved, loaded):
    checkpoint, target = _other_mode_pair(saved, loaded)
    before = snapshot(target)
    with pytest.raises((RuntimeError, ValueError)):
        target.load_state_dict(checkpoint, strict=False)
    assert_unchanged(target, before)


@pytest.mark.parametrize("kind", ["torch", "layers"])
@pytest.mark.parametrize("mode", [*INTEGER_MODES, "float8"])
def test_same_mode_quantized_round_trip(mode, kind):
    """The documented route keeps working: a quantized checkpoint into a fresh
    model quantized the same way, loaded with weights_only=True."""
    import io

    source = _float_model(kind, seed=1)
    quantize_with(source, mode)
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    target = _float_model(kind, seed=2)
    quantize_with(target, mode)
    target.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(target(X), source(X))


@pytest.mark.parametrize("mode", ["int8", "int4_128"])
def test_quantized_state_dict_keys_do_not_shadow_float_keys(mode):
    """`<w>_int8` / `<w>_int4` never `<w>`: the float key is absent."""
    model = _float_model("torch", seed=1)
    quantize_with(model, mode)
    keys = set(model.state_dict())
    suffix = "int8" if mode == "int8" else "int4"
    assert "0.weight" not in keys and "2.weight" not in keys
    assert {f"0.weight_{suffix}", "0.weight_scale", f"2.weight_{suffix}"} <= keys


@pytest.mark.usefixtures("quiet")
def test_load_state_dict_float_into_quantized_requantizes_and_quantized_into_float_refuses():
    torch.manual_seed(0)
    source = mlp()
    quantized = mlp()
    quantize(quantized, "int8")
    quantized.load_state_dict(source.state_dict())  # strict
    expected = copy.deepcopy(source)
    quantize(expected, "int8")
    x = torch.randn(4, 32)
    assert torch.equal(quantized(x), expected(x))

    float_model = mlp()
    weights = {k: v.clone() for k, v in float_model.state_dict().items()}
    with pytest.raises(RuntimeError, match="weight_int8"):
        float_model.load_state_dict(quantized.state_dict())
    report = float_model.load_state_dict(quantized.state_dict(), strict=False)
    assert "0.weight_int8" in report.unexpected_keys and "0.weight" in report.missing_keys
    assert all(  # the float weights are untouched (only the biases matched)
        torch.equal(float_model.state_dict()[k], weights[k]) for k in weights if "weight" in k
    )

    policied = mlp()
    apply_policy(policied, "mixed_bfloat16")
    dense = layers.Dense(32)
    dense.build((None, 32))
    dense_q = layers.Dense(32)
    dense_q.build((None, 32))
    dense_q.quantize("int8")
    with pytest.raises(ValueError, match="kernel_int8"):
        dense.load_state_dict(dense_q.state_dict(), strict=False)

    int4_model = mlp()
    quantize(int4_model, "int4")
    with pytest.raises(ValueError, match=r"'0\.weight_int8'.*mode 'int4'"):
        int4_model.load_state_dict(quantized.state_dict())


@pytest.mark.usefixtures("quiet")
def test_load_state_dict_assign_sees_new_values():
    model = mlp()
    apply_policy(model, "mixed_bfloat16")
    x = torch.randn(2, 32)
    with torch.no_grad():
        model(x)
        other = mlp()
        model.load_state_dict(other.state_dict(), assign=True)
        reference = copy.deepcopy(other)
        apply_policy(reference, "mixed_bfloat16")
        assert torch.equal(model(x), reference(x))


def test_a_model_only_quantized_checks_the_whole_checkpoint_before_loading_any_of_it():
    # no policy at the root (quantize() alone): a later module's refusal used
    # to leave the earlier ones loaded although the error said "nothing was loaded"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    quantize(model, "int8")
    donor = copy.deepcopy(model)
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    quantize(other, "int8", filters="^0$")
    quantize(other, "int4", filters="^2$")
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"2\.weight_int4.*nothing was loaded"):
        model.load_state_dict(other.state_dict())
    assert_unchanged(model, before)
    model.load_state_dict(copy.deepcopy(donor).state_dict())  # the guard lets a fitting one in
    assert torch.equal(model(X), donor(X))
    copied = copy.deepcopy(model)  # the guard travels with copies
    with pytest.raises(ValueError, match="nothing was loaded"):
        copied.load_state_dict(other.state_dict())


def test_a_float8_state_of_another_history_length_is_refused_before_anything_loads():
    from dtype_policies.quantization import Float8QuantizationConfig

    def build(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))

    source, target = build(0), build(1)
    dtype_policies.quantize(source, "float8", Float8QuantizationConfig(amax_history_length=16))
    dtype_policies.quantize(target, "float8")
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=r"'0.inputs_amax_history': \(16,\)"):
        target.load_state_dict(source.state_dict(), strict=False)
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())


def _model_of_width(kind, width, seed):
    torch.manual_seed(seed)
    if kind == "layers":
        model = layers.Sequential(
            [layers.Dense(width, activation="relu"), layers.Dense(16)], dtype="mixed_bfloat16"
        )
        model(X)
        return model
    model = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 16))
    if kind == "policied":
        apply_policy(model, "mixed_bfloat16")
    elif kind == "quantized":  # quantize() alone: its root is not policied
        quantize(model, "int8", filters="^2$")
    return model


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("kind", ["policied", "layers", "quantized"])
def test_a_checkpoint_of_other_shapes_is_refused_before_anything_loads(kind, strict):
    """torch copies every tensor that fits, then raises for those of another
    shape (strict or not): a model of ours refuses first, in one
    `CheckpointError` naming every tensor that does not fit and both shapes."""
    checkpoint = _model_of_width("float" if kind == "quantized" else kind, 48, seed=1)
    target = _model_of_width(kind, 64, seed=2)
    before = snapshot(target)
    with pytest.raises(dtype_policies.saving.CheckpointError) as info:
        target.load_state_dict(checkpoint.state_dict(), strict=strict)
    message = str(info.value)
    assert "nothing was loaded" in message
    if kind == "layers":
        assert re.search(r"shape \(32, 48\) in the checkpoint, \(32, 64\) in the module", message)
    else:
        assert "'0.weight': shape (48, 32) in the checkpoint, (64, 32) in the module" in message
        assert "'0.bias': shape (48,) in the checkpoint, (64,) in the module" in message
    if kind == "quantized":  # the float weight a quantized module would quantize on loading
        assert "Cannot load '2.weight' of shape (16, 48)" in message
    assert_unchanged(target, before)


def test_a_module_that_loads_its_own_way_is_left_to_torch():
    """A class whose `_load_from_state_dict` is its own (here: it takes its
    weight transposed) is not checked against torch's rule: it loads."""

    class TransposedLoad(nn.Linear):
        def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
            key = prefix + "weight"
            if key in state_dict and state_dict[key].shape != self.weight.shape:
                state_dict[key] = state_dict[key].t()
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    torch.manual_seed(0)
    model = nn.Sequential(TransposedLoad(32, 16), nn.BatchNorm1d(16))
    apply_policy(model, "mixed_bfloat16")
    weight = torch.randn(32, 16)
    state = {k: v.clone() for k, v in model.state_dict().items() if "num_batches" not in k}
    state["0.weight"] = weight
    model.load_state_dict(state)  # BatchNorm adds its missing counter, as in torch
    assert torch.equal(model[0].weight, weight.t())


@pytest.mark.parametrize(
    "dropped", ["0.inputs_scale", "0.kernel_amax_history", "0.outputs_grad_scale"]
)
def test_a_float8_checkpoint_missing_part_of_its_scaling_state_reports_it(dropped):
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(32, 16))
    quantize(source, "float8")
    source.train()
    for _ in range(2):  # the scales move away from their initial values
        source(torch.randn(8, 32) * 50).square().mean().backward()
    state = {k: v for k, v in source.state_dict().items() if k != dropped}
    target = nn.Sequential(nn.Linear(32, 16))
    quantize(target, "float8")
    with pytest.raises(RuntimeError, match=re.escape(f'Missing key(s) in state_dict: "{dropped}"')):
        target.load_state_dict(state)
    assert target.load_state_dict(state, strict=False).missing_keys == [dropped]
    # a float checkpoint (none of the scaling state) still keeps the module's own
    fresh = nn.Sequential(nn.Linear(32, 16))
    quantize(fresh, "float8")
    before = fresh.state_dict()[dropped].clone()
    fresh.load_state_dict({"0.weight": torch.randn(16, 32), "0.bias": torch.zeros(16)})
    assert torch.equal(fresh.state_dict()[dropped], before)


def _quantized_pair(kind, mode):
    """A quantized checkpoint (seed 1) and a model quantized the same way (seed 2)."""
    source = _float_model(kind, seed=1)
    quantize_with(source, mode)
    target = _float_model(kind, seed=2)
    quantize_with(target, mode)
    return {k: v.clone() for k, v in source.state_dict().items()}, target


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("kind", ["torch", "layers"])
@pytest.mark.parametrize("mode", INTEGER_MODES)
def test_a_quantized_weight_missing_one_of_its_stored_tensors_is_refused(mode, kind, strict):
    """With `strict=False` the new integers loaded beside the module's old
    scales (another weight, silently); with `strict=True` torch raised only
    after copying them."""
    checkpoint, target = _quantized_pair(kind, mode)
    scale_key = [k for k in checkpoint if k.endswith("_scale")][-1]
    del checkpoint[scale_key]
    before = snapshot(target)
    with pytest.raises(ValueError, match=r"holds \[.*\] but not \[" + re.escape(f"'{scale_key}'")):
        target.load_state_dict(checkpoint, strict=strict)
    assert_unchanged(target, before)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 0.0, -0.5])
@pytest.mark.parametrize("mode", (*INTEGER_MODES, "float8"))
def test_a_quantized_checkpoint_with_a_non_finite_or_non_positive_scale_is_refused(mode, bad):
    """Every mode's scales are positive (an all-zero row's too): 0 divides to
    inf (int8's and per-channel int4's weights are their integers over the
    scale), a negative one flips the weight's sign; both loaded silently."""
    checkpoint, target = _quantized_pair("torch", mode)
    scale_key = sorted(k for k in checkpoint if k.endswith("_scale"))[0]
    checkpoint[scale_key].view(-1)[0] = bad
    before = snapshot(target)
    found = (
        "1 non-finite"
        if bad != bad or abs(bad) == float("inf")
        else "1 scale.s. that are not positive"
    )
    refused = re.escape(f"Cannot load '{scale_key}'") + ".*" + found
    with pytest.raises(ValueError, match=refused):
        target.load_state_dict(checkpoint)
    assert_unchanged(target, before)


def test_a_float_checkpoint_with_a_non_finite_weight_is_refused_by_float8_too():
    """float8 keeps the float weight and quantizes it at each call; quantize()
    refuses a NaN weight, loading one made every output NaN."""
    checkpoint = {k: v.clone() for k, v in _float_model("torch", seed=1).state_dict().items()}
    checkpoint["2.weight"][3, 5] = float("nan")
    target = _float_model("torch", seed=2)
    quantize(target, "float8")
    before = snapshot(target)
    with pytest.raises(ValueError, match=r"Cannot load '2.weight' .* 1 non-finite value\(s\)"):
        target.load_state_dict(checkpoint)
    assert_unchanged(target, before)
    assert torch.isfinite(target(X)).all()
