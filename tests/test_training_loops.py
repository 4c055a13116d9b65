"""Contract (training loops): whatever updates the weights between two steps,
the next training call reads them. A policied model trained by any loop
tracks, bit for bit and step for step, the float32 master weights trained by
the same loop through explicit bfloat16 casts (no library, nothing kept):
the same losses, the same weights after every update, the same validation and
EMA outputs.

The loops are the ways people write them: the hand-written SGD of tutorials
(`p.data.add_`, `p.data.copy_`, `p.data.mul_`, `p.data = ...`,
`p -= lr * g` under `no_grad`), foreach and fused optimizers (fused steps do
not move the version counter either), gradient accumulation, validation
between steps, and an EMA model updated with `torch._foreach_lerp_`.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dtype_policies
from dtype_policies import apply_policy, layers
from dtype_policies._core.module_state import state_of

IN, HIDDEN, OUT = 24, 48, 4
STEPS = 6
LR = 0.05


def _data(seed: int, rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, IN, generator=generator), torch.randn(rows, OUT, generator=generator)


# -- the models under test and their explicit-cast references -------------------------------


def _torch_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, OUT))
    apply_policy(model, "mixed_bfloat16")
    return model


def _layers_model() -> nn.Module:
    torch.manual_seed(0)
    with dtype_policies.policy_scope("mixed_bfloat16"):
        model = layers.Sequential([layers.Dense(HIDDEN, activation="gelu"), layers.Dense(OUT)])
    model.build((None, IN))
    return model


def _torch_reference(masters: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2 = (m.bfloat16() for m in masters)
    return F.linear(F.gelu(F.linear(x.bfloat16(), w1, b1)), w2, b2)


def _layers_reference(masters: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    k1, b1, k2, b2 = (m.bfloat16() for m in masters)
    return torch.addmm(b2, F.gelu(torch.addmm(b1, x.bfloat16(), k1)), k2)


MODELS = {
    "apply_policy": (_torch_model, _torch_reference),
    "layers": (_layers_model, _layers_reference),
}


class Pair:
    """A policied model and its reference (float32 masters, explicit casts)."""

    def __init__(self, kind: str) -> None:
        build, self.reference_forward = MODELS[kind]
        self.model = build()
        self.params = list(self.model.parameters())
        assert all(p.dtype == torch.float32 for p in self.params)
        self.masters = [nn.Parameter(p.detach().clone()) for p in self.params]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model(x), self.reference_forward(self.masters, x)

    def losses(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, expected = self.forward(x)
        assert out.dtype == expected.dtype == torch.bfloat16
        return F.mse_loss(out.float(), y), F.mse_loss(expected.float(), y)

    def backward(self, x: torch.Tensor, y: torch.Tensor, scale: float = 1.0) -> float:
        loss, expected = self.losses(x, y)
        assert torch.equal(loss, expected), (loss.item(), expected.item())
        (loss * scale).backward()
        (expected * scale).backward()
        for p, m in zip(self.params, self.masters):
            assert p.grad is not None and torch.equal(p.grad, m.grad)
        return loss.item()

    def zero_grad(self) -> None:
        for p in (*self.params, *self.masters):
            p.grad = None

    def assert_same_weights(self) -> None:
        for p, m in zip(self.params, self.masters):
            assert torch.equal(p, m)


# -- the updates: each applied alike to the model's parameters and the masters ---------------


def _data_add(params):
    for p in params:
        p.data.add_(p.grad, alpha=-LR)  # the issue's loop


def _data_copy(params):
    for p in params:
        p.data.copy_(p.data - LR * p.grad)


def _data_mul(params):
    for p in params:
        p.data.mul_(0.98)  # weight decay through .data
        p.data.sub_(LR * p.grad)


def _data_assign(params):
    for p in params:
        p.data = p.data - LR * p.grad


def _no_grad_isub(params):
    with torch.no_grad():
        for p in params:
            p -= LR * p.grad


HAND_WRITTEN = {
    "data_add": _data_add,
    "data_copy": _data_copy,
    "data_mul": _data_mul,
    "data_assign": _data_assign,
    "no_grad_isub": _no_grad_isub,
}

OPTIMIZERS = {
    "sgd_foreach_momentum": lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, foreach=True),
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=LR, fused=True),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=True),
    "adamw_single_tensor": lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=False),
}


def _updater(name: str, pair: Pair):
    """`update()` applying the update `name` to both parameter sets."""
    if name in HAND_WRITTEN:
        update = HAND_WRITTEN[name]
        return lambda: (update(pair.params), update(pair.masters))
    model_opt, reference_opt = OPTIMIZERS[name](pair.params), OPTIMIZERS[name](pair.masters)
    return lambda: (model_opt.step(), reference_opt.step())


def _train(pair: Pair, update_name: str, steps: int = STEPS) -> list[float]:
    update = _updater(update_name, pair)
    losses = []
    for step in range(steps):
        x, y = _data(step % 3)
        pair.zero_grad()
        losses.append(pair.backward(x, y))
        update()
        pair.assert_same_weights()
    return losses


@pytest.mark.parametrize("update", [*HAND_WRITTEN, *OPTIMIZERS])
@pytest.mark.parametrize("kind", MODELS)
def test_every_update_is_read_by_the_next_step(kind, update):
    pair = Pair(kind)
    losses = _train(pair, update)
    assert losses[-1] < 0.9 * losses[0], losses  # it trains (asserted bit-exact above)


@pytest.mark.parametrize("kind", MODELS)
def test_gradient_accumulation(kind):
    pair = Pair(kind)
    for step in range(STEPS):
        pair.zero_grad()
        for micro in range(3):
            x, y = _data(10 * step + micro, rows=8)
            pair.backward(x, y, scale=1 / 3)
        _data_add(pair.params)
        _data_add(pair.masters)
        pair.assert_same_weights()


@pytest.mark.parametrize("update", ["data_add", "adam_fused", "no_grad_isub"])
@pytest.mark.parametrize("kind", MODELS)
def test_validation_between_steps(kind, update):
    """No-grad validation before and after each step, in eval mode or not: the
    kept inference casts never leak into training, and every validation sees
    the latest step."""
    pair = Pair(kind)
    step_fn = _updater(update, pair)
    x_val, _ = _data(99)
    for step in range(STEPS):
        switch = step % 2 == 0
        for _ in range(2):  # the second call reads what the first one kept
            if switch:
                pair.model.eval()
            with torch.no_grad():
                out, expected = pair.forward(x_val)
            assert torch.equal(out, expected)
            if switch:
                pair.model.train()
        x, y = _data(step)
        pair.zero_grad()
        pair.backward(x, y)
        step_fn()
        pair.assert_same_weights()
        with torch.inference_mode():
            out, expected = pair.forward(x_val)
        assert torch.equal(out, expected)


@pytest.mark.parametrize("kind", MODELS)
def test_ema_model_updated_with_foreach_lerp(kind):
    pair = Pair(kind)
    ema = copy.deepcopy(pair.model)  # policied too; evaluated under no_grad only
    ema.eval()
    ema_params = list(ema.parameters())
    ema_masters = [m.detach().clone() for m in pair.masters]
    x_val, _ = _data(99)
    for step in range(STEPS):
        x, y = _data(step)
        pair.zero_grad()
        pair.backward(x, y)
        _data_add(pair.params)
        _data_add(pair.masters)
        with torch.no_grad():
            torch._foreach_lerp_(ema_params, pair.params, 0.3)
            torch._foreach_lerp_(ema_masters, [m.detach() for m in pair.masters], 0.3)
            out = ema(x_val)
            assert torch.equal(out, pair.reference_forward(ema_masters, x_val))


def test_the_issue_loop_trains_like_float32():
    """Issue 22's report: the loss stayed at 0.88 for 30 steps."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 512), torch.randn(64, 1)

    def run(policy):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 1))
        if policy is not None:
            apply_policy(model, policy)
        for _ in range(30):
            loss = ((model(x).float() - y) ** 2).mean()
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-0.05)
        return loss.item()

    assert run(None) < 1e-3
    assert run("mixed_bfloat16") < 1e-3


