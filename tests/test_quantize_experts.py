"""Mixture-of-experts blocks (transformers 5's experts with 3-D weights)
quantized expert by expert: the expansion into one linear per expert computes
what the fused module computes, every expert is quantized with its own
scales, nothing changes until everything is planned, policies reach the
experts' linears and leave with them, and the expanded model saves, loads,
trains and compiles."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dtype_policies import (  # noqa: E402
    apply_policy,
    compile_for_inference,
    quantize,
    saving,
)
from dtype_policies._core.module_state import quantization_of, state_of  # noqa: E402
from dtype_policies.quantization import Int4QuantizationConfig  # noqa: E402
from dtype_policies.quantization.attach import is_quantized  # noqa: E402
from dtype_policies.quantization.experts import (  # noqa: E402
    ExpertsExpansion,
    expanded,
    experts_layout,
)
from dtype_policies.quantizers import AWQConfig, GPTQConfig  # noqa: E402

VOCAB = 96
TOKENS = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def _mixtral():
    config = transformers.MixtralConfig(
        **SMALL, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2
    )
    return transformers.MixtralForCausalLM(config)


def _gpt_oss():  # transposed (in, out) experts with biases and an interleaved, clamped gate
    config = transformers.GptOssConfig(
        **SMALL,
        intermediate_size=96,
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        layer_types=["full_attention"] * 2,
    )
    return transformers.GptOssForCausalLM(config)


def _qwen3_moe():
    config = transformers.Qwen3MoeConfig(
        **SMALL,
        intermediate_size=96,
        moe_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
    )
    return transformers.Qwen3MoeForCausalLM(config)


MODELS = {"mixtral": _mixtral, "gpt_oss": _gpt_oss, "qwen3_moe": _qwen3_moe}


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    with torch.no_grad():  # trained-looking biases (gpt-oss initializes them to zero)
        for parameter_name, parameter in model.named_parameters():
            if parameter_name.endswith("_bias"):
                parameter.normal_(0, 0.02)
    return model


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits.float()


def quantize_quietly(*args, **kwargs):
    """`quantize()` with its summary warning ignored."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize(*args, **kwargs)


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if experts_layout(m) is not None or expanded(m)]


def reloaded(model: torch.nn.Module, name: str, tmp_path) -> torch.nn.Module:
    """`model` saved with `saving.save` and loaded into a fresh meta-device one."""
    saving.save(model, tmp_path / "ckpt")
    with torch.device("meta"):
        fresh = MODELS[name]().eval()
    saving.load(fresh, tmp_path / "ckpt")
    return fresh


def relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


