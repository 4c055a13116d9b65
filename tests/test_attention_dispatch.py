"""This library's attention implementations behind transformers' `"sdpa"`:
the name a model reads never changes, so models that branch on it keep their
`"sdpa"` path (Falcon attended without its causal mask when it was renamed)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from dtype_policies import _attention_dispatch, apply_policy, compile_for_inference
from dtype_policies._attention_dispatch import SELECTION, dispatch, register, selecting

transformers = pytest.importorskip("transformers")


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )
    return transformers.LlamaForCausalLM(config).eval()


def tiny_falcon() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.FalconConfig(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        new_decoder_architecture=True,
        num_kv_heads=2,
    )
    return transformers.FalconForCausalLM(config).eval()


TOKENS = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))


def recording(calls: list):
    def implementation(module, query, key, value, attention_mask, **kwargs):
        calls.append(module.config._attn_implementation)
        return _attention_dispatch.transformers_sdpa()(
            module, query, key, value, attention_mask, **kwargs
        )

    return implementation


def test_dispatch_replaces_sdpa_once_and_runs_transformers_own_unless_selected():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls: list = []
    register("test_recording", recording(calls))
    register("test_recording", recording(calls))  # idempotent: one dispatcher
    assert AttentionInterface._global_mapping["sdpa"] is dispatch
    assert _attention_dispatch.transformers_sdpa() is sdpa_attention_forward
    model = tiny_llama()
    with torch.no_grad():
        plain = model(TOKENS).logits
        assert calls == []
        with selecting(model, "test_recording") as selected:
            assert selected
            chosen = model(TOKENS).logits
        assert calls == ["sdpa", "sdpa"]  # one per layer, the name unchanged
        assert not hasattr(model.config, SELECTION)
        assert torch.equal(plain, chosen)  # it ran transformers' own function


def test_selecting_nests_restores_on_error_and_names_an_unknown_implementation():
    register("test_outer", recording([]))
    register("test_inner", recording([]))
    model = tiny_llama()
    with selecting(model, "test_outer"):
        with pytest.raises(RuntimeError, match="inside"), selecting(model, "test_inner"):
            assert model.config._dtype_policies_attention == "test_inner"
            raise RuntimeError("inside")
        assert model.config._dtype_policies_attention == "test_outer"
    assert not hasattr(model.config, SELECTION)
    unknown = selecting(model, "no_such_attention")
    with pytest.raises(KeyError, match="'no_such_attention'"), unknown:
        pass
    assert not hasattr(model.config, SELECTION)


def test_models_that_are_not_selectable_are_left_alone():
    register("test_left_alone", recording([]))
    linear = torch.nn.Linear(4, 4)
    eager = tiny_llama()
    eager.config._attn_implementation = "eager"
    for model in (linear, eager):
        with selecting(model, "test_left_alone") as selected:
            assert not selected
        assert not hasattr(getattr(model, "config", None), SELECTION)


@pytest.mark.parametrize(
    "compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"]
)
def test_falcon_keeps_its_causal_attention_under_a_policy(compiled):
    """Falcon tests `_attn_implementation == "sdpa"` literally: with the name
    renamed during a call it took its eager branch with SDPA's boolean mask
    added to its scores (no causal mask: 66% of the logits' scale)."""
    model = tiny_falcon()
    with torch.no_grad():
        reference = model(TOKENS).logits
        as_bfloat16 = copy.deepcopy(model).to(torch.bfloat16)(TOKENS).logits.float()
        float32 = copy.deepcopy(model)
        apply_policy(float32, "float32")
        assert torch.equal(float32(TOKENS).logits, reference)
        mixed = copy.deepcopy(model)
        apply_policy(mixed, "mixed_bfloat16")
        call = compile_for_inference(mixed, autotune=False) if compiled else mixed
        ours = call(TOKENS).logits.float()
    scale = reference.abs().max()
    bfloat16_error = ((as_bfloat16 - reference).abs().max() / scale).item()
    assert ((ours - reference).abs().max() / scale).item() < max(2 * bfloat16_error, 2e-2)


def test_a_selection_holds_for_calls_in_other_threads_during_the_block():
    calls: list = []
    register("test_threads", recording(calls))
    model = tiny_llama()
    with torch.no_grad(), selecting(model, "test_threads"):
        worker = threading.Thread(target=model, args=(TOKENS,))
        worker.start()
        worker.join()
    assert calls == ["sdpa", "sdpa"]


def test_overlapping_selections_end_with_the_config_as_it_was():
    """Thread A enters, thread B enters, A leaves, B leaves: B must not put
    back the selection it found when it entered (A's), or the config would
    keep it after both (and save it with the model)."""
    register("test_overlap", recording([]))
    model = tiny_llama()
    a, b = selecting(model, "test_overlap"), selecting(model, "test_overlap")
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert model.config._dtype_policies_attention == "test_overlap"  # B's, still under way
    b.__exit__(None, None, None)
    assert not hasattr(model.config, SELECTION)
    assert _attention_dispatch._ACTIVE == {}


@pytest.mark.parametrize("kernels", ["1", "0"])
@pytest.mark.parametrize("island", ["float32", "int8_from_float32", "int4_from_mixed_float16"])
@pytest.mark.filterwarnings("ignore::dtype_policies.CPUFloat16Warning")
def test_an_island_on_one_projection_attends_in_the_promoted_dtype(island, kernels, monkeypatch):
    """A float32 island on the query projection of a bfloat16 attention gave
    SDPA a float32 query and bfloat16 keys: "Expected query, key, and value to
    have the same dtype". They meet as Keras's ops meet mixed inputs, promoted."""
    from dtype_policies import DTypePolicyMap

    monkeypatch.setenv("DTYPE_POLICIES_NATIVE_KERNELS", kernels)
    reference = tiny_llama()
    mask = torch.ones_like(TOKENS)
    mask[1, :4] = 0  # a padded row: the additive mask is promoted with them
    with torch.no_grad():
        expected = reference(TOKENS, attention_mask=mask).logits
    model = copy.deepcopy(reference)
    policies = DTypePolicyMap(default_policy="mixed_bfloat16")
    policies["model.layers.0.self_attn.q_proj"] = island
    apply_policy(model, policies)
    queries = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda module, args, out: queries.append(out.dtype)
    )
    with torch.no_grad():
        logits = model(TOKENS, attention_mask=mask).logits
    # the island computed in its own dtype (float16 and bfloat16 promote to float32)
    assert queries == [torch.float16 if "float16" in island else torch.float32]
    assert logits.dtype == torch.bfloat16 and bool(torch.isfinite(logits).all())
    error = (logits.float() - expected).abs().max() / expected.abs().max()
    assert error < 0.05, float(error)


