"""This library's bfloat16 attention kernel (`quantization.kernels.attention`):
torch's SDPA values within torch's own bfloat16 error, on every mask form,
head grouping and length; torch's kernel wherever it does not apply; and the
transformers attention function that reaches it."""

import copy
import math

import pytest
import torch
import torch._inductor.config
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dtype_policies import _cpu
from dtype_policies._attention_dispatch import SELECTION
from dtype_policies._compat import TORCH_VERSION
from dtype_policies.quantization.kernels import attention

_PROBE = torch.zeros(1, 1, 1, 16, dtype=torch.bfloat16)
KERNEL_HERE = attention.applies(_PROBE, _PROBE, _PROBE)
needs_kernel = pytest.mark.skipif(
    not KERNEL_HERE,
    reason="needs AVX-512 bfloat16 without AMX (there torch's kernel is faster) and a compiler",
)


def _draw(generator, *shape):
    return torch.randn(*shape, generator=generator).bfloat16()


def _mask(kind, generator, batch, heads, queries, keys):
    if kind == "bool":  # per head; some rows with no key at all
        return torch.rand(batch, heads, queries, keys, generator=generator) > 0.4
    if kind == "float":  # padding over the keys, broadcast over heads and queries
        mask = torch.randn(batch, 1, 1, keys, generator=generator)
        return mask.masked_fill(torch.rand(batch, 1, 1, keys, generator=generator) < 0.3, -math.inf)
    return None


def _reference(query, key, value, mask, causal, scale):
    """float64 attention of the bfloat16 values; rows with no key give zeros (as torch)."""
    groups = query.shape[1] // key.shape[1]
    key = key.double().repeat_interleave(groups, 1)
    value = value.double().repeat_interleave(groups, 1)
    scores = query.double() @ key.transpose(-1, -2) * scale
    if causal:
        keep = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, -math.inf)
    elif mask is not None and mask.dtype is torch.bool:
        scores = scores.masked_fill(~mask, -math.inf)
    elif mask is not None:
        scores = scores + mask.double()
    weights = scores.softmax(-1).nan_to_num(0.0)
    return weights @ value


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 2),
    key_heads=st.integers(1, 3),
    groups=st.integers(1, 3),
    queries=st.integers(1, 40),
    keys=st.integers(1, 70),
    depth=st.sampled_from([16, 32, 48, 64, 80, 128]),
    masking=st.sampled_from(["none", "causal", "bool", "float"]),
    seed=st.integers(0, 2**16),
)
def test_kernel_gives_torchs_values(batch, key_heads, groups, queries, keys, depth, masking, seed):
    generator = torch.Generator().manual_seed(seed)
    heads = key_heads * groups
    query = _draw(generator, batch, heads, queries, depth)
    key = _draw(generator, batch, key_heads, keys, depth)
    value = _draw(generator, batch, key_heads, keys, depth)
    mask = _mask(masking, generator, batch, heads, queries, keys)
    causal = masking == "causal"
    options = dict(attn_mask=mask, is_causal=causal, enable_gqa=True)
    ours = attention.scaled_dot_product_attention(query, key, value, **options)
    theirs = F.scaled_dot_product_attention(query, key, value, **options)
    reference = _reference(query, key, value, mask, causal, depth**-0.5)
    assert ours.dtype == torch.bfloat16 and ours.shape == theirs.shape == reference.shape
    assert ours.isfinite().all()
    empty = reference.abs().amax(-1) == 0  # rows without a key: zeros, as torch
    assert torch.equal(
        ours.float().abs().amax(-1) == 0, empty | (theirs.float().abs().amax(-1) == 0)
    )

    def error(out):
        return ((out.double() - reference).norm() / reference.norm().clamp_min(1e-12)).item()

    # torch's own bfloat16 kernel errs by about 2e-3 (the probabilities and the result rounded)
    assert error(ours) <= max(1.5 * error(theirs), 4e-3), (error(ours), error(theirs))