# -- the lifetimes themselves ---------------------------------------------------------------


def _kept(module: nn.Module) -> int:
    """How many casts `module` and its submodules keep between calls."""
    count = 0
    for m in module.modules():
        state = state_of(m)
        if state is not None:
            count += len(state.casts.entries) + (state.casts.pair is not None)
    return count


@pytest.mark.parametrize("kind", MODELS)
def test_a_training_call_keeps_nothing_and_drops_what_inference_kept(kind):
    pair = Pair(kind)
    x, y = _data(0)
    with torch.no_grad():
        pair.model(x)
    assert _kept(pair.model) == 2
    loss = F.mse_loss(pair.model(x).float(), y)
    assert _kept(pair.model) == 0  # graph-carrying casts went with the call
    loss.backward()
    assert _kept(pair.model) == 0


@pytest.mark.parametrize("scaling", ["dynamic", "weight_only"])
def test_a_training_call_drops_a_float32_float8_kernel(scaling):
    """float8 computing in float32 reads its weight with no cast, and that
    read never told the store a training call was running: the float8
    kernel an inference call kept survived a `.data` write followed by a
    training call (33% off after the write)."""
    from dtype_policies import quantize
    from dtype_policies.quantizers import Float8QuantizationConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32))
    quantize(model, "float8", Float8QuantizationConfig(scaling=scaling))
    x = torch.randn(4, 32)
    with torch.no_grad():
        model(x)  # keeps the float8 kernel
    model[0].weight.data.mul_(1.5)  # not seen by the version counter
    model(x).sum().backward()  # a training call
    with torch.no_grad():
        after = model(x)
    dtype_policies.clear_cast_caches(model)
    with torch.no_grad():
        assert torch.equal(after, model(x))


