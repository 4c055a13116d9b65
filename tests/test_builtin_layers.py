"""Built-in layers: Dense, EinsumDense, Embedding, LayerNormalization,
MultiHeadAttention, Dropout, Activation, Sequential."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import dtype_policies
from dtype_policies import CPUFloat16Warning, DTypePolicyMap, layers, saving
from dtype_policies.layers.einsum_dense import EinsumSpec


def test_dense_matches_reference_and_shapes():
    layer = layers.Dense(5, activation="relu")
    x = torch.randn(3, 4, 6)
    y = layer(x)
    assert tuple(y.shape) == (3, 4, 5)
    torch.testing.assert_close(y, torch.relu(x @ layer.kernel + layer.bias))
    no_bias = layers.Dense(5, use_bias=False)
    no_bias(x)
    assert no_bias.bias is None and list(no_bias.state_dict()) == ["kernel"]


@pytest.mark.parametrize(
    ("policy", "dtype"),
    [("float32", torch.float32), ("mixed_bfloat16", torch.bfloat16), ("int8_from_float32", None)],
)
def test_dense_takes_integer_inputs_as_keras_does(policy, dtype):
    """Integer inputs are not autocast; Keras's product promotes them to the
    kernel's dtype. The library raised torch's "mat1 and mat2 must have the
    same dtype"."""
    layer = layers.Dense(3, dtype=policy)
    ids = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
    out = layer(ids)
    assert out.dtype == (dtype or torch.float32)
    torch.testing.assert_close(out, layer(ids.float()))


def test_dense_mixed_bfloat16_close_to_float32():
    x = torch.randn(8, 16)
    reference = layers.Dense(4, dtype="float32")
    mixed = layers.Dense(4, dtype="mixed_bfloat16")
    reference(x)
    mixed(x)
    mixed.load_state_dict(reference.state_dict())
    torch.testing.assert_close(mixed(x).float(), reference(x), atol=0.05, rtol=0.02)


@pytest.mark.parametrize(
    ("equation", "output_shape", "bias_axes", "input_shape", "kernel", "bias", "out"),
    [
        ("ab,bc->ac", 64, "c", (2, 32), (32, 64), (64,), (2, 64)),
        ("abc,cd->abd", (None, 64), "d", (2, 5, 32), (32, 64), (64,), (2, 5, 64)),
        ("abc,cde->abde", (None, 4, 8), "de", (2, 5, 16), (16, 4, 8), (4, 8), (2, 5, 4, 8)),
        ("abcd,cde->abe", (None, 16), "e", (2, 5, 4, 8), (4, 8, 16), (16,), (2, 5, 16)),
        ("...b,bc->...c", 6, "c", (2, 3, 4, 8), (8, 6), (6,), (2, 3, 4, 6)),
        ("ab...,bc->ac...", (6,), "c", (2, 8, 3, 4), (8, 6), (6, 1, 1), (2, 6, 3, 4)),
        ("abc,cd->abd", (None, 64), None, (2, 5, 32), (32, 64), None, (2, 5, 64)),
        ("abc,cd->abd", (5, 64), "b", (2, 5, 32), (32, 64), (5, 1), (2, 5, 64)),
    ],
)
def test_einsum_dense_shapes(equation, output_shape, bias_axes, input_shape, kernel, bias, out):
    layer = layers.EinsumDense(
        equation, output_shape, bias_axes=bias_axes, bias_initializer="random_normal"
    )
    x = torch.randn(input_shape)
    y = layer(x)
    assert tuple(layer.kernel.shape) == kernel
    assert (None if layer.bias is None else tuple(layer.bias.shape)) == bias
    assert tuple(y.shape) == out
    expected = torch.einsum(equation, x, layer.kernel)
    if layer.bias is not None:
        expected = expected + layer.bias
    torch.testing.assert_close(y, expected)


