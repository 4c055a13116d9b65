"""Hugging Face models built from configs (random weights, nothing downloaded):
GPT-2, Llama and BERT under float policies and every quantization mode, with
`generate`, under `no_grad` and `inference_mode`, and training steps.

Skipped, loudly, only when transformers is not installed."""

import copy
import warnings

import pytest
import torch

from dtype_policies import apply_policy, quantize

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

# Relative error of the logits against float32, per mode, for these tiny
# random models (int4 with hidden size 64 has one group per column).
TOLERANCE = {None: 0.02, "int8": 0.04, "float8": 0.15, "int4": 0.3}


def gpt2():
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


def llama():
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=500,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).eval()


def relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("mode", [None, "int8", "int4", "float8"])
@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_causal_lm_generates_under_every_mode(build, mode, context):
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(1, 500, (2, 10))
    with torch.no_grad():
        reference = model(ids).logits
        expected = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    apply_policy(model, "mixed_bfloat16")
    if mode is not None:
        report = quantize(model, mode)
        assert report.num_quantized > 0
        assert not report.errors
    with context():
        logits = model(ids).logits
        out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert logits.dtype == torch.bfloat16
    assert relative_error(logits, reference) < TOLERANCE[mode]
    assert out.shape == expected.shape
    assert torch.equal(out[:, :10], ids)


def test_gpt2_conv1d_is_a_linear_kind():
    model = gpt2()
    report = quantize(model, "int8")
    quantized = {path for path, _, _ in report.quantized}
    for layer in range(2):
        for name in ("attn/c_attn", "attn/c_proj", "mlp/c_fc", "mlp/c_proj"):
            assert f"transformer/h/{layer}/{name}" in quantized
    c_attn = model.transformer.h[0].attn.c_attn
    assert c_attn.weight_int8.shape == (64, 192)  # Conv1D keeps its (in, out) orientation
    assert "transformer/wte" in quantized and "lm_head" in quantized  # tied: quantized once
    assert model.lm_head.weight_int8 is model.transformer.wte.weight_int8


def test_gpt2_from_config_close_to_float32_and_trains():
    torch.manual_seed(0)
    model = gpt2()
    ids = torch.randint(0, 500, (2, 16))
    with torch.no_grad():
        reference = model(ids).logits
    apply_policy(model, "mixed_bfloat16")
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), reference, atol=0.05, rtol=0.05)
    model.train()
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {torch.float32}
    assert model.transformer.wte.weight.grad is not None  # tied with lm_head


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_llama_trains_biases_and_norms_through_a_frozen_quantized_base(mode):
    torch.manual_seed(0)
    model = llama()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, mode)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    ids = torch.randint(1, 500, (4, 12))
    losses = []
    for _ in range(8):
        loss = model(ids, labels=ids).loss
        loss.backward()
        assert model.model.norm.weight.grad is not None
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_bert_from_config_close_to_float32():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=500,
    )
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 500, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).last_hidden_state
    handle = apply_policy(model, "mixed_bfloat16")
    assert "embeddings/LayerNorm" in handle.float32_paths
    with torch.no_grad():
        out = model(ids, attention_mask=mask).last_hidden_state
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, atol=0.08, rtol=0.05)
    quantize(model, "int8")
    with torch.inference_mode():
        quantized = model(ids, attention_mask=mask).last_hidden_state
    assert relative_error(quantized, reference) < 0.05


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_lora_fine_tune_on_a_quantized_llama_tracks_the_float_base(mode):
    peft = pytest.importorskip("peft", reason="peft is not installed")
    torch.manual_seed(0)
    base = llama()
    ids = torch.randint(1, 500, (4, 16))

    def fine_tune(model):
        config = peft.LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]
        )
        torch.manual_seed(1)
        model = peft.get_peft_model(model, config)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
        losses = []
        for _ in range(12):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    reference = fine_tune(copy.deepcopy(base))
    quantized = copy.deepcopy(base)
    apply_policy(quantized, "mixed_bfloat16")
    quantize(quantized, mode)
    losses = fine_tune(quantized)
    assert losses[-1] < losses[0] - 0.2  # it learns
    for ours, theirs in zip(losses, reference):
        assert abs(ours - theirs) < 0.05 * theirs  # and tracks the float base
