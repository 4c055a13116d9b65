"""Numerical edges: all-zero weights, one huge outlier, inf/nan input rows
(confined to their rows), empty batches in every mode, and the weight-only
int8 kernel on awkward shapes (in a subprocess: it can crash the interpreter)."""

import copy

import pytest
import torch
import torch.nn as nn

from dtype_policies import apply_policy, quantize
from dtype_policies.quantization import Int8QuantizationConfig
from tiny_models import tiny_decoder

from .helpers import (
    EMBEDDING_KINDS,
    IN_FEATURES,
    LINEAR_KINDS,
    OUT_FEATURES,
    QUANT_MODES,
    TOLERANCE,
    make_embedding,
    make_linear,
    quantize_with,
    relative_error,
)


def _weight_param(leaf, kind):
    return leaf.weight if kind == "linear" else leaf.kernel


# ---------------------------------------------------------------- zero weights


@pytest.mark.parametrize("kind", LINEAR_KINDS)
@pytest.mark.parametrize("mode", QUANT_MODES)
def test_all_zero_weights(mode, kind):
    model, leaf, _ = make_linear(kind, "mixed_bfloat16")
    with torch.no_grad():
        _weight_param(leaf, kind).zero_()
    bias = leaf.bias.detach().clone()
    quantize_with(model, mode)
    for name, buffer in leaf.named_buffers():
        assert torch.isfinite(buffer.float()).all(), name
    x = torch.randn(5, IN_FEATURES)
    with torch.no_grad():
        out = model(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(
        out.float(), bias.expand(5, -1).bfloat16().float(), rtol=0.01, atol=0.01
    )
    zeros = torch.zeros(3, IN_FEATURES)  # zero inputs too (a zero activation scale)
    with torch.no_grad():
        out = model(zeros)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kind", EMBEDDING_KINDS)
@pytest.mark.parametrize("mode", ["int8", "int4_128", "int4_pc"])
def test_all_zero_embedding_table(mode, kind):
    model, leaf, _ = make_embedding(kind, "mixed_bfloat16")
    with torch.no_grad():
        (leaf.weight if kind == "nn_embedding" else leaf.embeddings).zero_()
    quantize_with(model, mode)
    out = model(torch.tensor([[0, 5, 9]]))
    assert torch.isfinite(out).all() and out.abs().max() == 0


# ---------------------------------------------------------------- an outlier


@pytest.mark.parametrize("kind", LINEAR_KINDS)
@pytest.mark.parametrize("mode", QUANT_MODES)
def test_one_huge_outlier_stays_in_its_channel(mode, kind):
    model, leaf, _reference = make_linear(kind, "float32")
    channel = 3
    with torch.no_grad():
        weight = _weight_param(leaf, kind)
        if kind == "linear":
            weight[channel, 7] = 1e4
        else:
            weight[7, channel] = 1e4
    _, _, fresh_reference = _reference_after_edit(leaf, kind)
    quantize_with(model, mode)
    model.eval()
    x = torch.randn(6, IN_FEATURES)
    with torch.no_grad():
        out = model(x)
    assert torch.isfinite(out).all()
    want = fresh_reference(x)
    others = [c for c in range(OUT_FEATURES) if c != channel]
    assert relative_error(out[:, others], want[:, others]) < TOLERANCE[mode]
    if mode != "float8":  # per-channel scales keep the outlier's own channel usable
        assert relative_error(out[:, channel], want[:, channel]) < 0.05


def _reference_after_edit(leaf, kind):
    weight = (leaf.weight if kind == "linear" else leaf.kernel.t()).detach().float().clone()
    bias = leaf.bias.detach().float().clone()
    return weight, bias, lambda x: torch.nn.functional.linear(x, weight, bias)


# ---------------------------------------------------------------- inf / nan rows


@pytest.mark.parametrize("rows", [6, 20])
@pytest.mark.parametrize("kind", LINEAR_KINDS)
@pytest.mark.parametrize("mode", ["int8", "int8_wo", "int4_128", "int4_pc", "float8"])
def test_non_finite_input_rows_stay_in_their_rows(mode, kind, rows):
    model, _leaf, reference = make_linear(kind, "mixed_bfloat16")
    quantize_with(model, mode)
    model.eval()
    torch.manual_seed(4)
    x = torch.randn(rows, IN_FEATURES)
    x[1, 5] = float("inf")
    x[3, 0] = float("nan")
    x[4, 9] = -float("inf")
    with torch.no_grad():
        out = model(x)
    clean = [r for r in range(rows) if r not in (1, 3, 4)]
    assert torch.isfinite(out[clean]).all(), "a non-finite input row leaked into other rows"
    assert relative_error(out[clean], reference(x[clean])) < TOLERANCE[mode]


@pytest.mark.parametrize("kind", LINEAR_KINDS)
def test_float8_training_step_with_an_inf_row_keeps_scales_finite(kind):
    """A float8 training step on a batch holding inf: the delayed-scaling state
    stays finite (no scale of inf or 0 poisoning every later step)."""
    model, leaf, reference = make_linear(kind, "mixed_bfloat16")
    quantize_with(model, "float8")
    model.train()
    for step in range(3):
        x = torch.randn(6, IN_FEATURES)
        if step == 0:
            x[2, 3] = float("inf")
        model(x).float().nan_to_num(0.0, 0.0, 0.0).sum().backward()
    for name in ("inputs_scale", "kernel_scale", "outputs_grad_scale"):
        value = dict(leaf.named_buffers())[name]
        assert torch.isfinite(value).all() and (value > 0).all(), (name, value)
    model.eval()
    x = torch.randn(6, IN_FEATURES)
    with torch.no_grad():
        out = model(x)
    assert torch.isfinite(out).all()
    assert relative_error(out, reference(x)) < TOLERANCE["float8"]


# ---------------------------------------------------------------- empty batches


EMPTY_SHAPES = [(0, IN_FEATURES), (2, 0, IN_FEATURES)]


@pytest.mark.parametrize("shape", EMPTY_SHAPES)
@pytest.mark.parametrize("kind", LINEAR_KINDS)
@pytest.mark.parametrize("mode", ["mixed_bfloat16", *QUANT_MODES])
def test_empty_batches_forward(mode, kind, shape):
    model, _leaf, _ = make_linear(kind, "mixed_bfloat16")
    if mode != "mixed_bfloat16":
        quantize_with(model, mode)
    for training in (False, True):
        model.train(training)
        with torch.no_grad():
            out = model(torch.randn(shape))
        assert out.shape == (*shape[:-1], OUT_FEATURES)
        out = model(torch.randn(shape))  # grad mode
        assert out.shape == (*shape[:-1], OUT_FEATURES)


@pytest.mark.parametrize("shape", EMPTY_SHAPES)
@pytest.mark.parametrize("kind", LINEAR_KINDS)
@pytest.mark.parametrize("mode", ["mixed_bfloat16", *QUANT_MODES])
def test_empty_batches_backward(mode, kind, shape):
    model, leaf, _ = make_linear(kind, "mixed_bfloat16")
    if mode != "mixed_bfloat16":
        quantize_with(model, mode)
    model.train()
    x = torch.randn(shape, requires_grad=True)
    model(x).float().sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert leaf.bias.grad is not None and leaf.bias.grad.abs().max() == 0
    for name, buffer in leaf.named_buffers():  # float8 state untouched by nothing
        assert torch.isfinite(buffer.float()).all(), name


@pytest.mark.parametrize("kind", EMBEDDING_KINDS)
@pytest.mark.parametrize("mode", ["mixed_bfloat16", "int8", "int4_128", "int4_pc"])
def test_empty_id_batches(mode, kind):
    model, _, _ = make_embedding(kind, "mixed_bfloat16")
    if mode != "mixed_bfloat16":
        quantize_with(model, mode)
    for ids in (torch.zeros(0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long)):
        out = model(ids)
        assert out.shape == (*ids.shape, 256)


@pytest.mark.usefixtures("quiet")
@pytest.mark.parametrize("mode", ["int8", "int4", "float8"])
def test_numerical_edges(mode):
    linear = nn.Linear(64, 32)
    with torch.no_grad():
        linear.weight.zero_()
    zero = copy.deepcopy(linear)
    quantize(zero, mode)
    x = torch.randn(4, 64)
    out = zero(x)
    assert torch.isfinite(out).all() and torch.allclose(out, linear.bias.expand(4, 32), atol=1e-6)

    outlier = nn.Linear(64, 32)
    with torch.no_grad():
        outlier.weight[3, 5] = 1e4
    reference = outlier(x)
    quantize(outlier, mode)
    assert torch.isfinite(outlier(x)).all()
    if mode != "float8":  # delayed scaling starts at scale 1: an outlier saturates until calibrated
        assert ((outlier(x) - reference).norm() / reference.norm()) < 0.2

    if mode == "int8":  # a bad row stays in its row (per-row activation scales)
        bad = x.clone()
        bad[1, 7] = float("inf")
        bad[2, 0] = float("nan")
        result = outlier(bad)
        assert torch.isfinite(result[[0, 3]]).all()


@pytest.mark.usefixtures("quiet")
def test_small_weight_only_int8_shapes_never_crash():
    for in_features in (17, 33, 100, 64):
        for rows in (1, 2, 5, 16, 17):
            linear = nn.Linear(in_features, 24)
            apply_policy(linear, "mixed_bfloat16")
            quantize(linear, "int8", Int8QuantizationConfig(activation_quantizer=None))
            x = torch.randn(rows, in_features)
            out = linear(x)
            reference = nn.functional.linear(
                x.bfloat16().float(), linear.weight.float(), linear.bias
            )
            assert ((out.float() - reference).norm() / reference.norm()) < 0.02


class _MaskedScores(nn.Module):
    """Scores plus an additive mask, softmax in float32: a transformers
    eager attention's arithmetic."""

    def forward(self, scores, attention_mask=None):
        return torch.softmax((scores + attention_mask).float(), dim=-1)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_an_additive_mask_of_float32_minima_stays_finite_in_a_narrower_dtype(policy):
    """`finfo(float32).min` rounds to -inf in bfloat16 (float16 far before):
    a query whose every key is masked became NaN, and a static cache carried
    it into every later token (transformers' eager attention under
    compile_for_generation)."""
    module = _MaskedScores()
    apply_policy(module, policy)
    scores = torch.randn(2, 5)
    mask = torch.zeros(2, 5)
    mask[1] = torch.finfo(torch.float32).min  # a padding query: every key masked
    probabilities = module(scores, attention_mask=mask)
    assert torch.isfinite(probabilities).all()
    torch.testing.assert_close(probabilities.sum(-1), torch.ones(2))


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_an_additive_mask_passed_by_position_is_saturated_too(policy):
    """transformers' GPT-2 hands each block its mask by position: a float32
    mask (built float32 because a float32 embedding island made the hidden
    states float32) rounded to -inf, and the padded sequence became NaN."""
    module = _MaskedScores()
    apply_policy(module, policy)
    mask = torch.zeros(2, 5)
    mask[1] = torch.finfo(torch.float32).min
    probabilities = module(torch.randn(2, 5), mask)
    assert torch.isfinite(probabilities).all()
    torch.testing.assert_close(probabilities.sum(-1), torch.ones(2))


def test_gpt2_with_a_float32_embedding_island_keeps_a_left_padded_batch_finite():
    transformers = pytest.importorskip("transformers")
    from dtype_policies import DTypePolicyMap

    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=32, vocab_size=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    apply_policy(model, DTypePolicyMap("mixed_bfloat16", {"transformer/wte": "float32"}))
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        assert torch.isfinite(model(ids, attention_mask=mask).logits).all()


def test_left_padded_generation_with_a_static_cache_under_mixed_bfloat16():
    model = tiny_decoder(attn_implementation="eager")
    model.generation_config.pad_token_id = 0
    apply_policy(model, "mixed_bfloat16")
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    outputs = {}
    for cache in (None, "static"):
        with torch.no_grad():
            generated = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=4,
                do_sample=False,
                cache_implementation=cache,
                return_dict_in_generate=True,
                output_scores=True,
            )
        assert not any(score.isnan().any() for score in generated.scores), cache
        outputs[cache] = generated.sequences
    assert torch.equal(outputs[None], outputs["static"])


def test_the_mask_positions_are_kept_weakly_and_for_layers_by_call():
    """An accelerate hook's forward (a partial holding its module) was a key
    of a plain dict: the module never died; a Keras-style layer's positional
    mask was not found (its `forward` takes `*args`)."""
    import functools
    import gc
    import weakref

    from dtype_policies import layers
    from dtype_policies._core import casting

    module = _MaskedScores()
    apply_policy(module, "mixed_bfloat16")

    def hooked_forward(owner, *args, **kwargs):
        return type(owner).forward(owner, *args, **kwargs)

    module.forward = functools.partial(hooked_forward, module)
    alive = weakref.ref(module)
    mask = torch.zeros(2, 5)
    mask[1] = torch.finfo(torch.float32).min
    module(torch.randn(2, 5), mask)
    del module
    gc.collect()
    assert alive() is None

    class Scores(layers.Layer):
        def call(self, scores, attention_mask=None):
            return torch.softmax((scores + attention_mask).float(), dim=-1)

    layer = Scores(dtype="mixed_bfloat16")
    assert torch.isfinite(layer(torch.randn(2, 5), mask)).all()
    assert casting.additive_mask_positions(layer.call) == frozenset({1})
