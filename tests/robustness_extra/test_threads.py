"""Contract (threads): casts that carry an autograd graph are never kept
beyond the call that made it (so never shared between threads); a thread
evaluating under no_grad while another trains never changes the trainer's
gradients (`.grad` is set and equals a single-threaded run's)."""

import threading

import pytest
import torch
import torch.nn as nn
from robust_helpers import quantize_with

from dtype_policies import apply_policy, layers

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
