"""Contract: `quantize()` on modules whose weights are read by the parent,
parametrized weights, tied weights, subclasses and other unusual modules
leaves a working model: each is skipped with a reason in the report, or
quantized correctly; never half-applied, never a crash."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dtype_policies import apply_policy, quantize
from dtype_policies.apply.summary import module_summaries
from dtype_policies.quantization import Int4QuantizationConfig

from .helpers import TOLERANCE, quantize_with, relative_error

torch.manual_seed(0)
X3 = torch.randn(2, 6, 64)


def _check_skipped_or_quantized(report, path, module, float_state):
    """`path` is either reported as quantized, or skipped with a reason and
    then its float tensors are bit-for-bit what they were."""
    quantized = [p for p, *_ in report.quantized]
    skipped = dict(report.skipped)
    assert (path in quantized) != (path in skipped), report.render()
    if path in skipped:
        assert isinstance(skipped[path], str) and skipped[path].strip()
        for key, value in float_state.items():
            now = module.state_dict()[key]
            assert now.dtype == value.dtype and torch.equal(now, value), f"{path}.{key}"


def _quantize_quietly(model, mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return quantize_with(model, mode)


# ------------------------------------------------------- weights read by the parent


@pytest.mark.parametrize("policy", [None, "mixed_bfloat16"])
@pytest.mark.parametrize("mode", ["int8", "int4_128", "float8"])
def test_multihead_attention(mode, policy):
    torch.manual_seed(0)
    model = nn.MultiheadAttention(64, 4, batch_first=True).eval()
    if policy:
        apply_policy(model, policy)
    with torch.no_grad():
        reference = model(X3, X3, X3)[0]
    out_proj_state = {k: v.clone() for k, v in model.out_proj.state_dict().items()}
    report = _quantize_quietly(model, mode)
    _check_skipped_or_quantized(report, "out_proj", model.out_proj, out_proj_state)
    with torch.no_grad():
        out = model(X3, X3, X3)[0]
    assert torch.isfinite(out).all()
    assert relative_error(out, reference) < TOLERANCE[mode]


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("mode", ["int8", "int4_128", "float8"])
def test_transformer_encoder(mode, training):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    model.train(training)
    with torch.no_grad():
        reference = model(X3)
    states = {
        name: {k: v.clone() for k, v in m.state_dict().items()}
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
    }
    report = _quantize_quietly(model, mode)
    for name, state in states.items():
        _check_skipped_or_quantized(
            report, name.replace(".", "/"), model.get_submodule(name), state
        )
    with torch.no_grad():
        out = model(X3)
    assert torch.isfinite(out).all()
    assert relative_error(out, reference) < TOLERANCE[mode]


class AttentionThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(64, 4, batch_first=True)
        self.head = nn.Linear(64, 64)

    def forward(self, x):
        return self.head(self.attention(x, x, x)[0])


@pytest.mark.parametrize(
    "policy", ["int8_from_float32", "int4_from_float32", "float8_from_float32"]
)
def test_apply_policy_keeps_weights_their_parent_reads_float_and_says_why(policy):
    """`nn.MultiheadAttention` computes with `out_proj.weight` itself (and
    `nn.TransformerEncoderLayer`'s fast path with its linears'): a quantized
    product there would never run. `apply_policy` leaves them float, as
    `quantize()` does, says why, and the attention computes what float does."""
    torch.manual_seed(0)
    model = AttentionThenLinear().eval()
    with torch.no_grad():
        reference = model.attention(X3, X3, X3)[0]
    handle = apply_policy(model, policy)
    assert handle.quantized_paths == ["head"]
    assert "read by its parent" in handle.unquantized["attention/out_proj"]
    assert not hasattr(model.attention.out_proj, "weight_int8")
    rows = {row.path: row for row in module_summaries(model)}
    assert rows["attention/out_proj"].quantization == "-"
    assert rows["head"].quantization != "-"
    with torch.no_grad():
        assert torch.equal(model.attention(X3, X3, X3)[0], reference)
    encoder = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True).eval()
    handle = apply_policy(encoder, policy)
    assert handle.quantized_paths == []
    assert sorted(handle.unquantized) == ["linear1", "linear2", "self_attn", "self_attn/out_proj"]


class ComputesWithItsChildsWeight(nn.Module):
    """As transformers' `MambaMixer` with `dt_proj`: the parent multiplies by
    its child's weight itself and never calls the child (and reads another
    child's weight's metadata only)."""

    def __init__(self):
        super().__init__()
        self.step = nn.Linear(64, 64)
        self.out = nn.Linear(64, 8)

    def forward(self, x):
        if isinstance(self.step.weight, torch.Tensor) and x.dtype != self.out.weight.dtype:
            x = x.to(self.out.weight.dtype)
        return self.out(x @ self.step.weight.t())


@pytest.mark.parametrize("how", ["quantize", "apply_policy"])
def test_a_child_whose_weight_its_parents_code_reads_and_never_calls_stays_float(how):
    """Such a child was reported quantized while its quantized forward never
    ran (the parent read a dequantized copy at every call). Found in the
    parent's source: left float, with why, the other child quantized."""
    torch.manual_seed(0)
    model = ComputesWithItsChildsWeight().eval()
    with torch.no_grad():
        reference = model(X3)
    if how == "quantize":
        report = quantize(model, "int8")
        skipped = dict(report.skipped)
    else:
        skipped = apply_policy(model, "int8_from_float32").unquantized
    assert (
        "weight read by its parent (ComputesWithItsChildsWeight, in its own code)"
        in skipped["step"]
    )
    assert not hasattr(model.step, "weight_int8") and hasattr(model.out, "weight_int8")
    with torch.no_grad():
        assert relative_error(model(X3), reference) < TOLERANCE["int8"]


