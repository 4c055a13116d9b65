"""Contract (weight-cast caches): a kept compute-dtype cast is reused only while
the weight is the same object with the same `_version`, `data_ptr()` and
dtype, so every ordinary way of changing a weight is seen by the next call,
in every grad mode. `.data.<op>_()` edits are the documented exception:
`clear_cast_caches(model)` drops kept casts, `weight_cache=False` keeps none."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dtype_policies
from dtype_policies import apply_policy, layers

from .helpers import mlp, relative_error

KINDS = ["linear", "dense", "einsum"]


def _build(kind, weight_cache, seed=0):
    """`(model, weight_name)`: a small layer (its casts are kept by default)
    computing in bfloat16 with float32 weights."""
    torch.manual_seed(seed)
    if kind == "linear":
        model = nn.Sequential(nn.Linear(32, 16))
        apply_policy(model, "mixed_bfloat16", weight_cache=weight_cache)
        return model, "0.weight"
    if kind == "dense":
        model = layers.Dense(16, dtype="mixed_bfloat16")
    else:
        model = layers.EinsumDense(
            "ab,bc->ac", output_shape=16, bias_axes="c", dtype="mixed_bfloat16"
        )
    model.build((None, 32))
    return model, "kernel"


def _weight_and_bias_nk(model, kind):
    params = dict(model.named_parameters())
    if kind == "linear":
        return params["0.weight"], params["0.bias"]
    return params["kernel"].t(), params["bias"]


def _reference(model, kind, x):
    """The output computed from the weights as they are now (float32)."""
    weight, bias = _weight_and_bias_nk(model, kind)
    return F.linear(x, weight.detach().float(), bias.detach().float())


X = torch.randn(6, 32, generator=torch.Generator().manual_seed(9))
G = torch.randn(6, 16, generator=torch.Generator().manual_seed(10))


def _warm_up(model, last="no_grad"):
    """Calls in every mode, so whatever can be kept is kept; the last call is
    in the mode `last` (the one the checked call will use)."""
    with torch.no_grad():
        model(X)
    model(X).float().sum().backward()
    model.zero_grad(set_to_none=True)
    with torch.inference_mode():
        model(X)
    if last == "no_grad":
        with torch.no_grad():
            model(X)
    else:
        model(X)


def _new_values(tensor, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tensor.shape, generator=generator) * 2


def _mutate(model, name, how):
    param = dict(model.named_parameters())[name]
    if how == "optimizer_step":
        optimizer = torch.optim.SGD([param], lr=1.0)
        param.grad = _new_values(param, 1)
        optimizer.step()
        param.grad = None
    elif how.startswith("load_state_dict"):
        state = {k: _new_values(v, i) for i, (k, v) in enumerate(model.state_dict().items())}
        if how == "load_state_dict":
            model.load_state_dict(state)
        elif how == "load_state_dict_non_strict":
            model.load_state_dict({name: state[name]}, strict=False)
        else:
            model.load_state_dict(state, assign=True)
    elif how == "copy_":
        with torch.no_grad():
            param.copy_(_new_values(param, 2))
    elif how == "ema":
        with torch.no_grad():
            param.mul_(0.5).add_(_new_values(param, 3), alpha=0.5)
    elif how == "data_assign":
        param.data = _new_values(param, 4)
    elif how == "data_assign_twice":  # the second often lands where the first was
        param.data = _new_values(param, 4)
        param.data = _new_values(param, 5)
    elif how == "init":
        with torch.no_grad():
            nn.init.normal_(param, std=2.0)
    else:
        raise ValueError(how)


MUTATIONS = [
    "optimizer_step",
    "load_state_dict",
    "load_state_dict_non_strict",
    "load_state_dict_assign",
    "copy_",
    "ema",
    "data_assign",
    "data_assign_twice",
    "init",
]


def _check_next_call(model, kind, then):
    reference = _reference(model, kind, X)
    if then == "no_grad":
        with torch.no_grad():
            out = model(X)
        assert relative_error(out, reference) < 0.02
        return
    out = model(X)
    assert relative_error(out, reference) < 0.02
    (out.float() * G).sum().backward()
    _weight, _ = _weight_and_bias_nk(model, kind)
    grad = dict(model.named_parameters())["0.weight" if kind == "linear" else "kernel"].grad
    assert grad is not None, "the cast carried no graph to the (new) weight"
    expected = G.t() @ X  # d/dW of sum(G * (x W^T)), (N, K)
    if kind != "linear":
        expected = expected.t()
    assert relative_error(grad, expected) < 0.02


@pytest.mark.parametrize("then", ["no_grad", "grad"])
@pytest.mark.parametrize("how", MUTATIONS)
@pytest.mark.parametrize(
    ("kind", "weight_cache"),
    [("linear", False), ("linear", True), ("dense", None), ("einsum", None)],
)
def test_weight_change_is_seen_by_the_next_call(kind, weight_cache, how, then):
    model, name = _build(kind, weight_cache)
    _warm_up(model, last=then)
    before = _reference(model, kind, X)
    _mutate(model, name, how)
    assert relative_error(_reference(model, kind, X), before) > 0.5  # a visible change
    _check_next_call(model, kind, then)


@pytest.mark.parametrize("then", ["no_grad", "grad"])
@pytest.mark.parametrize("kind", KINDS)
def test_data_edit_seen_after_clear_cast_caches(kind, then):
    model, name = _build(kind, weight_cache=True)
    _warm_up(model, last=then)
    param = dict(model.named_parameters())[name]
    param.data.mul_(-3.0)  # no version bump: invisible to kept casts
    dtype_policies.clear_cast_caches(model)
    _check_next_call(model, kind, then)


@pytest.mark.parametrize("then", ["no_grad", "grad"])
def test_data_edit_always_seen_without_weight_cache(then):
    model, name = _build("linear", weight_cache=False)
    _warm_up(model, last=then)
    dict(model.named_parameters())[name].data.mul_(-3.0)
    _check_next_call(model, "linear", then)


def test_clear_cast_caches_on_a_plain_module_is_harmless():
    model = nn.Linear(4, 4)
    dtype_policies.clear_cast_caches(model)  # nothing kept, nothing to do
    assert model(torch.ones(1, 4)).shape == (1, 4)


@pytest.mark.parametrize("kind", KINDS)
def test_to_double_then_back_is_seen(kind):
    """`.to()` replaces the tensors: the next call uses the new ones."""
    model, _ = _build(kind, weight_cache=True)
    _warm_up(model)
    model.double()
    with torch.no_grad():
        out = model(X)
    assert out.dtype == torch.bfloat16
    model.float()
    with torch.no_grad():
        nn.init.normal_(
            dict(model.named_parameters())["0.weight" if kind == "linear" else "kernel"]
        )
        out = model(X)
    assert relative_error(out, _reference(model, kind, X)) < 0.02


@pytest.mark.usefixtures("quiet")
def test_weight_changes_are_seen_by_kept_casts():
    model = mlp()
    apply_policy(model, "mixed_bfloat16")
    x = torch.randn(4, 32)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)

    def same():
        with torch.no_grad():
            return torch.equal(model(x), reference(x))

    assert same()
    for m, opt in ((model, optimizer), (reference, reference_optimizer)):
        m(x).float().sum().backward()
        opt.step()
    assert same()
    with torch.no_grad():
        for m in (model, reference):
            m[0].weight.mul_(0.5).add_(m[2].bias.mean())  # an EMA-style update
    assert same()
    new = torch.randn(32, 32)
    model[0].weight.data = new.clone()
    reference[0].weight.data = new.clone()
    assert same()
    with torch.no_grad():
        model[0].weight.data.mul_(3)  # invisible to torch's version counter
        reference[0].weight.data.mul_(3)
    dtype_policies.clear_cast_caches(model)
    dtype_policies.clear_cast_caches(reference)  # a policied copy: its kept casts too
    assert same()
    uncached = mlp()
    apply_policy(uncached, "mixed_bfloat16", weight_cache=False)
    with torch.no_grad():
        first = uncached(x)
        uncached[0].weight.data.zero_()
        assert not torch.equal(uncached(x), first)


def test_a_new_storage_at_the_old_address_is_seen():
    """`p.data = new` keeps `p`'s version counter, and the new tensor may sit
    where the old one was (here forced: two tensors on one numpy buffer, the
    buffer rewritten in between): the kept cast is keyed on the storage too."""
    import numpy as np

    from dtype_policies._core.tensor_identity import contents_key

    model, _ = _build("linear", weight_cache=True)
    buffer = np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)
    first = torch.from_numpy(buffer)
    model[0].weight.data = first
    with torch.no_grad():
        model(X)  # keeps a cast of `first`
    del first
    buffer *= -2.0
    second = torch.from_numpy(buffer)
    model[0].weight.data = second  # same address, same version, another storage
    with torch.no_grad():
        out = model(X)
    assert relative_error(out, _reference(model, "linear", X)) < 0.02
    third = torch.from_numpy(buffer)
    assert third.data_ptr() == second.data_ptr() and third._version == second._version
    assert contents_key(second) != contents_key(third)


@pytest.mark.parametrize("scaling", ["delayed", "dynamic", "weight_only"])
@pytest.mark.parametrize("drop", ["eval", "clear_cast_caches", "training_call"])
def test_a_float8_kernel_kept_for_inference_is_dropped_with_the_casts(scaling, drop):
    """float8's quantized kernel kept between calls without gradients is a
    kept cast of the float weight: a write torch does not see (a fused
    optimizer's, `p.data.mul_`) is seen after `eval()`, `clear_cast_caches`
    or any training call, as for the casts."""
    from dtype_policies.quantization import Float8QuantizationConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16))
    apply_policy(model, "mixed_bfloat16")
    dtype_policies.quantize(model, "float8", Float8QuantizationConfig(scaling=scaling))
    with torch.no_grad():
        before = model(X)
    model[0].weight.data.mul_(-3.0)  # no version bump
    if drop == "eval":
        model.eval()
    elif drop == "clear_cast_caches":
        dtype_policies.clear_cast_caches(model)
    else:
        model(X).float().sum().backward()
    with torch.no_grad():
        after = model(X)
    expected = _reference(model, "linear", X)
    assert relative_error(before, expected) > 0.5
    assert relative_error(after, expected) < 0.1


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_stored_tensors_written_behind_the_version_counter_are_read_after_clear_cast_caches(mode):
    # what a torch.distributed broadcast into a quantized model does
    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).eval()
        apply_policy(model, "mixed_bfloat16")
        dtype_policies.quantize(model, mode)
        return model

    source, target = build(0), build(1)
    x = torch.randn(3, 64)
    with torch.no_grad():
        expected = source(x)
        assert not torch.equal(target(x), expected)  # the target's kernels now hold its layouts
        for ours, theirs in zip(target.state_dict().values(), source.state_dict().values()):
            ours.data.copy_(theirs)
        dtype_policies.clear_cast_caches(target)
        assert torch.equal(target(x), expected)


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("view", ["slice", "transpose"])
def test_a_weight_replaced_by_a_view_of_its_own_memory_is_seen(grad_mode, view):
    """`p.data = p.data[:k]` (structured pruning) and `p.data = p.data.t()`
    keep the address, the storage and the version: the kept casts are keyed on
    the shape and strides too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)).eval()
    apply_policy(model, "mixed_bfloat16")
    x = torch.randn(4, 16)
    with grad_mode():
        before = model(x)
    if view == "slice":
        keep = 10
        model[0].weight.data = model[0].weight.data[:keep]
        model[0].bias.data = model[0].bias.data[:keep]
        model[2].weight.data = model[2].weight.data[:, :keep]
    else:
        model[0].weight.data = model[0].weight.data.t()
    reference = copy.deepcopy(model)
    dtype_policies.clear_cast_caches(reference)
    with grad_mode():
        out, expected = model(x), reference(x)
    assert torch.equal(out, expected)
    assert not torch.equal(out, before)


