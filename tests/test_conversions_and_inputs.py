"""Contract: a policied model keeps working whatever ordinary torch does to it
or feeds it.

* Every dtype conversion after a policy (`.double()`, `.half()`,
  `.bfloat16()`, `.float()`, `.to(dtype)`) leaves a working model: weights
  are read in the compute dtype whatever they are stored in; normalization
  layers, which use their own tensors as stored, compute in their stored
  dtype when no kernel combines it with the compute dtype (running statistics
  keep updating); converting back restores the exact outputs.
* Weights that a hook or parametrization computes in every call
  (`spectral_norm`, `weight_norm`, old style or `parametrizations`) are cast
  per call, and their gradients reach the parameters they come from.
* NumPy (and other array) inputs of Keras-style layers become tensors in the
  compute dtype, as in Keras.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dtype_policies
from dtype_policies import CPUFloat16Warning, apply_policy, layers

CONVERSIONS = {
    "double": lambda m: m.double(),
    "half": lambda m: m.half(),
    "bfloat16": lambda m: m.bfloat16(),
    "float": lambda m: m.float(),
    "to_float64": lambda m: m.to(torch.float64),
    "to_float16": lambda m: m.to(dtype=torch.float16),
}
STORED = {
    "double": torch.float64,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "to_float64": torch.float64,
    "to_float16": torch.float16,
}


class ScaleNorm(nn.Module):
    """A Hugging Face style RMS norm (its class name ends with "Norm")."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(dtype)


def _torch_model() -> nn.Module:
    torch.manual_seed(0)
    norms = [nn.LayerNorm(32), nn.BatchNorm1d(32), nn.GroupNorm(4, 32), ScaleNorm(32)]
    if hasattr(nn, "RMSNorm"):
        norms.append(nn.RMSNorm(32))
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), *norms, nn.Linear(32, 8))


def _layers_model() -> nn.Module:
    torch.manual_seed(0)
    with dtype_policies.policy_scope("mixed_bfloat16"):
        model = layers.Sequential(
            [layers.Dense(32, activation="gelu"), layers.LayerNormalization(), layers.Dense(8)]
        )
    model.build((None, 16))
    return model


X = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))


def _reference(model: nn.Module) -> nn.Module:
    """The same weights, no policy, in float64 (what bfloat16 approximates)."""
    reference = copy.deepcopy(model)
    if isinstance(reference, layers.Layer):
        reference.dtype_policy = "float64"
        for layer in reference._flatten_layers():
            layer.dtype_policy = "float64"
    return reference.double()


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("conversion", CONVERSIONS)
@pytest.mark.parametrize("kind", ["torch", "torch_bfloat16_norms", "layers"])
def test_a_dtype_conversion_after_a_policy_leaves_a_working_model(kind, conversion, training):
    if kind == "torch":
        model = _torch_model()
        apply_policy(model, "mixed_bfloat16")  # norms are float32 islands
    elif kind == "torch_bfloat16_norms":
        model = _torch_model()  # norms at 2..6 compute in bfloat16 (with float32 weights)
        apply_policy(
            model, dtype_policies.DTypePolicyMap("mixed_bfloat16", {"[2-6]": "mixed_bfloat16"})
        )
    else:
        model = _layers_model()
    policies = [getattr(m, "dtype_policy", None) for m in model.modules()]
    CONVERSIONS[conversion](model)
    assert all(p.dtype == STORED[conversion] for p in model.parameters())
    assert [getattr(m, "dtype_policy", None) for m in model.modules()] == policies
    model.train(training)
    reference = _reference(model).train(training)
    statistics = [b.clone() for n, b in model.named_buffers() if n.endswith("running_mean")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPUFloat16Warning)  # norms computing in float16
        out = model(X)
    assert out.dtype == torch.bfloat16
    assert _relative_error(out, reference(X.double())) < 0.03
    if training:
        out.float().square().sum().backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and p.grad.dtype == p.dtype, name
            assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    for before, (name, now) in zip(
        statistics, [(n, b) for n, b in model.named_buffers() if n.endswith("running_mean")]
    ):
        assert now.dtype == STORED[conversion]
        assert torch.equal(before, now) != training, f"{name} updated only in training"


