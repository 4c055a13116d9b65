"""Hugging Face models built from tiny configs: mixed_bfloat16 then int8, then
greedy generation under inference_mode and no_grad; GPT-2's Conv1D is a
linear-like kind; GPT-2's tied embedding and head are quantized once."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dtype_policies import apply_policy, quantize  # noqa: E402

from .helpers import relative_error  # noqa: E402

PROMPT = torch.tensor([[5, 17, 3, 99, 42, 8]])


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=128,
        n_positions=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config).eval()


BUILDERS = {"llama": _llama, "gpt2": _gpt2}


def _quantized(name, mode="int8"):
    model = BUILDERS[name]()
    with torch.no_grad():
        reference = model(PROMPT).logits.float()
    apply_policy(model, "mixed_bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        report = quantize(model, mode)
    return model, reference, report


def _generate(model, context):
    with context():
        return model.generate(PROMPT, max_new_tokens=4, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("name", BUILDERS)
def test_generate_after_int8_under_inference_mode_and_no_grad(name):
    model, reference, report = _quantized(name)
    assert report.num_quantized > 0
    with_inference = _generate(model, torch.inference_mode)
    with_no_grad = _generate(model, torch.no_grad)
    assert with_inference.shape == (1, PROMPT.shape[1] + 4)
    assert torch.equal(with_inference, with_no_grad)
    assert torch.equal(with_inference[:, : PROMPT.shape[1]], PROMPT)
    with torch.inference_mode():
        logits = model(PROMPT).logits
    assert logits.dtype == torch.float32  # the int8 head computes from float32
    assert with_inference[0, PROMPT.shape[1]] == logits[0, -1].argmax()
    assert relative_error(logits, reference) < 0.1


@pytest.mark.parametrize("name", BUILDERS)
def test_generate_after_int8_then_no_grad_after_inference_mode(name):
    """A model first used under inference_mode keeps working under no_grad
    and in grad mode (eval) afterwards."""
    model, reference, _ = _quantized(name)
    _generate(model, torch.inference_mode)
    with torch.no_grad():
        logits = model(PROMPT).logits
    assert relative_error(logits, reference) < 0.1
    logits = model(PROMPT).logits  # grad mode
    assert relative_error(logits, reference) < 0.1


def test_gpt2_conv1d_is_quantized():
    model, reference, report = _quantized("gpt2")
    quantized = {path for path, *_ in report.quantized}
    for block in (0, 1):
        for leaf in ("attn/c_attn", "attn/c_proj", "mlp/c_fc", "mlp/c_proj"):
            assert f"transformer/h/{block}/{leaf}" in quantized, report.render()
    state = model.state_dict()
    weight = state["transformer.h.0.attn.c_attn.weight_int8"]
    assert weight.dtype == torch.int8 and weight.shape == (64, 192)  # Conv1D's (in, out)
    assert "transformer.h.0.attn.c_attn.weight" not in state
    with torch.no_grad():
        logits = model(PROMPT).logits
    assert relative_error(logits, reference) < 0.1


def test_gpt2_tied_embedding_and_head_quantized_once():
    model, reference, report = _quantized("gpt2")
    quantized = [path for path, *_ in report.quantized]
    assert "transformer/wte" in quantized or "lm_head" in quantized, report.render()
    state = model.state_dict(keep_vars=True)
    wte = [
        v for k, v in state.items() if k.startswith("transformer.wte.") and v.dtype == torch.int8
    ]
    head = [v for k, v in state.items() if k.startswith("lm_head.") and v.dtype == torch.int8]
    shared = any(a.data_ptr() == b.data_ptr() for a in wte for b in head)
    once = not ("transformer/wte" in quantized and "lm_head" in quantized)
    assert shared or once, (
        report.render(),
        sorted(k for k in state if "wte" in k or "lm_head" in k),
    )
    with torch.no_grad():
        logits = model(PROMPT).logits
    assert relative_error(logits, reference) < 0.1


def test_llama_every_projection_is_quantized():
    model, reference, report = _quantized("llama")
    quantized = {path for path, *_ in report.quantized}
    for leaf in (
        "self_attn/q_proj",
        "self_attn/k_proj",
        "self_attn/v_proj",
        "self_attn/o_proj",
        "mlp/gate_proj",
        "mlp/up_proj",
        "mlp/down_proj",
    ):
        assert f"model/layers/0/{leaf}" in quantized, report.render()
    with torch.inference_mode():
        logits = model(PROMPT).logits
    assert relative_error(logits, reference) < 0.1


@pytest.mark.parametrize("name", BUILDERS)
def test_generate_after_int4_under_inference_mode(name):
    model, reference, _ = _quantized(name, "int4")
    out = _generate(model, torch.inference_mode)
    assert out.shape == (1, PROMPT.shape[1] + 4)
    with torch.inference_mode():
        logits = model(PROMPT).logits
    assert relative_error(logits, reference) < 0.3
