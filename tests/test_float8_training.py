"""float8 delayed scaling in training: what one step records (every call of
the step, by maximum; frozen layers too), what it never records (non-finite
maxima, steps a loss scaler skips), and the edges of the scales (overflowed
gradients stay visible, maxima near 0 give no NaN)."""

import math

import pytest
import torch

from dtype_policies import QuantizedFloat8DTypePolicy, layers
from dtype_policies.optimizers import LossScaleOptimizer

STATE = tuple(
    f"{tensor}_{kind}"
    for tensor in ("inputs", "kernel", "outputs_grad")
    for kind in ("scale", "amax_history")
)


def _dense(source="float32", scaling="delayed", history=4, units=4, width=8, bias=False):
    torch.manual_seed(0)
    layer = layers.Dense(
        units,
        use_bias=bias,
        dtype=QuantizedFloat8DTypePolicy("float8", source, history, scaling=scaling),
    )
    layer.build((None, width))
    return layer


def _state(layer):
    return {name: getattr(layer, name).detach().clone() for name in STATE}


@pytest.mark.parametrize("scaling", ["delayed", "dynamic"])
def test_an_overflowed_output_gradient_reaches_the_loss_scaler(scaling):
    # e5m2's clamp would turn the inf into 57344 x scale: a finite, wrong update
    layer = _dense("mixed_float16", scaling)
    with torch.no_grad():
        layer.kernel.fill_(0.5)
        layer.kernel[:, 0] = 448.0
    before_kernel, before_state = layer.kernel.detach().clone(), _state(layer)
    optimizer = LossScaleOptimizer(torch.optim.SGD(layer.parameters(), lr=1e-3))
    loss = layer(torch.full((2, 8), 1e-2)).float().square().mean()
    optimizer.scale_loss(loss).backward()
    assert not torch.isfinite(layer.kernel.grad).all()
    optimizer.step()
    assert optimizer.last_step_skipped
    assert optimizer.dynamic_scale == 2.0**14
    assert torch.equal(layer.kernel.detach(), before_kernel)
    for name, value in _state(layer).items():
        assert torch.equal(value, before_state[name]), name


def _assert_a_nan_step_is_skipped_and_undone(layer, optimizer, before):
    """A step whose input holds a NaN: skipped, the scales as in `before`."""
    spike = torch.randn(4, 8)
    spike[0, 0] = float("nan")
    optimizer.scale_loss(layer(spike).float().sum()).backward()
    optimizer.step()
    assert optimizer.last_step_skipped
    for name, value in _state(layer).items():
        assert torch.equal(value, before[name]), name


def test_a_step_the_loss_scaler_skips_leaves_the_scales_as_they_were():
    layer = _dense("mixed_float16")
    optimizer = LossScaleOptimizer(torch.optim.SGD(layer.parameters(), lr=1e-3))
    for _ in range(3):
        optimizer.zero_grad()
        optimizer.scale_loss(layer(torch.randn(4, 8)).float().sum()).backward()
        optimizer.step()
    before = _state(layer)
    assert before["inputs_amax_history"][0] > 0
    optimizer.zero_grad()
    _assert_a_nan_step_is_skipped_and_undone(layer, optimizer, before)
    optimizer.zero_grad()  # the next step records as usual
    optimizer.scale_loss(layer(torch.full((4, 8), 3.0)).float().sum()).backward()
    optimizer.step()
    assert not optimizer.last_step_skipped
    assert layer.inputs_amax_history[0].item() == 3.0
    expected = torch.roll(before["inputs_amax_history"], -1)[1:]
    assert torch.equal(layer.inputs_amax_history[1:], expected)