@pytest.mark.parametrize("switch", ["train", "eval"])
@pytest.mark.parametrize("kind", MODELS)
def test_a_mode_switch_drops_kept_casts(kind, switch):
    """A `.data` write between two no-grad calls is seen once the model
    switches mode in between (an evaluation loop calls `eval()`)."""
    pair = Pair(kind)
    x, _ = _data(0)
    with torch.no_grad():
        pair.model(x)
    for p, m in zip(pair.params, pair.masters):
        p.data.mul_(-2.0)  # not seen by the version counter
        m.data.mul_(-2.0)
    getattr(pair.model, switch)()
    with torch.no_grad():
        out, expected = pair.forward(x)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("weight_cache", [True, False])
def test_a_no_grad_read_inside_a_training_call_does_not_starve_the_gradient(weight_cache):
    """A forward that reads a weight under `no_grad` (a statistic) and then
    with gradients gets a graph for the second read (one call, one scope)."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            with torch.no_grad():
                norm = self.weight.norm()
            return x @ self.weight / norm

    model = Scaled()
    apply_policy(model, "mixed_bfloat16", weight_cache=weight_cache)
    model(torch.ones(2, 4)).float().sum().backward()
    expected = torch.ones(2, 4).t() @ torch.ones(2, 4) / model.weight.detach().bfloat16().norm()
    assert model.weight.grad is not None
    assert torch.allclose(model.weight.grad, expected.float(), rtol=1e-2)


def test_a_weight_read_twice_in_one_call_is_cast_once():
    """A shared layer called twice in one forward: one cast for both calls (the
    gradient of both uses reaches the weight)."""
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    model = nn.Sequential(shared, nn.Tanh(), shared)
    apply_policy(model, "mixed_bfloat16")
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: seen.append(module.weight) if module is shared else None
    )
    try:
        model(torch.randn(2, 8)).float().sum().backward()
    finally:
        handle.remove()
    assert len(seen) == 2 and seen[0] is seen[1] and seen[0].dtype == torch.bfloat16
    assert shared.weight.grad is not None


def test_clear_cast_caches_is_still_there_for_the_unseen_case():
    """The one case kept casts cannot see (docs/apply_policy.md): a `.data`
    write between two no-grad calls with nothing in between."""
    pair = Pair("apply_policy")
    x, _ = _data(0)
    with torch.no_grad():
        pair.model(x)
    for p, m in zip(pair.params, pair.masters):
        p.data.mul_(-2.0)
        m.data.mul_(-2.0)
    dtype_policies.clear_cast_caches(pair.model)
    with torch.no_grad():
        out, expected = pair.forward(x)
    assert torch.equal(out, expected)


# -- copies, compilation, quantized bases -----------------------------------------------------


def _tracked_add(params):
    """The update of `_data_add` through the parameters (torch counts it)."""
    with torch.no_grad():
        for p in params:
            p.add_(p.grad, alpha=-LR)


def _train_model(model: nn.Module, update, steps: int = STEPS) -> list[torch.Tensor]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for step in range(steps):
        x, y = _data(step % 3)
        model.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        update(trainable)
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("kind", MODELS)
def test_a_copy_made_mid_training_trains_alike(kind, how):
    """Copied between a forward and its backward, after inference calls kept
    their casts: the copy and the original train alike, step for step."""
    import io

    pair = Pair(kind)
    x, y = _data(0)
    with torch.no_grad():
        pair.model(x)  # inference casts kept
    loss = F.mse_loss(pair.model(x).float(), y)  # a forward whose backward is pending
    if how == "deepcopy":
        twin = copy.deepcopy(pair.model)
    else:
        buffer = io.BytesIO()
        torch.save(pair.model, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    loss.backward()
    _data_add(list(pair.model.parameters()))
    for p in twin.parameters():
        p.grad = None
    twin_loss = F.mse_loss(twin(x).float(), y)
    twin_loss.backward()
    _data_add(list(twin.parameters()))
    for a, b in zip(pair.model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(_train_model(pair.model, _data_add), _train_model(twin, _data_add)):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("kind", MODELS)
def test_a_compiled_model_trained_through_data_tracks_eager(kind):
    eager = Pair(kind)
    compiled = Pair(kind)
    compiled.model = torch.compile(compiled.model)
    expected = _train_model(eager.model, _data_add)
    got = _train_model(compiled.model, _data_add)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)
    assert got[-1] < 0.9 * got[0]


@pytest.mark.parametrize("mode", ["int8", "int4", "float8"])
def test_lora_adapters_on_a_quantized_base_read_every_update(mode):
    """peft adapters (policied, trainable) on a quantized frozen base, trained by
    a hand-written `.data` loop: the same losses and adapters, bit for bit, as
    with an update torch counts (the two differ only in what kept casts see)."""
    peft = pytest.importorskip("peft", reason="peft is not installed")

    def build():
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(IN, 128), nn.GELU(), nn.Linear(128, OUT))
        config = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["0", "2"], init_lora_weights=False
        )
        model = peft.get_peft_model(base, config)
        apply_policy(model, "mixed_bfloat16")
        dtype_policies.quantize(model, mode)  # the bases (adapters stay float)
        return model

    through_data, tracked = build(), build()
    trainable = [n for n, p in through_data.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n in trainable)
    for a, b in zip(_train_model(through_data, _data_add), _train_model(tracked, _tracked_add)):
        assert torch.equal(a, b)
    for a, b in zip(through_data.parameters(), tracked.parameters()):
        assert torch.equal(a, b)


def _lora_mlp() -> nn.Module:
    """A peft LoRA model (adapters initialised non-zero) of a small MLP."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(IN, 128), nn.GELU(), nn.Linear(128, OUT))
    config = peft.LoraConfig(r=4, target_modules=["0", "2"], init_lora_weights=False)
    return peft.get_peft_model(base, config)