@needs_kernel
def test_a_nan_stays_in_its_row():
    generator = torch.Generator().manual_seed(0)
    query, key, value = (_draw(generator, 1, 2, 20, 32) for _ in range(3))
    query[0, 1, 7, 3] = float("nan")
    out = attention.scaled_dot_product_attention(query, key, value)
    assert out[0, 1, 7].isnan().all()
    out[0, 1, 7] = 0
    assert out.isfinite().all()


@needs_kernel
def test_compiled_calls_run_the_same_kernel():
    generator = torch.Generator().manual_seed(1)
    query, key, value = (_draw(generator, 2, 4, 33, 64) for _ in range(3))

    def attend(q, k, v):
        return attention.scaled_dot_product_attention(q, k, v, is_causal=True) * 2

    # no cached graph: it would hold an earlier build's output strides
    with torch.inference_mode(), torch._inductor.config.patch(fx_graph_cache=False):
        eager = attend(query, key, value)
        compiled = torch.compile(attend, fullgraph=True)(query, key, value)
    assert torch.equal(eager, compiled)
    assert compiled.stride() == eager.stride()


@needs_kernel
def test_the_operator_names_a_head_size_it_does_not_take():
    query = torch.zeros(1, 1, 4, 24, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="head size 24"):
        torch.ops.dtype_policies.attention_bf16(query, query, query, None, 0.2, False)


def test_everything_else_is_torchs_kernel():
    generator = torch.Generator().manual_seed(2)
    query, key, value = (torch.randn(1, 2, 9, 32, generator=generator) for _ in range(3))
    assert not attention.applies(query, key, value)  # float32
    assert torch.equal(
        attention.scaled_dot_product_attention(query, key, value, is_causal=True),
        F.scaled_dot_product_attention(query, key, value, is_causal=True),
    )
    half = [t.bfloat16() for t in (query, key, value)]
    assert not attention.applies(*half, dropout_p=0.1)
    assert not attention.applies(*(t[..., :24] for t in half))  # head size not a multiple of 16
    assert not attention.applies(
        half[0], half[1][:, :1], half[2][:, :1]
    )  # grouped without enable_gqa
    trained = half[0].clone().requires_grad_()
    assert not attention.applies(trained, half[1], half[2])
    out = attention.scaled_dot_product_attention(trained, half[1], half[2])
    out.float().sum().backward()
    assert trained.grad is not None and trained.grad.shape == trained.shape
    with _cpu.emulate("avx2"):
        assert not attention.applies(*half)


transformers = pytest.importorskip("transformers")


def _tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()


def _tiny_bert():
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.BertModel(config).to(torch.bfloat16).eval()


@needs_kernel
@pytest.mark.parametrize("build", [_tiny_llama, _tiny_bert], ids=["llama", "bert"])
@pytest.mark.parametrize("padded", [False, True])
def test_transformers_models_attend_on_the_kernel_within_selected(monkeypatch, build, padded):
    model = build()
    tokens = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(tokens)
    if padded:
        mask[1, :5] = 0
    calls = []
    original = attention.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(kwargs.get("is_causal"))
        return original(*args, **kwargs)

    monkeypatch.setattr(attention, "scaled_dot_product_attention", counted)
    with torch.inference_mode():
        theirs = model(input_ids=tokens, attention_mask=mask)[0]
        assert not calls
        with attention.selected(model):
            assert model.config._attn_implementation == "sdpa"  # the name a model reads
            assert getattr(model.config, SELECTION) == attention.NAME
            ours = model(input_ids=tokens, attention_mask=mask)[0]
    assert model.config._attn_implementation == "sdpa"
    assert not hasattr(model.config, SELECTION)
    assert len(calls) == 2  # one per layer
    keep = mask.bool()
    error = (ours.float() - theirs.float())[keep].norm() / theirs.float()[keep].norm()
    assert error.item() < 2e-2


def test_selected_leaves_other_models_alone():
    model = torch.nn.Linear(4, 4)
    with attention.selected(model):
        assert not hasattr(model, "config")
    llama = _tiny_llama()
    llama.config._attn_implementation = "eager"
    with attention.selected(llama):
        assert llama.config._attn_implementation == "eager"
        assert not hasattr(llama.config, SELECTION)