@pytest.mark.parametrize("conversion", ["double", "half", "bfloat16", "to_float64"])
@pytest.mark.parametrize("kind", ["torch", "layers"])
def test_converting_back_restores_the_outputs(kind, conversion):
    model = _torch_model() if kind == "torch" else _layers_model()
    if kind == "torch":
        apply_policy(model, "mixed_bfloat16")
    model.eval()
    with torch.no_grad():
        before = model(X)
    if conversion in ("half", "bfloat16"):  # lossy: compare with the rounded weights
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                if t.is_floating_point():
                    t.copy_(t.to(STORED[conversion]))
            before = model(X)
    CONVERSIONS[conversion](model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPUFloat16Warning)
        with torch.no_grad():
            model(X)
    model.float()
    with torch.no_grad():
        assert torch.equal(model(X), before)


# -- weights computed by hooks and parametrizations ------------------------------------------


def _old_spectral(module):
    return nn.utils.spectral_norm(module)


def _old_weight_norm(module):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated in favour of parametrizations
        return nn.utils.weight_norm(module)


def _new_spectral(module):
    return nn.utils.parametrizations.spectral_norm(module)


def _new_weight_norm(module):
    return nn.utils.parametrizations.weight_norm(module)


HOOKS = {
    "spectral_norm": _old_spectral,
    "weight_norm": _old_weight_norm,
    "parametrizations.spectral_norm": _new_spectral,
    "parametrizations.weight_norm": _new_weight_norm,
}


def _computed_weight(module: nn.Module) -> torch.Tensor:
    """The weight the hook or parametrization computes, as it is now."""
    if nn.utils.parametrize.is_parametrized(module, "weight"):
        return module.weight
    return module.__dict__["weight"]


def _hooked(kind: str, hook: str, policy_first: bool) -> nn.Module:
    """A fresh layer with `hook` (its random power-iteration state seeded
    alike every time), under `mixed_bfloat16` first when `policy_first`."""
    torch.manual_seed(0)
    module = nn.Linear(16, 16) if kind == "linear" else nn.Conv1d(16, 16, 1)
    if policy_first:
        apply_policy(module, "mixed_bfloat16")
    torch.manual_seed(1)
    module = HOOKS[hook](module)
    if policy_first is False:
        apply_policy(module, "mixed_bfloat16")
    return module


CASES = [
    (kind, hook, policy_first)
    for kind in ("linear", "conv")
    for hook in HOOKS
    for policy_first in (False, True)
]


@pytest.mark.parametrize(("kind", "hook", "policy_first"), CASES)
def test_weights_computed_in_every_call_are_cast_per_call(kind, hook, policy_first):
    model = _hooked(kind, hook, policy_first)
    reference = _hooked(kind, hook, None)  # the same layer, no policy
    x = torch.randn(4, 16) if kind == "linear" else torch.randn(4, 16, 3)
    for step in range(3):
        training = step < 2
        model.train(training)
        reference.train(training)
        with torch.set_grad_enabled(training):
            out = model(x)
            reference(x)  # the same power iteration, in float32
        weight = _computed_weight(reference).detach()
        if kind == "linear":
            expected = F.linear(x.bfloat16(), weight.bfloat16(), reference.bias.bfloat16())
        else:
            expected = F.conv1d(x.bfloat16(), weight.bfloat16(), reference.bias.bfloat16())
        assert out.dtype == torch.bfloat16
        assert _relative_error(out, expected) < 0.02
        if training:
            out.float().sum().backward()
            grads = [p.grad for p in model.parameters()]
            assert len(grads) >= 2 and all(g is not None and g.abs().sum() > 0 for g in grads)
            model.zero_grad()