@pytest.mark.parametrize("mode", ["int8", "int4", "float8"])
def test_quantize_leaves_peft_adapters_float_and_trainable(mode):
    """`quantize(model, mode)` on a peft model quantizes the bases, not the
    adapters (reported as "adapter"): an optimizer made before still trains."""
    model = _lora_mlp()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    report = dtype_policies.quantize(model, mode)
    assert [path.rsplit("/", 1)[-1] for path, *_ in report.quantized] == ["base_layer"] * 2
    adapters = report.skipped_by_reason("adapter")
    assert len(adapters) == 4 and all("/lora_" in path for path in adapters)
    assert [p for p in model.parameters() if p.requires_grad] == trainable
    x, target = torch.randn(32, IN), torch.randn(32, OUT)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = (model(x).float() - target).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0]


def test_a_quantized_policy_on_a_peft_model_leaves_the_adapters_float_and_trainable():
    """The quantized policy route (`apply_policy(model, "int8_from_...")`)
    keeps the adapters as `quantize()` does: listed in `handle.unquantized`."""
    model = _lora_mlp()
    trainable = [p for p in model.parameters() if p.requires_grad]
    handle = apply_policy(model, "int8_from_mixed_bfloat16")
    assert [p.rsplit("/", 1)[-1] for p in handle.quantized_paths] == ["base_layer"] * 2
    assert sum("/lora_" in path for path in handle.unquantized) == 4
    assert [p for p in model.parameters() if p.requires_grad] == trainable
    loss = model(torch.randn(4, IN)).float().pow(2).mean()
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable)


