"""Quantized layers and modules: every mode on every layer kind, errors, policies,
state_dict round trips, reports, and the float8 delayed-scaling oracle."""

import copy
import io
import re
import warnings

import pytest
import torch
import torch.nn as nn

import dtype_policies
from dtype_policies import DTypePolicyMap, apply_policy, layers, quantize
from dtype_policies.quantization import (
    Int4QuantizationConfig,
    Int8QuantizationConfig,
    QuantizationReport,
)
from dtype_policies.quantizers import AbsMaxQuantizer

MODES = ["int8", "int4", "float8"]
# Relative error bounds of a random layer's output against float32.
TOLERANCE = {"int8": 0.03, "int4": 0.15, "float8": 0.08, "int8_weight_only": 0.02}


def relative_error(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _built_dense(units, input_shape, policy="float32", use_bias=True):
    layer = layers.Dense(units, use_bias=use_bias, dtype=policy, bias_initializer="random_normal")
    layer(torch.randn(input_shape))
    return layer


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize(
    ("units", "input_shape", "use_bias"),
    [(32, (8, 64), True), (7, (3, 5, 13), False), (48, (1, 256), True)],
)
def test_dense_every_mode(mode, policy, units, input_shape, use_bias):
    torch.manual_seed(0)
    layer = _built_dense(units, input_shape, policy, use_bias)
    x = torch.randn(input_shape)
    reference = layer(x).float()
    layer.quantize(mode)
    out = layer(x)
    assert out.dtype == layer.dtype_policy.torch_compute_dtype
    assert tuple(out.shape) == (*input_shape[:-1], units)
    assert relative_error(out, reference) < TOLERANCE[mode] + (0.01 if policy != "float32" else 0)
    expected_name = {"int8": "int8_from_", "int4": "int4/128_from_", "float8": "float8_from_"}
    assert layer.dtype_policy.name == expected_name[mode] + policy
    assert layer.quantization_mode == mode
    state = layer.state_dict()
    if mode == "int8":
        assert "kernel" not in state  # never a key a float checkpoint also has
        assert state["kernel_int8"].dtype == torch.int8
        assert tuple(state["kernel_int8"].shape) == (input_shape[-1], units)
        # the default int8 steps its weights per block of 32 inputs, laid out like
        # the kernel (Keras's per-channel (units,) comes with Int8QuantizationConfig())
        blocks = -(-input_shape[-1] // 32)
        assert state["kernel_scale"].dtype == torch.float32
        assert state["kernel_scale"].shape == (blocks, units)
    elif mode == "int4":
        assert "kernel" not in state
        assert state["kernel_int4"].dtype == torch.int8
        assert tuple(state["kernel_int4"].shape) == (input_shape[-1], (units + 1) // 2)
        groups = -(-input_shape[-1] // 128)
        assert tuple(state["kernel_scale"].shape) == (groups, units)
        assert state["kernel_zero"].dtype == torch.float32  # real-valued zero points
        assert torch.equal(state["kernel_g_idx"], torch.arange(input_shape[-1]) // 128)
    else:
        assert state["kernel"].dtype == torch.float32
        assert state["inputs_amax_history"].shape == (1024,)
    assert ("bias" in state) == use_bias


def test_int8_weight_only_and_int4_per_channel_configs():
    torch.manual_seed(0)
    x = torch.randn(4, 64)
    layer = _built_dense(16, (4, 64), "mixed_bfloat16")
    reference = layer(x)
    layer.quantize(config=Int8QuantizationConfig(activation_quantizer=None))
    assert relative_error(layer(x), reference) < TOLERANCE["int8_weight_only"]
    per_channel = _built_dense(16, (4, 64), "mixed_bfloat16")
    reference = per_channel(x)
    per_channel.quantize("int4", Int4QuantizationConfig(block_size=-1))
    assert per_channel.dtype_policy.name == "int4/-1_from_mixed_bfloat16"
    assert per_channel.kernel_scale.shape == (16,) and "kernel_zero" not in per_channel.state_dict()
    assert relative_error(per_channel(x), reference) < TOLERANCE["int4"]


@pytest.mark.parametrize(
    "config",
    [
        Int8QuantizationConfig(),
        Int8QuantizationConfig(activation_quantizer=None),
        Int4QuantizationConfig(),
        Int4QuantizationConfig(block_size=-1, activation_quantizer=None),
    ],
    ids=repr,
)
def test_a_config_reads_back_from_its_repr(config):
    # a weight-only int8 config printed as `Int8QuantizationConfig()`, which is W8A8
    namespace = {type(config).__name__: type(config), "AbsMaxQuantizer": AbsMaxQuantizer}
    assert eval(repr(config), namespace) == config


@pytest.mark.parametrize("mode", MODES)
def test_einsum_dense_every_mode(mode):
    torch.manual_seed(0)
    layer = layers.EinsumDense(
        "abc,cde->abde", (None, 4, 8), bias_axes="de", bias_initializer="random_normal"
    )
    x = torch.randn(2, 5, 32)
    reference = layer(x)
    layer.quantize(mode)
    out = layer(x)
    assert out.shape == (2, 5, 4, 8)
    assert relative_error(out, reference) < TOLERANCE[mode]
    second = layers.EinsumDense("abcd,cde->abe", (None, 16))
    y = torch.randn(2, 5, 4, 8)
    reference = second(y)
    second.quantize(mode)
    assert relative_error(second(y), reference) < TOLERANCE[mode]


@pytest.mark.parametrize("mode", MODES)
def test_a_quantized_einsum_dense_checks_its_input_as_the_float_one(mode):
    """The quantized product flattened the contracted axes: a transposed
    (2, 5, 4, 2) input into 'abcd,cde->abe' (c=2, d=4), or an input of
    another rank, gave scrambled outputs where the float layer raises."""
    torch.manual_seed(0)
    layer = layers.EinsumDense("abcd,cde->abe", (None, 6), bias_axes="e")
    layer(torch.randn(2, 5, 2, 4))
    layer.quantize(mode)
    for shape in [(2, 5, 4, 2), (2, 5, 8, 1), (2, 5, 1, 8), (5, 2, 4), (3, 2, 5, 2, 4)]:
        with pytest.raises(
            RuntimeError, match=r"asks for rank 4, ending in the contracted axes \(2, 4\)"
        ):
            layer(torch.randn(*shape))
    assert layer(torch.randn(3, 7, 2, 4)).shape == (3, 7, 6)
    left = layers.EinsumDense("...b,bc->...c", 6)
    left(torch.randn(3, 8))
    left.quantize(mode)
    assert left(torch.randn(8)).shape == (6,) and left(torch.randn(2, 3, 8)).shape == (2, 3, 6)
    with pytest.raises(RuntimeError, match="rank 1 or more"):
        left(torch.randn(2, 4, 2))


def test_einsum_dense_non_matmul_equation():
    layer = layers.EinsumDense("abc,bcd->abd", (5, 8))  # b is shared by all three
    x = torch.randn(2, 5, 3)
    reference = layer(x)
    with pytest.raises(NotImplementedError, match="not a matrix product"):
        layer.quantize("int8")
    assert layer.quantization_mode is None and layer.dtype_policy.name == "float32"
    layer.quantize("float8")
    assert relative_error(layer(x), reference) < TOLERANCE["float8"]


@pytest.mark.parametrize("scaling", ["delayed", "dynamic", "weight_only"])
@pytest.mark.parametrize("equation", ["abc,bcd->abd", "ab...,bc->ac..."])
def test_einsum_dense_non_matmul_equation_float8_without_autograd(equation, scaling):
    """The kept kernel of a call without autograd had no (N, K) view for a
    general contraction and raised `TypeError` in every `no_grad` /
    `inference_mode` call; it gives the graph path's values."""
    from dtype_policies.quantizers import Float8QuantizationConfig

    torch.manual_seed(0)
    general = "..." not in equation
    shape, x = ((5, 8), torch.randn(2, 5, 3)) if general else (8, torch.randn(2, 3, 4))
    layer = layers.EinsumDense(equation, shape)
    reference = layer(x)
    layer.quantize("float8", config=Float8QuantizationConfig(scaling=scaling))
    layer.eval()
    graph = layer(x)
    with torch.no_grad():
        assert torch.equal(layer(x), graph)
    with torch.inference_mode():
        assert torch.equal(layer(x), graph)
    assert relative_error(graph, reference) < TOLERANCE["float8"]


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_embedding_modes(mode, policy):
    torch.manual_seed(0)
    layer = layers.Embedding(100, 48, dtype=policy, embeddings_initializer="random_normal")
    ids = torch.randint(0, 100, (3, 7))
    reference = layer(ids)
    layer.quantize(mode)
    out = layer(ids)
    assert out.dtype == layer.dtype_policy.torch_compute_dtype and out.shape == (3, 7, 48)
    assert relative_error(out, reference) < TOLERANCE[mode]
    assert layer.embeddings.dtype == torch.int8  # Keras: the quantized integer values
    assert tuple(layer.embeddings.shape) == (100, 48)
    # Keras's layout: a table's grouped scales are (rows, groups); the default
    # int8's steps per block of 32 features likewise.
    expected = (100, 2) if mode == "int8" else (100, 1)
    assert tuple(layer.embeddings_scale.shape) == expected


def test_keras_int8_config_keeps_keras_per_channel_layout():
    from dtype_policies.quantization import Int8QuantizationConfig

    torch.manual_seed(0)
    dense = _built_dense(12, (2, 40))
    dense.quantize("int8", config=Int8QuantizationConfig())
    assert dense.kernel_scale.shape == (12,) and dense.kernel_int8.shape == (40, 12)
    table = layers.Embedding(30, 40)
    table(torch.tensor([1]))
    table.quantize("int8", config=Int8QuantizationConfig())
    assert table.embeddings_scale.shape == (30,)


def test_embedding_float8_is_not_supported_and_leaves_layer_unchanged():
    layer = layers.Embedding(10, 4)
    layer(torch.tensor([1]))
    with pytest.raises(NotImplementedError, match="Invalid quantization mode"):
        layer.quantize("float8")
    assert layer.dtype_policy.name == "float32" and layer.quantization_config is None
    assert layer.embeddings.dtype == torch.float32


def test_an_embedding_given_float8_raises_as_in_keras_and_a_default_float8_does_not():
    """Given to the layer, a policy it cannot take was silently ignored (the
    layer computed in float32 under a float8 policy); Keras raises."""
    with pytest.raises(NotImplementedError, match="Expected one of \\('int8', 'int4'\\)"):
        layers.Embedding(10, 4, dtype="float8_from_float32")(torch.tensor([1]))
    with dtype_policies.policy_scope("float8_from_float32"):  # the README's difference
        table = layers.Embedding(10, 4)
        assert table(torch.tensor([1])).dtype == torch.float32


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(8, 64), (2, 3, 64), (1, 64), (17, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_torch_linear_every_mode(mode, shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=bias)
    x = torch.randn(shape)
    reference = linear(x)
    report = quantize(linear, mode)
    assert report.quantized == [
        (
            "(root)",
            mode,
            {
                "int8": "int8_from_float32",
                "int4": "int4/128_from_float32",
                "float8": "float8_from_float32",
            }[mode],
        )
    ]
    out = linear(x)
    assert out.dtype == torch.float32 and out.shape == reference.shape
    assert relative_error(out, reference) < TOLERANCE[mode]
    assert isinstance(linear, nn.Linear)
    assert "quantization=" + mode in repr(linear)


@pytest.mark.parametrize(("in_features", "out_features"), [(13, 7), (100, 30), (256, 64)])
def test_torch_linear_odd_shapes_use_fallbacks_correctly(in_features, out_features):
    torch.manual_seed(0)
    for mode in ("int8", "int4"):
        model = nn.Sequential(nn.Linear(in_features, out_features))
        apply_policy(model, "mixed_bfloat16")
        x = torch.randn(5, in_features)
        reference = model(x)
        quantize(model, mode, Int4QuantizationConfig(block_size=-1) if mode == "int4" else None)
        assert relative_error(model(x), reference) < TOLERANCE[mode]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_torch_embedding(mode):
    torch.manual_seed(0)
    embedding = nn.Embedding(50, 64)
    ids = torch.randint(0, 50, (2, 9))
    reference = embedding(ids)
    reference_table = embedding.weight.detach().clone()
    quantize(embedding, mode)
    assert relative_error(embedding(ids), reference) < TOLERANCE[mode]
    assert getattr(embedding, f"weight_{mode}").dtype == torch.int8
    assert "weight" not in embedding.state_dict()
    # The weight attribute reads as the dequantized table (for code reading it).
    assert embedding.weight.dtype == torch.float32
    assert relative_error(embedding.weight, reference_table) < TOLERANCE[mode]


@pytest.mark.parametrize("block", [16, 24, 64])
@pytest.mark.parametrize("permuted", [False, True])
def test_int4_embedding_rows_equal_the_dequantized_table(block, permuted):
    """The lookup decodes only the rows asked for; each equals that row of
    the dequantized table, rounded once to the compute dtype: natural groups
    (block 16 and 64 divide the 64 features), a shorter last group (24) and a
    permuted `g_idx` (a Keras archive may store one)."""
    torch.manual_seed(0)
    embedding = nn.Embedding(50, 64)
    apply_policy(embedding, "mixed_bfloat16")
    quantize(embedding, "int4", Int4QuantizationConfig(block_size=block))
    if permuted:
        g_idx = embedding.weight_g_idx
        g_idx.copy_(g_idx[torch.randperm(64, generator=torch.Generator().manual_seed(1))])
    ids = torch.randint(0, 50, (3, 7))
    rows = embedding(ids)
    table = embedding.weight  # float32, decoded from the stored tensors
    assert rows.dtype == torch.bfloat16
    assert torch.equal(rows, table[ids].to(torch.bfloat16))


def test_int4_embedding_lookup_compiles_in_one_graph():
    """The eager lookup's choice of natural groups reads `g_idx`'s values;
    traced, it must not (a graph break split compiled MiniLM into pieces and
    ran its embeddings eagerly, 2026-12-07)."""
    torch.manual_seed(0)
    embedding = nn.Embedding(50, 64)
    apply_policy(embedding, "mixed_bfloat16")
    quantize(embedding, "int4", Int4QuantizationConfig(block_size=16))
    ids = torch.randint(0, 50, (3, 7))
    torch._dynamo.reset()
    compiled = torch.compile(embedding, fullgraph=True, backend="eager")
    assert torch.equal(compiled(ids), embedding(ids))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_torch_embedding_refuses_the_ids_torch_refuses(mode):
    """Negative ids wrapped to the last rows and float or bool ids were
    truncated, where `nn.Embedding` raises."""
    embedding = nn.Embedding(10, 64)
    quantize(embedding, mode)
    for ids in (torch.tensor([-1]), torch.tensor([3, -10])):
        with pytest.raises(IndexError, match="index out of range in self"):
            embedding(ids)
    for ids in (torch.tensor([2.9]), torch.tensor([True, False])):
        with pytest.raises(RuntimeError, match="scalar types: Long, Int; but got torch"):
            embedding(ids)
    assert embedding(torch.tensor([9], dtype=torch.int32)).shape == (1, 64)


def test_quantize_composes_with_apply_policy_and_computes_in_bfloat16():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 64))
    x = torch.randn(4, 128)
    reference = model(x)
    handle = apply_policy(model, "mixed_bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a LayerNorm holds no weight matrix: nothing to say
        report = quantize(model, "int4")
    assert [name for _, _, name in report.quantized] == ["int4/128_from_mixed_bfloat16"] * 2
    assert report.skipped == [("2", "no weight matrix")]
    out = model(x)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, reference) < TOLERANCE["int4"]
    assert handle.module is model
    assert dtype_policies.mixed_precision.get_layer_policy(model[0]).name == (
        "int4/128_from_mixed_bfloat16"
    )


def test_apply_policy_with_quantized_policy_quantizes_and_never_breaks_others():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(20, 32),
        nn.Linear(32, 32),
        nn.LayerNorm(32),
        nn.Identity(),
        nn.Linear(32, 8),
    )
    ids = torch.randint(0, 20, (2, 5))
    reference = model(ids)
    handle = apply_policy(model, "int8_from_mixed_bfloat16")
    assert model[1].weight_int8.dtype == torch.int8 and model[0].weight_int8.dtype == torch.int8
    assert handle.policies["2"].name == "float32"  # the norm island
    out = model(ids)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, reference) < 0.05


def test_float8_global_policy_skips_unsupported_layers():
    dtype_policies.set_dtype_policy("float8_from_mixed_bfloat16")
    model = layers.Sequential(
        [layers.Embedding(10, 8), layers.Dense(8), layers.LayerNormalization(), layers.Dense(2)],
        name="m",
    )
    out = model(torch.tensor([[1, 2, 3]]))
    assert out.dtype == torch.bfloat16
    assert model.layers[0].quantization_mode is None  # embeddings have no float8
    assert model.layers[1].quantization_mode == "float8"
    assert model.layers[2].quantization_mode is None
    assert model.layers[3].inputs_amax_history.shape == (1024,)


@pytest.mark.parametrize("mode", MODES)
def test_quantized_policy_through_dtype_builds_quantized(mode):
    policy = {
        "int8": "int8_from_float32",
        "int4": "int4/32_from_float32",
        "float8": "float8_from_float32",
    }[mode]
    layer = layers.Dense(16, dtype=policy)
    layer(torch.randn(2, 64))
    assert layer.quantization_mode == mode
    assert layer.dtype_policy.name == policy
    if mode == "int4":
        assert layer.kernel_scale.shape == (2, 16)


def test_legacy_int4_policy_string_is_per_channel():
    layer = layers.Dense(16, dtype="int4_from_float32")
    layer(torch.randn(2, 64))
    assert layer.kernel_scale.shape == (16,) and "kernel_zero" not in layer.state_dict()


def test_setting_quantized_policy_after_build_quantizes():
    layer = _built_dense(8, (2, 16))
    layer.dtype_policy = "int8_from_float32"
    assert layer.kernel.dtype == torch.int8
    with pytest.raises(ValueError, match="cannot take the policy"):
        layer.dtype_policy = "float32"
    assert layer.dtype_policy.name == "int8_from_float32"


def test_quantize_errors_leave_layer_unchanged():
    unbuilt = layers.Dense(4)
    with pytest.raises(ValueError, match="isn't yet built"):
        unbuilt.quantize("int8")
    layer = _built_dense(4, (1, 8))
    with pytest.raises(ValueError, match="Invalid quantization mode"):
        layer.quantize("int7")
    with pytest.raises(ValueError, match="You must provide either"):
        layer.quantize()
    with pytest.raises(ValueError, match="Contradictory arguments"):
        layer.quantize("int4", Int8QuantizationConfig())
    with pytest.raises(ValueError, match="must be an instance of `QuantizationConfig`"):
        layer.quantize("int8", {"mode": "int8"})
    assert layer.dtype_policy.name == "float32" and layer.kernel.dtype == torch.float32
    layer.quantize("int8")
    with pytest.raises(ValueError, match="is already quantized with dtype_policy='int8_from"):
        layer.quantize("float8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        half = _built_dense(4, (1, 8), policy="mixed_float16")
        with pytest.raises(ValueError, match="doesn't work well"):
            half.quantize("int8")
    assert half.kernel.dtype == torch.float32


def test_type_check_refuses_subclasses():
    class MyDense(layers.Dense):
        pass

    layer = MyDense(4)
    layer(torch.randn(1, 8))
    with pytest.raises(NotImplementedError, match="does not have a `quantize` method"):
        layer.quantize("int8")
    layer.quantize("int8", type_check=False)
    assert layer.kernel.dtype == torch.int8


def test_model_report_filters_and_single_warning():
    model = nn.Sequential(
        nn.Linear(8, 8), nn.Conv1d(2, 2, 1), nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8)
    )
    with pytest.warns(UserWarning, match="1 module") as record:
        report = quantize(model, "int8", filters=["^[012]$", "^4$"])
    assert len(record) == 1
    message = str(record[0].message)
    assert "'1' (Conv1d, not a quantizable kind)" in message
    # the Conv1d's 6 of the model's 238 parameter elements
    assert "2.5% of the model's parameters stay in floating point" in message
    assert isinstance(report, QuantizationReport)
    assert [path for path, _, _ in report.quantized] == ["0", "4"]
    assert report.skipped_by_reason("filtered out") == ["3"]
    assert report.skipped_by_reason("no quantize support") == ["1"]
    assert report.skipped_by_reason("no weight matrix") == ["2"]
    again = quantize(model, "int8", filters=lambda path, module: path == "3")
    assert again.skipped_by_reason("already quantized") == ["0", "4"]
    assert [path for path, _, _ in again.quantized] == ["3"]
    with pytest.raises(ValueError, match="`filters` argument"):
        quantize(model, "int8", filters=3)
    with pytest.raises(ValueError, match="Invalid quantization mode"):
        quantize(model, "int3")


def test_no_warning_when_only_filtered():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize(model, "int8", filters="^0$")


def _build_model(name_prefix):
    torch.manual_seed(0)
    return layers.Sequential(
        [
            layers.Embedding(30, 16, name=f"{name_prefix}emb"),
            layers.Dense(32, activation="gelu", name=f"{name_prefix}up"),
            layers.Dense(16, name=f"{name_prefix}down"),
        ],
        name=f"{name_prefix}model",
    )


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_state_dict_weights_only_round_trip_with_architecture_keys(mode):
    ids = torch.randint(0, 30, (2, 6))
    model = _build_model("a_")
    model(ids)
    quantize(model, mode)
    expected = model(ids)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert all(t.dtype in (torch.int8, torch.float32) for t in state.values())
    fresh = _build_model("other_names_")  # different names: keys must not depend on them
    fresh(ids)
    quantize(fresh, mode)
    assert list(fresh.state_dict()) == list(state)
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh(ids), expected)


def test_torch_module_state_dict_round_trip_and_pickle():
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int8")
    x = torch.randn(3, 32)
    expected = model(x)
    fresh = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    apply_policy(fresh, "mixed_bfloat16")
    quantize(fresh, "int8")
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    torch.testing.assert_close(fresh(x), expected)
    clone = copy.deepcopy(model)
    torch.testing.assert_close(clone(x), expected)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    torch.testing.assert_close(torch.load(buffer, weights_only=False)(x), expected)


def test_seed_my_multi_head_attention_example():
    @dtype_policies.saving.register_serializable("MyPackage")
    class MyMultiHeadAttention(layers.MultiHeadAttention):
        def get_config(self):
            config = super().get_config()
            dtype_policy_map = dtype_policies.DTypePolicyMap()
            for layer in self._flatten_layers():
                if layer.dtype_policy.quantization_mode is not None:
                    dtype_policy_map[layer.path] = layer.dtype_policy
            if len(dtype_policy_map) > 0:
                config.update({"dtype": dtype_policy_map})
            return config

    torch.manual_seed(0)
    mha = MyMultiHeadAttention(num_heads=2, key_dim=8, name="mha")
    x = torch.randn(2, 5, 16)
    mha(x, x)
    for sublayer in (mha.query, mha.key, mha.value):
        sublayer.quantize("int8")
    config = mha.get_config()
    policy_map = config["dtype"]
    assert isinstance(policy_map, DTypePolicyMap)
    assert sorted(policy_map) == ["mha/key", "mha/query", "mha/value"]
    assert policy_map["mha/query"].name == "int8_from_float32"
    restored = MyMultiHeadAttention.from_config(config)
    restored(x, x)
    assert restored.query.quantization_mode == "int8"
    assert restored.query.kernel.dtype == torch.int8
    assert restored.attention_output.quantization_mode is None
    restored.load_state_dict(mha.state_dict())
    torch.testing.assert_close(restored(x, x), mha(x, x))
    serialized = dtype_policies.saving.serialize_layer(mha)
    assert serialized["config"]["dtype"]["class_name"] == "DTypePolicyMap"
    again = dtype_policies.saving.deserialize_layer(serialized)
    again(x, x)
    assert again.value.quantization_mode == "int8"


def test_layer_config_carries_quantization_config():
    layer = _built_dense(8, (1, 64))
    layer.quantize("int4", Int4QuantizationConfig(block_size=32))
    config = layer.get_config()
    assert config["quantization_config"] == {
        "module": "keras.quantizers",
        "class_name": "Int4QuantizationConfig",
        "config": {"weight_quantizer": None, "activation_quantizer": None, "block_size": 32},
        "registered_name": None,
    }
    clone = layers.Dense.from_config(config)
    clone(torch.randn(1, 64))
    assert clone.kernel_scale.shape == (2, 8)


# ------------------------------------------------------------------ float8 oracle


def _qdq(x, scale, fmt):
    limit = torch.finfo(fmt).max
    return (x / scale).clamp(-limit, limit).to(fmt).float() * scale


def _next(scale, history, amax, fmt_max):
    peak = history.max()
    new_scale = peak / fmt_max if peak > 0 else scale
    rolled = torch.roll(history, -1)
    rolled[0] = amax
    return new_scale, rolled


def test_float8_three_step_replay_oracle():
    torch.manual_seed(0)
    layer = layers.Dense(
        4,
        dtype=dtype_policies.QuantizedFloat8DTypePolicy("float8", "float32", amax_history_length=3),
    )
    layer(torch.randn(2, 8))
    assert layer.quantization_mode == "float8"
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    state = {
        name: getattr(layer, name).clone()
        for name in (
            "inputs_scale",
            "inputs_amax_history",
            "kernel_scale",
            "kernel_amax_history",
            "outputs_grad_scale",
            "outputs_grad_amax_history",
        )
    }
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    for step in range(3):
        x = torch.randn(2, 8) * (step + 1) * 10
        kernel = layer.kernel.detach().clone()
        bias = layer.bias.detach().clone()
        # The oracle, in plain ops.
        x_q = _qdq(x, state["inputs_scale"], e4)
        k_q = _qdq(kernel, state["kernel_scale"], e4)
        y_ref = x_q @ k_q + bias
        upstream = torch.randn(2, 4) * 100
        g_q = _qdq(upstream, state["outputs_grad_scale"], e5)
        kernel_grad_ref = x_q.T @ g_q
        new = {}
        new["inputs_scale"], new["inputs_amax_history"] = _next(
            state["inputs_scale"], state["inputs_amax_history"], x.abs().max(), 448.0
        )
        new["kernel_scale"], new["kernel_amax_history"] = _next(
            state["kernel_scale"], state["kernel_amax_history"], kernel.abs().max(), 448.0
        )
        new["outputs_grad_scale"], new["outputs_grad_amax_history"] = _next(
            state["outputs_grad_scale"],
            state["outputs_grad_amax_history"],
            upstream.abs().max(),
            57344.0,
        )
        # The layer.
        layer.train()
        optimizer.zero_grad()
        y = layer(x)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-4)
        for name, value in state.items():  # the forward alone changes nothing
            torch.testing.assert_close(getattr(layer, name), value)
        y.backward(upstream)
        torch.testing.assert_close(layer.kernel.grad, kernel_grad_ref, rtol=1e-4, atol=1e-2)
        optimizer.step()
        for name, value in new.items():
            torch.testing.assert_close(getattr(layer, name), value, msg=f"step {step} {name}")
        state = {name: value.clone() for name, value in new.items()}
    # Eval mode: same outputs as train mode would give, and nothing changes.
    layer.eval()
    before = {name: getattr(layer, name).clone() for name in state}
    layer(torch.randn(2, 8)).sum().backward()
    for name, value in before.items():
        torch.testing.assert_close(getattr(layer, name), value)
    # The state is in the state_dict and never a parameter.
    assert set(state) <= set(layer.state_dict())
    assert {name for name, _ in layer.named_parameters()} == {"kernel", "bias"}