@pytest.mark.parametrize("hook", ["parametrizations.spectral_norm", "parametrizations.weight_norm"])
def test_applying_the_policy_again_takes_in_a_later_parametrization(hook):
    model = _hooked("conv", hook, policy_first=True)
    apply_policy(model, "mixed_bfloat16")  # replaces the first application
    out = model(torch.randn(4, 16, 3))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_a_parametrization_computes_its_weight_in_the_variable_dtype(kind):
    """`orthogonal`'s `matrix_exp` in bfloat16 returns NaN for any non-zero
    input: under the policy it computed there, and training went NaN after
    one step. A parametrization computes a variable, so in float32."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        first = nn.Linear(16, 16) if kind == "linear" else nn.Conv1d(16, 16, 1)
        nn.utils.parametrizations.orthogonal(first)
        return nn.Sequential(first, nn.Flatten(), nn.LazyLinear(4))

    x = torch.randn(8, 16) if kind == "linear" else torch.randn(8, 16, 3)
    target = torch.randint(0, 4, (8,))
    losses = {}
    for policied in (True, False):
        model = build()
        model(x)  # materialises the lazy head
        if policied:
            apply_policy(model, "mixed_bfloat16")
            assert model[0].parametrizations.weight.dtype_policy.name == "float32"
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(4):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not policied):
                out = model(x)
            assert out.dtype == torch.bfloat16
            loss = F.cross_entropy(out.float(), target)
            loss.backward()
            optimizer.step()
        losses[policied] = loss.item()
        original = model[0].parametrizations.weight.original
        assert original.dtype == torch.float32 and torch.isfinite(original).all()
    # the same computation as torch's autocast, which keeps matrix_exp in float32
    assert losses[True] == pytest.approx(losses[False], rel=0.02)


PARAMETRIZATIONS = {
    "weight_norm": nn.utils.parametrizations.weight_norm,
    "orthogonal": nn.utils.parametrizations.orthogonal,
    "spectral_norm": nn.utils.parametrizations.spectral_norm,
}


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("policy_first", [False, True])
@pytest.mark.parametrize("kind", ["linear", "conv"])
@pytest.mark.parametrize("parametrization", list(PARAMETRIZATIONS))
def test_removing_a_parametrization_keeps_the_policy(parametrization, kind, policy_first, policy):
    """torch's `remove_parametrizations` deletes the weight's property from
    `type(module)` and gives the module `type(module).__bases__[0]`: the
    policy's class sits under torch's, whichever came first."""
    torch.manual_seed(0)
    module = nn.Linear(16, 16) if kind == "linear" else nn.Conv1d(16, 16, 1)
    if policy_first:
        handle = apply_policy(module, policy)
    PARAMETRIZATIONS[parametrization](module)
    if not policy_first:
        handle = apply_policy(module, policy)
    module.eval()  # spectral_norm's power iteration stays put
    own = nn.Linear if kind == "linear" else nn.Conv1d
    assert issubclass(nn.utils.parametrize.type_before_parametrizations(module), own)
    computed = module.weight.detach().clone()
    assert computed.dtype == torch.float32  # read outside a call: the variable dtype
    original = module.parametrizations.weight.original if parametrization == "orthogonal" else None

    nn.utils.parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)

    weight = module._parameters["weight"]
    assert isinstance(weight, nn.Parameter) and weight.dtype == torch.float32
    assert torch.equal(weight.detach(), computed)
    if original is not None:  # torch keeps the parameter object (set_)
        assert weight is original
    assert module.dtype_policy.name == policy
    x = torch.randn(4, 16) if kind == "linear" else torch.randn(4, 16, 3)
    out = module(x)
    assert out.dtype == (torch.bfloat16 if policy == "mixed_bfloat16" else torch.float32)
    handle.remove()
    assert type(module) is own
    assert module(x).dtype == torch.float32


@pytest.mark.parametrize("kind", ["linear", "conv"])
@pytest.mark.parametrize("parametrization", list(PARAMETRIZATIONS))
def test_removing_the_policy_gives_a_parametrized_module_its_own_class(parametrization, kind):
    """The class torch's `parametrize` made for the module (before the policy)
    comes back as that very class object, so that `isinstance` checks
    against it hold (a Wav2Vec2 positional convolution under weight_norm)."""
    torch.manual_seed(0)
    module = nn.Linear(16, 16) if kind == "linear" else nn.Conv1d(16, 16, 1)
    PARAMETRIZATIONS[parametrization](module)
    made_by_torch = type(module)
    module.eval()
    x = torch.randn(4, 16) if kind == "linear" else torch.randn(4, 16, 3)
    before = module(x)
    for policy in ("mixed_bfloat16", "float32"):  # twice: the cached class is reused too
        handle = apply_policy(module, policy)
        assert isinstance(module, nn.Linear if kind == "linear" else nn.Conv1d)
        assert module(x).dtype == getattr(torch, policy.removeprefix("mixed_"))
        handle.remove()
        assert type(module) is made_by_torch
    assert torch.equal(module(x), before)
    nn.utils.parametrize.remove_parametrizations(module, "weight")
    assert type(module) is (nn.Linear if kind == "linear" else nn.Conv1d)


@pytest.mark.parametrize("parametrization", list(PARAMETRIZATIONS))
def test_a_parametrization_registered_after_the_policy_computes_in_the_variable_dtype(
    parametrization,
):
    """A parametrization registered after `apply_policy` joins it: it computes
    the weight in float32 (torch's bfloat16 `matrix_exp`, under `orthogonal`,
    gives NaN) and the convolution reads it in bfloat16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(16, 16, 1), nn.ReLU())
    apply_policy(model, "mixed_bfloat16")
    PARAMETRIZATIONS[parametrization](model[0])
    model.eval()  # spectral_norm's power iteration stays where it is
    x = torch.randn(4, 16, 3)
    out = model(x)
    weight = model[0].weight  # outside a call: as computed, in float32
    assert weight.dtype == torch.float32 and torch.isfinite(weight).all()
    expected = F.relu(F.conv1d(x.bfloat16(), weight.bfloat16(), model[0].bias.bfloat16()))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)