class HandsItsChildToAHelper(nn.Module):
    """As transformers' `LayoutLMv3Encoder`: the parent hands its child to a
    method of its own, which reads the child's weight (a lookup table), and
    another child to a method that calls it."""

    def __init__(self):
        super().__init__()
        self.table = nn.Linear(64, 64, bias=False)
        self.static_table = nn.Linear(64, 64, bias=False)
        self.called = nn.Linear(64, 64)

    def _lookup(self, positions, bias):
        return bias.weight[:, positions]

    def _run(self, x, *, layer):
        return layer(x)

    @staticmethod
    def _static_lookup(positions, bias):
        return bias.weight[:, positions]

    def forward(self, x):
        table = self._lookup(torch.arange(64), self.table) + self._static_lookup(
            torch.arange(64), self.static_table
        )
        return self._run(x, layer=self.called) + table.sum(0)


def test_a_child_handed_to_a_method_that_reads_its_weight_stays_float():
    torch.manual_seed(0)
    model = HandsItsChildToAHelper().eval()
    with torch.no_grad():
        reference = model(X3)
    skipped = dict(quantize(model, "int8").skipped)
    assert "in its own code" in skipped["table"] and "called" not in skipped
    assert "in its own code" in skipped["static_table"]
    assert not hasattr(model.table, "weight_int8") and hasattr(model.called, "weight_int8")
    with torch.no_grad():
        assert relative_error(model(X3), reference) < TOLERANCE["int8"]


_TWO_DEFINITIONS = """
import torch
from torch import nn

USE_FIRST = False
if USE_FIRST:

    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.step = nn.Linear(64, 64)

        def forward(self, x):
            return x @ self.step.weight.t()

else:

    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.step = nn.Linear(64, 64)

        def forward(self, x):
            return self.step(x)
"""