def test_float8_training_learns():
    torch.manual_seed(0)
    model = layers.Sequential(
        [layers.Dense(32, activation="relu"), layers.Dense(1)], dtype="float32"
    )
    x = torch.randn(64, 8)
    target = x.sum(1, keepdim=True)
    model(x)
    quantize(model, "float8")
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(80):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]
    assert model.layers[0].inputs_scale.item() != 1.0


@pytest.mark.parametrize("reentrant", [False, True])
def test_float8_delayed_scaling_under_activation_checkpointing(reentrant):
    """Activation checkpointing recomputes the forward during the backward:
    the recomputation reads the scales the forward read (the step's new ones
    are written when the backward is over), so the gradients and the float8
    state are those of the same steps without checkpointing, bit for bit."""
    from torch.utils.checkpoint import checkpoint

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
        quantize(model, "float8")
        return model

    x, target = torch.randn(32, 16) * 5, torch.randn(32, 4)
    plain, checkpointed = build(), build()
    for _ in range(3):
        checkpointed.load_state_dict(plain.state_dict())
        plain.zero_grad(set_to_none=True)
        checkpointed.zero_grad(set_to_none=True)
        (plain(x) - target).pow(2).mean().backward()
        inputs = x.clone().requires_grad_(reentrant)
        out = checkpoint(checkpointed, inputs, use_reentrant=reentrant)
        (out - target).pow(2).mean().backward()
        for p, q in zip(plain.parameters(), checkpointed.parameters()):
            assert torch.equal(p.grad, q.grad)
        state, other = plain.state_dict(), checkpointed.state_dict()
        assert all(torch.equal(state[k], other[k]) for k in state)
        with torch.no_grad():
            for p in plain.parameters():
                p.sub_(1e-3 * p.grad)


