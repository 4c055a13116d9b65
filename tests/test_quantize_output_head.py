"""`quantize()` computes a model's output head from float32 when its product
rounds its inputs to int8 and its policy would hand out 16-bit logits: the
same integer product, with float32 logits."""

from __future__ import annotations

import warnings

import pytest
import torch
from tests.tiny_models import tiny_decoder

from dtype_policies import DTypePolicyMap, apply_policy, quantize, saving
from dtype_policies.quantizers import Int4QuantizationConfig, Int8QuantizationConfig

IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def quantized(mode: str, config=None, policy="mixed_bfloat16", tie=True):
    model = tiny_decoder(tie=tie)
    if policy is not None:
        apply_policy(model, policy)
    report = quantize(model, mode, config)
    return model, report


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def test_the_default_int8_head_computes_from_float32_and_the_rest_as_applied():
    model, report = quantized("int8")
    assert dict((path, policy) for path, _, policy in report.quantized)["lm_head"] == (
        "int8_from_float32"
    )
    assert model.lm_head.dtype_policy.name == "int8_from_float32"
    assert model.model.embed_tokens.dtype_policy.name == "int8_from_mixed_bfloat16"
    assert model.model.layers[0].mlp.down_proj.dtype_policy.name == "int8_from_mixed_bfloat16"
    # the tied table is still stored once
    assert model.lm_head.weight_int8 is model.model.embed_tokens.weight_int8
    out = logits(model)
    assert out.dtype == torch.float32
    # the same as a head mapped to float32 before quantizing: its bfloat16
    # hidden states rounded to int8 by the same rule
    mapped = tiny_decoder(tie=True)
    apply_policy(mapped, DTypePolicyMap("mixed_bfloat16", {"lm_head": "float32"}))
    quantize(mapped, "int8")
    assert torch.equal(logits(mapped), out)


def test_float32_logits_are_the_16_bit_ones_before_their_rounding():
    model, _ = quantized("int8")
    out = logits(model)
    apply_policy(model.lm_head, "mixed_bfloat16")  # as the model's policy says
    assert model.lm_head.dtype_policy.name == "int8_from_mixed_bfloat16"
    rounded = logits(model)
    assert rounded.dtype == torch.bfloat16
    assert torch.equal(out.to(torch.bfloat16), rounded)
    assert not torch.equal(out, rounded.float())


@pytest.mark.parametrize(
    ("mode", "config", "tie", "head_policy"),
    [
        ("int4", None, True, "int8_from_float32"),  # the tied table's int8
        ("int4", None, False, "int4/128_from_mixed_bfloat16"),  # weight-only int4
        (
            "int4",
            Int4QuantizationConfig(block_size=32, activation_block_size=32),
            False,
            "int4/32_from_float32",
        ),  # W4A8
        (
            "int8",
            Int8QuantizationConfig(activation_quantizer=None),
            True,
            "int8_from_mixed_bfloat16",
        ),  # weight-only int8
        ("int8", Int8QuantizationConfig(), False, "int8_from_float32"),  # Keras's per-token
        ("float8", None, False, "float8_from_mixed_bfloat16"),
    ],
)
def test_which_heads_compute_from_float32(mode, config, tie, head_policy):
    model, _ = quantized(mode, config, tie=tie)
    assert model.lm_head.dtype_policy.name == head_policy
    expected = torch.float32 if head_policy.endswith("_from_float32") else torch.bfloat16
    assert logits(model).dtype == expected


def test_a_float32_model_is_quantized_as_before_and_follows_conversions():
    from dtype_policies.quantization.modules import computes_in_own_dtype

    model, _ = quantized("int8", policy=None)
    assert computes_in_own_dtype(model.lm_head)  # no application of quantize()'s own above
    model.to(torch.bfloat16)
    assert model.lm_head.dtype_policy.name == "int8_from_bfloat16"  # as every module


def test_a_model_in_bfloat16_without_a_policy_computes_in_its_own_dtype_throughout():
    from dtype_policies.quantization.modules import computes_in_own_dtype

    model = tiny_decoder(tie=True).to(torch.bfloat16)
    quantize(model, "int8")
    assert model.lm_head.dtype_policy.name == "int8_from_bfloat16"
    assert computes_in_own_dtype(model.lm_head)  # follows conversions as every module
    assert logits(model).dtype == torch.bfloat16


def test_a_float32_model_is_unchanged():
    model, report = quantized("int8", policy=None)
    assert {policy for _, _, policy in report.quantized} == {"int8_from_float32"}
    assert logits(model).dtype == torch.float32


