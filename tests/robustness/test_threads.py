"""Contract (threads): casts that carry an autograd graph are never kept
beyond the call that made it (so never shared between threads); a thread
evaluating under no_grad while another trains never changes the trainer's
gradients (`.grad` is set and equals a single-threaded run's)."""

import threading
import time

import pytest
import torch
import torch.nn as nn

from dtype_policies import apply_policy, layers, quantize
from dtype_policies.quantizers import Int4QuantizationConfig

from .helpers import quantize_with

STEPS = 8


def _model(kind):
    torch.manual_seed(0)
    if kind == "einsum_large":  # a kernel above the small-weight limit: read via the scope
        model = layers.EinsumDense(
            "ab,bc->ac", output_shape=600, bias_axes="c", dtype="mixed_bfloat16"
        )
        model.build((None, 128))
        return model, (8, 128)
    if kind == "conv_large":
        model = nn.Sequential(nn.Conv1d(128, 600, 1))
        apply_policy(model, "mixed_bfloat16")
        return model, (8, 128, 2)
    if kind == "mlp_small":
        model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 8))
        apply_policy(model, "mixed_bfloat16")
        return model, (8, 128)
    if kind == "mlp_small_weight_cache":
        model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 8))
        apply_policy(model, "mixed_bfloat16", weight_cache=True)
        return model, (8, 128)
    model = layers.Sequential(
        [layers.Dense(64, activation="relu"), layers.Dense(8)], dtype="mixed_bfloat16"
    )
    model(torch.zeros(1, 128))
    return model, (8, 128)