def test_the_parents_code_read_is_the_definition_that_ran(tmp_path, monkeypatch):
    """A file defining a class twice under `if`/`else` (transformers' xLSTM
    does): `inspect.getsource` gave the first definition, so the child of a
    parent that calls it would have been left float for a read in code that
    never ran. The definition holding the class's methods is read."""
    (tmp_path / "two_definitions.py").write_text(_TWO_DEFINITIONS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import two_definitions

    model = two_definitions.Parent().eval()
    report = quantize(model, "int8")
    assert report.skipped == [] and hasattr(model.step, "weight_int8")


def test_mambas_time_step_projection_is_read_by_its_mixer():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MambaConfig(
        vocab_size=64, hidden_size=72, state_size=8, num_hidden_layers=1, expand=2
    )
    model = transformers.MambaForCausalLM(config).eval()
    report = quantize(model, "int8")
    skipped = dict(report.skipped)
    assert "read by its parent (MambaMixer" in skipped["backbone/layers/0/mixer/dt_proj"]
    mixer = model.backbone.layers[0].mixer
    assert not hasattr(mixer.dt_proj, "weight_int8") and hasattr(mixer.in_proj, "weight_int8")


class ReadsChildWeight(nn.Module):
    """A parent computing with its child's weight directly (as tied heads do)."""

    def __init__(self):
        super().__init__()
        self.child = nn.Linear(64, 64)
        self.other = nn.Linear(64, 8)

    def forward(self, x):
        return self.other(F.linear(x, self.child.weight) + self.child(x))


@pytest.mark.parametrize("policy", [None, "mixed_bfloat16"])
@pytest.mark.parametrize("mode", ["int8", "int8_wo", "int4_128", "int4_pc"])
def test_parent_reading_child_weight(mode, policy):
    torch.manual_seed(0)
    model = ReadsChildWeight()
    if policy:
        apply_policy(model, policy)
    with torch.no_grad():
        reference = model(X3)
    child_state = {k: v.clone() for k, v in model.child.state_dict().items()}
    report = _quantize_quietly(model, mode)
    _check_skipped_or_quantized(report, "child", model.child, child_state)
    with torch.no_grad():
        out = model(X3)
    assert relative_error(out, reference) < TOLERANCE[mode]


# ------------------------------------------------------- parametrized weights


class Doubled(nn.Module):
    def forward(self, weight):
        return weight * 2


def _parametrized(kind):
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    if kind == "weight_norm":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return torch.nn.utils.weight_norm(linear)
    if kind == "parametrizations.weight_norm":
        return torch.nn.utils.parametrizations.weight_norm(linear)
    if kind == "spectral_norm":
        return torch.nn.utils.spectral_norm(linear)
    if kind == "parametrizations.spectral_norm":
        return torch.nn.utils.parametrizations.spectral_norm(linear)
    torch.nn.utils.parametrize.register_parametrization(linear, "weight", Doubled())
    return linear


PARAMETRIZED = [
    "weight_norm",
    "parametrizations.weight_norm",
    "spectral_norm",
    "parametrizations.spectral_norm",
    "register_parametrization",
]


@pytest.mark.parametrize("mode", ["int8", "int4_128", "float8"])
@pytest.mark.parametrize("kind", PARAMETRIZED)
def test_parametrized_weights_are_skipped(kind, mode):
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), _parametrized(kind)).eval()
    with torch.no_grad():
        reference = model(X3)
    state = {k: v.clone() for k, v in model[2].state_dict().items()}
    report = _quantize_quietly(model, mode)
    skipped = dict(report.skipped)
    assert "2" in skipped and skipped["2"].strip(), report.render()
    assert "2" not in [p for p, *_ in report.quantized]
    assert "0" in [p for p, *_ in report.quantized]  # the rest is quantized
    for key, value in state.items():
        assert torch.equal(model[2].state_dict()[key], value), key
    with torch.no_grad():
        out = model(X3)
    assert relative_error(out, reference) < TOLERANCE[mode]


# ------------------------------------------------------- tied weights


def _tied_lm(vocab=50, dim=64):
    torch.manual_seed(0)
    embedding = nn.Embedding(vocab, dim)
    head = nn.Linear(dim, vocab, bias=False)
    head.weight = embedding.weight
    return nn.ModuleDict({"embed": embedding, "head": head})


@pytest.mark.parametrize("policy", [None, "mixed_bfloat16"])
@pytest.mark.parametrize("mode", ["int8", "int4_128", "int4_pc"])
def test_tied_embedding_and_head_quantized_once(mode, policy):
    model = _tied_lm()
    if policy:
        apply_policy(model, policy)
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model["head"](model["embed"](ids))
    report = _quantize_quietly(model, mode)
    with torch.no_grad():
        out = model["head"](model["embed"](ids))
    assert relative_error(out, reference) < TOLERANCE[mode]
    quantized = [p for p, *_ in report.quantized]
    state = model.state_dict()
    integer = {k: v for k, v in state.items() if v.dtype == torch.int8}
    embed_data = [v for k, v in integer.items() if k.startswith("embed.")]
    head_data = [v for k, v in integer.items() if k.startswith("head.")]
    shared = bool(embed_data and head_data) and any(
        a.data_ptr() == b.data_ptr() for a in embed_data for b in head_data
    )
    assert shared or len(quantized) == 1, (report.render(), list(integer))