@pytest.mark.parametrize("name", MODELS)
def test_the_expansion_computes_what_every_experts_implementation_computes(name):
    model = build(name)
    references = {}
    for implementation in ("eager", "batched_mm", "grouped_mm"):
        model.set_experts_implementation(implementation)
        references[implementation] = logits(model)
    for module in experts_modules(model):
        ExpertsExpansion.of(module).attach()
    expanded_logits = logits(model)
    for reference in references.values():
        assert relative(expanded_logits, reference) < 1e-5
    first = experts_modules(model)[0]
    assert expanded(first) and not [p for p in first.parameters(recurse=False)]
    assert isinstance(first.down_proj, torch.nn.ModuleList) and len(first.down_proj) >= 4


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("mode", ["int8", "int4", "float8"])
def test_each_expert_is_quantized_on_its_own_and_computes_with_its_dequantized_weights(name, mode):
    model = build(name)
    fused = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left float to warn about: routers are quiet
        report = quantize(model, mode)
    routers = report.skipped_by_reason("router")
    assert len(routers) == 2
    experts = experts_modules(model)
    assert len(experts) == 2 and all(expanded(m) for m in experts)
    quantized_paths = {path for path, _, _ in report.quantized}
    for module_path, module in model.named_modules():
        if expanded(module):
            for name_, linears in module.named_children():
                if isinstance(linears, torch.nn.ModuleList):
                    for index in range(len(linears)):
                        path = f"{module_path}.{name_}.{index}".replace(".", "/")
                        assert path in quantized_paths
    # each expert computes exactly what an nn.Linear of its weights quantized
    # alone computes: its scales are its own
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    for fused_module, module in zip(experts_modules(fused), experts, strict=True):
        layout = experts_layout(fused_module)
        for weight_name in layout.weights:
            for index in (0, layout.num_experts - 1):
                weight = getattr(fused_module, weight_name)[index].detach()
                weight = weight.t() if layout.transposed else weight
                bias = getattr(fused_module, f"{weight_name}_bias", None)
                alone = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
                with torch.no_grad():
                    alone.weight.copy_(weight)
                    if bias is not None:
                        alone.bias.copy_(bias[index])
                quantize(alone, mode)
                inputs = x if weight.shape[1] == 64 else torch.randn(5, weight.shape[1])
                with torch.no_grad():
                    assert torch.equal(getattr(module, weight_name)[index](inputs), alone(inputs))
    if mode != "float8":  # (float8's weight attribute is its float weight)
        # the fused model with each expert's dequantized weights computes
        # what the expanded one computes, up to the kernels' activation rounding
        with torch.no_grad():
            for fused_module, module in zip(experts_modules(fused), experts, strict=True):
                layout = experts_layout(fused_module)
                for weight_name in layout.weights:
                    stacked = torch.stack(
                        [linear.weight.float() for linear in getattr(module, weight_name)]
                    )
                    if layout.transposed:
                        stacked = stacked.transpose(1, 2)
                    getattr(fused_module, weight_name).copy_(stacked)
            for module_path, module in fused.named_modules():
                if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                    module.weight.copy_(model.get_submodule(module_path).weight.float())
        assert relative(logits(model), logits(fused)) < 0.05
    for module in experts:  # no 3-D tensor left, no view of one kept
        for parameter in module.parameters():
            assert parameter.dim() <= 2 and parameter.is_contiguous()
            assert parameter.untyped_storage().nbytes() == parameter.numel() * parameter.itemsize


def test_a_filter_chooses_experts_and_the_rest_stay_float_in_storage_of_their_own():
    model = build("mixtral")
    report = quantize_quietly(model, "int8", filters=r"layers/0/mlp/experts/down_proj/1$")
    assert [path for path, _, _ in report.quantized] == ["model/layers/0/mlp/experts/down_proj/1"]
    first, second = experts_modules(model)
    assert expanded(first) and not expanded(second)  # the second block is untouched
    assert second.gate_up_proj.dim() == 3
    for linear in first.gate_up_proj:
        weight = linear.weight
        assert weight.is_contiguous()
        assert weight.untyped_storage().nbytes() == weight.numel() * weight.itemsize
    assert torch.isfinite(logits(model)).all()


def test_a_filter_matching_no_expert_leaves_the_experts_as_they_are():
    model = build("qwen3_moe")
    before = [p for m in experts_modules(model) for p in m.parameters()]
    quantize_quietly(model, "int8", filters="self_attn")
    after = [p for m in experts_modules(model) for p in m.parameters()]
    assert len(before) == len(after) and all(a is b for a, b in zip(before, after, strict=True))
    assert not any(expanded(m) for m in model.modules())


def test_an_error_in_one_expert_leaves_the_model_bit_for_bit_unchanged():
    model = build("gpt_oss")
    reference = logits(model)
    experts = experts_modules(model)[1]
    with torch.no_grad():
        experts.down_proj[2, 5, 7] = float("nan")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    classes = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"layers/1/mlp/experts/down_proj/2.*non-finite"):
        quantize(model, "int4")
    assert [type(m) for m in model.modules()] == classes
    after = model.state_dict()
    assert after.keys() == state.keys()
    assert all(
        torch.allclose(after[k], v, rtol=0, atol=0, equal_nan=True) for k, v in state.items()
    )
    assert experts.down_proj.dim() == 3 and experts_layout(experts) is not None
    with torch.no_grad():
        experts.down_proj[2, 5, 7] = state["model.layers.1.mlp.experts.down_proj"][2, 5, 6]
    assert logits(model).shape == reference.shape


