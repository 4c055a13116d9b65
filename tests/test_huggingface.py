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


def llama(tie_word_embeddings=False):
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=500,
        max_position_embeddings=64,
        tie_word_embeddings=tie_word_embeddings,
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
    # quantize() computes an output head whose product rounds its inputs to
    # int8 from float32 (int8; int4's int8 table of GPT-2's tied head)
    float32_head = mode == "int8" or (mode == "int4" and build is gpt2)
    assert logits.dtype == (torch.float32 if float32_head else torch.bfloat16)
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


def _conv1d_and_linear(nx=72, nf=40, seed=0):
    """A transformers `Conv1D` and the `nn.Linear` holding its transposed weight."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(seed)
    conv = Conv1D(nf, nx)
    with torch.no_grad():
        conv.bias.normal_()
    linear = torch.nn.Linear(nx, nf)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    return conv, linear


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16", "bfloat16", "float32"])
@pytest.mark.parametrize("shape", [(1, 72), (5, 72), (64, 72), (2, 7, 72)])
def test_conv1d_computes_as_the_linear_of_its_transpose(policy, shape):
    # Conv1D takes the same leaf path as nn.Linear: the same product on this
    # CPU, so the same bits, with its weight read as its transpose
    # (float32: its own product, `x @ weight`, whose bits differ from
    # `F.linear`'s on the transposed layout)
    conv, linear = _conv1d_and_linear()
    x = torch.randn(*shape)
    with torch.no_grad():
        own = conv(x)
    apply_policy(conv, policy)
    apply_policy(linear, policy)
    with torch.no_grad():
        for _ in range(2):  # the call that keeps the casts, then one that reuses them
            out = conv(x)
            assert torch.equal(out, own if policy == "float32" else linear(x))
    assert out.shape == (*shape[:-1], 40)
    assert out.dtype == conv.dtype_policy.torch_compute_dtype


def test_conv1d_gradients_and_updates_match_the_linear():
    conv, linear = _conv1d_and_linear(seed=1)
    apply_policy(conv, "mixed_bfloat16")
    apply_policy(linear, "mixed_bfloat16")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (conv, linear)]
    for _ in range(3):
        x = torch.randn(6, 72)
        for module, optimizer in zip((conv, linear), optimizers):
            module(x).float().square().mean().backward()
            optimizer.step()
        assert conv.weight.dtype == torch.float32
        assert torch.equal(conv.weight.grad, linear.weight.grad.t())
        assert torch.equal(conv.bias.grad, linear.bias.grad)
        for optimizer in optimizers:
            optimizer.zero_grad()
    with torch.no_grad():  # kept casts follow the optimizer's updates
        x = torch.randn(3, 72)
        assert torch.equal(conv(x), linear(x))
        conv.weight.data = conv.weight.data * 2  # and a replaced `.data`
        linear.weight.data = linear.weight.data * 2
        assert torch.equal(conv(x), linear(x))


def test_conv1d_under_a_parametrization_and_after_removal():
    from torch.nn.utils import parametrizations

    conv, _ = _conv1d_and_linear(seed=2)
    x = torch.randn(4, 72)
    with torch.no_grad():
        own = conv(x)
    handle = apply_policy(conv, "mixed_bfloat16")
    parametrizations.weight_norm(conv, dim=1)  # computed per call, cast per call
    with torch.no_grad():
        out = conv(x)
        computed = conv.weight.detach()
    assert out.dtype == torch.bfloat16
    expected = torch.addmm(conv.bias.bfloat16(), x.bfloat16(), computed.bfloat16())
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    torch.nn.utils.parametrize.remove_parametrizations(conv, "weight")
    handle.remove()
    assert type(conv).__name__ == "Conv1D" and type(conv).__module__.startswith("transformers")
    with torch.no_grad():
        back = conv(x)
    assert back.dtype == torch.float32
    torch.testing.assert_close(back, own, atol=1e-5, rtol=1e-5)


def test_conv1d_subclass_keeps_its_own_forward():
    from transformers.pytorch_utils import Conv1D

    class Doubled(Conv1D):
        def forward(self, x):
            return 2 * super().forward(x)

    torch.manual_seed(3)
    layer = Doubled(8, 16)
    x = torch.randn(2, 16)
    with torch.no_grad():
        expected = 2 * torch.addmm(layer.bias.bfloat16(), x.bfloat16(), layer.weight.bfloat16())
        apply_policy(layer, "mixed_bfloat16")
        torch.testing.assert_close(layer(x), expected, atol=1e-2, rtol=1e-2)


def test_gpt2_reads_no_weight_by_attribute_in_its_linears(monkeypatch):
    # The Conv1D leaves cast their own weights: no autocast scope hands any
    from dtype_policies._core import scope
    from dtype_policies.apply.kernel_report import kernel_of

    torch.manual_seed(0)
    model = gpt2()
    apply_policy(model, "mixed_bfloat16")
    handed = []
    original = scope.AutocastScope.hand
    monkeypatch.setattr(
        scope.AutocastScope, "hand", lambda self, t, *a: handed.append(t) or original(self, t, *a)
    )
    ids = torch.randint(0, 500, (1, 4))
    with torch.no_grad():
        model(ids)
    conv_weights = {id(m.weight) for m in model.modules() if type(m).__name__ == "Conv1D"}
    assert conv_weights and not conv_weights & {id(t) for t in handed}
    c_attn = model.transformer.h[0].attn.c_attn
    assert kernel_of(c_attn) == kernel_of(_linear_like(c_attn)) != "-"


def _linear_like(conv):
    linear = torch.nn.Linear(conv.nx, conv.nf)
    apply_policy(linear, "mixed_bfloat16")
    return linear


@pytest.mark.parametrize(
    "config",
    [
        None,
        {"activation_quantizer": None},
        {"block_size": None},
        {"activation_block_size": None, "block_size": None},
    ],
    ids=["default", "weight_only", "per_channel", "per_token"],
)
def test_int8_conv1d_derives_its_kernel_data_once(config):
    # its steps are read through a transposed view made in every call: the
    # kernel's derived data (packed layouts, steps) must not be rebuilt per call
    from dtype_policies.quantization import Int8QuantizationConfig
    from dtype_policies.quantization.attach import quantization_of

    conv, linear = _conv1d_and_linear(nx=96, nf=64, seed=4)
    configs = None if config is None else Int8QuantizationConfig(**config)
    for module in (conv, linear):
        apply_policy(module, "mixed_bfloat16")
        quantize(module, "int8", configs)
    x = torch.randn(3, 96)
    with torch.no_grad():
        assert torch.equal(conv(x), linear(x))
        runtime = quantization_of(conv).runtime
        derived = (runtime.q_nk, runtime.column_step, runtime.native, runtime.packed)
        for _ in range(3):
            assert torch.equal(conv(x), linear(x))
        assert quantization_of(conv).runtime is runtime
        now = (runtime.q_nk, runtime.column_step, runtime.native, runtime.packed)
        assert all(a is b for a, b in zip(now, derived))
        conv.weight_scale.mul_(2)  # a write to the stored steps is seen
        assert not torch.equal(conv(x), linear(x))
    assert runtime.column_step is not derived[1]


@pytest.mark.parametrize("block_size", [32, 128, -1])
def test_int4_quantizes_the_same_values_the_same_whatever_their_layout(block_size):
    # Conv1D's (in, out) weight and a column-major copy of a Linear's give the
    # Linear's grid to the bit: the zero points' solver sums in one layout
    from dtype_policies.quantization import Int4QuantizationConfig

    conv, linear = _conv1d_and_linear(nx=256, nf=64, seed=5)
    strided = copy.deepcopy(linear)
    strided.weight = torch.nn.Parameter(linear.weight.detach().t().contiguous().t())
    config = Int4QuantizationConfig(block_size=block_size)
    for module in (conv, linear, strided):
        quantize(module, "int4", config)
    stored = linear.state_dict()
    assert stored.keys() == strided.state_dict().keys()
    assert all(torch.equal(t, stored[k]) for k, t in strided.state_dict().items())
    x = torch.randn(3, 256)
    with torch.no_grad():
        assert torch.equal(strided(x), linear(x))
        assert torch.equal(conv(x), linear(x))


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


def _tied_llama():
    return llama(tie_word_embeddings=True)


@pytest.mark.parametrize("build", [gpt2, _tied_llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_tie_weights_on_a_model_with_a_quantized_tied_table(build, mode):
    """transformers ties by parameter name; the quantized table has none:
    `model.tie_weights()` (Trainer, accelerate and DeepSpeed call it) raised
    "is neither a parameter, buffer, nor extra state"."""
    torch.manual_seed(0)
    model = build()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, mode)
    ids = torch.randint(0, 500, (1, 6))
    with torch.no_grad():
        before = model(ids).logits
    model.tie_weights()
    model.tie_weights(recompute_mapping=False)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    copied = copy.deepcopy(model)  # the instance's tie_weights follows the copy
    copied.tie_weights()
    with torch.no_grad():
        assert torch.equal(copied(ids).logits, before)
