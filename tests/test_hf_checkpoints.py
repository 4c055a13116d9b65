"""Hugging Face checkpoints: `save_pretrained` / `from_pretrained` of models
with policies and quantization (bit-exact logits and `generate` after reload,
GPT-2 Conv1D and tied weights, Llama, BERT), what plain transformers does with
them (raises, or loads the float model), the import-time cost, the listener
that keeps `hf_quantizer` current, and the explicit meta-device route with
`saving.save` / `saving.load`. Tiny models built from configs."""

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from dtype_policies import DTypePolicyMap, apply_policy, quantize, saving
from dtype_policies.quantization import (
    Float8QuantizationConfig,
    Int4QuantizationConfig,
    Int8QuantizationConfig,
)

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("safetensors")

from dtype_policies._core.module_state import state_of  # noqa: E402
from dtype_policies.saving import huggingface  # noqa: E402 (after the importorskip)
from dtype_policies.saving.manifest import CheckpointError  # noqa: E402

SRC = str(Path(__file__).resolve().parent.parent / "src")
VOCAB = 256


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


@pytest.fixture(scope="module", autouse=True)
def _no_progress_bars():
    transformers.utils.logging.disable_progress_bar()
    yield
    transformers.utils.logging.enable_progress_bar()


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def llama(tie=False):
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).eval()


def gpt2():
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


def bert():
    config = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    return transformers.BertForMaskedLM(config).eval()


IDS = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))


def outputs(model):
    with torch.no_grad():
        return model(IDS).logits


def generated(model):
    with torch.no_grad():
        return model.generate(IDS, max_new_tokens=4, do_sample=False)


def train_steps(model, steps=2):
    """A few SGD steps (float8 scales and histories move)."""
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    for _ in range(steps):
        model(IDS, labels=IDS).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def reload(model, directory, **kwargs):
    """save_pretrained, then from_pretrained; returns the model and the
    warnings transformers logged while loading."""
    model.save_pretrained(directory, **kwargs)
    capture = _Capture()
    logger = logging.getLogger("transformers")
    logger.addHandler(capture)
    try:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(directory)
    finally:
        logger.removeHandler(capture)
    return loaded, capture.messages


def policies(model):
    return {
        name: state_of(module).call.policy.name
        for name, module in model.named_modules()
        if getattr(state_of(module), "call", None) is not None
    }


def assert_same_model(loaded, model):
    expected_state, state = model.state_dict(), loaded.state_dict()
    assert sorted(state) == sorted(expected_state)
    for key, tensor in expected_state.items():
        assert state[key].dtype == tensor.dtype, key
        assert torch.equal(state[key], tensor), key
    assert policies(loaded) == policies(model)
    assert torch.equal(outputs(loaded), outputs(model))
    assert torch.equal(generated(loaded), generated(model))


ISLANDS = DTypePolicyMap(
    "mixed_bfloat16", {"lm_head": "float32", "model/layers/1/mlp/.*": "float32"}
)
WEIGHT_ONLY = Int8QuantizationConfig(activation_quantizer=None)
LLAMA_CASES = {
    "int8": ("mixed_bfloat16", "int8", None),
    "int8_weight_only": ("mixed_bfloat16", "int8", WEIGHT_ONLY),
    "int4_grouped": ("mixed_bfloat16", "int4", Int4QuantizationConfig(block_size=32)),
    "int4_per_channel": ("mixed_bfloat16", "int4", Int4QuantizationConfig(block_size=-1)),
    "int8_from_float32": (None, "int8", None),
    "float8_trained": ("mixed_bfloat16", "float8", Float8QuantizationConfig(amax_history_length=8)),
    "mixed_bfloat16_with_islands": (ISLANDS, None, None),
}


@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_llama_round_trip_is_bit_exact(case, tmp_path):
    policy, mode, config = LLAMA_CASES[case]
    torch.manual_seed(0)
    model = llama()
    if policy is not None:
        apply_policy(model, policy)
    if mode is not None:
        quantize(model, mode, config)
    if mode == "float8":
        train_steps(model)
        assert model.model.layers[0].mlp.up_proj.kernel_amax_history.abs().sum() > 0
    loaded, logged = reload(model, tmp_path)
    assert not [m for m in logged if "LOAD REPORT" in m], logged
    assert type(loaded.hf_quantizer) is huggingface.DTypePoliciesHfQuantizer
    assert loaded.config.quantization_config.quant_method == "dtype_policies"
    assert loaded.is_quantized == (mode in ("int8", "int4"))
    assert_same_model(loaded, model)
    if case == "mixed_bfloat16_with_islands":
        assert policies(loaded)["model.layers.1.mlp.up_proj"] == "float32"
        assert policies(loaded)["model.norm"] == "float32"  # a normalization island
        assert policies(loaded)["model.layers.0.mlp.up_proj"] == "mixed_bfloat16"
        assert outputs(loaded).dtype == torch.float32  # lm_head computes in float32


def test_what_save_pretrained_writes(tmp_path):
    from safetensors import safe_open

    model = llama()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int8", filters=r"layers/0/")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "dtype_policies"
    manifest = config["manifest"]
    assert manifest["format"] == "dtype_policies" and manifest["format_version"] == 1
    assert manifest["quantized"]["model.layers.0.self_attn.q_proj"]["mode"] == "int8"
    assert "model.layers.1.self_attn.q_proj" not in manifest["quantized"]
    assert manifest["modules"]["model.norm"]["island"] is True
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as reader:
        keys = set(reader.keys())
        sentinel = reader.get_tensor("model.layers.0.self_attn.q_proj.weight")
        assert reader.get_tensor("model.layers.0.self_attn.q_proj.weight_int8").dtype == torch.int8
    assert sentinel.dtype == torch.int8 and sentinel.shape == (1,)
    assert "model.layers.0.self_attn.q_proj.weight_scale" in keys
    assert "model.layers.1.self_attn.q_proj.weight" in keys  # float, not a sentinel
    assert "model.layers.1.self_attn.q_proj.weight_int8" not in keys