def test_a_skipped_step_undoes_only_its_own_optimizers_models():
    """Two models, two optimizers (a GAN, a teacher and a student): a loss
    scaler skipping one model's step restores that model's scales, not the
    other's, whose optimizer stepped (before or after) and applied them."""
    first, second = _dense("mixed_float16"), _dense("mixed_float16", units=3)
    skipping = LossScaleOptimizer(torch.optim.SGD(first.parameters(), lr=1e-3))
    stepping = torch.optim.SGD(second.parameters(), lr=1e-3)
    first_before, second_before = _state(first), _state(second)
    spike = torch.randn(4, 8)
    spike[0, 0] = float("inf")
    skipping.scale_loss(first(spike).float().sum()).backward()
    second(torch.full((4, 8), 2.0)).float().sum().backward()
    stepping.step()  # between the first model's backward and its skipped step
    skipping.step()
    assert skipping.last_step_skipped
    for name, value in _state(first).items():
        assert torch.equal(value, first_before[name]), name
    assert second.inputs_amax_history[0].item() == 2.0
    assert not torch.equal(second.inputs_amax_history, second_before["inputs_amax_history"])

    second_recorded = _state(second)  # the other order: the skip comes first
    skipping.zero_grad()
    skipping.scale_loss(first(spike).float().sum()).backward()
    second(torch.full((4, 8), 5.0)).float().sum().backward()
    skipping.step()
    assert skipping.last_step_skipped
    assert second.inputs_amax_history[0].item() == 5.0
    assert not torch.equal(second.inputs_amax_history, second_recorded["inputs_amax_history"])
    stepping.step()
    for name, value in _state(first).items():
        assert torch.equal(value, first_before[name]), name


def test_a_non_finite_maximum_never_enters_a_history():
    layer = _dense()
    layer(torch.full((2, 8), 2.0)).sum().backward()
    before = _state(layer)
    spike = torch.full((2, 8), 2.0)
    spike[0, 0] = float("inf")
    layer(spike).sum().backward()
    for name in ("inputs_scale", "inputs_amax_history"):
        assert torch.equal(getattr(layer, name), before[name]), name
    assert torch.isfinite(layer.outputs_grad_amax_history).all()


def test_a_layer_called_twice_in_one_step_records_the_larger_call():
    layer = _dense()
    small, big = torch.full((2, 8), 1.0), torch.full((2, 8), 100.0)
    (layer(small).sum() + layer(big).sum()).backward()
    history = layer.inputs_amax_history.tolist()
    assert history == [100.0, 0.0, 0.0, 0.0]  # rolled once, with the larger maximum
    layer.zero_grad()
    (layer(big).sum() + layer(small).sum()).backward()
    assert layer.inputs_amax_history.tolist() == [100.0, 0.0, 0.0, 100.0]
    assert layer.inputs_scale.item() == pytest.approx(100.0 / 448.0)


def test_a_step_under_functional_call_advances_the_state_it_was_given():
    """`torch.func.functional_call` with the float8 state substituted (a
    second replica's): the step advanced the module's own buffers, and the
    substituted ones, which the forward read, stayed at their first scales
    (as torch's batch norm, the running statistics given are updated)."""
    layer = _dense()
    own = _state(layer)
    given = {name: value.clone() for name, value in own.items()}
    kernel = layer.kernel.detach().clone().requires_grad_()
    for value in (5.0, 7.0):
        x = torch.full((2, 8), value)
        torch.func.functional_call(layer, {"kernel": kernel, **given}, (x,)).sum().backward()
    for name, value in _state(layer).items():
        assert torch.equal(value, own[name]), name
    assert given["inputs_amax_history"].tolist() == [7.0, 0.0, 0.0, 5.0]
    assert given["inputs_scale"].item() == pytest.approx(5.0 / 448.0)
    layer(torch.full((2, 8), 3.0)).sum().backward()  # its own state steps from its own
    assert layer.inputs_amax_history.tolist() == [3.0, 0.0, 0.0, 0.0]