def _llama_counting_kernel_calls(monkeypatch):
    """A float32 tiny Llama, its tokens, and the list the kernel's calls
    append their query's dtype to."""
    model = _tiny_llama().float()
    tokens = torch.randint(0, 64, (2, 19), generator=torch.Generator().manual_seed(4))
    calls = []
    original = attention.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(args[0].dtype)
        return original(*args, **kwargs)

    monkeypatch.setattr(attention, "scaled_dot_product_attention", counted)
    return model, tokens, calls


@needs_kernel
def test_apply_policy_makes_eager_calls_attend_on_the_kernel(monkeypatch):
    from dtype_policies import apply_policy

    model, tokens, calls = _llama_counting_kernel_calls(monkeypatch)
    with torch.inference_mode():
        reference = model(tokens).logits
        handle = apply_policy(model, "mixed_bfloat16")
        ours = model(tokens).logits
        assert calls == [torch.bfloat16, torch.bfloat16]  # one per layer
        assert model.config._attn_implementation == "sdpa"  # after the call
        with pytest.raises(IndexError):  # a failing call restores the setting too
            model(torch.full((1, 3), 99))
        assert model.config._attn_implementation == "sdpa"
        handle.remove()
        calls.clear()
        again = model(tokens).logits
    assert not calls
    assert torch.equal(again, reference)
    error = (ours.float() - reference).norm() / reference.norm()
    assert error.item() < 3e-2


@needs_kernel
@pytest.mark.parametrize("part", ["a decoder layer", "the layers' ModuleList"])
def test_a_policied_part_of_a_model_attends_on_the_kernel_after_its_config_is_replaced(
    monkeypatch, part
):
    """`apply_policy(llm.model.layers[1], ...)`: the decoder layer holds no
    config of its own; its attention reads the model's. It attended with
    torch's kernel while the model reloaded from `save_pretrained` (the policy
    recorded for the layer, applied from the root) attended with this
    library's: the reloaded model's logits were not the saved model's on
    torch 2.6. And `save_pretrained` replaces the model's config object:
    the hooks read the config at each call."""
    from dtype_policies import apply_policy

    model, tokens, calls = _llama_counting_kernel_calls(monkeypatch)
    layers = model.model.layers
    handle = apply_policy(layers[1] if part == "a decoder layer" else layers, "mixed_bfloat16")
    # a ModuleList is never called: its layers are hooked (none attended so before)
    expected = [torch.bfloat16] * (1 if part == "a decoder layer" else 2)
    with torch.inference_mode():
        before = model(tokens).logits
        assert calls == expected  # a float32 layer 0 attends with torch's
        model.config = copy.deepcopy(model.config)
        for module in model.modules():
            if hasattr(module, "config"):
                module.config = model.config
        calls.clear()
        assert torch.equal(model(tokens).logits, before)
        assert calls == expected
        handle.remove()
        calls.clear()
        model(tokens)
    assert not calls
    assert not hasattr(model.config, SELECTION)


@needs_kernel
@pytest.mark.xfail(
    TORCH_VERSION <= (2, 6),
    raises=torch._dynamo.exc.Unsupported,
    strict=True,
    reason="torch 2.6's Dynamo cannot trace `name in func.__code__.co_varnames` "
    "(transformers' merge_with_config_defaults around LlamaModel.forward): "
    "torch.compile(fullgraph=True) of the plain transformers model fails the same way",
)
def test_a_traced_call_keeps_the_models_attention():
    from dtype_policies import apply_policy

    model = _tiny_llama().float()
    apply_policy(model, "mixed_bfloat16")
    tokens = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        eager = model(tokens).logits
        compiled = torch.compile(model, fullgraph=True)(tokens).logits
    assert model.config._attn_implementation == "sdpa"
    # torch's kernel in the graph, this library's eagerly: the same values up to rounding
    assert ((compiled.float() - eager.float()).norm() / eager.float().norm()).item() < 2e-2