class _UpdatedMidCall(nn.Module):
    """Two reads of one child in a forward, its weights updated in place in
    between (a test-time adaptation step through `self.parameters()`)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        first = self.inner(x)
        with torch.no_grad():
            for p in self.parameters():
                p.mul_(0.5)
        return first, self.inner(x)


@pytest.mark.parametrize("weight_cache", [True, False])
@pytest.mark.parametrize("grad_mode", ["enable_grad", "no_grad", "inference_mode"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_weight_written_during_a_call_is_read_anew_later_in_that_call(
    kind, weight_cache, grad_mode
):
    inner, _ = _build(kind, weight_cache)
    model = _UpdatedMidCall(inner)
    if kind == "linear":  # the parent computes in bfloat16 too: one scope for both reads
        apply_policy(model, "mixed_bfloat16", weight_cache=weight_cache)
    weight, bias = (t.detach().clone() for t in _weight_and_bias_nk(inner, kind))
    x = torch.randn(4, 32)
    with getattr(torch, grad_mode)():
        first, second = model(x)
    expected = F.linear(x.bfloat16(), (weight * 0.5).bfloat16(), (bias * 0.5).bfloat16())
    assert second.dtype == torch.bfloat16
    torch.testing.assert_close(second.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("weight_cache", [True, False])
@pytest.mark.parametrize("grad_mode", ["enable_grad", "no_grad"])
def test_a_weight_replaced_by_a_view_of_its_memory_during_a_call_is_read_anew(
    weight_cache, grad_mode
):
    class Transposing(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            first = self.fc(x)
            self.fc.weight.data = self.fc.weight.data.t()  # same memory, same version
            return first, self.fc(x)

    torch.manual_seed(0)
    model = Transposing()
    apply_policy(model, "mixed_bfloat16", weight_cache=weight_cache)
    weight, bias = model.fc.weight.detach().clone(), model.fc.bias.detach().clone()
    x = torch.randn(2, 16)
    with getattr(torch, grad_mode)():
        _, second = model(x)
    expected = F.linear(x.bfloat16(), weight.t().bfloat16(), bias.bfloat16())
    torch.testing.assert_close(second, expected)
    # the write reached the parameter: the elements it changed, in the precision
    # of the copy it was made on; the others keep their float32 values
    written = weight.t().bfloat16()
    changed = written != weight.bfloat16()
    assert torch.equal(model.fc.weight.detach(), torch.where(changed, written.float(), weight))


def test_a_cast_made_before_clear_cast_caches_and_kept_after_it_is_never_used(monkeypatch):
    """Another thread's call may make a cast from the old values, then keep it
    after a `.data` write and `clear_cast_caches` ran: the next call must not
    use it (the store's generation moved on)."""
    from dtype_policies._core import weight_casts

    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    apply_policy(model, "mixed_bfloat16")
    real = weight_casts._make_cast
    raced = []

    def made_then_raced(weight, dtype):
        cast = real(weight, dtype)  # the old values
        if not raced:
            raced.append(True)
            model.weight.data.mul_(1.5)  # the other thread's write, then its clear
            dtype_policies.clear_cast_caches(model)
        return cast

    monkeypatch.setattr(weight_casts, "_make_cast", made_then_raced)
    x = torch.randn(2, 8)
    with torch.no_grad():
        model(x)  # keeps the cast of the old values after the clear
        now = model(x)
    expected = F.linear(x.bfloat16(), model.weight.bfloat16(), model.bias.bfloat16())
    assert torch.equal(now, expected)