def _train(model, shape):
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(shape, generator=generator) for _ in range(STEPS)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    grads = []
    for x in batches:
        optimizer.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        grads.append(
            {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        )
        optimizer.step()
    return grads


@pytest.mark.parametrize(
    "kind", ["einsum_large", "conv_large", "mlp_small", "mlp_small_weight_cache", "dense_small"]
)
@pytest.mark.parametrize("evaluation", ["no_grad", "inference_mode"])
def test_eval_thread_does_not_change_training_gradients(kind, evaluation):
    reference = _train(*_model(kind))
    model, shape = _model(kind)
    stop = threading.Event()
    errors = []
    context = torch.no_grad if evaluation == "no_grad" else torch.inference_mode

    def evaluate():
        x = torch.randn(shape)
        try:
            while not stop.is_set():
                with context():
                    model(x)
        except Exception as error:  # reported below
            errors.append(error)

    thread = threading.Thread(target=evaluate)
    thread.start()
    try:
        grads = _train(model, shape)
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    for step, (got, want) in enumerate(zip(grads, reference)):
        for name, value in want.items():
            assert got[name] is not None, f"step {step}: {name}.grad is None"
            assert torch.equal(got[name], value), f"step {step}: {name}.grad differs"


@pytest.mark.parametrize("setup", ["mixed_bfloat16", "int8", "int8_wo", "int4_128", "float8"])
def test_concurrent_evaluation_threads_agree(setup):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 16))
    apply_policy(model, "mixed_bfloat16")
    if setup != "mixed_bfloat16":
        quantize_with(model, setup)
    model.eval()
    inputs = [torch.randn(rows, 256) for rows in (1, 5, 20, 3)]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
    results, errors = {}, []

    def worker(index, context):
        try:
            for repeat in range(15):
                for i, x in enumerate(inputs):
                    with context():
                        out = model(x)
                    if not torch.equal(out, expected[i]):
                        results[(index, repeat, i)] = out
        except Exception as error:
            errors.append(error)

    threads = [
        threading.Thread(target=worker, args=(0, torch.no_grad)),
        threading.Thread(target=worker, args=(1, torch.inference_mode)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert not results, sorted(results)[:5]


@pytest.mark.usefixtures("quiet")
def test_training_thread_keeps_its_gradients_while_another_evaluates():
    def train(parallel):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        apply_policy(model, "mixed_bfloat16")
        x = torch.randn(8, 16)
        stop = threading.Event()

        def evaluate():
            while not stop.is_set():
                with torch.no_grad():
                    model(x)

        worker = threading.Thread(target=evaluate)
        if parallel:
            worker.start()
        grads = []
        try:
            for _ in range(25):
                model.zero_grad()
                model(x).float().sum().backward()
                grads.append([p.grad.clone() for p in model.parameters()])
        finally:
            stop.set()
            if parallel:
                worker.join()
        return grads

    together, alone = train(True), train(False)
    assert all(torch.equal(a, b) for ga, gb in zip(together, alone) for a, b in zip(ga, gb))


def _int4_models():
    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
        quantize(model, "int4")
        return model

    return build(0), build(1).state_dict()


def test_a_write_while_the_packed_int4_weight_is_rebuilt_is_seen_by_the_next_call(monkeypatch):
    """Another thread's write lands after a call read the integer values
    and before it filed the packed weight: the packed weight must be filed
    under the key taken before the read, so that the next call rebuilds it
    (filed under the new key, it served the old values for good)."""
    from dtype_policies.quantization.schemes.int4 import Int4Scheme

    model, other = _int4_models()
    own = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(x)
        model.load_state_dict(other)  # the next call rebuilds
    read = Int4Scheme.integer_values
    armed = [True]

    def integer_values(self, module, qw):
        values = read(self, module, qw)
        if armed[0]:
            armed[0] = False
            model.load_state_dict(own)  # "the other thread" writes now
        return values

    monkeypatch.setattr(Int4Scheme, "integer_values", integer_values)
    with torch.no_grad():
        model(x)  # overlapped the write: any result
    monkeypatch.setattr(Int4Scheme, "integer_values", read)
    with torch.no_grad():
        assert torch.equal(model(x), expected)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_clearing_the_caches_during_a_call_leaves_the_call_consistent(mode, monkeypatch):
    """`clear_cast_caches` (from another thread) replaces a quantized weight's
    runtime: a call in progress keeps the runtime it started with (it read
    the new, empty one half-way and failed)."""
    from dtype_policies import clear_cast_caches
    from dtype_policies.quantization.kernels import int4 as int4_kernels
    from dtype_policies.quantization.kernels import int8 as int8_kernels

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    quantize(model, mode)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    if mode == "int4":  # between the plan's refresh and the kernel's call
        owner, name = int4_kernels, "int4_path"
    else:  # between the runtime's refresh and its use
        owner, name = int8_kernels.Int8Runtime, "refresh"
    original = getattr(owner, name)

    def cleared_meanwhile(*args, **kwargs):
        result = original(*args, **kwargs)
        clear_cast_caches(model)
        return result

    monkeypatch.setattr(owner, name, cleared_meanwhile)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    monkeypatch.setattr(owner, name, original)
    with torch.no_grad():
        assert torch.equal(model(x), expected)


@pytest.mark.parametrize("second", ["int8", "int4"])
def test_a_second_quantize_of_a_model_being_quantized_is_refused_clearly(second):
    """Two threads quantizing one model: each planned from the float weights
    the other replaced, and the later one failed with a bare
    `KeyError: 'weight'`. The second call is refused by name, the first
    quantizes the whole model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    inside, tried = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def waiting_filter(path, module):
        inside.set()
        tried.wait(10)
        return True

    def first():
        outcome["first"] = quantize(model, "int8", filters=waiting_filter)

    thread = threading.Thread(target=first)
    thread.start()
    assert inside.wait(10)
    try:
        with pytest.raises(RuntimeError, match=r"being quantized by another quantize\(\) call"):
            quantize(model[2], second)
    finally:
        tried.set()
        thread.join(10)
    assert all(m.weight_int8.dtype == torch.int8 for m in (model[0], model[2]))
    assert "weight" not in model[0]._parameters and "weight" not in model[2]._parameters


def test_a_policy_set_while_another_thread_quantizes_the_layer_changes_nothing(monkeypatch):
    """`layer.dtype_policy = "int8_from_float32"` planned, then another
    thread quantized the layer to int4 before the commit: the commit's
    re-check refused, but the setter had already set the int8 policy over
    the int4 tensors (a checkpoint of it then failed to load)."""
    from dtype_policies.layers import _quantizable
    from dtype_policies.quantization import attach

    torch.manual_seed(0)
    dense = layers.Dense(8)
    dense.build((None, 16))
    planned, elsewhere = attach.plan, []

    def plan_then_quantized_elsewhere(*args, **kwargs):
        made = planned(*args, **kwargs)
        if not elsewhere:  # (the other thread's quantize plans through here too)
            elsewhere.append(threading.Thread(target=lambda: dense.quantize("int4")))
            elsewhere[0].start()
            elsewhere[0].join()
        return made

    monkeypatch.setattr(_quantizable.attach, "plan", plan_then_quantized_elsewhere)
    with pytest.raises(ValueError, match="already quantized"):
        dense.dtype_policy = "int8_from_float32"
    assert dense.dtype_policy.name.startswith("int4") and "float32" in dense.dtype_policy.name
    assert dense.quantization_config.mode == "int4"


def test_a_save_while_another_thread_quantizes_writes_one_consistent_model(tmp_path, monkeypatch):
    """The manifest was described before another thread's quantize()
    committed and the tensors collected after: save() succeeded and wrote a
    file load() refused, over the earlier good one."""
    from dtype_policies import saving
    from dtype_policies.saving import checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    described, described_with = threading.Event(), checkpoint.describe

    def slow_describe(*args, **kwargs):
        manifest = described_with(*args, **kwargs)
        described.set()
        threading.Event().wait(0.3)  # the other thread's quantize() comes to commit here
        return manifest

    monkeypatch.setattr(checkpoint, "describe", slow_describe)
    saved: dict[str, object] = {}
    saver = threading.Thread(target=lambda: saved.update(path=saving.save(model, tmp_path)))
    saver.start()
    assert described.wait(10)
    quantize(model, "int8")
    saver.join(10)
    fresh = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    saving.load(fresh, saved["path"])  # the float model, whole
    assert not hasattr(fresh[0], "weight_int8") and fresh[0].weight.dtype == torch.float32


def test_compiling_a_quantized_model_while_another_thread_imports():
    """A traced quantized product read whether weights are frozen by looking
    Inductor's config up in `sys.modules`; Dynamo traced that lookup by
    walking the dictionary, and another thread's import (any `sys.modules`
    change) failed the compile: "dictionary changed size during iteration"."""
    import sys
    import types

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32))
    quantize(model, config=Int4QuantizationConfig(block_size=32, activation_block_size=32))
    compiled = torch.compile(model, backend="inductor", dynamic=False)
    x = torch.randn(3, 64)
    torch.compile(torch.neg, backend="eager")(x)  # Dynamo's imports, before the window
    stop = threading.Event()

    def importing() -> None:
        names = [f"_dtype_policies_test_module_{i}" for i in range(50)]
        end = time.monotonic() + 3  # the tracing of the first products, not all the compile
        while not stop.is_set() and time.monotonic() < end:
            for name in names:
                sys.modules[name] = types.ModuleType(name)
            for name in names:
                sys.modules.pop(name, None)

    thread = threading.Thread(target=importing)
    thread.start()
    try:
        with torch.no_grad():
            out = compiled(x)
    finally:
        stop.set()
        thread.join()
    with torch.no_grad():
        eager = model(x)
    # W4A8: a traced sum may flip an activation's int8 step (docs: export differences)
    assert torch.allclose(out, eager, rtol=0, atol=5e-3 * float(eager.abs().max()))


@pytest.mark.parametrize("scaling", ["delayed", "dynamic"])
def test_a_float8_call_racing_its_removal_says_so(scaling):
    """`remove()` in another thread takes float8's scales away module by
    module while a call may still run the float8 forward: that call raised a
    bare `KeyError: 'inputs_scale'`; it now raises the race's own error (the
    state a concurrent removal leaves, made here without threads)."""
    from dtype_policies.quantization import Float8QuantizationConfig

    linear = nn.Linear(16, 8)
    quantize(linear, config=Float8QuantizationConfig(scaling=scaling))
    del linear._buffers["inputs_scale"]
    with pytest.raises(RuntimeError, match="raced it"):
        linear(torch.randn(2, 16))