def test_a_copied_config_shares_the_manifest_and_stays_apart(tmp_path):
    # transformers deep-copies an encoder-decoder model's config (and reads
    # its `to_dict()`) in every forward that makes its own cache: the
    # manifest, replaced whole and never edited in place, is shared
    import copy

    model = llama()
    apply_policy(model, "mixed_bfloat16")
    config = model.config.quantization_config
    copied = copy.deepcopy(model.config).quantization_config
    assert copied is not config and copied.manifest is config.manifest
    assert copied.to_dict() == config.to_dict()
    edited = copied.to_dict()
    edited["manifest"]["modules"].clear()  # a caller's edits stay in its dict
    assert config.to_dict()["manifest"]["modules"] == copied.to_dict()["manifest"]["modules"] != {}
    quantize(model, "int8")  # described again; the copy keeps what it described
    now = model.config.quantization_config.to_dict()["manifest"]
    assert "model.layers.0.mlp.up_proj" in now["quantized"]
    assert copied.to_dict()["manifest"]["quantized"] == {}
    model.save_pretrained(tmp_path)
    assert (
        "model.layers.0.mlp.up_proj"
        in json.loads((tmp_path / "config.json").read_text())["quantization_config"]["manifest"][
            "quantized"
        ]
    )


def test_gpt2_conv1d_and_tied_quantized_embedding(tmp_path):
    torch.manual_seed(0)
    model = gpt2()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int8")
    assert model.lm_head.weight_int8 is model.transformer.wte.weight_int8
    loaded, logged = reload(model, tmp_path)
    assert not [m for m in logged if "LOAD REPORT" in m], logged
    c_attn = loaded.transformer.h[0].attn.c_attn
    assert c_attn.weight_int8.shape == (64, 192)  # Conv1D keeps its (in, out) orientation
    assert loaded.lm_head.weight_int8 is loaded.transformer.wte.weight_int8
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved["manifest"]["aliases"] == {
        "lm_head.weight_int8": "transformer.wte.weight_int8",
        "lm_head.weight_scale": "transformer.wte.weight_scale",
    }
    assert_same_model(loaded, model)


def test_gpt2_float_policy_keeps_tied_parameters(tmp_path):
    torch.manual_seed(0)
    model = gpt2()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int4", filters=r"/h/")  # Conv1D only; the tied embedding stays float
    loaded, logged = reload(model, tmp_path)
    assert not [m for m in logged if "LOAD REPORT" in m], logged
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert_same_model(loaded, model)


def test_llama_tied_embeddings_int4(tmp_path):
    torch.manual_seed(0)
    model = llama(tie=True)
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int4", Int4QuantizationConfig(block_size=32))  # the tied table: int8
    loaded, logged = reload(model, tmp_path)
    assert not [m for m in logged if "LOAD REPORT" in m], logged
    assert loaded.lm_head.weight_int8 is loaded.model.embed_tokens.weight_int8
    assert loaded.model.layers[0].mlp.up_proj.weight_int4.dtype == torch.int8
    assert_same_model(loaded, model)


def test_llama_tied_embeddings_int4_when_asked(tmp_path):
    torch.manual_seed(0)
    model = llama(tie=True)
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int4", Int4QuantizationConfig(block_size=32, tied_embeddings="int4"))
    loaded, logged = reload(model, tmp_path)
    assert not [m for m in logged if "LOAD REPORT" in m], logged
    assert loaded.lm_head.weight_int4 is loaded.model.embed_tokens.weight_int4
    assert_same_model(loaded, model)


def test_gemma_scaled_tied_embedding_round_trip_is_bit_exact(tmp_path):
    """Gemma's table is a scaled embedding with a non-persistent `embed_scale`
    buffer, which the checkpoint does not hold: the model's own initialisation
    must still set it (it was left as uninitialized memory: 1e36)."""
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    model = transformers.Gemma2ForCausalLM(config).eval()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int8")
    loaded, logged = reload(model, tmp_path)
    assert not [m for m in logged if "LOAD REPORT" in m], logged
    embedding = loaded.model.embed_tokens
    assert embedding.weight_int8 is loaded.lm_head.weight_int8
    assert torch.equal(embedding.embed_scale, model.model.embed_tokens.embed_scale)
    assert_same_model(loaded, model)


def test_bert_round_trip_is_bit_exact(tmp_path):
    torch.manual_seed(0)
    model = bert()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int8", filters="encoder")
    model.save_pretrained(tmp_path)
    loaded = transformers.BertForMaskedLM.from_pretrained(tmp_path)
    assert loaded.bert.encoder.layer[0].attention.self.query.weight_int8.dtype == torch.int8
    assert policies(loaded)["bert.embeddings.LayerNorm"] == "float32"
    mask = torch.ones_like(IDS)
    mask[1, 6:] = 0
    with torch.no_grad():
        expected = model(IDS, attention_mask=mask).logits
        assert torch.equal(loaded(IDS, attention_mask=mask).logits, expected)
    assert policies(loaded) == policies(model)