def test_a_policy_reaches_the_experts_linears_and_leaves_them_with_remove():
    model = build("qwen3_moe")
    handle = apply_policy(model, "mixed_bfloat16")
    quantize_quietly(model, "int8")
    linear = experts_modules(model)[0].gate_up_proj[3]
    assert state_of(linear).call.policy.name == "int8_from_mixed_bfloat16"
    assert model.lm_head.dtype_policy.name == "int8_from_float32"  # float32 logits
    assert model.model.norm(model.model.embed_tokens(TOKENS)).dtype == torch.bfloat16
    handle.remove()
    assert state_of(linear).call.compute == torch.float32
    assert model(TOKENS).logits.dtype == torch.float32


@pytest.mark.parametrize(("name", "mode"), [("gpt_oss", "int4"), ("qwen3_moe", "float8")])
def test_the_expanded_model_saves_and_loads_bit_for_bit(name, mode, tmp_path):
    model = build(name)
    apply_policy(model, "mixed_bfloat16")
    quantize_quietly(model, mode)
    expected = logits(model)
    assert torch.equal(logits(reloaded(model, name, tmp_path)), expected)
    model.save_pretrained(tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = type(model).from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(logits(loaded), expected)
    assert torch.equal(logits(copy.deepcopy(loaded)), expected)
    assert torch.equal(logits(pickle.loads(pickle.dumps(loaded))), expected)


def test_loading_into_a_model_whose_experts_are_not_transformers_experts_raises(tmp_path):
    model = build("mixtral")
    quantize_quietly(model, "int8")
    saving.save(model, tmp_path / "ckpt")
    target = build("mixtral")
    target.model.layers[1].mlp.experts = torch.nn.Linear(2, 2)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(saving.CheckpointError, match=r"layers.1.mlp.experts.*Linear"):
        saving.load(target, tmp_path / "ckpt")
    assert all(torch.equal(target.state_dict()[k], v) for k, v in before.items())
    assert not any(expanded(m) for m in target.modules())


def test_a_second_quantize_keeps_the_expansion_and_changes_nothing():
    model = build("mixtral")
    quantize_quietly(model, "int8")
    expected = logits(model)
    report = quantize_quietly(model, "int8")
    assert report.quantized == [] and torch.equal(logits(model), expected)


def test_straight_through_gradients_reach_the_router_and_the_inputs():
    model = build("qwen3_moe").train()
    quantize_quietly(model, "int8")
    loss = model(TOKENS, labels=TOKENS).loss
    loss.backward()
    router = model.model.layers[0].mlp.gate
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    assert model.model.layers[0].input_layernorm.weight.grad.abs().sum() > 0


CALIBRATION = torch.randint(3, VOCAB, (16, 12), generator=torch.Generator().manual_seed(1))


def _calibrated_config(mode: str):
    config_class = GPTQConfig if mode == "gptq" else AWQConfig
    return config_class(CALIBRATION, None, num_samples=16, sequence_length=12, group_size=32)


def _error(model: torch.nn.Module, reference: torch.Tensor) -> float:
    return ((logits(model) - reference).norm() / reference.norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("mode", ["gptq", "awq"])
def test_calibrated_modes_quantize_each_expert_on_the_tokens_routed_to_it(name, mode, tmp_path):
    """GPTQ and AWQ expand the experts like the plain modes; while
    calibrating, the block computes with the linears, so that each expert's
    statistics are its routed tokens'; routers stay float; the model saves and
    loads bit for bit."""
    model = build(name)
    apply_policy(model, "mixed_bfloat16")
    reference = logits(model)
    report = quantize_quietly(model, config=_calibrated_config(mode), progress=False)
    experts = [m for m in model.modules() if expanded(m)]
    assert len(experts) == 2 and not any("forward" in vars(m) for m in experts)
    for module in experts:
        for linears in (module.gate_up_proj, module.down_proj):
            assert [linear.dtype_policy.name for linear in linears] == [
                f"{mode}/4/32_from_mixed_bfloat16"
            ] * len(linears)
            assert all(linear._parameters.get("weight") is None for linear in linears)
    assert "model/layers/0/mlp/experts/down_proj/3" in {path for path, *_ in report.quantized}
    block = model.model.layers[0].mlp
    assert not is_quantized(block.router if name == "gpt_oss" else block.gate)
    error = _error(model, reference)
    assert 0 < error < 0.3
    if mode == "gptq":  # better than round to nearest on the same grid, on other tokens
        rounded = build(name)
        apply_policy(rounded, "mixed_bfloat16")
        quantize_quietly(rounded, "int4", Int4QuantizationConfig(block_size=32))
        assert error < 0.9 * _error(rounded, reference)
    expected = logits(model)
    assert torch.equal(logits(reloaded(model, name, tmp_path)), expected)


def _never_choose(expert: int):
    """A forward hook for a Qwen3-MoE router: no token goes to `expert` (its
    place in each top-k given to the next expert)."""

    def hook(module, args, output):
        router_logits, scores, indices = output
        count = router_logits.shape[-1]
        return router_logits, scores, torch.where(indices == expert, (indices + 1) % count, indices)

    return hook


def test_an_expert_no_calibration_token_chose_is_rounded_on_its_grid():
    """An expert that no calibration token reaches has statistics of no rows:
    GPTQ's Hessian is then the identity, and its weights are rounded on their
    grid (an error like round to nearest's), never NaN or left float."""
    model = build("qwen3_moe")
    original = copy.deepcopy(model)
    handles = [
        layer.mlp.gate.register_forward_hook(_never_choose(7)) for layer in model.model.layers
    ]
    quantize_quietly(model, config=_calibrated_config("gptq"), progress=False)
    for handle in handles:
        handle.remove()
    for layer, float_layer in zip(model.model.layers, original.model.layers, strict=True):
        for name in ("gate_up_proj", "down_proj"):
            linear = getattr(layer.mlp.experts, name)[7]
            assert linear.dtype_policy.name == "gptq/4/32_from_float32"
            weight = quantization_of(linear).scheme.dequantize(linear, quantization_of(linear))
            expected = getattr(float_layer.mlp.experts, name)[7]
            assert torch.isfinite(weight).all()
            assert ((weight - expected).norm() / expected.norm()).item() < 0.15


def test_calibration_keeps_no_casts_of_the_experts_weights(monkeypatch):
    """The experts' linears, outside the model's tree while calibrating, keep
    no compute-dtype casts either (a second copy of the experts: on the
    benchmark's MoE model, peak memory 10.5 GB instead of 7.3)."""
    from dtype_policies.quantization import calibration

    model = build("qwen3_moe")
    apply_policy(model, "mixed_bfloat16")
    planned = calibration._plan_block
    kept = []

    def observed(block, calls, group, config, limit):
        plans = planned(block, calls, group, config, limit)
        for path, checked in group:
            if "/experts/" in path:
                casts = state_of(checked.module).casts
                kept.append(casts.enabled or bool(casts.entries) or casts.pair is not None)
        return plans

    monkeypatch.setattr(calibration, "_plan_block", observed)
    quantize_quietly(model, config=_calibrated_config("gptq"), progress=False)
    assert len(kept) == 2 * 2 * 8 and not any(kept)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["gptq", "awq"])
def test_statistics_in_several_passes_give_the_same_quantization(mode, monkeypatch):
    """A block whose statistics exceed `STATISTICS_PER_PASS` runs its calls once
    per share of its weights; each weight's statistics, hence its integers,
    are those of one pass."""
    from dtype_policies.quantization import calibration

    def calibrated(per_pass: int):
        monkeypatch.setattr(calibration, "STATISTICS_PER_PASS", per_pass)
        model = build("qwen3_moe")
        apply_policy(model, "mixed_bfloat16")
        passes = []
        observing = calibration._observing

        def counted(block, members, statistics):
            passes.append(len(members))
            return observing(block, members, statistics)

        monkeypatch.setattr(calibration, "_observing", counted)
        quantize_quietly(model, config=_calibrated_config(mode), progress=False)
        monkeypatch.setattr(calibration, "_observing", observing)
        return model.state_dict(), passes

    one, passes = calibrated(2**40)
    several, many_passes = calibrated(1)  # every weight alone
    assert len(passes) == 2 and len(many_passes) == sum(passes) > 2
    assert one.keys() == several.keys()
    assert all(torch.equal(one[key], several[key]) for key in one)


def test_an_interrupted_calibration_leaves_the_experts_as_they_were(monkeypatch):
    from dtype_policies.quantization import calibration

    model = build("qwen3_moe")
    before = {key: value.clone() for key, value in model.state_dict().items()}
    expected = logits(model)
    planned = calibration._plan_block
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second block
            raise KeyboardInterrupt
        return planned(*args, **kwargs)

    monkeypatch.setattr(calibration, "_plan_block", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quantize(model, config=_calibrated_config("gptq"), progress=False)
    assert len(calls) == 2
    assert not any(expanded(m) for m in model.modules())
    assert not any("forward" in vars(m) for m in model.modules())
    state = model.state_dict()
    assert state.keys() == before.keys()
    assert all(torch.equal(state[key], value) for key, value in before.items())
    assert torch.equal(logits(model), expected)


@pytest.mark.slow
def test_a_compiled_graph_runs_the_experts_as_one_operator():
    model = build("qwen3_moe")
    apply_policy(model, "mixed_bfloat16")
    quantize_quietly(model, "int8")
    expected = logits(model)
    compiled = compile_for_inference(model, fullgraph=True, autotune=False)
    with torch.inference_mode():
        ours = compiled(TOKENS).logits.float()
    assert relative(ours, expected) < 0.02


@pytest.mark.parametrize(
    ("config_class", "model_class", "router"),
    [
        ("PhimoeConfig", "PhimoeForCausalLM", "mlp/router"),  # an nn.Linear subclass
        ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", "mlp/gate/wg"),  # nested nn.Linear
    ],
)
def test_routers_stay_float_whatever_their_class(config_class, model_class, router):
    config = getattr(transformers, config_class)(
        **SMALL, intermediate_size=96, num_experts_per_tok=2, head_dim=16
    )
    for name in ("num_local_experts", "num_experts"):
        if hasattr(config, name):
            setattr(config, name, 4)
    if hasattr(config, "moe_intermediate_size"):
        config.moe_intermediate_size = 48
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = quantize(model, "int8")
    assert report.skipped_by_reason("router") == [f"model/layers/{i}/{router}" for i in range(2)]
    module = model.get_submodule(f"model.layers.0.{router.replace('/', '.')}")
    assert module.weight.dtype == torch.float32 and state_of(module) is None
    assert all(expanded(m) for m in experts_modules(model))


@pytest.mark.parametrize("policy", ["int8_from_mixed_bfloat16", "float8_from_float32"])
def test_apply_policy_with_a_quantized_policy_quantizes_the_experts_too(policy, tmp_path):
    model = build("gpt_oss")
    by_quantize = build("gpt_oss")
    handle = apply_policy(model, policy)
    source, mode = policy.split("_from_")[1], policy.split("_from_")[0]
    apply_policy(by_quantize, source)
    quantize_quietly(by_quantize, mode)
    apply_policy(by_quantize.lm_head, source)  # the head as the policy says (int8: from float32)
    experts = experts_modules(model)
    assert all(expanded(m) for m in experts)
    assert "model/layers/0/mlp/experts/down_proj/3" in handle.quantized_paths
    assert handle.policies["model/layers/0/mlp/experts/down_proj/3"].name == policy
    router = model.model.layers[0].mlp.router
    assert router.weight.dtype == torch.float32 and "model/layers/0/mlp/router" not in (
        handle.quantized_paths
    )
    assert torch.equal(logits(model), logits(by_quantize))
    saving.save(model, tmp_path / "ckpt")
    with torch.device("meta"):
        fresh = MODELS["gpt_oss"]().eval()
    saving.load(fresh, tmp_path / "ckpt")
    assert torch.equal(logits(fresh), logits(model))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        handle.remove()
    if mode == "float8":  # undone exactly: the experts compute in float32 again
        assert not seen
        assert relative(logits(model), logits(build("gpt_oss"))) < 1e-5
    else:
        assert "stay quantized" in str(seen[0].message)


@pytest.mark.slow
def test_torch_compile_trains_through_the_experts():
    model = build("qwen3_moe").train()
    quantize_quietly(model, "int8")
    eager = model(TOKENS, labels=TOKENS).loss
    compiled = torch.compile(model)(TOKENS, labels=TOKENS).loss  # (tracing the loop gave NaN)
    assert abs(compiled.item() - eager.item()) < 1e-3
    compiled.backward()
    grad = model.model.layers[0].mlp.gate.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["gpt_oss", "mixtral"])
def test_load_state_dict_of_the_fused_float_model_quantizes_it_into_the_experts(name):
    donor = build(name)
    with torch.no_grad():
        for parameter in donor.parameters():
            parameter.mul_(1.5)  # other values than the model's own
    expected = copy.deepcopy(donor)
    model = build(name)
    quantize_quietly(model, "int8")
    quantize_quietly(expected, "int8")
    model.load_state_dict(donor.state_dict())  # strict: every key placed
    assert torch.equal(logits(model), logits(expected))
    fresh = build(name)
    quantize_quietly(fresh, "int8")
    before = logits(fresh)
    bad = donor.state_dict()
    key = "model.layers.0.mlp.experts.down_proj"
    bad[key] = bad[key][:2]
    with pytest.raises((RuntimeError, ValueError), match="down_proj"):
        fresh.load_state_dict(bad)
    assert torch.equal(logits(fresh), before)  # nothing loaded


def test_experts_outside_the_calibrated_blocks_stay_float_and_are_reported():
    model = build("mixtral")
    config = GPTQConfig(
        CALIBRATION,
        None,
        num_samples=16,
        sequence_length=12,
        group_size=32,
        quantization_layer_structure=[model.model.layers[0]],  # the second layer is outside
    )
    report = quantize_quietly(model, config=config, progress=False)
    outside = [p for p in report.outside_linears if p.startswith("model/layers/1/mlp/experts")]
    assert outside, report.outside_linears
    assert not any(expanded(m) for m in model.model.layers[1].modules())
    assert any(expanded(m) for m in model.model.layers[0].modules())


def _switch_transformers():
    config = transformers.SwitchTransformersConfig(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        num_experts=4,
        encoder_sparse_step=1,
        decoder_sparse_step=1,
        expert_capacity=64,
    )
    return transformers.SwitchTransformersForConditionalGeneration(config)


def _nllb_moe():
    config = transformers.NllbMoeConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_experts=4,
        expert_capacity=64,
        encoder_sparse_step=1,
        decoder_sparse_step=1,
        max_position_embeddings=64,
    )
    return transformers.NllbMoeForConditionalGeneration(config)