@pytest.mark.parametrize(
    ("equation", "output_shape", "bias_axes", "input_shape", "message"),
    [
        ("ab,bc", 4, None, (2, 3), "Invalid einsum equation"),
        ("...ab,bc->ac...", 4, None, (2, 3), "Invalid einsum equation"),
        ("ab,bc->ac", 4, "x", (2, 3), "Bias axis 'x'"),
        ("ab,bcd->ac", 4, None, (2, 3), "Kernel dimension 'd'"),
        ("abc,cd->abd", (7, 4), None, (2, 5, 3), "has size 7"),
        ("ab,bc->ac", (4, 5), None, (2, 3), "does not fit the output spec"),
        ("abc,cd->abd", (None, 4), None, (2, 3), "does not fit the input spec"),
        ("ab,bc->acz", (4, 5), None, (2, 3), "appears in neither"),
    ],
)
def test_einsum_dense_errors(equation, output_shape, bias_axes, input_shape, message):
    with pytest.raises(ValueError, match=message):
        layer = layers.EinsumDense(equation, output_shape, bias_axes=bias_axes)
        layer(torch.randn(input_shape))


def test_einsum_spec_reduced_axes():
    assert EinsumSpec.parse("abc,cde->abde").kernel_reduced_axes == (0,)
    assert EinsumSpec.parse("abcd,cde->abe").kernel_reduced_axes == (0, 1)


def test_einsum_dense_mixed_precision():
    layer = layers.EinsumDense("abc,cd->abd", (None, 8), bias_axes="d", dtype="mixed_bfloat16")
    y = layer(torch.randn(2, 3, 4))
    assert y.dtype == torch.bfloat16 and layer.kernel.dtype == torch.float32


def test_embedding_never_casts_ids_and_casts_output():
    layer = layers.Embedding(50, 4, dtype="mixed_bfloat16", mask_zero=True)
    ids = torch.tensor([[0, 7, 49]])
    y = layer(ids)
    assert y.dtype == torch.bfloat16 and layer.embeddings.dtype == torch.float32
    torch.testing.assert_close(y[0, 1].float(), layer.embeddings[7].to(torch.bfloat16).float())
    assert layer.embeddings.abs().max() <= 0.05
    float_ids = torch.tensor([[1.0, 2.0]])
    torch.testing.assert_close(layer(float_ids), layer(torch.tensor([[1, 2]])))
    assert layer.compute_mask(ids).tolist() == [[False, True, True]]
    assert layers.Embedding(5, 2).compute_mask(ids) is None


def test_embedding_gradient_is_float32():
    layer = layers.Embedding(10, 3, dtype="mixed_bfloat16")
    layer(torch.tensor([1, 2, 2])).float().sum().backward()
    assert layer.embeddings.grad.dtype == torch.float32
    assert layer.embeddings.grad[2].tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_layer_norm_large_values_within_mixed_precision(policy):
    # Values whose square overflows float16: statistics must be float32.
    layer = layers.LayerNormalization(dtype=policy)
    x = torch.full((2, 4), 1e3)
    x[:, 0] = 3e4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPUFloat16Warning)
        y = layer(x)
    reference = F.layer_norm(x, (4,), eps=1e-3)
    assert y.dtype == layer.dtype_policy.torch_compute_dtype
    assert torch.isfinite(y.float()).all()
    torch.testing.assert_close(y.float(), reference, atol=0.02, rtol=0.01)


def test_layer_norm_half_input_uses_float32_weights():
    layer = layers.LayerNormalization(dtype="mixed_bfloat16")
    x = (torch.randn(3, 16) * 5 + 2).bfloat16()
    y = layer(x)
    assert y.dtype == torch.bfloat16 and layer.gamma.dtype == torch.float32
    torch.testing.assert_close(
        y.float(), F.layer_norm(x.float(), (16,), eps=1e-3), atol=0.03, rtol=0.02
    )
    y.float().sum().backward()
    assert layer.gamma.grad.dtype == torch.float32