@pytest.mark.parametrize("architecture", ["bert", "roberta"])
def test_masked_lm_with_int4_tied_embeddings_round_trip(architecture, tmp_path):
    """The decoder's weight is the embedding's, its bias `cls.predictions.bias`
    (tied by transformers): initializing the decoder and tying its bias read
    its weight, from int4 tensors shared only once loading is over (group
    indices out of range: an IndexError). Both wait for them now."""
    torch.manual_seed(0)
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    if architecture == "bert":
        config, cls = transformers.BertConfig(vocab_size=128, **sizes), transformers.BertForMaskedLM
    else:
        config = transformers.RobertaConfig(vocab_size=128, pad_token_id=1, **sizes)
        cls = transformers.RobertaForMaskedLM
    model = cls(config).eval()
    quantize(model, "int4", Int4QuantizationConfig(block_size=32, tied_embeddings="int4"))
    model.save_pretrained(tmp_path)
    capture = _Capture()
    logger = logging.getLogger("transformers")
    logger.addHandler(capture)
    try:
        loaded = cls.from_pretrained(tmp_path)
    finally:
        logger.removeHandler(capture)
    assert not [m for m in capture.messages if "LOAD REPORT" in m], capture.messages
    head = loaded.get_output_embeddings()
    assert head.weight_int4 is loaded.get_input_embeddings().weight_int4
    bias = loaded.cls.predictions.bias if architecture == "bert" else loaded.lm_head.bias
    assert head.bias is bias
    ids = torch.randint(2, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert policies(loaded) == policies(model)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_modernbert_masked_lm_with_a_quantized_tied_decoder_round_trip(mode, tmp_path):
    """ModernBERT's root initializes its tied decoder's weight itself
    (`_init_weights` of the whole model, which loading leaves uninitialized
    while the decoder's tensors are shared only after it): the write to the
    decoder's dequantized weight was refused ("Cannot write to the weight of
    the int8-quantized Linear 'decoder'"). A module whose every tensor comes
    from the file reads its weight as loaded, which transformers' init skips."""
    torch.manual_seed(0)
    config = transformers.ModernBertConfig(
        vocab_size=160,
        hidden_size=96,
        intermediate_size=144,
        num_hidden_layers=2,
        num_attention_heads=3,
        global_attn_every_n_layers=2,
        local_attention=8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
    )
    model = transformers.ModernBertForMaskedLM(config).eval()
    assert model.decoder.weight is model.model.embeddings.tok_embeddings.weight
    quantize(model, mode)
    model.save_pretrained(tmp_path)
    loaded = transformers.ModernBertForMaskedLM.from_pretrained(tmp_path).eval()
    assert loaded.decoder.weight_scale is loaded.model.embeddings.tok_embeddings.weight_scale
    ids = torch.randint(3, 160, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert policies(loaded) == policies(model)


def test_sharded_checkpoint_and_resave(tmp_path):
    torch.manual_seed(0)
    model = llama()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int4")
    loaded, _ = reload(model, tmp_path / "a", max_shard_size="20KB")
    assert (tmp_path / "a" / "model.safetensors.index.json").is_file()
    assert_same_model(loaded, model)
    again, _ = reload(loaded, tmp_path / "b")  # the reloaded model saves the same way
    assert_same_model(again, model)


def test_load_in_bfloat16_keeps_stored_dtypes(tmp_path):
    model = llama()
    quantize(model, "int8")
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    q_proj = loaded.model.layers[0].self_attn.q_proj
    assert q_proj.weight_int8.dtype == torch.int8 and q_proj.weight_scale.dtype == torch.float32
    assert torch.equal(q_proj.weight_int8, model.model.layers[0].self_attn.q_proj.weight_int8)
    assert loaded.model.norm.weight.dtype == torch.bfloat16
    # quantized on a float32 model without a policy: its layers follow the
    # dtype asked for, as the model converted in memory does
    assert q_proj.dtype_policy.name == "int8_from_bfloat16"
    in_memory = model.to(torch.bfloat16)
    assert in_memory.model.layers[0].self_attn.q_proj.dtype_policy.name == "int8_from_bfloat16"
    got = outputs(loaded)
    # a float32 model's head is quantized as any module: it follows the dtype too
    assert loaded.lm_head.dtype_policy.name == "int8_from_bfloat16"
    assert got.dtype == torch.bfloat16 and got.shape == (2, 9, VOCAB)
    expected = outputs(in_memory).float()  # (its rotary buffers rounded to bfloat16 too)
    assert float((got.float() - expected).norm() / expected.norm()) < 0.02


# -- the listener: apply_policy / quantize / remove keep hf_quantizer current ------------------


def test_listener_attaches_updates_and_detaches():
    model = llama()
    assert getattr(model, "hf_quantizer", None) is None
    handle = apply_policy(model, "mixed_bfloat16")
    assert type(model.hf_quantizer) is huggingface.DTypePoliciesHfQuantizer
    assert model.config.quantization_config is model.hf_quantizer.quantization_config
    assert model.is_quantized is False and model.quantization_method == "dtype_policies"
    manifest = model.config.quantization_config.to_manifest()
    assert manifest.modules["model.layers.0.mlp.up_proj"].policy["config"]["name"] == (
        "mixed_bfloat16"
    )
    assert not manifest.quantized
    handle.remove()
    assert getattr(model, "hf_quantizer", None) is None
    assert getattr(model.config, "quantization_config", None) is None
    assert model.is_quantized is False
    quantize(model, "int8", filters="mlp")
    assert model.is_quantized is True and model.config._is_quantized is True
    assert set(model.config.quantization_config.to_manifest().quantized) == {
        f"model.layers.{i}.mlp.{name}_proj" for i in range(2) for name in ("gate", "up", "down")
    }


@pytest.mark.parametrize("change", ["mixed_bfloat16", "int8"])
def test_models_built_from_one_config_object_save_their_own_policies(change, tmp_path):
    config = llama().config
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).eval()
    trial = transformers.LlamaForCausalLM(config).eval()
    if change == "int8":
        quantize(trial, "int8")
    else:
        apply_policy(trial, change)
    assert getattr(base.config, "quantization_config", None) is None
    assert trial.model.layers[0].self_attn.config is trial.config  # the copy reaches its users
    base.save_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (1, 8))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(back(ids).logits, base(ids).logits)
    assert getattr(back, "hf_quantizer", None) is None