@pytest.mark.parametrize("merge", ["merge_adapter", "merge_and_unload", "unmerge_adapter"])
def test_merging_peft_adapters_is_seen_by_the_next_inference_call(merge):
    """peft merges through `.data` (no version counter moves): the next
    `no_grad` call of a policied model computes with the merged weight, not a
    cast kept from before."""
    model = _lora_mlp().eval()
    apply_policy(model, "mixed_bfloat16")
    x = torch.randn(8, IN)
    with torch.no_grad():
        with model.disable_adapter():
            without = model(x)
        with_adapters = model(x)  # casts of the bases kept from here
        if merge == "unmerge_adapter":
            model.merge_adapter()
            model(x)
            model.unmerge_adapter()
            merged = model(x)
        else:
            merged = getattr(model, merge)()(x) if merge == "merge_and_unload" else None
            if merged is None:
                model.merge_adapter()
                merged = model(x)
    assert not torch.equal(with_adapters, without)
    assert (merged.float() - with_adapters.float()).abs().max() < 0.05
    assert (merged.float() - without.float()).abs().max() > 0.1


def test_an_adapter_merged_again_with_new_weights_is_seen():
    """unmerge, new adapter weights, merge, with no call between: the base
    was written twice through `.data`; the next call reads the new merge."""
    model = _lora_mlp().eval()
    apply_policy(model, "mixed_bfloat16")
    x = torch.randn(8, IN)
    with torch.no_grad():
        model.merge_adapter()
        first = model(x)
        model.unmerge_adapter()
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p))
        expected = model(x)  # unmerged: adapters computed beside the base
        model.merge_adapter()
        merged = model(x)
    assert (merged.float() - expected.float()).abs().max() < 0.15  # bfloat16 roundings
    assert (merged.float() - first.float()).abs().max() > 1.0  # not the first merge's cast