def _tiny(architecture: str, attention: str) -> tuple[torch.nn.Module, str]:
    torch.manual_seed(0)
    common = {"vocab_size": 64}
    if architecture == "bert":
        config = transformers.BertConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=32, **common,
        )  # fmt: skip
        model_class, island = transformers.BertModel, "encoder.layer.0.attention.self.query"
    elif architecture == "t5":
        config = transformers.T5Config(
            d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2, decoder_start_token_id=0,
            **common,
        )  # fmt: skip
        model_class = transformers.T5ForConditionalGeneration
        island = "encoder.block.0.layer.0.SelfAttention.q"
    else:  # gemma2: eager whatever is asked (transformers refuses sdpa for it)
        config = transformers.Gemma2Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=32, sliding_window=16,
            **common,
        )  # fmt: skip
        model_class, island = transformers.Gemma2ForCausalLM, "model.layers.0.self_attn.k_proj"
    config._attn_implementation = attention
    return model_class(config).eval(), island


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("architecture", ["bert", "t5", "gemma2"])
def test_an_island_attends_in_the_promoted_dtype_on_eager_attention_too(architecture, attention):
    """Each model's `eager_attention_forward` multiplied a float32 query by
    bfloat16 keys ("expected m1 and m2 to have the same dtype"); under sdpa,
    T5's bfloat16 position bias met a float32 query."""
    from dtype_policies import DTypePolicyMap

    if architecture == "gemma2" and attention == "sdpa":
        pytest.skip("transformers runs Gemma2 on eager attention only")
    model, island = _tiny(architecture, attention)
    ids = TOKENS[:, :8]
    extra = {"decoder_input_ids": ids[:, :4]} if architecture == "t5" else {}
    with torch.no_grad():
        expected = model(ids, **extra)[0]
    policies = DTypePolicyMap(default_policy="mixed_bfloat16")
    policies[island] = "float32"
    apply_policy(model, policies)
    with torch.no_grad():
        got = model(ids, **extra)[0]
    assert bool(torch.isfinite(got).all())
    error = (got.float() - expected).abs().max() / expected.abs().max()
    assert error < 0.05, float(error)


def test_an_island_still_attends_after_the_model_switches_to_eager():
    from dtype_policies import DTypePolicyMap

    model = tiny_llama()
    policies = DTypePolicyMap(default_policy="mixed_bfloat16")
    policies["model.layers.0.self_attn.q_proj"] = "float32"
    apply_policy(model, policies)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        assert torch.isfinite(model(TOKENS).logits).all()