@pytest.mark.parametrize("change", ["mixed_bfloat16", "int8"])
@pytest.mark.parametrize("built", ["the model's config", "its saved config"])
def test_a_model_built_from_a_described_config_saves_as_what_it_is(change, built, tmp_path):
    """A plain model built from a policied model's config object, or with
    `from_config(AutoConfig.from_pretrained(its directory))`, carried that
    model's description: its checkpoint reloaded with policies it never had
    (bfloat16 logits), or was refused (int8 tensors missing); `sync` kept it."""
    torch.manual_seed(0)
    described = llama()
    quantize(described, "int8") if change == "int8" else apply_policy(described, change)
    if built == "the model's config":
        plain = transformers.LlamaForCausalLM(described.config).eval()
    else:
        described.save_pretrained(tmp_path / "described")
        config = transformers.AutoConfig.from_pretrained(tmp_path / "described")
        plain = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert not any(state_of(module) for module in plain.modules())
    back, _ = reload(plain, tmp_path / "plain")
    assert getattr(back, "hf_quantizer", None) is None and not policies(back)
    assert torch.equal(outputs(back), outputs(plain)) and outputs(back).dtype == torch.float32
    huggingface.sync(plain)
    assert getattr(plain.config, "quantization_config", None) is None
    # the described model keeps its own description
    assert huggingface.describes_policies(described.config)
    again, _ = reload(described, tmp_path / "again")
    assert torch.equal(outputs(again), outputs(described))


def test_a_model_whose_applications_are_all_removed_saves_without_a_description(tmp_path):
    """The whole model's application removed before a part's: the part's
    removal reached no listener of the model, which kept a description of
    policies it no longer had, and save_pretrained wrote it."""
    model = llama()
    whole = apply_policy(model, "mixed_bfloat16")
    part = apply_policy(model.model.layers[0].mlp, "mixed_float16")
    whole.remove()
    part.remove()
    model.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in written
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not policies(back) and torch.equal(outputs(back), outputs(model))


def test_listener_ignores_plain_modules_and_submodules():
    block = torch.nn.Sequential(torch.nn.Linear(8, 8))
    apply_policy(block, "mixed_bfloat16")
    assert not hasattr(block, "hf_quantizer")
    model = llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # save_pretrained describes the model: nothing to warn of
        apply_policy(model.model.layers[0], "mixed_bfloat16")  # not the PreTrainedModel itself
        quantize(model.model.layers[0], "int8")
    assert getattr(model, "hf_quantizer", None) is None
    with pytest.raises(TypeError, match="Received: Sequential"):
        huggingface.sync(block)
    huggingface.sync(model)  # describes it now (save_pretrained does it by itself)
    manifest = model.config.quantization_config.to_manifest()
    assert "model.layers.0.mlp.up_proj" in manifest.modules
    assert "model.layers.0.mlp.up_proj" in manifest.quantized
    assert "model.layers.1.mlp.up_proj" not in manifest.quantized
    assert model.is_quantized is True


def test_a_model_with_another_transformers_quantizer_keeps_it():
    from types import SimpleNamespace

    model = llama()
    other = SimpleNamespace(quantization_config=SimpleNamespace(quant_method="bitsandbytes_8bit"))
    model.hf_quantizer = other
    with pytest.warns(UserWarning, match=r"'bitsandbytes_8bit'.*leaves its hf_quantizer alone"):
        apply_policy(model, "mixed_bfloat16")
    assert model.hf_quantizer is other
    assert getattr(model.config, "quantization_config", None) is None


def test_policy_only_and_float8_models_half_to_and_train():
    for mode in (None, "float8"):
        model = llama()
        apply_policy(model, "mixed_bfloat16")
        if mode:
            quantize(model, mode, Float8QuantizationConfig(amax_history_length=8))
        assert model.is_quantized is False
        transformers.trainer_utils.validate_quantization_for_training(model)
        train_steps(model)
        model.half()
        assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.float16
        model.to(torch.bfloat16)
        assert outputs(model).dtype == torch.bfloat16


def test_int8_model_trains_and_casts_with_to():
    model = llama()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int8", filters="layers")
    transformers.trainer_utils.validate_quantization_for_training(model)  # does not raise
    before = model.model.norm.weight.detach().clone()
    train_steps(model)
    assert not torch.equal(model.model.norm.weight, before)
    with pytest.raises(ValueError, match=r"\.half\(\)"):
        model.half()  # transformers' rule for quantized models
    model.to(torch.float16)
    assert model.model.layers[0].mlp.up_proj.weight_int8.dtype == torch.int8
    assert model.model.norm.weight.dtype == torch.float16