@pytest.mark.parametrize("kind", MODELS)
def test_training_through_data_while_another_thread_evaluates(kind):
    """A thread evaluating under no_grad keeps casts all along; the training
    thread, writing through `.data`, never reads them (bit for bit)."""
    import threading

    pair = Pair(kind)
    stop, errors = threading.Event(), []
    x_val, _ = _data(99)

    def evaluate():
        try:
            while not stop.is_set():
                with torch.no_grad():
                    pair.model(x_val)
        except Exception as error:  # reported below
            errors.append(error)

    thread = threading.Thread(target=evaluate)
    thread.start()
    try:
        losses = _train(pair, "data_add", steps=STEPS * 2)
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert losses[-1] < 0.9 * losses[0]


# -- activation checkpointing inside a forward --------------------------------------------------


class _CheckpointsAFunction(nn.Module):
    """A forward that checkpoints a function reading the module's own weight
    by attribute (not a module call): its recomputation, in the backward
    pass, runs outside the module's call."""

    def __init__(self, context_fn=None):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(HIDDEN, IN) * 0.1)
        self.norm = nn.LayerNorm(HIDDEN)
        self.context_fn = context_fn

    def inner(self, x):
        return self.norm(F.gelu(F.linear(x, self.weight)))

    def forward(self, x):
        if self.context_fn is None:
            return self.inner(x)
        return torch.utils.checkpoint.checkpoint(
            self.inner, x, use_reentrant=False, context_fn=self.context_fn
        )


def test_checkpoint_contexts_recompute_in_the_forwards_scopes():
    x = torch.randn(8, IN, generator=torch.Generator().manual_seed(1))
    grads = []
    for context_fn in (None, dtype_policies.checkpoint_contexts):
        model = _CheckpointsAFunction(context_fn)
        apply_policy(model, "mixed_bfloat16")
        out = model(x)
        assert out.dtype == torch.bfloat16
        out.float().square().sum().backward()
        assert model.weight.grad.dtype == torch.float32
        grads.append([p.grad for p in model.parameters()])
    for plain, checkpointed in zip(*grads):
        assert torch.equal(plain, checkpointed)


class _CheckpointsALinear(_CheckpointsAFunction):
    """As `_CheckpointsAFunction`, with a linear where the norm was (the form
    in which a compiled call met torch's error)."""

    def __init__(self, context_fn=None):
        super().__init__(context_fn)
        self.norm = nn.Linear(HIDDEN, HIDDEN)


@pytest.mark.slow  # Inductor compiles
def test_checkpoint_contexts_under_torch_compile():
    """The same code eagerly and under `torch.compile`: compiled, torch takes
    only its own dispatch-mode contexts (`checkpoint_contexts` gave context
    managers: an AssertionError from the backend at the first call)."""
    x = torch.randn(8, IN, generator=torch.Generator().manual_seed(1))
    projection = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(2))
    grads = []
    for context_fn, compiled in (
        (None, False),
        (dtype_policies.checkpoint_contexts, True),
        (None, True),
    ):
        model = _CheckpointsALinear(context_fn)
        apply_policy(model, "mixed_bfloat16")
        run = torch.compile(model) if compiled else model
        out = run(x)
        assert out.dtype == torch.bfloat16
        (out.float() * projection).sum().backward()  # (a norm's output squared is ~constant)
        grads.append([p.grad for p in model.parameters()])
    eager, checkpointed, compiled = grads
    for plain, kept, traced in zip(eager, checkpointed, compiled):
        assert ((kept - plain).norm() / plain.norm()).item() < 2e-2
        assert ((traced - plain).norm() / plain.norm()).item() < 2e-2