def _jetmoe():  # experts in 3-D `ParallelExperts`, in the MLP and in the attention
    config = transformers.JetMoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_key_value_heads=2,
        kv_channels=8,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    return transformers.JetMoeForCausalLM(config)


LIST_STYLE = {
    "switch": (_switch_transformers, ["encoder/block/0/layer/1/mlp/router/classifier"]),
    "nllb_moe": (_nllb_moe, ["model/encoder/layers/0/ffn/router/classifier"]),
    "jetmoe": (
        _jetmoe,
        ["model/layers/0/mlp/router/layer", "model/layers/0/self_attention/experts/router/layer"],
    ),
}


def _outputs(model: torch.nn.Module) -> torch.Tensor:
    inputs = {"input_ids": TOKENS}
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = TOKENS[:, :5]
    with torch.no_grad():
        return model(**inputs).logits.float()


@pytest.mark.parametrize("name", sorted(LIST_STYLE))
def test_routers_of_experts_in_lists_stay_float(name):
    """Switch Transformers' and NLLB-MoE's experts are a list of MLPs, JetMoe's
    3-D `ParallelExperts`: their blocks' routers stay float as Mixtral's do
    (by `quantize()` and by a quantized policy), and a second `quantize()`
    after a filtered one still finds them."""
    build_model, routers = LIST_STYLE[name]
    torch.manual_seed(0)
    model = build_model().eval()
    reference = _outputs(model)
    report = quantize_quietly(model, "int8", filters="expert")
    report = quantize_quietly(model, "int8")
    skipped = report.skipped_by_reason("router")
    assert set(routers) <= set(skipped) and len(skipped) == 2 * len(routers) * (
        2 if model.config.is_encoder_decoder else 1
    )
    for path in skipped:
        router = model.get_submodule(path.replace("/", "."))
        assert quantization_of(router) is None and router.weight.dtype == torch.float32
    assert not any("router" in path for path, *_ in report.quantized)
    assert relative(_outputs(model), reference) < 0.1
    torch.manual_seed(0)
    model = build_model().eval()
    handle = apply_policy(model, "int8_from_float32")
    assert not any("router" in path for path in handle.quantized_paths)
    assert all("gate" in handle.unquantized[path] for path in routers)