def test_registration_is_idempotent():
    from transformers.quantizers.auto import (
        AUTO_QUANTIZATION_CONFIG_MAPPING,
        AUTO_QUANTIZER_MAPPING,
    )

    huggingface.register()
    huggingface.register()
    assert AUTO_QUANTIZER_MAPPING["dtype_policies"] is huggingface.DTypePoliciesHfQuantizer
    assert AUTO_QUANTIZATION_CONFIG_MAPPING["dtype_policies"] is huggingface.DTypePoliciesConfig
    from dtype_policies.saving import _hf_hooks

    _hf_hooks.install()
    _hf_hooks.install()
    assert _hf_hooks._HOOK not in sys.meta_path  # transformers is imported: no hook needed


# -- errors --------------------------------------------------------------------------------------


def test_bad_configs_raise_naming_the_value():
    with pytest.raises(ValueError, match="quant_method='gptq'"):
        huggingface.DTypePoliciesConfig(manifest={}, quant_method="gptq")
    with pytest.raises(TypeError, match=r"\['colour'\]"):
        huggingface.DTypePoliciesConfig(manifest={}, colour="red")
    with pytest.raises(CheckpointError, match="not a dtype_policies checkpoint"):
        huggingface.DTypePoliciesConfig(manifest={"format": "other"})
    with pytest.raises(CheckpointError, match="format version 7"):
        huggingface.DTypePoliciesConfig(manifest={"format": "dtype_policies", "format_version": 7})
    with pytest.raises(TypeError, match="Received: int"):
        huggingface.DTypePoliciesConfig(manifest=3)
    with pytest.raises(TypeError, match="Received: dict"):
        huggingface.DTypePoliciesHfQuantizer({"quant_method": "dtype_policies"})


def _saved_without(directory, mode, key):
    """A `save_pretrained` checkpoint of a `mode` Llama with `key` removed."""
    from safetensors.torch import load_file, save_file

    model = llama()
    quantize(model, mode)
    model.save_pretrained(directory)
    file = directory / "model.safetensors"
    tensors = load_file(str(file))
    del tensors[key]
    save_file(tensors, str(file), metadata={"format": "pt"})
    return directory


def test_checkpoint_that_does_not_match_its_config_raises(tmp_path):
    missing = _saved_without(
        tmp_path / "missing", "int8", "model.layers.1.mlp.up_proj.weight_scale"
    )
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight_scale' is"):
        transformers.AutoModelForCausalLM.from_pretrained(missing)
    # float8 keeps its float weights: one of them removed
    float8 = _saved_without(tmp_path / "float8", "float8", "model.layers.0.mlp.up_proj.weight")
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' \(the"):
        transformers.AutoModelForCausalLM.from_pretrained(float8)

    truncated = tmp_path / "float8" / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors' is not a readable safetensors"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "float8")

    model = llama()
    quantize(model, "int8")
    model.save_pretrained(tmp_path / "renamed")
    config_file = tmp_path / "renamed" / "config.json"
    config = json.loads(config_file.read_text())
    quantized = config["quantization_config"]["manifest"]["quantized"]
    quantized["model.layers.9.mlp.up_proj"] = quantized.pop("model.layers.1.mlp.up_proj")
    config_file.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.9\.mlp\.up_proj': no such module"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "renamed")


def test_config_on_a_float_checkpoint_is_refused(tmp_path):
    model = llama()
    model.save_pretrained(tmp_path)  # a float checkpoint
    quantize(model, "int8")
    config = model.config.quantization_config
    with pytest.raises(ValueError, match="cannot be passed to from_pretrained"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config)


# -- without dtype_policies, and in a fresh process ----------------------------------------------

PLAIN = textwrap.dedent(
    """
    import sys, torch
    import transformers
    transformers.utils.logging.set_verbosity_error()
    assert "dtype_policies" not in sys.modules
    for directory in sys.argv[1:]:
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(directory)
        except Exception as e:
            print("RAISED", type(e).__name__, str(e)[:200].replace(chr(10), " "))
            continue
        torch.save(model.state_dict(), directory + "/plain_state.pt")
        print("LOADED", getattr(model, "hf_quantizer", None))
    assert "dtype_policies" not in sys.modules
    """
)


@pytest.mark.slow  # a whole run in a fresh process: kept out of the default suite for its time
def test_without_dtype_policies_quantized_raises_and_policies_load_as_float(tmp_path):
    models = {}
    for case in ("int8", "int4", "policy_only", "float8"):
        torch.manual_seed(0)
        model = llama(tie=case == "int4")
        apply_policy(model, DTypePolicyMap("mixed_bfloat16", {"lm_head": "float32"}))
        if case in ("int8", "int4", "float8"):
            quantize(model, case)
        if case == "float8":
            train_steps(model)
        model.save_pretrained(tmp_path / case)
        models[case] = model
    directories = [str(tmp_path / case) for case in models]
    result = subprocess.run(
        [sys.executable, "-c", PLAIN, *directories],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ""},  # no dtype_policies on the path at all
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("RAISED RuntimeError") and "ignore_mismatched_sizes" in lines[0]
    assert lines[1].startswith("RAISED RuntimeError")
    assert lines[2:] == ["LOADED None", "LOADED None"]
    for case in ("policy_only", "float8"):
        state = torch.load(tmp_path / case / "plain_state.pt")
        expected = models[case].state_dict()
        float_keys = [k for k in expected if not k.endswith(("_scale", "_history"))]
        assert sorted(state) == sorted(float_keys)
        assert all(torch.equal(state[k], expected[k]) for k in float_keys)