def test_functional_call_state_steps_per_pair_and_a_skip_undoes_it():
    """Only the output gradient's pair substituted, beside a plain call in the
    same backward: the merged step went to the module's own pair. And a loss
    scaler's skip left a substituted pair advanced (its optimizer holds the
    substituted parameters, not the module's)."""
    layer = _dense()
    given = {name: getattr(layer, name).clone() for name in STATE if "outputs_grad" in name}
    x = torch.full((2, 8), 1.0)
    substituted = torch.func.functional_call(layer, given, (x,)).sum() * 1000.0
    (substituted + layer(x).sum()).backward()
    assert given["outputs_grad_amax_history"][0].item() == 1000.0
    assert layer.outputs_grad_amax_history[0].item() == 1.0
    assert layer.inputs_amax_history.tolist() == [1.0, 0.0, 0.0, 0.0]  # both calls: one step

    layer = _dense()
    given = {name: value.clone() for name, value in _state(layer).items()}
    kernel = layer.kernel.detach().clone().requires_grad_()
    optimizer = LossScaleOptimizer(torch.optim.SGD([kernel], lr=1e-3))
    before = {name: value.clone() for name, value in given.items()}
    spike = torch.full((2, 8), 5.0)
    spike[0, 0] = float("nan")  # the kernel's pair still steps (a finite maximum)
    out = torch.func.functional_call(layer, {"kernel": kernel, **given}, (spike,))
    optimizer.scale_loss(out.sum()).backward()
    assert not torch.equal(given["kernel_amax_history"], before["kernel_amax_history"])
    optimizer.step()  # skipped: the gradients are not finite
    assert optimizer.last_step_skipped
    for name, value in given.items():
        assert torch.equal(value, before[name]), name

    # a meta-learning loop: copies of its own parameters, its own state, its optimizer
    layer = _dense()
    optimizer = LossScaleOptimizer(torch.optim.SGD(layer.parameters(), lr=1e-3))
    before = _state(layer)
    fast = {"kernel": layer.kernel * 1.0}
    optimizer.scale_loss(torch.func.functional_call(layer, fast, (spike,)).sum()).backward()
    assert not torch.equal(layer.kernel_amax_history, before["kernel_amax_history"])
    optimizer.step()
    assert optimizer.last_step_skipped
    for name, value in _state(layer).items():
        assert torch.equal(value, before[name]), name


def test_a_frozen_layer_in_training_mode_records_its_steps():
    layer = _dense()
    layer.kernel.requires_grad_(False)
    head = torch.nn.Linear(4, 1)
    for _ in range(3):
        head(layer(torch.full((2, 8), 5.0))).sum().backward()
    assert layer.inputs_amax_history.tolist() == [5.0, 0.0, 5.0, 5.0]  # Keras's roll
    assert layer.inputs_scale.item() == pytest.approx(5.0 / 448.0)
    layer.eval()  # eval mode still changes nothing
    before = _state(layer)
    head(layer(torch.full((2, 8), 50.0))).sum().backward()
    for name, value in _state(layer).items():
        assert torch.equal(value, before[name]), name


def test_a_gradient_penalty_runs_under_delayed_scaling():
    layer = _dense(units=1)
    x = torch.randn(4, 8, requires_grad=True)
    (gradient,) = torch.autograd.grad(layer(x).sum(), x, create_graph=True)
    gradient.square().sum().backward()
    assert layer.kernel.grad is not None and torch.isfinite(layer.kernel.grad).all()
    assert layer.inputs_amax_history[0].item() == pytest.approx(x.abs().max().item())


@pytest.mark.parametrize("scaling", ["delayed", "dynamic", "weight_only"])
def test_maxima_near_zero_give_a_finite_output(scaling):
    layer = _dense(scaling=scaling)
    tiny = torch.full((2, 8), 1e-37)
    if scaling == "weight_only":
        with torch.no_grad():
            layer.kernel[:, 0] = 1e-44  # one output channel near zero
    layer(tiny).sum().backward()
    layer(torch.randn(2, 8)).sum().backward()
    assert layer.inputs_scale.item() > 0
    layer.eval()
    with torch.no_grad():
        assert torch.isfinite(layer(torch.arange(8.0)[None])).all()
        assert torch.isfinite(layer(tiny)).all()


@pytest.mark.parametrize("scaling", ["delayed", "dynamic"])
def test_a_model_may_add_into_a_float8_product_in_place(scaling):
    """Falcon does `mlp_output += attention_output` on a bias-free product:
    the output gradient's quantize-dequantize handed back a view, which
    autograd refuses to modify in place."""
    import copy

    from dtype_policies import apply_policy

    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 16, bias=False)
    apply_policy(linear, QuantizedFloat8DTypePolicy("float8", "float32", scaling=scaling))
    twin = copy.deepcopy(linear)
    x = torch.randn(4, 16)
    first, second = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = linear(first)
    out += 1.0
    (out * out).sum().backward()
    (twin(second) + 1.0).pow(2).sum().backward()
    assert torch.equal(first.grad, second.grad)  # as without the in-place add