# ------------------------------------------------------- subclasses and others


class ScaledLinear(nn.Linear):
    """A subclass with its own forward (LoRA-style wrappers look like this)."""

    def forward(self, x):
        return super().forward(x) * 2 + 1


@pytest.mark.parametrize("mode", ["int8", "int4_128", "float8"])
def test_linear_subclass_with_own_forward(mode):
    torch.manual_seed(0)
    model = nn.Sequential(ScaledLinear(64, 32))
    with torch.no_grad():
        reference = model(X3)
    state = {k: v.clone() for k, v in model[0].state_dict().items()}
    report = _quantize_quietly(model, mode)
    _check_skipped_or_quantized(report, "0", model[0], state)
    with torch.no_grad():
        out = model(X3)
    assert relative_error(out, reference) < TOLERANCE[mode]


def test_uninitialized_lazy_linear_is_skipped():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LazyLinear(16))
    report = _quantize_quietly(model, "int8")
    assert "1" in dict(report.skipped) and dict(report.skipped)["1"].strip()
    out = model(X3)  # the lazy module initializes itself (float) and works
    assert out.shape == (2, 6, 16) and torch.isfinite(out).all()


@pytest.mark.parametrize("mode", ["int8", "int4_128", "float8"])
def test_unsupported_modules_are_reported_and_untouched(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(6, 6, 3, padding=1), nn.Flatten(), nn.Linear(6 * 64, 8))
    gru = nn.GRU(8, 8, batch_first=True)
    model.add_module("gru_in", nn.Unflatten(1, (1, 8)))
    model.add_module("gru", gru)
    with torch.no_grad():
        reference = model(X3)[0]
    conv_state = {k: v.clone() for k, v in model[0].state_dict().items()}
    report = _quantize_quietly(model, mode)
    skipped = dict(report.skipped)
    assert skipped.get("0") and skipped.get("gru"), report.render()
    for key, value in conv_state.items():
        assert torch.equal(model[0].state_dict()[key], value)
    with torch.no_grad():
        out = model(X3)[0]
    assert relative_error(out, reference) < TOLERANCE[mode]