FRESH = textwrap.dedent(
    """
    import sys, torch
    import dtype_policies
    assert "transformers" not in sys.modules, "import dtype_policies imported transformers"
    from transformers import AutoModelForCausalLM
    transformers = sys.modules["transformers"]
    transformers.utils.logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
    ids = torch.load(sys.argv[1] + "/ids.pt")
    with torch.no_grad():
        torch.save(model(ids).logits, sys.argv[1] + "/fresh_logits.pt")
    print(type(model.hf_quantizer).__name__)
    """
)


@pytest.mark.slow  # a whole run in a fresh process: kept out of the default suite for its time
def test_fresh_process_import_dtype_policies_then_from_pretrained(tmp_path):
    torch.manual_seed(0)
    model = llama()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int4")
    model.save_pretrained(tmp_path)
    torch.save(IDS, tmp_path / "ids.pt")
    name = _in_a_fresh_process(FRESH, tmp_path).strip()
    assert name == "DTypePoliciesHfQuantizer"
    assert torch.equal(torch.load(tmp_path / "fresh_logits.pt"), outputs(model))


FRESH_FROM_CONFIG = textwrap.dedent(
    """
    import sys, torch, transformers
    import dtype_policies
    directory = sys.argv[1]
    config = transformers.AutoConfig.from_pretrained(directory + "/int8")
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(config).eval()
    plain.save_pretrained(directory + "/plain")
    back = transformers.AutoModelForCausalLM.from_pretrained(directory + "/plain").eval()
    ids = torch.load(directory + "/ids.pt")
    with torch.no_grad():
        same = torch.equal(back(ids).logits, plain(ids).logits)
    print(same, getattr(back.config, "quantization_config", None))
    """
)


@pytest.mark.slow  # a fresh process
def test_fresh_process_saves_a_model_built_from_a_described_config_as_plain(tmp_path):
    """In a process where no model had policies, `save_pretrained` was not
    hooked yet: the stale description of the config went into the checkpoint."""
    model = llama()
    quantize(model, "int8")
    model.save_pretrained(tmp_path / "int8")
    torch.save(IDS, tmp_path / "ids.pt")
    assert _in_a_fresh_process(FRESH_FROM_CONFIG, tmp_path).split() == ["True", "None"]


def _in_a_fresh_process(script: str, directory) -> str:
    """What `script` prints, run on `directory` by a fresh Python process."""
    result = subprocess.run(
        [sys.executable, "-c", script, str(directory)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": SRC},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


# -- the explicit route: saving.save / saving.load onto a meta-built model ------------------------


@pytest.mark.parametrize("mode", [None, "int8", "int4"])
def test_meta_route_with_saving_save_and_load(mode, tmp_path):
    torch.manual_seed(0)
    model = llama()
    apply_policy(model, "mixed_bfloat16")
    if mode is not None:
        quantize(model, mode)
    path = saving.save(model, tmp_path / "checkpoint")
    with torch.device("meta"):
        fresh = transformers.AutoModelForCausalLM.from_config(model.config)
    loaded = saving.load(fresh, path)
    assert not [n for n, t in [*loaded.named_parameters(), *loaded.named_buffers()] if t.is_meta]
    assert loaded.model.rotary_emb.inv_freq.device.type == "cpu"
    assert torch.equal(loaded.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    assert_same_model(loaded, model)
    assert type(loaded.hf_quantizer) is huggingface.DTypePoliciesHfQuantizer  # the listener
    loaded.save_pretrained(tmp_path / "pretrained")  # and it can go on to the Hub format
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pretrained")
    assert torch.equal(outputs(again), outputs(model))


@pytest.mark.parametrize("policy", ["mixed_bfloat16", None])
def test_an_int8_model_loads_in_float16_as_it_converts(policy, tmp_path):
    """`from_pretrained(dtype=torch.float16)` is `.to(torch.float16)` after
    loading: an applied policy stays; without one, int8 computes in float32
    and hands float16 on, as a converted quantized module does."""
    torch.manual_seed(0)
    model = llama()
    if policy is not None:
        apply_policy(model, policy)
    quantize(model, "int8")
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (2, 9))
    rotary = model.model.rotary_emb.inv_freq
    converted = model.to(torch.float16)  # int8 does not compute in float16
    # ... except the non-persistent rotary frequencies, which transformers
    # computes in float32 and leaves so (a policy reads them as stored)
    converted.model.rotary_emb.inv_freq = rotary
    with torch.no_grad():
        expected = converted(ids).logits
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float16)
    assert loaded.model.rotary_emb.inv_freq.dtype == torch.float32
    up_proj = loaded.model.layers[0].mlp.up_proj
    assert up_proj.dtype_policy == converted.model.layers[0].mlp.up_proj.dtype_policy
    assert up_proj.dtype_policy.name == f"int8_from_{policy or 'float32'}"
    assert up_proj.weight_scale.dtype == torch.float32
    with torch.no_grad():
        logits = loaded(ids).logits
    assert logits.dtype == expected.dtype and torch.equal(logits, expected)


def _encoder_outputs(encoder, ids=IDS):
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with torch.no_grad():
        return encoder(ids, attention_mask=mask).last_hidden_state


def _assert_same_encoder(loaded, saved):
    """`loaded` (a base model) holds `saved`'s tensors, policies and outputs
    (and a pooler where `saved`, a masked LM's encoder, has none)."""
    expected, state = saved.state_dict(), loaded.state_dict()
    assert {k for k in state if not k.startswith("pooler.")} == set(expected)
    for key, tensor in expected.items():
        assert state[key].dtype == tensor.dtype and torch.equal(state[key], tensor), key
    pooler = {k: v for k, v in policies(loaded).items() if k.startswith("pooler")}
    assert {**policies(saved), **pooler} == policies(loaded)
    assert torch.equal(_encoder_outputs(loaded), _encoder_outputs(saved))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_task_checkpoint_loads_into_its_base_model_and_another_head(mode, tmp_path):
    """As transformers loads a float `BertForMaskedLM` checkpoint into
    `BertModel` (the `bert.` prefix dropped, the head's tensors unused) or
    `BertForSequenceClassification` (its classifier initialized)."""
    torch.manual_seed(0)
    model = bert()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, mode)
    assert getattr(model.bert.encoder.layer[0].output.dense, f"weight_{mode}").dtype == torch.int8
    model.save_pretrained(tmp_path)

    base = transformers.BertModel.from_pretrained(tmp_path)
    _assert_same_encoder(base, model.bert)
    assert base.config.quantization_config.manifest["quantized"].keys() == {
        name.removeprefix("bert.")
        for name in huggingface.describe(model, "").quantized
        if name.startswith("bert.")
    }

    classifier = transformers.BertForSequenceClassification.from_pretrained(tmp_path)
    _assert_same_encoder(classifier.bert, model.bert)
    assert classifier.classifier.weight.dtype == torch.float32
    assert torch.isfinite(classifier.classifier.weight).all()
    with torch.no_grad():
        logits = classifier(IDS).logits
    assert logits.shape == (2, 2) and torch.isfinite(logits).all()