def test_an_undo_record_of_a_dead_tensor_is_not_taken_for_a_new_one_s():
    """The records of a step's scales are keyed by id: a model dropped after a
    backward left its records, a new model's buffer reusing an id found one,
    and a skipped step kept the update. The records also piled up."""
    import gc
    import weakref

    from dtype_policies.quantization.schemes import float8

    for _ in range(20):  # backward passes without an optimizer step, then dropped
        dropped = _dense("float32")
        dropped(torch.randn(4, 8)).float().sum().backward()
        del dropped
    gc.collect()
    alive = _dense("float32")
    alive(torch.randn(4, 8)).float().sum().backward()  # the next commit drops them
    assert not [key for key, (ref, *_) in float8._undo.items() if ref() is None]
    layer = _dense("float32")
    optimizer = LossScaleOptimizer(torch.optim.SGD(layer.parameters(), lr=1e-3))
    before = _state(layer)
    dead = torch.zeros(1)
    stale = (weakref.ref(dead), dead.clone(), weakref.ref(layer), None, ())
    del dead  # a dead tensor's record under each buffer's id
    for name in ("inputs_amax_history", "kernel_amax_history"):
        float8._undo[id(getattr(layer, name))] = stale
    _assert_a_nan_step_is_skipped_and_undone(layer, optimizer, before)


@pytest.mark.parametrize("hook", ["step", "skipped step"])
def test_records_dropped_by_a_collection_while_a_step_walks_them(monkeypatch, hook):
    """A dead buffer's weakref callback may run inside any allocation, in any
    thread, within the step hook's walk over the records too: it popped the
    record without the lock, and the walk met a key already gone (KeyError,
    seen in an evaluation thread next to training) or a dict that changed
    size. The callback now only notes the record; holders of the lock drop it."""
    from dtype_policies.quantization.schemes import float8

    layer = _dense("float32")
    layer(torch.randn(4, 8)).float().sum().backward()
    assert float8._undo  # the step's records
    optimizer = torch.optim.SGD(layer.parameters(), lr=1e-3)
    steps_for = float8._steps_for

    def collected_meanwhile(record, *args, **kwargs):
        for key, (ref, *_) in list(float8._undo.items()):
            float8._forget_dead(key, ref)  # as if every buffer had died
        return steps_for(record, *args, **kwargs)

    monkeypatch.setattr(float8, "_steps_for", collected_meanwhile)
    if hook == "step":
        optimizer.step()
    else:
        float8._undo_since_last_step(optimizer)
    monkeypatch.setattr(float8, "_steps_for", steps_for)
    float8._undo_since_last_step(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]))
    assert not float8._undo and not float8._dead