def test_a_later_policy_application_sets_the_head_as_any_module():
    model, _ = quantized("int8")
    handle = apply_policy(model, "mixed_bfloat16")
    assert model.lm_head.dtype_policy.name == "int8_from_mixed_bfloat16"
    assert logits(model).dtype == torch.bfloat16
    handle.remove()
    assert model.lm_head.dtype_policy.name == "int8_from_float32"  # its own dtype
    assert logits(model).dtype == torch.float32


def test_the_head_is_the_application_s_own_entry_for_its_handle_and_for_saving(tmp_path):
    converted = tiny_decoder(tie=True)
    apply_policy(converted, "mixed_bfloat16")
    quantize(converted, "int8")
    converted.to(torch.bfloat16)  # policies do not follow conversions
    assert converted.lm_head.dtype_policy.name == "int8_from_float32"
    model = tiny_decoder(tie=True)
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int8")
    saving.save(model, tmp_path / "ckpt")
    fresh = tiny_decoder(tie=True)
    saving.load(fresh, tmp_path / "ckpt")
    for each in (model, fresh):  # the live and the reloaded model, step by step
        assert each.lm_head.dtype_policy.name == "int8_from_float32"
        again = apply_policy(each, "mixed_bfloat16")  # in place of the one in force
        assert each.lm_head.dtype_policy.name == "int8_from_mixed_bfloat16"
        again.remove()  # every module computes in its own dtype again
        assert each.lm_head.dtype_policy.name == "int8_from_float32"
        assert each.model.layers[0].mlp.down_proj.dtype_policy.name == "int8_from_float32"


def test_a_filtered_out_head_and_a_quantized_body_alone_are_left_as_they_are():
    model = tiny_decoder(tie=False)
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int8", filters=r"^model/")
    assert model.lm_head.dtype_policy.name == "mixed_bfloat16"
    assert logits(model).dtype == torch.bfloat16
    model = tiny_decoder(tie=False)
    apply_policy(model, "mixed_bfloat16")
    quantize(model.model, "int8")
    assert model.lm_head.dtype_policy.name == "mixed_bfloat16"


class EmbeddingNamedHead(torch.nn.Module):
    """A model naming a table as its output embeddings (FSMT's form): its
    logits come from a linear tied to it."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(128, 64)
        self.project = torch.nn.Linear(64, 128, bias=False)
        self.project.weight = self.embed.weight

    def get_output_embeddings(self):
        return self.embed

    def forward(self, ids):
        return self.project(self.embed(ids))


class NoHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)

    def get_output_embeddings(self):
        raise NotImplementedError("no head here")

    def forward(self, x):
        return self.linear(x)


class HeadAsProperty(NoHead):
    get_output_embeddings = property(lambda self: self.linear)  # type: ignore[assignment]


def test_only_a_linear_head_a_model_names_is_changed():
    torch.manual_seed(0)
    model = EmbeddingNamedHead()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int8")
    assert model.embed.dtype_policy.name == "int8_from_mixed_bfloat16"
    assert model.project.dtype_policy.name == "int8_from_mixed_bfloat16"
    assert model(IDS).dtype == torch.bfloat16
    for kind in (NoHead, HeadAsProperty):
        model = kind()
        apply_policy(model, "mixed_bfloat16")
        report = quantize(model, "int8")
        assert report.quantized == [("linear", "int8", "int8_from_mixed_bfloat16")]


def test_the_float32_head_saves_and_loads(tmp_path):
    model, _ = quantized("int8")
    expected = logits(model)
    saving.save(model, tmp_path / "ckpt")
    fresh = tiny_decoder(tie=True)
    saving.load(fresh, tmp_path / "ckpt")
    assert fresh.lm_head.dtype_policy.name == "int8_from_float32"
    assert torch.equal(logits(fresh), expected)
    model.save_pretrained(tmp_path / "hf")
    loaded = type(model).from_pretrained(tmp_path / "hf").eval()
    assert loaded.lm_head.dtype_policy.name == "int8_from_float32"
    assert torch.equal(logits(loaded), expected)


def test_every_16_bit_application_on_the_head_computes_from_float32():
    model = tiny_decoder(tie=True)
    apply_policy(model, "mixed_bfloat16")
    inner = apply_policy(model.lm_head, "mixed_bfloat16")
    quantize(model, "int8")
    assert model.lm_head.dtype_policy.name == "int8_from_float32"
    inner.remove()  # the application below is in force again: its head entry too
    assert model.lm_head.dtype_policy.name == "int8_from_float32"
    assert logits(model).dtype == torch.float32