def test_the_issue_spectral_norm_call():
    layer = nn.utils.spectral_norm(nn.Linear(16, 16))
    apply_policy(layer, "mixed_bfloat16")
    assert layer(torch.randn(2, 16)).dtype == torch.bfloat16


# -- array inputs -----------------------------------------------------------------------------


def _keras_layer(kind: str) -> tuple[layers.Layer, np.ndarray]:
    with dtype_policies.policy_scope("mixed_bfloat16"):
        if kind == "dense":
            return layers.Dense(3), np.ones((2, 5))
        if kind == "dense_float32_array":
            return layers.Dense(3), np.linspace(-1, 1, 10, dtype=np.float32).reshape(2, 5)
        if kind == "einsum":
            return layers.EinsumDense("ab,bc->ac", output_shape=3, bias_axes="c"), np.ones((2, 5))
        if kind == "sequential":
            return layers.Sequential([layers.Dense(4), layers.Dense(2)]), np.ones((2, 5))
        if kind == "layer_norm":
            return layers.LayerNormalization(), np.arange(10.0).reshape(2, 5)
        return layers.Embedding(10, 4), np.array([[1, 2, 3]])


@pytest.mark.parametrize(
    "kind", ["dense", "dense_float32_array", "einsum", "sequential", "layer_norm", "embedding"]
)
def test_array_inputs_become_tensors_in_the_compute_dtype(kind):
    layer, array = _keras_layer(kind)
    out = layer(array)  # builds the layer from the array's shape
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    tensor = torch.as_tensor(array)
    assert torch.equal(out, layer(tensor)), "an array computes as the same tensor"
    assert torch.equal(layer(array), out)  # and again once built


def test_the_issue_numpy_call():
    out = layers.Dense(3, dtype="mixed_bfloat16")(np.ones((2, 5)))
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3)


@pytest.mark.parametrize("name", ["weight", "bias"])
def test_a_linears_bias_or_weight_parametrized_after_the_policy(name):
    """A parametrization registered after apply_policy computes the tensor
    in every call (the bias too: the linear's own forward read only the
    registered one and raised KeyError)."""

    class Doubled(nn.Module):
        def forward(self, tensor):
            return tensor * 2.0

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8))
    reference = copy.deepcopy(model[0])
    apply_policy(model, "mixed_bfloat16")
    torch.nn.utils.parametrize.register_parametrization(model[0], name, Doubled())
    x = torch.randn(2, 8)
    out = model(x)
    weight = reference.weight * (2.0 if name == "weight" else 1.0)
    bias = reference.bias * (2.0 if name == "bias" else 1.0)
    expected = F.linear(x.bfloat16(), weight.bfloat16(), bias.bfloat16())
    assert out.dtype == torch.bfloat16
    assert _relative_error(out, expected) < 0.01