def test_int4_checkpoint_of_earlier_versions_loads_unchanged_in_value():
    """Before 0.3 grouped int4 stored an int8 zero point, (G, N) grids for every
    weight and no g_idx; such a state dict loads and computes the same."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 32), torch.nn.ReLU(), layers.Dense(16))
    model(torch.randn(1, 256))
    integer_zeros = Int4QuantizationConfig(block_size=64, refine_zero_points=False)
    quantize(model, "int4", integer_zeros)  # the min/max rule: integer zero points
    x = torch.randn(3, 256)
    expected = model(x)
    legacy = {}
    for key, value in model.state_dict().items():
        if key.endswith("_g_idx"):
            continue
        if key.startswith("0.") and key.endswith(("_scale", "_zero")):
            value = value.t()  # nn.Linear's grids were (G, N)
        if key.endswith("_zero"):
            assert torch.equal(value, value.round())  # normal weights: integer zero points
            value = value.to(torch.int8)
        legacy[key] = value.contiguous()
    fresh = torch.nn.Sequential(torch.nn.Linear(256, 32), torch.nn.ReLU(), layers.Dense(16))
    fresh(torch.randn(1, 256))
    quantize(fresh, "int4", integer_zeros)
    fresh.load_state_dict(legacy)
    assert fresh[0].weight_zero.dtype == torch.float32
    assert torch.equal(fresh[0].weight_g_idx, torch.arange(256) // 64)
    assert torch.equal(fresh(x), expected)


def _int4_linear(block_size=128, in_features=256, out_features=64):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(in_features, out_features))
    with torch.no_grad():
        model[0].weight[:, :block_size] *= 8.0  # groups of different ranges
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int4", config=Int4QuantizationConfig(block_size=block_size))
    return model.eval()


def test_int4_kernel_is_packed_once_per_stored_weight(monkeypatch):
    """nn.Linear stores grouped scales as (N, G); the kernel's key is taken on
    the stored buffers, not on the (G, N) views made per call."""
    from dtype_policies.quantization.kernels import int4 as int4_kernels

    model = _int4_linear()
    packs = []
    original = int4_kernels._pack
    monkeypatch.setattr(int4_kernels, "_pack", lambda *a: packs.append(1) or original(*a))
    x = torch.randn(3, 256)
    with torch.no_grad():
        outputs = [model(x) for _ in range(6)]
    assert len(packs) == 1
    assert all(torch.equal(out, outputs[0]) for out in outputs)
    with torch.no_grad():
        model[0].weight_scale.mul_(2.0)  # an in-place write repacks once
        halved = model(x)
        model(x)
    assert len(packs) == 2
    bias = model[0].bias.detach().to(halved.dtype)
    assert torch.allclose(halved - bias, 2 * (outputs[0] - bias), rtol=0.02, atol=0.02)


def test_int4_products_follow_a_stored_g_idx():
    """A `g_idx` that is not `arange(K) // block` (Keras's activation order)
    is honoured: the same weight with its groups stored in another order
    gives the same outputs."""
    model = _int4_linear()
    x = torch.randn(5, 256)
    with torch.no_grad():
        expected = model(x).float()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        # groups 0 and 1 swap places: features 0-127 now read group 1's grid
        state["0.weight_scale"] = state["0.weight_scale"].flip(1)
        state["0.weight_zero"] = state["0.weight_zero"].flip(1)
        model.load_state_dict(state)
        wrong = model(x).float()  # grids swapped, g_idx not: another weight
        state["0.weight_g_idx"] = 1.0 - state["0.weight_g_idx"]
        model.load_state_dict(state)
        swapped = model(x).float()
    assert not torch.allclose(wrong, expected, rtol=0.1, atol=0.1)
    assert torch.allclose(swapped, expected, rtol=0.02, atol=0.02)
    assert model[0].weight_g_idx[0].item() == 1.0


def _replace_entry(policy_map: DTypePolicyMap, key: str, policy: str) -> None:
    del policy_map[key]  # Keras's maps refuse to overwrite a key
    policy_map[key] = policy


@pytest.mark.parametrize(
    ("built_under", "edited_to"),
    [
        ("int8_from_float32", "int4/32_from_float32"),  # another mode
        ("int4/32_from_float32", "int4/128_from_float32"),  # another configuration
        ("int8_from_float32", "float32"),  # float again
        ("float32", "int8_from_float32"),  # quantizing a float layer
    ],
)
def test_a_map_edit_of_a_built_layer_s_quantization_is_refused_until_restored(
    built_under, edited_to
):
    """A built layer follows its map's edits of float dtypes. An edit of its
    quantization was ignored: the layer kept computing as built while its
    resolved policy, summary and config said the entry (a config that could
    not reload the layer's own weights)."""
    torch.manual_seed(0)
    policy_map = DTypePolicyMap("float32", {"dense": built_under})
    dense = layers.Dense(48, name="dense", dtype=policy_map)
    x = torch.randn(3, 64)
    expected = dense(x)
    mode = dense.quantization_mode
    _replace_entry(policy_map, "dense", edited_to)
    with pytest.raises(ValueError, match=rf"'dense' to '{re.escape(edited_to)}', edited since"):
        dense(x)
    with pytest.raises(ValueError, match="undo the edit"):
        dense.get_config()
    _replace_entry(policy_map, "dense", built_under)
    assert torch.equal(dense(x), expected)
    assert dense.quantization_mode == mode
    policy_map["other"] = "bfloat16"  # an entry of another layer: followed silently
    _replace_entry(
        policy_map, "dense", "int8_from_mixed_bfloat16" if mode == "int8" else "mixed_bfloat16"
    )
    if mode != "int4":  # a change of float dtypes: followed at once
        assert dense(x).dtype == torch.bfloat16


def test_a_float_layer_is_quantized_through_its_own_policy_not_a_map_edit():
    torch.manual_seed(0)
    policy_map = DTypePolicyMap("float32")
    dense = layers.Dense(8, name="dense", dtype=policy_map)
    dense(torch.randn(2, 16))
    dense.dtype_policy = "int8_from_float32"  # quantizes, and writes the entry
    assert dense.quantization_mode == "int8"
    assert policy_map["dense"].name == "int8_from_float32"
    assert dense(torch.randn(2, 16)).dtype == torch.float32


def test_a_legacy_int4_entry_is_read_by_the_configuration_the_layer_has():
    """`int4_from_X` builds a layer per channel and quantizes a built layer
    given it at block 128 (docs/quantization.md): an edit naming the same
    configuration another way, or changing the source alone, is followed;
    another configuration is refused (the check compared the names'
    configurations, not the layer's: it followed int4/-1 on a block-128
    layer and refused the explicit int4/128)."""
    torch.manual_seed(0)
    x = torch.randn(2, 256)
    built_under = DTypePolicyMap("float32", {"d": "int4_from_float32"})
    per_channel = layers.Dense(16, name="d", dtype=built_under)
    per_channel(x)
    _replace_entry(built_under, "d", "int4/-1_from_mixed_bfloat16")
    assert per_channel(x).dtype == torch.bfloat16
    _replace_entry(built_under, "d", "int4/128_from_float32")
    with pytest.raises(ValueError, match="now resolves its path 'd' to 'int4/128_from_float32'"):
        per_channel(x)

    given = DTypePolicyMap("float32")
    grouped = layers.Dense(16, name="g", dtype=given)
    grouped(x)
    grouped.dtype_policy = "int4_from_float32"  # block 128, the entry written as given
    assert given["g"].name == "int4_from_float32"
    _replace_entry(given, "g", "int4/128_from_mixed_bfloat16")
    assert grouped(x).dtype == torch.bfloat16
    _replace_entry(given, "g", "int4_from_float32")
    assert grouped(x).dtype == torch.float32
    _replace_entry(given, "g", "int4/-1_from_float32")
    with pytest.raises(ValueError, match="now resolves its path 'g' to 'int4/-1_from_float32'"):
        grouped(x)

    custom = layers.Dense(16, name="c", dtype=DTypePolicyMap("float32"))
    custom(x)
    custom.quantize("int4", Int4QuantizationConfig(block_size=32))  # writes int4/32_from_float32
    _replace_entry(custom.dtype_policy, "c", "int4/32_from_mixed_bfloat16")
    assert custom(x).dtype == torch.bfloat16


@pytest.mark.parametrize("given", ["map", "policy"])
def test_a_quantized_layer_refuses_a_policy_or_map_of_other_quantization(given):
    """`dense.dtype_policy = DTypePolicyMap(...)` on an int8 layer was
    accepted whatever its entry: the layer kept computing in int8 while its
    policy and config said float32 or int4/32."""
    torch.manual_seed(0)
    dense = layers.Dense(8, name="d", dtype="int8_from_float32")
    x = torch.randn(2, 32)
    expected = dense(x)
    other = (
        DTypePolicyMap("float32", {"d": "int4/32_from_float32"})
        if given == "map"
        else "int4/32_from_float32"
    )
    with pytest.raises(ValueError, match=r"quantized in mode 'int8'.*int4/32_from_float32"):
        dense.dtype_policy = other
    assert dense.dtype_policy.name == "int8_from_float32"
    assert torch.equal(dense(x), expected)
    dense.dtype_policy = DTypePolicyMap("float32", {"d": "int8_from_mixed_bfloat16"})
    assert dense(x).dtype == torch.bfloat16  # a float dtype change: followed
