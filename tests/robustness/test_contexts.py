"""Contract: everything works under `torch.inference_mode()` and `torch.no_grad()`:
float policies, int8, int4 and float8 layers called inside it, `quantize()` called
inside it, and models created inside it then used under `no_grad` or grad mode."""

import pytest
import torch
import torch.nn as nn

from dtype_policies import apply_policy, layers, quantize

from .helpers import (
    CONTEXTS,
    EMBEDDING_KINDS,
    FLOAT_POLICIES,
    INTEGER_MODES,
    LINEAR_KINDS,
    QUANT_MODES,
    QUANTIZE_ARGS,
    TOLERANCE,
    VOCAB,
    compute_dtype_of,
    make_embedding,
    make_linear,
    quantize_with,
    relative_error,
)

FLOAT_TOLERANCE = {"float32": 1e-5, "mixed_bfloat16": 0.02, "bfloat16": 0.02}


def _inputs(rows=5):
    torch.manual_seed(123)
    return torch.randn(rows, 256)


@pytest.mark.parametrize("kind", LINEAR_KINDS)
@pytest.mark.parametrize("policy", FLOAT_POLICIES)
@pytest.mark.parametrize("context", CONTEXTS)
def test_float_policy_linear_called_inside(context, policy, kind):
    model, _, reference = make_linear(kind, policy)
    x = _inputs()
    with CONTEXTS[context]():
        first = model(x)
        second = model(x)  # a second call reads whatever the first one kept
    assert first.dtype == compute_dtype_of(policy)
    assert torch.equal(first, second)
    assert relative_error(first, reference(x)) < FLOAT_TOLERANCE[policy]


@pytest.mark.parametrize("kind", EMBEDDING_KINDS)
@pytest.mark.parametrize("policy", FLOAT_POLICIES)
@pytest.mark.parametrize("context", CONTEXTS)
def test_float_policy_embedding_called_inside(context, policy, kind):
    model, _, reference = make_embedding(kind, policy)
    ids = torch.tensor([[0, 3, VOCAB - 1], [7, 7, 1]])
    with CONTEXTS[context]():
        first = model(ids)
        second = model(ids)
    assert first.dtype == compute_dtype_of(policy)
    assert torch.equal(first, second)
    assert relative_error(first, reference(ids)) < FLOAT_TOLERANCE[policy]


@pytest.mark.parametrize("kind", LINEAR_KINDS)
@pytest.mark.parametrize("mode", QUANT_MODES)
@pytest.mark.parametrize("context", CONTEXTS)
def test_quantized_linear_called_inside(context, mode, kind):
    model, _, reference = make_linear(kind, "mixed_bfloat16")
    quantize_with(model, mode)
    model.eval()
    x = _inputs()
    with CONTEXTS[context]():
        first = model(x)
        second = model(x)
    assert first.dtype == torch.bfloat16
    assert torch.isfinite(first).all()
    assert torch.equal(first, second)
    assert relative_error(first, reference(x)) < TOLERANCE[mode]


@pytest.mark.parametrize("kind", LINEAR_KINDS)
@pytest.mark.parametrize("mode", QUANT_MODES)
@pytest.mark.parametrize("context", CONTEXTS)
def test_quantize_called_inside(context, mode, kind):
    """`quantize()` inside the context, calls inside it and then outside it."""
    model, _, reference = make_linear(kind, "mixed_bfloat16")
    model.eval()
    x = _inputs()
    with CONTEXTS[context]():
        report = quantize_with(model, mode)
        inside = model(x)
    assert report.num_quantized == 1, report.render()
    assert relative_error(inside, reference(x)) < TOLERANCE[mode]
    with torch.no_grad():
        after_no_grad = model(x)
    after_grad = model(x)  # grad mode, eval
    assert torch.equal(after_no_grad, inside)
    assert torch.equal(after_grad.detach(), inside)


@pytest.mark.parametrize("kind", EMBEDDING_KINDS)
@pytest.mark.parametrize("mode", INTEGER_MODES[:1] + INTEGER_MODES[2:])
@pytest.mark.parametrize("context", CONTEXTS)
def test_quantized_embedding_inside(context, mode, kind):
    model, _, reference = make_embedding(kind, "mixed_bfloat16")
    ids = torch.tensor([[0, 3, VOCAB - 1], [7, 7, 1]])
    with CONTEXTS[context]():
        report = quantize_with(model, mode)
        inside = model(ids)
    assert report.num_quantized == 1, report.render()
    assert inside.dtype == torch.bfloat16
    assert relative_error(inside, reference(ids)) < TOLERANCE[mode]
    with torch.no_grad():
        assert torch.equal(model(ids), inside)


def _mlp():
    # No LayerNorm: torch's layer_norm saves its (inference-tensor) weight for
    # backward, so a plain LayerNorm made under inference_mode already fails in
    # grad mode without any policy; this suite checks what the library adds.
    return nn.Sequential(nn.Linear(256, 64), nn.GELU(), nn.Linear(64, 16))