@pytest.mark.parametrize("update", ["adam_fused", "sgd_fused"])
@pytest.mark.parametrize("kind", MODELS)
def test_a_fused_step_between_two_inference_calls_is_seen(kind, update):
    """A fused step writes the parameters without moving their version
    counters (Adam's); the library's step hook moves them, so the cast the
    first inference call kept is not reused by the second."""
    pair = Pair(kind)
    step_fn = _updater(update, pair)
    x_val, _ = _data(99)
    x, y = _data(0)
    pair.zero_grad()
    pair.backward(x, y)
    with torch.no_grad():
        pair.forward(x_val)  # keeps its casts
    versions = [p._version for p in pair.params]
    step_fn()
    pair.assert_same_weights()
    assert all(p._version > v for p, v in zip(pair.params, versions))
    with torch.no_grad():
        out, expected = pair.forward(x_val)
    assert torch.equal(out, expected)


def test_a_fused_step_leaves_a_frozen_parameters_graph_valid():
    """Only what the fused kernels write (parameters with a gradient) moves:
    a frozen weight in the optimizer keeps a retained graph usable, as in
    plain torch."""
    torch.manual_seed(0)
    frozen, trained = nn.Linear(4, 4), nn.Linear(4, 4)
    frozen.weight.requires_grad_(False)
    optimizer = torch.optim.AdamW([*frozen.parameters(), *trained.parameters()], fused=True)
    x = torch.randn(2, 4, requires_grad=True)
    kept = frozen(x)
    trained(kept.detach()).sum().backward()
    versions = (frozen.weight._version, trained.weight._version)
    optimizer.step()
    assert frozen.weight._version == versions[0] and trained.weight._version > versions[1]
    (grad,) = torch.autograd.grad(kept.sum(), x)  # the graph reading frozen.weight
    assert torch.isfinite(grad).all()


# -- weights written inside a call ---------------------------------------------------------------


class _RenormsItself(nn.Module):
    """Constrains its own weight in its forward (a max-norm constraint), then
    reads it again: what torch does with the parameter itself."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(HIDDEN, IN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.weight.renorm_(2, 0, 1.0)
        return F.linear(x, self.weight)


class _ClampsChild(nn.Module):
    """A parent that clamps its child's weight, then calls the child."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.fc.weight.clamp_(-0.05, 0.05)
        return self.fc(x)


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("build", [_RenormsItself, _ClampsChild])
def test_a_weight_written_inside_a_call_reaches_the_parameter(build, grad):
    """A weight read inside a call is a copy in the compute dtype; a write to
    it reaches the parameter (the elements it changed, rounded as computed),
    this call and the next read the written weight, and no copy kept for
    inference serves the weight as it was."""
    model, reference = build(), build()
    apply_policy(model, "mixed_bfloat16")
    x = _data(1)[0]
    for _ in range(2):  # the second call: kept casts, if any, are checked
        with torch.set_grad_enabled(grad):
            out = model(x)
            expected = reference(x)  # float32: constrains its parameter itself
        written = dict(model.named_parameters())
        for name, parameter in reference.named_parameters():
            # changed elements hold the bfloat16 result, the others their float32 value
            assert torch.allclose(written[name], parameter, rtol=1e-2, atol=1e-3), name
        relative = (out.float() - expected).norm() / expected.norm()
        assert out.dtype == torch.bfloat16 and relative < 0.01
    if build is _RenormsItself:
        norms = model.weight.detach().norm(dim=1)
        assert torch.allclose(norms, torch.ones_like(norms), atol=5e-3)
    else:
        untouched = reference.fc.weight.abs() < 0.05  # kept exactly as stored
        assert torch.equal(model.fc.weight[untouched], reference.fc.weight[untouched])


def test_a_weights_data_replaced_inside_a_call_reaches_the_parameter():
    """`weight.data = ...` on the copy a call reads (from a forward hook)."""
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, OUT))
    apply_policy(model, "mixed_bfloat16")
    new = torch.randn(OUT, HIDDEN, generator=torch.Generator().manual_seed(3))

    def replace(module, args, output):
        model[2].weight.data = new.clone()

    model[0].register_forward_hook(replace)
    out = model(_data(1)[0])
    assert torch.equal(model[2].weight.detach(), new)
    assert out.dtype == torch.bfloat16