def _qwen2_moe():  # a shared expert as wide as the number of experts, and its gate
    config = transformers.Qwen2MoeConfig(
        **SMALL,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=8,
    )
    return transformers.Qwen2MoeForCausalLM(config), "mlp/shared_expert", ["mlp/shared_expert_gate"]


def _deepseek_v3():
    config = transformers.DeepseekV3Config(
        **SMALL,
        intermediate_size=96,
        moe_intermediate_size=8,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=0,
        n_group=1,
        topk_group=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    )
    return transformers.DeepseekV3ForCausalLM(config), "mlp/shared_experts", []


def _olmoe():
    config = transformers.OlmoeConfig(
        **SMALL, intermediate_size=8, num_experts=8, num_experts_per_tok=2
    )
    return transformers.OlmoeForCausalLM(config), None, []


def _granite_moe_shared():  # the shared MLP is the decoder layer's, beside the block
    config = transformers.GraniteMoeSharedConfig(
        **SMALL,
        intermediate_size=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        shared_intermediate_size=8,
    )
    return transformers.GraniteMoeSharedForCausalLM(config), "shared_mlp", []


SHARED = {
    "qwen2_moe": _qwen2_moe,
    "deepseek_v3": _deepseek_v3,
    "olmoe": _olmoe,
    "granite_moe_shared": _granite_moe_shared,
}


