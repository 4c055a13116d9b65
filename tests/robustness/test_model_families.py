"""Hugging Face model families beyond Llama, GPT-2 and BERT, built from tiny
configs: a policy keeps each model's own attention path (Falcon's literal
`"sdpa"` test), int8 quantizes every weight matrix or names what it leaves
float (convolutions, positional tables; a mixture of experts' router stays
float quietly, its experts are quantized one linear each), and a
quantized model survives `save_pretrained` / `from_pretrained` bit for bit
(GPT-NeoX and ViT are saved under legacy names; Gemma's scaled, tied table
has a non-persistent scale)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dtype_policies import apply_policy, quantize  # noqa: E402

VOCAB = 128
DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
TOKENS = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
PIXELS = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def _decoder(config_class: str, model_class: str, **extra):
    def build():
        config = getattr(transformers, config_class)(**DECODER, **extra)
        return getattr(transformers, model_class)(config)

    return build


def _lara_mini():
    """A hybrid of gated delta nets and attention with experts, whose checkpoints
    fuse the delta net's input projections (a converter that must not touch
    stored tensors)."""
    config = transformers.AutoConfig.for_model(
        "lara_mini",
        **DECODER,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


FAMILIES = {
    "qwen2": _decoder("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": _decoder("Qwen3Config", "Qwen3ForCausalLM", head_dim=16),
    "mistral": _decoder("MistralConfig", "MistralForCausalLM"),
    "gemma2": _decoder("Gemma2Config", "Gemma2ForCausalLM", head_dim=16),
    "phi3": _decoder("Phi3Config", "Phi3ForCausalLM", pad_token_id=0),
    "mixtral": _decoder("MixtralConfig", "MixtralForCausalLM", num_local_experts=4),
    "qwen3_moe": _decoder(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    "lara_mini": _lara_mini,
    "falcon": lambda: transformers.FalconForCausalLM(
        transformers.FalconConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            new_decoder_architecture=True,
            num_kv_heads=2,
        )
    ),
    "gpt_neox": lambda: transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
        )
    ),
    "opt": lambda: transformers.OPTForCausalLM(
        transformers.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=64,
        )
    ),
    "t5": lambda: transformers.T5ForConditionalGeneration(
        transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2)
    ),
    "bart": lambda: transformers.BartForConditionalGeneration(
        transformers.BartConfig(
            vocab_size=VOCAB,
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
        )
    ),
    "vit": lambda: transformers.ViTForImageClassification(
        transformers.ViTConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
            num_labels=3,
        )
    ),
}
# what int8 leaves float and names in its warning: (modules, share of the parameters)
LEFT_FLOAT = {
    "lara_mini": ("conv1d", 0.0),  # the delta net's depthwise convolution
    "opt": ("embed_positions", 0.05),
    "bart": ("embed_positions", 0.05),
    "vit": ("projection", 0.05),  # the patch convolution
}


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return FAMILIES[name]().eval()


def logits(model: torch.nn.Module, name: str) -> torch.Tensor:
    with torch.no_grad():
        if name == "vit":
            return model(PIXELS).logits.float()
        if name in ("t5", "bart"):
            return model(TOKENS, decoder_input_ids=TOKENS[:, :6]).logits.float()
        return model(TOKENS).logits.float()


def relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_policy_is_within_bfloat16s_rounding_of_the_model(name):
    model = build(name)
    reference = logits(model, name)
    as_bfloat16 = relative(logits(copy.deepcopy(model).to(torch.bfloat16), name), reference)
    float32 = copy.deepcopy(model)
    apply_policy(float32, "float32")
    assert torch.equal(logits(float32, name), reference)
    handle = apply_policy(model, "mixed_bfloat16")
    assert relative(logits(model, name), reference) < max(2 * as_bfloat16, 0.01)
    handle.remove()
    assert torch.equal(logits(model, name), reference)


CASES = [(name, "int8") for name in FAMILIES] + [("gpt_neox", "int4"), ("vit", "int4")]


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_quantize_covers_every_weight_matrix_or_names_it_and_reloads_bit_for_bit(
    name, mode, tmp_path
):
    model = build(name)
    reference = logits(model, name)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        report = quantize(model, mode)
    messages = [str(w.message) for w in seen if str(w.message).startswith("quantize()")]
    left = {  # the modules that still hold a float weight matrix
        path.replace(".", "/")
        for path, module in model.named_modules()
        if any(p.dim() >= 2 and p.shape[0] > 1 for p in module.parameters(recurse=False))
    }
    if name in LEFT_FLOAT:
        part, share = LEFT_FLOAT[name]
        assert len(messages) == 1 and part in messages[0]
        assert report.unsupported_parameters >= share * report.total_parameters
        assert left == set(report.skipped_by_reason("no quantize support")) | set(
            report.skipped_by_reason("router")
        )
    else:
        assert messages == [] and left == set(report.skipped_by_reason("router"))
    quantized = logits(model, name)
    assert torch.isfinite(quantized).all()
    if mode == "int8":  # (int4 on random weights says little about int4)
        assert relative(quantized, reference) < 0.1
    model.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = type(model).from_pretrained(tmp_path).eval()
    assert torch.equal(logits(loaded, name), quantized)
