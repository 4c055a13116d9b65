"""A weight shared by several modules is quantized in all of them or in none;
transformers' scaled word embeddings (Gemma, BART) are quantized as tables
whose rows are scaled."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dtype_policies import DTypePolicyMap, apply_policy, quantize
from dtype_policies.quantization.kinds import SCALED_EMBEDDING, kind_of


class ScaledWordEmbedding(nn.Embedding):
    """transformers' form (Gemma's), word for word."""

    def __init__(self, num_embeddings: int, embedding_dim: int, embed_scale: float = 1.0):
        super().__init__(num_embeddings, embedding_dim)
        self.embed_scale = nn.Buffer(torch.tensor(embed_scale), persistent=False)

    def forward(self, input_ids: torch.Tensor):
        return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)


class ShiftedEmbedding(nn.Embedding):
    def forward(self, input_ids: torch.Tensor):
        return super().forward(input_ids) + 1.0


class TiedLM(nn.Module):
    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.embed = embedding
        self.body = nn.Linear(64, 64)
        self.head = nn.Linear(64, 256, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.embed(ids))))


IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))


def test_a_tied_head_stays_float_when_its_table_cannot_be_quantized():
    torch.manual_seed(0)
    model = TiedLM(ShiftedEmbedding(256, 64))
    reference = model(IDS)
    with pytest.warns(UserWarning, match="'embed' \\(its class ShiftedEmbedding defines"):
        report = quantize(model, "int8")
    assert [path for path, *_ in report.quantized] == ["body"]
    reasons = dict(report.skipped)
    assert reasons["head"] == (
        "no quantize support: its weight is shared with 'embed', which keeps it in floating point"
    )
    assert model.head.weight is model.embed.weight and isinstance(model.head.weight, nn.Parameter)
    assert not hasattr(model.head, "weight_int8")
    assert ((model(IDS) - reference).norm() / reference.norm()).item() < 0.02  # only `body`


def test_transformers_scaled_embedding_is_quantized_once_with_its_head():
    torch.manual_seed(0)
    model = TiedLM(ScaledWordEmbedding(256, 64, embed_scale=8.0))
    assert kind_of(model.embed) is SCALED_EMBEDDING
    reference = model(IDS)
    table = model.embed.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = quantize(model, "int8")
    assert sorted(path for path, *_ in report.quantized) == ["body", "embed", "head"]
    assert model.embed.weight_int8 is model.head.weight_int8  # stored once
    rows = model.embed(IDS)
    expected = model.embed.weight[IDS] * 8.0  # the dequantized table's rows, scaled
    assert torch.allclose(rows, expected, atol=1e-6)
    assert ((rows - table[IDS] * 8.0).norm() / (table[IDS] * 8.0).norm()).item() < 0.01
    assert ((model(IDS) - reference).norm() / reference.norm()).item() < 0.03


def test_other_embedding_subclasses_are_not_taken_for_scaled_ones():
    assert kind_of(ShiftedEmbedding(4, 4)) is not SCALED_EMBEDDING
    assert kind_of(nn.Embedding(4, 4)) is not SCALED_EMBEDDING


def test_gemma_under_mixed_bfloat16_stores_its_tied_table_once():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    model = transformers.Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        reference = model(IDS).logits
        apply_policy(model, "mixed_bfloat16")
        policied = model(IDS).logits.float()
        quantize(model, "int8")
        ours = model(IDS).logits.float()
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert embedding.weight_int8 is head.weight_int8
    assert not any(p.dim() == 2 for p in model.parameters())  # no float matrix is left
    scale = reference.abs().max()
    assert ((ours - reference).abs().max() / scale).item() < 0.05
    assert ((policied - reference).abs().max() / scale).item() < 0.02


@pytest.mark.parametrize("policy", ["int8_from_mixed_bfloat16", "int4/32_from_float32"])
def test_apply_policy_with_a_quantized_policy_stores_a_tied_table_once(policy):
    """`quantize()` stored the table once; a quantized policy through
    `apply_policy` (the advisor's `advice.apply`) stored it twice."""
    torch.manual_seed(0)
    model = TiedLM(nn.Embedding(256, 64))
    reference = TiedLM(nn.Embedding(256, 64))
    reference.load_state_dict(model.state_dict())
    apply_policy(model, policy)
    apply_policy(reference, policy.split("_from_")[1])
    stored = [name for name in model.embed._buffers if name.startswith("weight_")]
    assert stored and all(
        model.embed._buffers[name] is model.head._buffers[name] for name in stored
    )
    with torch.no_grad():
        error = (model(IDS).float() - reference(IDS).float()).norm() / reference(IDS).float().norm()
    assert error < (0.05 if policy.startswith("int8") else 0.2)  # random weights, int4/32


@pytest.mark.parametrize("kept", ["embed", "head"])
def test_a_tied_weight_filtered_out_on_one_side_stays_float_on_both(kept):
    """Quantizing only one of two modules sharing a table stored a quantized
    copy beside the float table (more memory, and the two sides untied)."""
    torch.manual_seed(0)
    model = TiedLM(nn.Embedding(256, 64))
    other = "head" if kept == "embed" else "embed"
    report = quantize(model, "int8", filters=f"^(body|{other})$")
    assert [path for path, *_ in report.quantized] == ["body"]
    assert dict(report.skipped)[other] == (
        f"filtered out: its weight is shared with '{kept}', which keeps it in floating point"
    )
    assert model.head.weight is model.embed.weight and not hasattr(model.head, "weight_int8")


@pytest.mark.parametrize("kept", ["embed", "head"])
def test_a_policy_map_quantizing_one_side_of_a_tied_weight(kept):
    torch.manual_seed(0)
    model = TiedLM(nn.Embedding(256, 64))
    other = "head" if kept == "embed" else "embed"
    handle = apply_policy(model, DTypePolicyMap("float32", {other: "int8_from_float32"}))
    assert handle.quantized_paths == []
    assert handle.unquantized == {
        other: f"its weight is shared with '{kept}', which keeps it in floating point"
    }
    assert model.head.weight is model.embed.weight
    assert model.head.dtype_policy.name == "float32"  # the policy's float source


def test_a_policy_map_quantizing_a_tied_weight_in_two_modes_raises_and_changes_nothing():
    torch.manual_seed(0)
    model = TiedLM(nn.Embedding(256, 64))
    policies = DTypePolicyMap(
        "float32", {"embed": "int4_from_float32", "head": "int8_from_float32"}
    )
    with pytest.raises(ValueError, match=r"'head' and 'embed' share one weight"):
        apply_policy(model, policies)
    assert model.head.weight is model.embed.weight and not hasattr(model.head, "dtype_policy")


def test_float8_on_one_side_of_a_tied_weight_keeps_the_other_float():
    """float8 keeps its float weight: its tied partner's int8 copy would be a
    second table, untied from it in training."""
    torch.manual_seed(0)
    model = TiedLM(nn.Embedding(256, 64))
    policies = DTypePolicyMap(
        "mixed_bfloat16",
        {"head": "float8_from_mixed_bfloat16", "embed": "int8_from_mixed_bfloat16"},
    )
    handle = apply_policy(model, policies)
    assert handle.quantized_paths == ["head"]
    assert handle.unquantized == {
        "embed": "its weight is shared with 'head', which keeps it in floating point"
    }
    assert model.head.weight is model.embed.weight


class LayerTiedLM(nn.Module):
    """This library's `Embedding` whose table is a torch linear head's weight."""

    def __init__(self):
        super().__init__()
        from dtype_policies import layers

        self.embed = layers.Embedding(256, 64)
        self.embed.build()
        self.head = nn.Linear(64, 256, bias=False)
        self.head.weight = self.embed.embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


@pytest.mark.parametrize("how", ["int8", "int4", "int8_from_float32"])
def test_a_layer_table_tied_to_a_torch_head_is_stored_once_and_reloads(how, tmp_path):
    from dtype_policies import saving

    torch.manual_seed(0)
    model = LayerTiedLM()
    if "_from_" in how:
        apply_policy(model, how)
    else:
        quantize(model, how)
    state = model.state_dict()
    # int4 stores a tied table as int8; one tensor under both names
    assert state["embed.embeddings_int8"].data_ptr() == state["head.weight_int8"].data_ptr()
    assert state["embed.embeddings_scale"].data_ptr() == state["head.weight_scale"].data_ptr()
    expected = model(IDS)
    table = model.head.weight  # dequantized
    assert torch.equal(model.embed(IDS), table[IDS])
    saving.save(model, tmp_path / "ckpt")
    fresh = LayerTiedLM()
    saving.load(fresh, tmp_path / "ckpt")
    assert torch.equal(fresh(IDS), expected)
    loaded = fresh.state_dict()
    assert loaded["embed.embeddings_int8"].data_ptr() == loaded["head.weight_int8"].data_ptr()


class TiedAutoencoder(nn.Module):
    """A torch linear (out, in) whose weight is a Keras-style Dense kernel (in, out)."""

    def __init__(self):
        super().__init__()
        from dtype_policies import layers

        self.encode = nn.Linear(32, 16, bias=False)
        self.decode = layers.Dense(32, use_bias=False)
        self.decode.build((None, 16))
        self.decode.kernel = self.encode.weight
        self.body = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.decode(torch.relu(self.encode(x))))