@pytest.mark.parametrize("mode", ["int8", "int4_128", "int4_pc", "float8"])
@pytest.mark.parametrize(("in_features", "out_features", "bias"), [(1, 1, True), (5, 3, False)])
def test_degenerate_linear_shapes(mode, in_features, out_features, bias):
    """Tiny layers. (Weight-only int8 crashes the interpreter on such shapes:
    it is exercised in a subprocess in test_numerical_edges.py.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(in_features, out_features, bias=bias))
    apply_policy(model, "mixed_bfloat16")
    x = torch.randn(4, in_features)
    with torch.no_grad():
        reference = model(x)
    _quantize_quietly(model, mode)
    with torch.no_grad():
        out = model(x)
    assert out.shape == (4, out_features) and torch.isfinite(out).all()
    tolerance = 0.35 if mode.startswith("int4") else TOLERANCE[mode]
    assert relative_error(out, reference) < tolerance


def test_module_reached_twice_is_quantized_once():
    torch.manual_seed(0)
    shared = nn.Linear(64, 64)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    with torch.no_grad():
        reference = model(X3)
    report = _quantize_quietly(model, "int8")
    assert [p for p, *_ in report.quantized] == ["0"]
    with torch.no_grad():
        assert relative_error(model(X3), reference) < TOLERANCE["int8"]


def test_register_linear_kind_third_party_class():
    """A class storing its weight as (in, out) joins the linear kinds."""
    from dtype_policies.quantization import register_linear_kind

    class InOut(nn.Module):
        def __init__(self, k, n):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(k, n) / k**0.5)
            self.bias = nn.Parameter(torch.randn(n))

        def forward(self, x):
            return x @ self.weight + self.bias

    register_linear_kind(InOut, weight="weight", layout="in_out", bias="bias")
    torch.manual_seed(0)
    model = nn.Sequential(InOut(64, 32))
    with torch.no_grad():
        reference = model(X3)
    report = quantize_with(model, "int8")
    assert [p for p, *_ in report.quantized] == ["0"]
    assert "0.weight_int8" in model.state_dict()
    assert model.state_dict()["0.weight_int8"].shape == (64, 32)  # the module's own orientation
    with torch.no_grad():
        assert relative_error(model(X3), reference) < TOLERANCE["int8"]


@pytest.mark.parametrize("mode", ["int8", "int8_wo", "int4_128", "float8"])
@pytest.mark.parametrize(
    ("built_with", "called_with"),
    [((4, 64), (2, 3, 64)), ((2, 3, 64), (5, 64)), ((2, 3, 64), (4, 7, 64))],
)
def test_quantized_einsum_with_ellipsis_other_input_ranks(mode, built_with, called_with):
    """An EinsumDense with a `...` equation takes any leading shape when
    float; quantized, it must too (not only the shape it was built with)."""
    from dtype_policies import layers

    torch.manual_seed(0)
    layer = layers.EinsumDense("...b,bc->...c", output_shape=32, bias_axes="c")
    layer(torch.randn(built_with))
    x = torch.randn(called_with)
    with torch.no_grad():
        reference = layer(x)
    quantize_with(layer, mode)
    with torch.no_grad():
        out = layer(x)
    assert out.shape == (*called_with[:-1], 32)
    assert relative_error(out, reference) < TOLERANCE[mode]


@pytest.mark.usefixtures("quiet")
def test_unusual_modules_stay_correct():
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2)
    encoder.eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        reference = encoder(x)
    report = quantize(encoder, "int8")
    reasons = dict(report.skipped)
    assert "read by its parent" in reasons["layers/0/self_attn/out_proj"]
    assert "read by its parent" in reasons["layers/0/linear1"]
    with torch.no_grad():
        assert torch.allclose(encoder(x), reference, atol=1e-5)

    class ReadsChild(nn.Module):
        def __init__(self):
            super().__init__()
            self.child = nn.Linear(16, 16)

        def forward(self, x):
            return nn.functional.linear(x, self.child.weight, self.child.bias)

    parent = ReadsChild()
    x = torch.randn(3, 16)
    reference = parent(x)
    quantize(parent, "int8")
    assert ((parent(x) - reference).norm() / reference.norm()) < 0.02

    normed = nn.Sequential(
        nn.Linear(16, 16),
        torch.nn.utils.parametrizations.weight_norm(nn.Linear(16, 16)),
        nn.utils.spectral_norm(nn.Linear(16, 8)),
    ).eval()
    reference = normed(x)
    report = quantize(normed, "int8")
    assert [path for path, _, _ in report.quantized] == ["0"]
    assert "parametrized" in dict(report.skipped)["1"]
    assert "spectral_norm" in dict(report.skipped)["2"]
    assert ((normed(x) - reference).norm() / reference.norm()) < 0.02

    bag = nn.EmbeddingBag(10, 4, mode="sum")
    apply_policy(bag, "mixed_bfloat16")
    ids, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])
    for weights in (torch.rand(4), torch.rand(4).bfloat16()):
        assert bag(ids, offsets, per_sample_weights=weights).dtype == torch.bfloat16

    recurrent = nn.LSTM(8, 16, batch_first=True)
    apply_policy(recurrent, "float32")
    report = quantize(recurrent, "int8")
    assert report.num_quantized == 0
    assert report.skipped == [("(root)", "no quantize support: LSTM, not a quantizable kind")]
    assert report.unsupported_parameters == report.total_parameters == 1664


@pytest.mark.usefixtures("quiet")
def test_tied_weights_are_quantized_once_and_shared():
    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 32)
            self.head = nn.Linear(32, 100, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.embed(ids))

    # int4 keeps a tied table in (weight-only) int8 unless told otherwise.
    for mode, config, stored in (
        ("int8", None, "int8"),
        ("int4", None, "int8"),
        ("int4", Int4QuantizationConfig(tied_embeddings="int4"), "int4"),
    ):
        model = TiedLM()
        ids = torch.randint(0, 100, (2, 5))
        reference = model(ids)
        report = quantize(model, mode, config)
        assert {m for _, m, _ in report.quantized} == {stored}
        assert getattr(model.head, f"weight_{stored}") is getattr(model.embed, f"weight_{stored}")
        assert model.head.weight_scale is model.embed.weight_scale
        assert ((model(ids) - reference).norm() / reference.norm()) < 0.2


def test_apply_policy_refuses_lazy_modules_not_yet_initialized_and_changes_nothing():
    model = nn.Sequential(nn.Linear(6, 6), nn.LazyLinear(4))
    before = type(model[0])
    with pytest.raises(ValueError, match=r"'1' \(LazyLinear\) not initialized yet.*Nothing"):
        apply_policy(model, "mixed_bfloat16")
    assert type(model[0]) is before and not hasattr(model[0], "dtype_policy")
    model(torch.randn(2, 6))  # initialized: it is an nn.Linear now
    handle = apply_policy(model, "mixed_bfloat16")
    assert model(torch.randn(2, 6)).dtype == torch.bfloat16
    handle.remove()
    assert type(model[1]) is nn.Linear and model(torch.randn(2, 6)).dtype == torch.float32


def test_remove_survives_a_module_whose_own_code_replaced_its_class():
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 4))
    handle = apply_policy(model, "mixed_bfloat16")
    model[1].__class__ = nn.Linear  # what a lazy module's first forward does to its class
    handle.remove()
    assert type(model[0]) is nn.Linear and model(torch.randn(2, 6)).dtype == torch.float32


def test_an_instance_forward_on_a_leaf_linear_still_reads_its_weight_in_the_compute_dtype():
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)
    original = linear.forward
    linear.forward = lambda x: original(x) * 2  # as accelerate's hooks wrap a forward
    model = nn.Sequential(linear, nn.ReLU())
    apply_policy(model, "mixed_bfloat16")
    x = torch.randn(2, 4)
    direct = model[0](x)  # called alone: no enclosing scope
    assert direct.dtype == torch.bfloat16
    expected = F.linear(x.bfloat16(), linear.weight.bfloat16(), linear.bias.bfloat16()) * 2
    assert torch.equal(direct, expected)
    assert torch.equal(model(x), torch.relu(expected))


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_torchs_float_padding_masks_are_clamped_not_turned_into_nan(policy):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8)
    padding = torch.zeros(2, 4)
    padding[1, :] = torch.finfo(torch.float32).min  # every key of the second sequence
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    reference = mha(q, q, q, key_padding_mask=padding)[0]
    assert torch.isfinite(reference).all()
    apply_policy(mha, policy)
    out = mha(q, q, q, key_padding_mask=padding)[0]
    assert torch.isfinite(out).all()
    assert relative_error(out.float(), reference) < 0.05


def test_a_map_key_naming_a_shared_module_s_later_path_says_so():
    from dtype_policies import DTypePolicyMap

    shared = torch.nn.Linear(8, 8)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        apply_policy(model, DTypePolicyMap("mixed_bfloat16", {"2": "float32"}))
    messages = [str(w.message) for w in seen if "DTypePolicyMap key" in str(w.message)]
    assert messages == [
        "apply_policy(): the DTypePolicyMap key '2' matches only '2', another path of the "
        "module at '0': a module reachable by several paths takes the policy of its first "
        "path (write the key for '0')."
    ]
    assert model(torch.randn(2, 8)).dtype == torch.bfloat16  # the first path's policy


def test_a_map_key_matching_nothing_costs_little_on_a_model_of_many_routes():
    import time

    from dtype_policies import DTypePolicyMap

    inner = torch.nn.Linear(4, 4)
    for _ in range(24):  # 2**24 routes to the innermost module
        level = torch.nn.Module()
        level.a = level.b = inner
        inner = level
    start = time.perf_counter()
    with pytest.warns(UserWarning, match="'nothing' matches no module path"):
        apply_policy(inner, DTypePolicyMap("float32", {"nothing": "bfloat16"}))
    assert time.perf_counter() - start < 10.0  # was 2**24 paths walked (minutes)


class _GraphConvolution(nn.Module):
    """A graph convolution holding its adjacency as a sparse buffer."""

    def __init__(self, layout: torch.layout) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        generator = torch.Generator().manual_seed(0)
        adjacency = (torch.rand(5, 5, generator=generator) > 0.5).float()
        sparse = adjacency.to_sparse() if layout is torch.sparse_coo else adjacency.to_sparse_csr()
        self.register_buffer("adj", sparse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(self.adj, self.lin(x).to(self.adj.dtype))


LAYOUTS = [torch.sparse_coo, torch.sparse_csr]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_a_sparse_buffer_is_counted_by_its_parts_and_refused_by_save_by_name(layout, tmp_path):
    from dtype_policies import saving
    from dtype_policies.apply.summary import model_totals
    from dtype_policies.saving import CheckpointError

    model = _GraphConvolution(layout)
    x = torch.randn(5, 8)
    expected = model(x)
    # torch multiplies bfloat16 CSR matrices by nothing ("not implemented for 'BFloat16'")
    apply_policy(model, "mixed_bfloat16" if layout is torch.sparse_coo else "float32")
    _quantize_quietly(model, "int8")
    assert model.adj.layout is layout and model.adj.dtype == torch.float32
    assert relative_error(model(x).float(), expected) < 0.05
    dense = model.adj.to_dense()
    stored = int(dense.count_nonzero()) * 4  # float32 values
    stored += (2 * int(dense.count_nonzero()) if layout is torch.sparse_coo else 6) * 8
    if layout is torch.sparse_csr:
        stored += int(dense.count_nonzero()) * 8  # column indices
    parameters, size = model_totals(model)
    assert parameters == 8 * 8 + 8  # the linear's; a buffer is no parameter
    linear = 8 * 8 + 8 * 4 + 8 * 4  # int8 weight, float32 scales per block and bias
    assert size - linear == stored, (size, linear, stored)
    rows = {row.path: row for row in module_summaries(model)}
    assert rows["(root)"].bytes == stored  # the model's own row: its adjacency alone
    target = tmp_path / "gcn.safetensors"
    with pytest.raises(CheckpointError, match=rf"'adj' is of layout {layout}"):
        saving.save(model, target)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_the_watch_of_a_compiled_model_sees_writes_to_a_sparse_buffer(layout):
    from dtype_policies._frozen import ModelWatch

    model = _GraphConvolution(layout)
    watch = ModelWatch(model)
    assert watch.unstrided == [model.adj] and watch.unchanged()
    model(torch.randn(5, 8))
    assert watch.unchanged()
    with torch.no_grad():
        model.adj.mul_(2)
    assert not watch.unchanged()
    watch = ModelWatch(model)
    model.adj = _GraphConvolution(layout).adj
    assert not watch.unchanged()
    if layout is torch.sparse_coo:  # `.data =` on a CSR tensor changes nothing (torch's)
        watch = ModelWatch(model)
        model.adj.data = _GraphConvolution(layout).adj.clone()  # the same values, new parts
        assert not watch.unchanged()


@pytest.mark.parametrize("part", ["values", "offsets"])
def test_the_watch_sees_a_write_to_either_part_of_a_jagged_buffer(part):
    from dtype_policies._frozen import ModelWatch

    model = nn.Linear(3, 3)
    pieces = [torch.ones(2, 3), torch.ones(4, 3)]
    model.register_buffer("ragged", torch.nested.nested_tensor(pieces, layout=torch.jagged))
    watch = ModelWatch(model)
    assert watch.unstrided == [model.ragged] and watch.unchanged()
    getattr(model.ragged, part)().add_(0)  # in place: the part's version moves
    assert not watch.unchanged()


@pytest.mark.slow
@pytest.mark.parametrize("policy", [None, "mixed_bfloat16"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_compile_for_inference_runs_a_model_with_a_sparse_buffer(layout, policy):
    """Its weights stay graph inputs (Dynamo cannot make a frozen sparse
    tensor an attribute of a graph: with a policy, an IndexError inside
    torch), with a warning naming the buffer; the values are eager's and
    follow a write."""
    from dtype_policies import compile_for_inference

    model = _GraphConvolution(layout).eval()
    if policy is not None and layout is torch.sparse_coo:  # CSR has no bfloat16 product
        apply_policy(model, policy)
    x = torch.randn(5, 8)
    tolerance = 1e-5 if model.adj.dtype == torch.float32 and policy is None else 2e-2
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        expected = model(x)
        compiled = compile_for_inference(model, autotune=False)
        torch.testing.assert_close(compiled(x), expected, rtol=tolerance, atol=tolerance)
        model.adj.mul_(3)
        torch.testing.assert_close(compiled(x), model(x), rtol=tolerance, atol=tolerance)
    assert any("'adj' are sparse or nested tensors" in str(w.message) for w in caught)