@pytest.mark.parametrize("name", sorted(SHARED))
def test_shared_experts_are_quantized_and_every_gate_stays_float(name):
    """A shared expert is an MLP of the block (several matrices): quantized,
    even when its width is the number of experts; the router and a shared
    expert's gate (one matrix each) stay float."""
    torch.manual_seed(0)
    model, shared, gates = SHARED[name]()
    model.eval()
    reference = logits(model)
    report = quantize_quietly(model, "int8")
    layer = "model/layers/0"
    routers = [p for p in report.skipped_by_reason("router") if p.startswith(layer + "/")]
    router = next(p for p in routers if p.endswith(("/gate", "/router")))
    assert sorted(routers) == sorted([router, *(f"{layer}/{gate}" for gate in gates)])
    quantized = {path for path, *_ in report.quantized}
    if shared is not None:
        linears = [
            f"{layer}/{shared}/{child}"
            for child, module in model.get_submodule(
                f"model.layers.0.{shared.replace('/', '.')}"
            ).named_children()
            if isinstance(module, torch.nn.Linear)
        ]
        assert len(linears) >= 2 and set(linears) <= quantized
    assert relative(logits(model), reference) < 0.1


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_removing_a_float8_policy_gives_the_experts_their_3d_weights_back(name):
    """float8's application expands the experts into one linear per expert;
    `remove()` undoes it whole: the same state_dict keys, shapes and order as
    before, holding what the linears hold now (a training step's values),
    and the module's own forward."""
    model = build(name)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    experts = model.model.layers[0].mlp.experts
    cls = type(experts)
    handle = apply_policy(model, "float8_from_float32")
    assert expanded(experts)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(TOKENS, labels=TOKENS).loss.backward()
    optimizer.step()
    trained = experts.down_proj[1].weight.detach().clone()
    model.eval()
    handle.remove()
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[key].shape == before[key].shape for key in before)
    assert type(experts) is cls and not expanded(experts)
    down = experts.down_proj
    assert isinstance(down, torch.nn.Parameter) and down.dtype == torch.float32
    assert torch.equal(down[1].t() if experts.is_transposed else down[1], trained)
    assert not torch.equal(down, before["model.layers.0.mlp.experts.down_proj"])
    reference = build(name)
    reference.load_state_dict(after)
    assert torch.equal(logits(model), logits(reference))