def test_base_checkpoint_loads_into_a_task_model(tmp_path):
    torch.manual_seed(0)
    encoder = bert().bert
    apply_policy(encoder, "mixed_bfloat16")
    quantize(encoder, "int8")
    encoder.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=r"cls\.predictions\.decoder\.weight.* cannot be tied"):
        loaded = transformers.BertForMaskedLM.from_pretrained(tmp_path)
    _assert_same_encoder(loaded.bert, encoder)
    # the head the checkpoint does not have computes as the base around it
    assert policies(loaded)["cls.predictions.transform.dense"] == "mixed_bfloat16"
    assert policies(loaded)["cls.predictions.transform.LayerNorm"] == "float32"
    assert policies(loaded)[""] == "mixed_bfloat16"
    assert loaded.cls.predictions.transform.dense.weight.dtype == torch.float32
    with torch.no_grad():
        logits = loaded(IDS).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    resaved = tmp_path / "again"
    loaded.save_pretrained(resaved)
    again = transformers.BertForMaskedLM.from_pretrained(resaved)
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, logits)


def test_gpt2_lm_checkpoint_loads_into_gpt2_model(tmp_path):
    torch.manual_seed(0)
    model = gpt2()
    quantize(model, "int8")
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModel.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "GPT2Model"
    expected, state = model.transformer.state_dict(), loaded.state_dict()
    assert sorted(state) == sorted(expected)
    assert all(torch.equal(state[k], v) for k, v in expected.items())
    with torch.no_grad():
        hidden = loaded(IDS).last_hidden_state
        assert torch.equal(hidden, model.transformer(IDS).last_hidden_state)


def test_a_base_model_path_the_target_lacks_still_raises(tmp_path):
    torch.manual_seed(0)
    model = bert()
    quantize(model, "int8")
    model.save_pretrained(tmp_path)
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    quantized = config["quantization_config"]["manifest"]["quantized"]
    moved = quantized.pop("bert.encoder.layer.1.output.dense")
    quantized["bert.encoder.layer.7.output.dense"] = moved
    config_file.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"'encoder\.layer\.7\.output\.dense': no such"):
        transformers.BertModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("target", ["BertForTokenClassification", "BertModel"])
def test_a_saved_pooler_leaves_when_the_target_is_built_without_one(target, tmp_path):
    """`BertModel` (and a sequence classifier) keep a pooler that token
    classification and question answering are built without
    (`add_pooling_layer=False`): transformers leaves its tensors unused, and
    so does the library its entries, whatever the two classes."""
    torch.manual_seed(0)
    encoder = transformers.BertModel(bert().config).eval()
    apply_policy(encoder, "mixed_bfloat16")
    quantize(encoder, "int8")
    assert encoder.pooler.dense.weight_int8.dtype == torch.int8
    encoder.save_pretrained(tmp_path)
    cls = getattr(transformers, target)
    loaded = cls.from_pretrained(
        tmp_path, **({"add_pooling_layer": False} if cls is transformers.BertModel else {})
    )
    base = loaded if cls is transformers.BertModel else loaded.bert
    assert base.pooler is None
    expected = {k: v for k, v in encoder.state_dict().items() if not k.startswith("pooler.")}
    state = base.state_dict()
    assert set(state) == set(expected)
    assert all(torch.equal(state[k], v) for k, v in expected.items())
    assert torch.equal(_encoder_outputs(base), _encoder_outputs(encoder))


def test_a_checkpoint_whose_base_model_has_another_name_raises(tmp_path):
    """Llama's question-answering class keeps its base model under
    `transformer`, its other classes under `model`: none of the saved paths
    fits, which must not load as an unquantized, uninitialized model."""
    torch.manual_seed(0)
    model = transformers.LlamaForQuestionAnswering(llama().config).eval()
    quantize(model, "int8")
    model.save_pretrained(tmp_path)
    with pytest.raises(
        CheckpointError, match=r"none of the checkpoint's \d+ modules .*'transformer'"
    ):
        transformers.LlamaModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("target", ["BertForSequenceClassification", "BertForTokenClassification"])
