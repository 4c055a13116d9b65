"""The one-query attention of compiled decode steps gives transformers' SDPA
values for every mask form, head grouping and dtype, and hands everything
else to SDPA itself."""

import pytest
import torch

from dtype_policies._one_query_attention import NAME, one_query_attention, register

transformers = pytest.importorskip("transformers")
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402


def attention_module(groups: int) -> torch.nn.Module:
    module = torch.nn.Module()
    module.num_key_value_groups = groups
    module.is_causal = True
    return module


def inputs(batch, key_heads, groups, queries, length, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    heads = key_heads * groups

    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    return (
        draw(batch, heads, queries, 16),
        draw(batch, key_heads, length, 16),
        draw(batch, key_heads, length, 16),
    )


def masks(batch, heads, length):
    generator = torch.Generator().manual_seed(1)
    keep = torch.rand(batch, 1, 1, length, generator=generator) > 0.3
    keep[..., 0] = True
    per_head = torch.rand(batch, heads, 1, length, generator=generator) > 0.3
    per_head[..., 0] = True
    additive = torch.zeros(batch, 1, 1, length).masked_fill(~keep, torch.finfo(torch.float32).min)
    return {"none": None, "bool": keep, "bool per head": per_head, "additive": additive}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "bool per head", "additive"])
def test_one_query_matches_sdpa(dtype, groups, mask_kind):
    batch, key_heads, length = 2, 2, 37
    query, key, value = inputs(batch, key_heads, groups, 1, length, dtype)
    mask = masks(batch, key_heads * groups, length)[mask_kind]
    module = attention_module(groups)
    ours, weights = one_query_attention(module, query, key, value, mask, scaling=0.25)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert weights is None
    assert ours.dtype == dtype and ours.shape == theirs.shape == (batch, 1, key_heads * groups, 16)
    # float32 arithmetic: at most bfloat16's rounding of the result apart.
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours.float(), theirs.float(), atol=tolerance, rtol=tolerance)


def test_the_default_scale_is_one_over_root_width():
    query, key, value = inputs(1, 1, 2, 1, 9, torch.float32)
    module = attention_module(2)
    ours, _ = one_query_attention(module, query, key, value, None)
    theirs, _ = sdpa_attention_forward(module, query, key, value, None)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "case",
    ["many queries", "dropout", "position bias"],
)
def test_what_is_not_one_plain_query_goes_to_sdpa_unchanged(case):
    queries = 4 if case == "many queries" else 1
    query, key, value = inputs(1, 2, 3, queries, 11, torch.float32)
    module = attention_module(3)
    extra = {}
    if case == "dropout":
        extra["dropout"] = 0.5
    if case == "position bias":
        extra["position_bias"] = torch.randn(1, 6, queries, 11)
    torch.manual_seed(3)
    ours, _ = one_query_attention(module, query, key, value, None, **extra)
    torch.manual_seed(3)
    theirs, _ = sdpa_attention_forward(module, query, key, value, None, **extra)
    assert torch.equal(ours, theirs)


def test_registered_behind_sdpa_under_its_name():
    from transformers import AttentionInterface

    from dtype_policies import _attention_dispatch

    assert register() == NAME
    assert AttentionInterface._global_mapping["sdpa"] is _attention_dispatch.dispatch
    assert _attention_dispatch._IMPLEMENTATIONS[NAME] is one_query_attention
    assert NAME not in AttentionInterface._global_mapping  # the model's name stays "sdpa"


def test_inputs_are_computed_once_before_the_loops_over_the_cache():
    """After `register`, the query, key and value pass through Inductor's
    stride prim when traced, which realizes them under Inductor (so a key's
    rotary embedding is not recomputed per cached position); in eager mode
    they are used as they are."""
    from dtype_policies import _one_query_attention as attention

    register()
    assert attention._force_stride_order is torch.ops.prims.inductor_force_stride_order
    query, key, value = inputs(2, 1, 3, 1, 7, torch.float32)
    assert attention._computed_once(key) is key
    module = attention_module(3)
    ours, _ = one_query_attention(module, query, key, value, None)
    theirs, _ = sdpa_attention_forward(module, query, key, value, None)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_compiled_attention_realizes_a_computed_key():
    """Under Inductor the key's producer (a rotation here) goes through the
    stride prim into a buffer of its own; the values are eager's."""
    from torch._inductor.utils import run_and_get_code

    register()
    module = attention_module(3)
    query, key, value = inputs(2, 1, 3, 1, 7, torch.float32)

    def rotated_step(query, raw_key, value, angle):
        key = raw_key * torch.cos(angle) + raw_key.flip(-1) * torch.sin(angle)
        return one_query_attention(module, query, key, value, None)[0]

    angle = torch.rand(7, 16, generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(rotated_step, backend="inductor", fullgraph=True)
    out, codes = run_and_get_code(compiled, query, key, value, angle)
    torch.testing.assert_close(out, rotated_step(query, key, value, angle), atol=1e-5, rtol=1e-5)
    assert any("inductor_force_stride_order" in code for code in codes)