def test_layer_norm_axes_and_rms():
    x = torch.randn(2, 3, 4)
    layer = layers.LayerNormalization(axis=1)
    y = layer(x)
    mean = x.mean(1, keepdim=True)
    var = x.var(1, keepdim=True, unbiased=False)
    torch.testing.assert_close(y, (x - mean) / torch.sqrt(var + 1e-3))
    assert tuple(layer.gamma.shape) == (3,)
    multi = layers.LayerNormalization(axis=[1, 2])
    torch.testing.assert_close(multi(x), F.layer_norm(x, (3, 4), eps=1e-3))
    with pytest.warns(UserWarning, match="rms_scaling=True`, which is deprecated"):
        rms = layers.LayerNormalization(rms_scaling=True, scale=False, dtype="mixed_bfloat16")
    with torch.no_grad():
        rms.build(x.shape)
        rms.gamma.copy_(torch.linspace(0.5, 2.0, 4))
    out = rms(x)
    # Keras's deprecated rule: the variance, the mean left in, gamma even when scale=False
    assert rms.beta is None and rms.gamma is not None and out.dtype == torch.bfloat16
    expected = x * torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-3) * rms.gamma
    torch.testing.assert_close(out.float(), expected, atol=0.03, rtol=0.01)
    with pytest.raises(ValueError, match="Invalid axis"):
        layers.LayerNormalization(axis=5)(x)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_layer_norm_built_at_one_rank_normalizes_inputs_of_another(policy):
    """Keras keeps `axis` as given: `-1` is the last axis at every call's
    rank. Built on (2, 8), a (3, 5, 8) input normalized over axis 1 (the
    build's last axis, read as a positive index) and failed."""
    torch.manual_seed(0)
    layer = layers.LayerNormalization(dtype=policy)
    layer(torch.randn(2, 8))
    x = torch.randn(3, 5, 8)
    expected = F.layer_norm(x, (8,), eps=layer.epsilon)
    tolerance = 1e-6 if policy == "float32" else 0.03
    torch.testing.assert_close(layer(x).float(), expected, atol=tolerance, rtol=0)
    with pytest.raises(ValueError, match=r"Invalid axis -1 for inputs of rank 0"):
        layer(torch.tensor(1.0))


def _mha_reference(mha, query, value, mask=None):
    q = torch.einsum("abc,cde->abde", query, mha.query.kernel) + mha.query.bias
    k = torch.einsum("abc,cde->abde", value, mha.key.kernel) + mha.key.bias
    v = torch.einsum("abc,cde->abde", value, mha.value.kernel) + mha.value.bias
    scores = torch.einsum("bthd,bshd->bhts", q, k) / mha.key_dim**0.5
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None], -1e9)
    probabilities = scores.softmax(-1)
    attended = torch.einsum("bhts,bshd->bthd", probabilities, v)
    return torch.einsum("abcd,cde->abe", attended, mha.attention_output.kernel) + (
        mha.attention_output.bias
    ), probabilities