def test_a_quantized_head_of_another_size_is_initialized_by_transformers(target, tmp_path):
    """`from_pretrained(..., num_labels=5, ignore_mismatched_sizes=True)`, the
    usual way to give a classifier new labels: the saved int8 classifier of
    2 labels leaves with a warning naming it; transformers initializes the
    new one, which computes with the policy around it; the encoder is the
    saved one."""
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(bert().config).eval()
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int8")
    assert model.classifier.weight_int8.shape[0] == 2
    model.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=r"'classifier' \(int8, saved \(2, 64\), now \(5, 64\)\)"):
        loaded = getattr(transformers, target).from_pretrained(
            tmp_path, num_labels=5, ignore_mismatched_sizes=True
        )
    assert loaded.classifier.weight.shape == (5, 64)
    assert loaded.classifier.weight.dtype == torch.float32
    assert policies(loaded)["classifier"] == "mixed_bfloat16"
    with torch.no_grad():
        logits = loaded(IDS).logits
    assert logits.shape[-1] == 5 and logits.dtype == torch.bfloat16
    assert torch.isfinite(logits).all()
    saved = {k: v for k, v in model.bert.state_dict().items() if not k.startswith("pooler.")}
    state = loaded.bert.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items())


@pytest.mark.parametrize(
    "change",
    [
        lambda llm: quantize(llm.model.layers, "int8"),
        lambda llm: quantize(llm.model, "int8"),  # a whole transformers model inside another
        lambda llm: apply_policy(llm.model.layers[1], "mixed_bfloat16"),
        lambda llm: (apply_policy(llm, "mixed_bfloat16"), quantize(llm.model.layers[0], "int4")),
    ],
    ids=["layers", "inner_model", "one_layer_policy", "whole_then_part"],
)
def test_save_pretrained_of_a_model_changed_in_a_part_records_the_part(change, tmp_path):
    """`quantize(llm.model, ...)`, `quantize(llm.model.layers, ...)`: the
    listener sees only the part (which holds no link to `llm`); `llm`'s
    save_pretrained describes `llm` before saving, so the checkpoint reloads
    bit-exact instead of with re-initialized float weights."""
    torch.manual_seed(0)
    model = llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        change(model)
    with torch.no_grad():
        expected = model(IDS).logits
    loaded, messages = reload(model, tmp_path)
    assert policies(loaded) == policies(model)
    assert not [m for m in messages if "MISSING" in m or "UNEXPECTED" in m]
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, expected)


def test_a_model_of_ones_own_around_a_transformers_model_is_not_a_part():
    class WithHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = llama()
            self.head = torch.nn.Linear(8, 2)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_policy(WithHead(), "mixed_bfloat16")


@pytest.mark.parametrize(
    ("mode", "shard", "key"),
    [
        ("int8", None, "model.layers.1.mlp.up_proj.weight_scale"),
        ("int4", "20KB", "model.layers.1.mlp.up_proj.weight_scale"),
        ("float8", None, "model.layers.1.mlp.up_proj.weight"),  # the float weight it keeps
    ],
)
def test_from_pretrained_refuses_a_non_finite_stored_value(mode, shard, key, tmp_path):
    """transformers fills the tensors itself, so the checks of
    `load_state_dict` and `saving.load` never ran: a NaN scale loaded
    silently (every logit NaN)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = llama()
    quantize(model, mode)
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    corrupted = 0
    for file in sorted(tmp_path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as reader:
            metadata = reader.metadata()
            tensors = {name: reader.get_tensor(name) for name in reader.keys()}  # noqa: SIM118
        if key in tensors:
            tensors[key].view(-1)[0] = float("nan")
            save_file(tensors, str(file), metadata)
            corrupted += 1
    assert corrupted == 1
    with pytest.raises(saving.CheckpointError, match=re.escape(key.rpartition(".")[0]) + ".*"
                       r"1 non-finite value\(s\) \(first: nan"):  # fmt: skip
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_from_pretrained_refuses_a_reshaped_float_weight_float8_keeps(tmp_path):
    """The float weight float8 keeps was checked for presence only: reshaped,
    transformers raised its own RuntimeError (ignore_mismatched_sizes)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = llama()
    quantize(model, "float8")
    model.save_pretrained(tmp_path)
    key = "model.layers.1.mlp.up_proj.weight"
    (file,) = tmp_path.glob("*.safetensors")
    with safe_open(str(file), "pt") as reader:
        metadata = reader.metadata()
        tensors = {name: reader.get_tensor(name) for name in reader.keys()}  # noqa: SIM118
    expected = tuple(tensors[key].shape)
    tensors[key] = tensors[key][:-1].contiguous()
    save_file(tensors, str(file), metadata)
    with pytest.raises(saving.CheckpointError, match=re.escape(
        f"'{key}' (the float weight float8 keeps): checkpoint shape "
        f"{(expected[0] - 1, expected[1])}, expected {expected}"
    )):  # fmt: skip
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "version, noted", [("5.20.2", True), ("5.23.0", False), ("6.0.dev0", False)]
)
def test_a_checkpoint_mismatch_under_an_untested_transformers_says_so(monkeypatch, version, noted):
    """transformers 5.20 (the newest on Python 3.10) saves GPT-NeoX's, ViT's
    and Mixtral's quantized heads under names of its own: the mismatch error
    names the version and the tested one."""
    import transformers

    from dtype_policies.saving.huggingface import _old_transformers_note

    monkeypatch.setattr(transformers, "__version__", version)
    note = _old_transformers_note()
    assert ("transformers >= 5.23" in note and version in note) if noted else note == ""