def _frozen_float8_model(seed):
    """A trainable Linear before a frozen float8 Linear (a base under a head)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    from dtype_policies import quantize
    from dtype_policies.quantization import Float8QuantizationConfig

    quantize(model[1], "float8", Float8QuantizationConfig(scaling="delayed"))
    for p in model[1].parameters():
        p.requires_grad_(False)
    model.train()
    return model, LossScaleOptimizer(torch.optim.SGD(model[0].parameters(), lr=1e-3))


def _float8_state(module):
    return {
        name: buffer.clone()
        for name, buffer in module.named_buffers()
        if "amax" in name or "scale" in name
    }


@pytest.mark.parametrize("other_step", ["skipped", "applied"])
def test_another_models_step_leaves_a_frozen_float8_layers_records_alone(other_step):
    """A frozen float8 layer was taken as every optimizer's: another model's
    skipped step rolled its state back, another model's applied step made its
    records final (its own skip then undid nothing)."""
    model, optimizer = _frozen_float8_model(0)
    other, other_optimizer = _frozen_float8_model(1)
    x = torch.randn(4, 8)
    before = _float8_state(model[1])
    optimizer.scale_loss(model(x).square().mean()).backward()  # records model[1]'s step
    recorded = _float8_state(model[1])
    assert any(not torch.equal(before[k], recorded[k]) for k in before)
    factor = math.inf if other_step == "skipped" else 1.0
    other_optimizer.scale_loss(other(x).square().mean() * factor).backward()
    other_optimizer.step()
    assert other_optimizer.last_step_skipped == (other_step == "skipped")
    kept = _float8_state(model[1])
    assert all(torch.equal(recorded[k], kept[k]) for k in recorded)  # not rolled back
    model[0].weight.grad.fill_(math.inf)  # this model's own step overflows
    optimizer.step()
    assert optimizer.last_step_skipped
    undone = _float8_state(model[1])
    assert all(torch.equal(before[k], undone[k]) for k in before)  # its own skip undoes it


def test_a_backward_pass_that_raised_does_not_freeze_delayed_scaling():
    """torch drops the callbacks queued in a pass that raises, the step's
    commit among them: the module's step stayed pending and no later pass
    scheduled one (the scales never moved again)."""
    from dtype_policies.quantization.schemes import float8

    layer = _dense("float32")
    layer.train()

    def backward(fail):
        x = torch.randn(4, 8, requires_grad=True)
        if fail:
            x.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("a failing hook")))
        layer(x).float().square().mean().backward()

    with pytest.raises(RuntimeError, match="a failing hook"):
        backward(fail=True)
    for _ in range(3):
        history = layer.inputs_amax_history.clone()
        backward(fail=False)
        assert not torch.equal(history, layer.inputs_amax_history)  # committed
    assert not float8._pending


def test_a_failed_scaled_backward_leaves_no_owner_for_later_plain_passes():
    from dtype_policies._core.listeners import backward_owner

    model, optimizer = _frozen_float8_model(0)
    x = torch.randn(4, 8, requires_grad=True)
    x.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("a failing hook")))
    with pytest.raises(RuntimeError, match="a failing hook"):
        optimizer.scale_loss(model(x).square().mean()).backward()
    seen = []
    y = torch.randn(4, 8, requires_grad=True)
    y.register_hook(lambda grad: seen.append(backward_owner()))
    model(y).square().mean().backward()  # a plain pass: no loss scaler's
    assert seen == [None]


def test_a_loss_scalers_skip_leaves_a_frozen_layer_a_plain_optimizer_trains_around():
    """Records made outside any loss scaler were claimed by every optimizer:
    another model's skipped step rolled back a frozen float8 base trained
    (through its adapter) by a plain optimizer."""
    model, _ = _frozen_float8_model(0)
    plain = torch.optim.AdamW(model[0].parameters(), lr=1e-3)
    other, other_optimizer = _frozen_float8_model(1)
    x = torch.randn(4, 8)
    model(x).square().mean().backward()  # a plain pass
    recorded = _float8_state(model[1])
    other_optimizer.scale_loss(other(x).square().mean() * math.inf).backward()
    other_optimizer.step()
    assert other_optimizer.last_step_skipped
    kept = _float8_state(model[1])
    assert all(torch.equal(recorded[k], kept[k]) for k in recorded)
    plain.step()


def test_a_float8_layer_in_reentrant_checkpoints_trains_as_without_them():
    """Two reentrant segments and a plain call of one float8 layer: the
    nested pass of a segment committed the outer pass's step in the middle
    of it (scales changed under the second replay, the history rolled twice)."""
    import copy

    import torch.utils.checkpoint as checkpoint

    torch.manual_seed(0)
    layer = _dense("float32", width=8, units=8)
    layer.train()
    layer(torch.randn(4, 8) * 5).float().square().sum().backward()  # histories filled
    layer.zero_grad()

    def run(model, checkpointed, x):
        def segment(t):
            return checkpoint.checkpoint(model, t, use_reentrant=True) if checkpointed else model(t)

        model(segment(segment(x) * 3) * 3).float().square().sum().backward()

    plain, checkpointed = copy.deepcopy(layer), copy.deepcopy(layer)
    x = torch.randn(4, 8)
    run(plain, False, x.clone().requires_grad_())
    run(checkpointed, True, x.clone().requires_grad_())
    assert torch.equal(plain.kernel.grad, checkpointed.kernel.grad)
    assert torch.equal(
        _state(plain)["inputs_amax_history"], _state(checkpointed)["inputs_amax_history"]
    )


def test_a_pass_that_raised_in_another_thread_does_not_freeze_this_one():
    import threading

    layer = _dense("float32")
    layer.train()

    def failing():
        x = torch.randn(4, 8, requires_grad=True)
        x.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("a failing hook")))
        with pytest.raises(RuntimeError, match="a failing hook"):
            layer(x).float().square().sum().backward()

    worker = threading.Thread(target=failing)
    worker.start()
    worker.join()
    for _ in range(2):
        history = layer.inputs_amax_history.clone()
        layer(torch.randn(4, 8)).float().square().sum().backward()
        assert not torch.equal(history, layer.inputs_amax_history)