@pytest.mark.parametrize("then", ["no_grad", "grad"])
@pytest.mark.parametrize(
    "setup", ["mixed_bfloat16", "bfloat16", "int8", "int8_wo", "int4_128", "int4_pc", "float8"]
)
@pytest.mark.parametrize("policy_inside", [True, False], ids=["policy-inside", "policy-after"])
def test_model_created_in_inference_mode_then_used(setup, then, policy_inside):
    """A model built (and maybe policied/quantized) under inference_mode, then
    used under no_grad or in grad mode (eval)."""
    x = _inputs(4)
    torch.manual_seed(0)
    with torch.inference_mode():
        model = _mlp().eval()
        reference = model(x).clone()  # plain float32, inside inference_mode

    def prepare():
        apply_policy(model, "mixed_bfloat16" if setup not in ("bfloat16",) else setup)
        if setup not in ("mixed_bfloat16", "bfloat16"):
            quantize_with(model, setup)

    if policy_inside:
        with torch.inference_mode():
            prepare()
    else:
        prepare()
    tolerance = TOLERANCE.get(setup, 0.03)
    with CONTEXTS[then]():
        out = model(x)
        again = model(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, again)
    assert relative_error(out, reference) < tolerance


@pytest.mark.parametrize("dtype", ["int8_from_mixed_bfloat16", "int4/128_from_mixed_bfloat16"])
def test_quantized_layer_built_on_first_call_inside_inference_mode(dtype):
    """A quantized `layers.Dense` built (so quantized) by its first call under
    inference_mode, then called under no_grad and in grad mode."""
    torch.manual_seed(0)
    x = _inputs(3)
    layer = layers.Dense(32, dtype=dtype)
    with torch.inference_mode():
        inside = layer(x)
    assert inside.shape == (3, 32) and torch.isfinite(inside).all()
    with torch.no_grad():
        assert torch.equal(layer(x), inside)
    assert torch.equal(layer(x).detach(), inside)


def test_int8_with_compiled_epilogues(compiled_epilogues):
    """The default (compiled) int8 epilogues in each context, with both CPU
    kernels (fewer and more than 16 rows). One test: compiling is slow."""
    model, _, reference = make_linear("linear", "mixed_bfloat16")
    quantize(model, "int8")
    for context in ("no_grad", "grad", "inference_mode"):
        for rows in (3, 20):
            x = _inputs(rows)
            with CONTEXTS[context]():
                out = model(x)
            assert torch.isfinite(out).all(), (context, rows)
            assert relative_error(out, reference(x)) < TOLERANCE["int8"], (context, rows)


def torch_linear():
    return nn.Sequential(nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 32))


def keras_dense():
    model = layers.Sequential([layers.Dense(48, activation="gelu"), layers.Dense(32)])
    model(torch.zeros(1, 64))
    return model


def keras_einsum():
    model = layers.Sequential(
        [layers.EinsumDense("ab,bc->ac", output_shape=48, bias_axes="c"), layers.Dense(32)]
    )
    model(torch.zeros(1, 64))
    return model


BUILDERS = {"nn.Linear": torch_linear, "Dense": keras_dense, "EinsumDense": keras_einsum}


@pytest.mark.usefixtures("quiet")
@pytest.mark.parametrize("mode", list(QUANTIZE_ARGS))
@pytest.mark.parametrize("context", list(CONTEXTS))
@pytest.mark.parametrize("kind", list(BUILDERS))
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_every_mode_runs_in_every_context(mode, context, kind, rows):
    torch.manual_seed(0)
    model = BUILDERS[kind]()
    x = torch.randn(rows, 64)
    with torch.no_grad():
        reference = model(x)
    apply_policy(model, "mixed_bfloat16")
    quantize(model, *QUANTIZE_ARGS[mode])
    with CONTEXTS[context]():
        out = model(x)
        empty = model(x[:0])
    assert out.dtype == torch.bfloat16 and out.shape == reference.shape
    assert relative_error(out, reference) < (0.25 if mode.startswith("int4") else 0.1)
    assert empty.shape == (0, 32)


@pytest.mark.usefixtures("quiet")
@pytest.mark.parametrize("mode", list(QUANTIZE_ARGS))
def test_quantize_inside_inference_mode_then_use_elsewhere(mode):
    torch.manual_seed(0)
    model = torch_linear()
    x = torch.randn(20, 64)
    with torch.inference_mode():
        apply_policy(model, "mixed_bfloat16")
        quantize(model, *QUANTIZE_ARGS[mode])
        inside = model(x)
    with torch.no_grad():
        outside = model(x)
    assert torch.equal(inside, outside)
    out = model(x.requires_grad_())
    out.float().sum().backward()  # buffers made in inference mode never block autograd
    assert x.grad is not None


@pytest.mark.usefixtures("quiet")
def test_models_built_in_inference_mode_work_under_no_grad_and_quantize():
    with torch.inference_mode():
        model = torch_linear()
        dense = layers.Dense(8, dtype="mixed_bfloat16")
        dense(torch.randn(2, 4))
    apply_policy(model, "mixed_bfloat16")
    with torch.no_grad():
        assert model(torch.randn(2, 64)).dtype == torch.bfloat16
        assert dense(torch.randn(2, 4)).dtype == torch.bfloat16
    quantize(model, "int8")
    with torch.no_grad():
        assert model(torch.randn(20, 64)).dtype == torch.bfloat16