def test_mha_matches_reference_in_float32_both_paths():
    mha = layers.MultiHeadAttention(num_heads=2, key_dim=4, name="mha")
    query, value = torch.randn(3, 5, 8), torch.randn(3, 7, 6)
    mask = torch.rand(3, 5, 7) > 0.3
    mask[..., 0] = True
    fused = mha(query, value, attention_mask=mask)
    expected, probabilities = _mha_reference(mha, query, value, mask)
    explicit, scores = mha(query, value, attention_mask=mask, return_attention_scores=True)
    torch.testing.assert_close(fused, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(explicit, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(scores, probabilities, atol=1e-6, rtol=1e-5)
    assert tuple(fused.shape) == (3, 5, 8)


def test_mha_a_query_with_no_key_left_attends_to_nothing_on_both_paths():
    """As Keras's masked softmax: a fully masked row's probabilities are 0
    (the scores path gave a uniform row, the fused path zeros)."""
    torch.manual_seed(0)
    mha = layers.MultiHeadAttention(num_heads=2, key_dim=4)
    query, value = torch.randn(1, 3, 8), torch.randn(1, 5, 8)
    mask = torch.ones(1, 3, 5, dtype=torch.bool)
    mask[0, 1] = False
    explicit, scores = mha(query, value, attention_mask=mask, return_attention_scores=True)
    fused = mha(query, value, attention_mask=mask)
    assert torch.equal(scores[0, :, 1], torch.zeros(2, 5))
    torch.testing.assert_close(scores[0, :, 0].sum(-1), torch.ones(2))
    torch.testing.assert_close(explicit, fused, atol=1e-5, rtol=1e-4)
    bias = mha.attention_output.bias.detach()
    torch.testing.assert_close(explicit[0, 1], bias.expand_as(explicit[0, 1]))


def test_mha_causal_mask_and_mixed_precision():
    mha = layers.MultiHeadAttention(num_heads=2, key_dim=8, dtype="mixed_bfloat16")
    x = torch.randn(2, 6, 16)
    y, scores = mha(x, x, use_causal_mask=True, return_attention_scores=True)
    assert y.dtype == torch.bfloat16 and scores.dtype == torch.bfloat16
    assert torch.all(scores.float().triu(1) == 0)
    torch.testing.assert_close(scores.float().sum(-1), torch.ones(2, 2, 6), atol=0.02, rtol=0)
    fused = mha(x, x, use_causal_mask=True)
    torch.testing.assert_close(fused.float(), y.float(), atol=0.05, rtol=0.05)
    assert all(p.dtype == torch.float32 for p in mha.parameters())


def test_mha_passes_policy_map_to_sublayers():
    policy_map = DTypePolicyMap("float32", {"mha/(query|key)": "mixed_bfloat16"})
    mha = layers.MultiHeadAttention(num_heads=2, key_dim=4, name="mha", dtype=policy_map)
    x = torch.randn(1, 3, 8)
    y = mha(x, x)
    assert [m.path for m in (mha.query, mha.key, mha.value, mha.attention_output)] == [
        "mha/query",
        "mha/key",
        "mha/value",
        "mha/attention_output",
    ]
    assert mha.query.compute_dtype == "bfloat16" and mha.key.compute_dtype == "bfloat16"
    assert mha.value.compute_dtype == "float32"
    assert y.dtype == torch.float32


def test_mha_errors():
    with pytest.raises(ValueError, match=r"attention_axes"):
        layers.MultiHeadAttention(2, 4, attention_axes=(1, 2))
    mha = layers.MultiHeadAttention(2, 4)
    with pytest.raises(ValueError, match="batch, sequence, features"):
        mha(torch.randn(2, 8), torch.randn(2, 8))


@pytest.mark.parametrize("scores", [False, True])
def test_mha_a_key_and_value_of_different_lengths_raise_as_keras(scores):
    """torch's fused attention took a value shorter or longer than the key
    without a word (outputs of neither); Keras raises in `build`."""
    torch.manual_seed(0)
    query, key, value = torch.randn(3, 4, 8), torch.randn(3, 6, 8), torch.randn(3, 7, 8)
    unbuilt = layers.MultiHeadAttention(2, 4)
    with pytest.raises(ValueError, match=r"must be equal. Received: value_shape=\(3, 7, 8\)"):
        unbuilt(query, value, key, return_attention_scores=scores)
    assert not unbuilt.built
    built = layers.MultiHeadAttention(2, 4)
    built(query, value)
    before = {k: v.clone() for k, v in built.state_dict().items()}
    with pytest.raises(ValueError, match=r"key_shape=\(3, 6, 8\)"):
        built(query, value, key, return_attention_scores=scores)
    assert all(torch.equal(v, before[k]) for k, v in built.state_dict().items())


@pytest.mark.parametrize(
    ("policy", "error"),
    [
        ("int8_from_float32", NotImplementedError),
        ("int4_from_mixed_bfloat16", NotImplementedError),
        ("float8_from_float32", NotImplementedError),
        ("gptq/4/128_from_float32", ValueError),
    ],
)
def test_a_built_layer_without_quantize_refuses_a_quantized_policy_as_keras(policy, error):
    """`mha.dtype_policy = "int8_from_float32"` on a built attention layer set
    the policy and quantized nothing, silently (its sublayers stayed float32);
    Keras raises. Nothing changes; unbuilt, the policy reaches the sublayers."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    mha, norm = layers.MultiHeadAttention(2, 4), layers.LayerNormalization()
    mha(x, x), norm(x)
    for layer in (mha, norm):
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        with pytest.raises(error, match=r"does not have a `quantize`|Implicitly enabling GPTQ"):
            layer.dtype_policy = policy
        assert layer.dtype_policy.name == "float32"
        assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())
    assert [sub.dtype_policy.name for sub in (mha.query, mha.attention_output)] == ["float32"] * 2
    mha.dtype_policy = "mixed_bfloat16"  # float policies change as before (as in Keras)
    assert mha.dtype_policy.name == "mixed_bfloat16" and mha.query.dtype_policy.name == "float32"
    if not policy.startswith("gptq"):
        unbuilt = layers.MultiHeadAttention(2, 4)
        unbuilt.dtype_policy = policy
        with torch.no_grad():
            unbuilt(x, x)
        assert unbuilt.query.quantization_mode == policy.split("_")[0]


def test_dropout_modes_and_noise_shape():
    layer = layers.Dropout(0.5, seed=1)
    x = torch.ones(4, 1000)
    assert torch.equal(layer(x, training=False), x)
    layer.eval()
    assert torch.equal(layer(x), x)
    layer.train()
    y = layer(x)
    assert set(y.unique().tolist()) <= {0.0, 2.0}
    assert 0.4 < (y == 0).float().mean().item() < 0.6
    broadcast = layers.Dropout(0.5, noise_shape=(None, 1), seed=2)(x, training=True)
    assert all(len(row.unique()) == 1 for row in broadcast)
    again = layers.Dropout(0.5, seed=1)(x, training=True)
    assert torch.equal(again, y)
    with pytest.raises(ValueError, match="between 0 and 1"):
        layers.Dropout(1.5)


def test_activation_layer():
    layer = layers.Activation("gelu", dtype="mixed_bfloat16")
    y = layer(torch.tensor([-1.0, 0.0, 2.0]))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(
        y.float(), F.gelu(torch.tensor([-1.0, 0.0, 2.0])), atol=0.02, rtol=0.01
    )
    with pytest.raises(ValueError, match="Unknown activation"):
        layers.Activation("nope")


def test_sequential_add_pop_paths_and_state_dict_keys():
    model = layers.Sequential(name="seq")
    model.add(layers.Dense(4, name="first"))
    model.add(torch.nn.ReLU())
    model.add(layers.Dense(2))
    y = model(torch.randn(3, 5))
    assert tuple(y.shape) == (3, 2)
    assert [getattr(layer, "path", None) for layer in model.layers] == ["seq/0", None, "seq/2"]
    assert list(model.state_dict()) == ["0.kernel", "0.bias", "2.kernel", "2.bias"]
    last = model.pop()
    assert isinstance(last, layers.Dense) and len(model) == 2
    with pytest.raises(TypeError, match=r"only accepts torch\.nn\.Module"):
        model.add("dense")


def test_sequential_explicit_build_and_training_flag():
    model = layers.Sequential([layers.Dense(4), layers.Dropout(0.9), layers.Dense(1)])
    model.build((None, 3))
    assert all(layer.built for layer in model.layers)
    assert tuple(model.layers[0].kernel.shape) == (3, 4)
    x = torch.ones(2, 3)
    torch.testing.assert_close(model(x, training=False), model(x, training=False))


def test_sequential_config_round_trip_with_custom_layer():
    @saving.register_serializable("Tests")
    class Scale(layers.Layer):
        def __init__(self, factor=2.0, **kwargs):
            super().__init__(**kwargs)
            self.factor = factor

        def call(self, inputs):
            return inputs * self.factor

        def get_config(self):
            return {**super().get_config(), "factor": self.factor}

    model = layers.Sequential(
        [layers.Dense(3, dtype="mixed_bfloat16"), Scale(3.0), layers.LayerNormalization()],
        name="seq",
    )
    x = torch.randn(2, 4)
    model(x)
    config = saving.serialize_layer(model)
    clone = saving.deserialize_layer(config)
    clone(x)
    clone.load_state_dict(model.state_dict())
    torch.testing.assert_close(clone(x), model(x))
    assert clone.layers[0].dtype_policy.name == "mixed_bfloat16"
    assert clone.layers[1].factor == 3.0
    with pytest.raises(ValueError, match="Unknown layer class"):
        saving.deserialize_layer({"class_name": "Nope", "config": {}})


class TransformerBlock(layers.Layer):
    def __init__(self, dim, heads, **kwargs):
        super().__init__(**kwargs)
        policy = self.dtype_policy
        self.attention = layers.MultiHeadAttention(heads, dim // heads, dtype=policy)
        self.norm1 = layers.LayerNormalization(dtype=policy)
        self.norm2 = layers.LayerNormalization(dtype=policy)
        self.up = layers.Dense(dim * 2, activation="gelu", dtype=policy)
        self.down = layers.Dense(dim, dtype=policy)

    def call(self, x):
        x = self.norm1(x + self.attention(x, x))
        return self.norm2(x + self.down(self.up(x)))


class TinyClassifier(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        policy = self.dtype_policy
        self.embed = layers.Embedding(16, 32, dtype=policy)
        self.block = TransformerBlock(32, 4, dtype=policy)
        self.head = layers.Dense(2, dtype=policy)

    def call(self, ids):
        return self.head(self.block(self.embed(ids)).mean(dim=1))


def _train_classifier(policy, steps=40):
    torch.manual_seed(0)
    ids = torch.randint(0, 16, (64, 10))
    labels = (ids[:, 0] > 7).long()
    model = TinyClassifier(dtype=policy)
    model(ids)
    torch.manual_seed(1)
    for parameter in model.parameters():  # same initial weights for both policies
        torch.nn.init.normal_(parameter, std=0.2) if parameter.dim() > 1 else None
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(ids).float(), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


def test_transformer_block_trains_under_mixed_bfloat16_like_float32():
    _, losses32 = _train_classifier("float32")
    model16, losses16 = _train_classifier("mixed_bfloat16")
    assert all(p.dtype == torch.float32 for p in model16.parameters())
    assert model16(torch.randint(0, 16, (2, 10))).dtype == torch.bfloat16
    # Stated tolerance: the mixed run's loss tracks float32 within 0.05 absolute
    # at the start and ends within 20% of it, both having learned the task.
    assert abs(losses16[0] - losses32[0]) < 0.05
    assert losses32[-1] < 0.5 * losses32[0] and losses16[-1] < 0.5 * losses16[0]
    assert abs(losses16[-1] - losses32[-1]) < 0.2 * losses32[0]


@pytest.mark.slow
def test_compile_fullgraph_sequential_of_dense_matches_eager():
    dtype_policies.set_dtype_policy("mixed_bfloat16")
    model = layers.Sequential(
        [layers.Dense(32, activation="relu"), layers.Dense(32), layers.Dense(8)]
    )
    x = torch.randn(4, 16)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), eager.float(), atol=0.02, rtol=0.02)
    out.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize(
    ("layer", "inputs", "expected"),
    [
        (lambda: layers.Dense(4), [(None, 7, 3)], (None, 7, 4)),
        (
            lambda: layers.EinsumDense("abc,cde->abde", (None, 2, 5), bias_axes="de"),
            [(None, 6, 3)],
            (None, 6, 2, 5),
        ),
        (lambda: layers.Embedding(10, 4), [(None, 7)], (None, 7, 4)),
        (lambda: layers.MultiHeadAttention(2, 4), [(None, 5, 8), (None, 7, 6)], (None, 5, 8)),
        (
            lambda: layers.MultiHeadAttention(2, 4, output_shape=3),
            [(None, 5, 8), (None, 7, 6)],
            (None, 5, 3),
        ),
        (lambda: layers.LayerNormalization(), [(None, 7, 3)], (None, 7, 3)),
        (lambda: layers.Dropout(0.5), [(None, 3)], (None, 3)),
        (lambda: layers.Activation("relu"), [(None, 3)], (None, 3)),
    ],
)
def test_compute_output_shape_as_keras_and_as_the_call(layer, inputs, expected):
    assert layer().compute_output_shape(*inputs) == expected
    concrete = [tuple(2 if d is None else d for d in shape) for shape in inputs]
    tensors = [
        torch.randint(0, 10, shape) if isinstance(layer(), layers.Embedding) else torch.randn(shape)
        for shape in concrete
    ]
    built = layer()
    assert tuple(built(*tensors).shape) == built.compute_output_shape(*concrete)


def test_dense_refuses_an_input_of_one_axis_as_keras():
    with pytest.raises(ValueError, match="expected min_ndim=2, found ndim=1"):
        layers.Dense(4)(torch.ones(5))


@pytest.mark.parametrize(
    "mode, trainable, frozen", [("int8", 1, 2), ("int4", 1, 4), ("float8", 2, 6)]
)
def test_a_quantized_layer_lists_its_stored_tensors_among_its_weights(mode, trainable, frozen):
    """Keras's `test_quantize_dtype_argument`: an int8 Dense has 1 trainable
    and 2 non-trainable weights (3 for int8, 5 for int4, 8 for float8 in all);
    the quantized tensors were left out (1 weight after int8)."""
    dense = layers.Dense(4)
    dense(torch.randn(2, 8))
    dense.quantize(mode)
    assert (len(dense.trainable_weights), len(dense.non_trainable_weights)) == (trainable, frozen)
    assert len(dense.weights) == trainable + frozen
    buffers = {id(b) for b in dense.buffers()}
    assert all(id(t) in buffers for t in dense.non_trainable_weights)  # the stored tensors
    if mode == "int8":
        assert dense.non_trainable_weights[0].dtype == torch.int8


def test_add_weight_takes_keras_s_aggregation_and_overwrite_with_gradient():
    layer = layers.Dense(2)
    weight = layer.add_weight(shape=(2,), name="w", aggregation="mean")
    assert weight.aggregation == "mean"
    assert layer.add_weight(shape=(2,), name="v", aggregation=None).aggregation == "none"
    assert layer.add_weight(shape=(2,), name="u", overwrite_with_gradient=False) is layer.u
    with pytest.raises(ValueError, match=r"Invalid value for argument `aggregation`.*=median"):
        layer.add_weight(shape=(2,), name="x", aggregation="median")
    not_bool = r"`overwrite_with_gradient` must be a boolean\. Received: 1"
    with pytest.raises(TypeError, match=not_bool):
        layer.add_weight(shape=(2,), name="x", overwrite_with_gradient=1)
    unsupported = r"overwrite_with_gradient=True\) is not supported"
    with pytest.raises(NotImplementedError, match=unsupported):
        layer.add_weight(shape=(2,), name="x", overwrite_with_gradient=True)
    assert not hasattr(layer, "x")


def test_embedding_compute_mask_takes_keras_s_mask_argument():
    embedding = layers.Embedding(10, 4, mask_zero=True)
    ids = torch.tensor([[0, 3]])
    assert embedding.compute_mask(ids, mask=None).tolist() == [[False, True]]
    assert embedding.compute_mask(ids, torch.ones(1, 2, dtype=torch.bool)).tolist() == [
        [False, True]
    ]


def test_a_mode_the_layer_cannot_take_is_refused_by_the_setter_as_by_the_constructor():
    """`Embedding(..., dtype="float8_from_float32")` raised Keras's error; the
    setter on a built Embedding accepted the policy and computed in float."""
    with pytest.raises(NotImplementedError, match="Invalid quantization mode"):
        layers.Embedding(10, 4, dtype="float8_from_float32")(torch.tensor([1]))
    embedding = layers.Embedding(10, 4)
    embedding(torch.tensor([1]))
    before = {k: v.clone() for k, v in embedding.state_dict().items()}
    with pytest.raises(NotImplementedError, match=r"Expected one of \('int8', 'int4'\)"):
        embedding.dtype_policy = "float8_from_float32"
    assert embedding.dtype_policy.name == "float32" and embedding.quantization_mode is None
    assert all(torch.equal(v, before[k]) for k, v in embedding.state_dict().items())


def test_loading_a_quantized_checkpoint_into_an_unbuilt_layer_names_the_cause(tmp_path):
    saved = layers.Dense(4)
    saved(torch.randn(2, 8))
    saved.quantize("int8")
    path = saving.save(saved, tmp_path / "dense")
    target = layers.Dense(4)
    with pytest.raises(saving.CheckpointError, match="the target Dense is not built"):
        saving.load(target, path)
    assert not target.built and dict(target.state_dict()) == {}