@pytest.mark.parametrize("how", ["int8", "int4", "int8_from_float32"])
def test_a_weight_its_holders_lay_out_otherwise_stays_float_in_both(how, tmp_path):
    from dtype_policies import saving

    torch.manual_seed(0)
    model = TiedAutoencoder()
    x = torch.randn(4, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = apply_policy(model, how) if "_from_" in how else quantize(model, how)
    assert model.decode.kernel is model.encode.weight  # still one Parameter
    assert isinstance(model.encode.weight, nn.Parameter)
    if "_from_" in how:
        assert "encode" not in result.quantized_paths and "decode" not in result.quantized_paths
        assert "body" in result.quantized_paths
    else:
        reasons = dict(result.skipped)
        assert "lays it out otherwise" in reasons["encode"] and "'decode'" in reasons["encode"]
        assert "'encode'" in reasons["decode"]
        assert [path for path, *_ in result.quantized] == ["body"]
    # the tied pair computes as before; only `body` is quantized
    body = model.body(model.decode(torch.relu(model.encode(x))))
    assert torch.equal(model(x), body)
    assert torch.equal(model.decode(torch.relu(model.encode(x))), expected_mid(model, x))
    saving.save(model, tmp_path / "ckpt")
    fresh = TiedAutoencoder()
    saving.load(fresh, tmp_path / "ckpt")
    assert torch.equal(fresh(x), model(x))


def expected_mid(model: TiedAutoencoder, x: torch.Tensor) -> torch.Tensor:
    weight = model.encode.weight
    return torch.relu(x @ weight.t()) @ weight


def test_a_third_holder_laid_out_otherwise_is_the_one_named_and_counted():
    torch.manual_seed(0)
    model = TiedAutoencoder()
    model.encode_again = nn.Linear(32, 16, bias=False)
    model.encode_again.weight = model.encode.weight
    with pytest.warns(UserWarning, match="stay in floating point"):
        report = quantize(model, "int8")
    reasons = dict(report.skipped)
    assert "'decode'" in reasons["encode"] and "'decode'" in reasons["encode_again"]
    assert report.unsupported_parameters == model.encode.weight.numel()
