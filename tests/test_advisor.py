"""The precision advisor: `dtype_policies.advise` and `dtype-policies advise`."""

import copy
import json
import math
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import dtype_policies
from dtype_policies import Advice, DTypePolicyMap, advise, saving
from dtype_policies.advisor import relative_error
from dtype_policies.quantization.attach import quantization_of
from tiny_models import tiny_decoder

# Aggressiveness of the labels advise uses, least first.
ORDER = ["float32", "mixed_bfloat16", "int8", "int4"]
QUANTIZED = {"int8", "int4"}
FAST = {"progress": False, "repeats": 2}


def fragile_mlp() -> torch.nn.Sequential:
    """Three linears; the first reads inputs with four outlier channels (x100),
    its weight columns for them scaled down so its outputs stay normal: int8
    and int4 (activations quantized per row, weights per output channel)
    crush the other 60 channels there."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.GELU(),
        torch.nn.Linear(128, 128),
        torch.nn.GELU(),
        torch.nn.Linear(128, 16),
    )
    with torch.no_grad():
        model[0].weight[:, :4] /= 100.0
    return model


def outlier_inputs(seed: int = 1) -> torch.Tensor:
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(seed))
    x[:, :4] *= 100.0
    return x


def snapshot(model: torch.nn.Module):
    return (
        {key: value.clone() for key, value in model.state_dict().items()},
        [(name, type(module), module.training) for name, module in model.named_modules()],
        [(name, p.requires_grad, p.dtype) for name, p in model.named_parameters()],
    )


def assert_unchanged(model: torch.nn.Module, before) -> None:
    state, modules, parameters = before
    now = model.state_dict()
    assert list(now) == list(state)
    for key, value in state.items():
        assert now[key].dtype == value.dtype and torch.equal(now[key], value), key
    assert [(n, type(m), m.training) for n, m in model.named_modules()] == modules
    assert [(n, p.requires_grad, p.dtype) for n, p in model.named_parameters()] == parameters
    assert not any(hasattr(m, "dtype_policy") for m in model.modules())


def measured_error(model: torch.nn.Module, advice: Advice, batches, call=None) -> float:
    """Applies the advice to a fresh copy and measures its error ourselves."""
    call = call or (lambda module, x: module(x))
    fresh = copy.deepcopy(model).eval()
    advice.apply(fresh)
    with torch.no_grad():
        got = [call(fresh, x) for x in batches]
        want = [call(model.eval(), x) for x in batches]
    diff = sum(float((a.double() - b.double()).square().sum()) for a, b in zip(got, want))
    norm = sum(float(b.double().square().sum()) for b in want)
    return math.sqrt(diff / norm)


def choices(advice: Advice) -> dict[str, str]:
    return {row.path: row.choice for row in advice.modules}


def test_fragile_layer_stays_precise_the_rest_is_quantized():
    model = fragile_mlp()
    before = snapshot(model)
    x = outlier_inputs()
    advice = advise(model, x, max_error=0.03, objective="memory", **FAST)
    assert_unchanged(model, before)

    chosen = choices(advice)
    assert chosen["0"] not in QUANTIZED  # the fragile layer
    assert chosen["2"] in QUANTIZED and chosen["4"] in QUANTIZED
    sensitivity = {row.path: row.errors for row in advice.modules}
    assert sensitivity["0"]["int8"] > 10 * sensitivity["2"]["int8"]
    assert set(advice.policy_map) == {"2", "4"}  # exact paths, float32 by default
    assert advice.policy_map.default_policy.name == "float32"

    error = measured_error(model, advice, [x])
    assert error <= 0.03
    assert error == pytest.approx(advice.error, rel=1e-4, abs=1e-6)
    # apply quantizes by the map: int8 storage on the chosen modules only
    fresh = copy.deepcopy(model)
    advice.apply(fresh)
    keys = fresh.state_dict()
    assert "2.weight_int8" in keys or "2.weight_int4" in keys
    assert "0.weight" in keys and keys["0.weight"].dtype == torch.float32
    assert relative_error(torch.ones(3), torch.ones(3)) == 0.0


def test_the_order_of_the_candidates_does_not_change_the_advice():
    """int4/32 listed before int8 had int8 (dearer in bytes) dropped from
    every group's ladder: a group whose int4 missed the budget stayed
    float32 where int8 met it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
    ).eval()
    x = torch.randn(4, 32)
    advices = [
        advise(model, x, max_error=0.02, candidates=order, objective="memory", **FAST)
        for order in (("int8",), ("int8", "int4/32"), ("int4/32", "int8"))
    ]
    assert choices(advices[0]) == choices(advices[1]) == choices(advices[2])
    assert advices[1].model_bytes["chosen"] == advices[0].model_bytes["chosen"]


def test_a_candidate_may_be_a_torch_dtype():
    from dtype_policies.advisor.candidates import parse_candidates

    labels = [c.label for c in parse_candidates((torch.bfloat16, "int8"))]
    assert labels == ["float32", "int8", "bfloat16"]


def test_an_unknown_candidate_is_told_every_form_accepted():
    """The message was Keras's list of float policies alone."""
    from dtype_policies.advisor.candidates import parse_candidate

    with pytest.raises(ValueError) as raised:
        parse_candidate("int9")
    message = str(raised.value)
    assert message.startswith("advise(): unknown candidate 'int9'; accepted: ")
    quantized = {"int8": "int8", "int4": "int4/128", "float8": "float8", "gptq": "gptq/4/128"}
    quantized |= {"awq": "awq/4/128", "int4/<block size>": "int4/64"}
    quantized |= {"gptq/<bits>/<group size>": "gptq/8/64", "awq/4/<group size>": "awq/4/32"}
    for form, mode in quantized.items():  # each listed, and each taken
        name = mode if "<" in form else form
        assert f"'{form}'" in message
        assert parse_candidate(name).name == f"{mode}_from_mixed_bfloat16"
    for name in ("mixed_bfloat16", "mixed_float16", "bfloat16", "float16", "float32"):
        assert f"'{name}'" in message and parse_candidate(name).name == name
    assert "'int8_from_mixed_bfloat16'" in message
    # a known form that is wrong says what is wrong in it
    with pytest.raises(ValueError, match=r"'int4/0': Invalid block_size"):
        parse_candidate("int4/0")


def test_a_tighter_budget_never_quantizes_more():
    model = fragile_mlp()
    x = outlier_inputs()
    previous = None
    for budget in (0.1, 0.02, 0.01, 0.004, 0.0005):
        advice = advise(model, x, max_error=budget, objective="memory", **FAST)
        assert advice.error <= budget
        assert measured_error(model, advice, [x]) <= budget
        ranks = {path: ORDER.index(choice) for path, choice in choices(advice).items()}
        if previous is not None:
            for path, rank in ranks.items():
                assert rank <= previous[path], (budget, path, choices(advice))
        previous = ranks
    assert previous == {"0": 0, "2": 0, "4": 0}  # the tightest keeps everything float32


def test_latency_objective_on_several_batches_meets_the_budget():
    model = fragile_mlp()
    batches = [outlier_inputs(seed) for seed in (1, 2)]
    before = snapshot(model)
    advice = advise(model, iter(batches), max_error=0.02, objective="latency", **FAST)
    assert_unchanged(model, before)
    assert advice.error <= 0.02
    assert measured_error(model, advice, batches) <= 0.02
    for row in advice.modules:
        assert row.micros["float32"] > 0 and row.calls == 1
        assert row.bytes["int8"] < row.bytes["float32"]


def test_metric_replaces_the_relative_error():
    model = fragile_mlp()
    x = outlier_inputs()
    calls = []

    def max_abs(outputs, reference):
        calls.append(1)
        return float((outputs.float() - reference).abs().max())

    advice = advise(model, (x,), max_error=0.05, metric=max_abs, objective="memory", **FAST)
    fresh = copy.deepcopy(model)
    advice.apply(fresh)
    with torch.no_grad():
        assert max_abs(fresh(x), model(x)) <= 0.05
    assert calls and advice.error <= 0.05


def test_table_and_json(tmp_path):
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)
    )
    advice = advise(model, torch.randn(8, 32), max_error=0.02, objective="memory", **FAST)
    table = advice.table()
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["path", "class", "group", "policy"]
    assert "sensitivity int8" in lines[0] and "µs/call f32" in lines[0]
    row_3 = next(line for line in lines if line.startswith("3 "))
    assert row_3.split()[1] == "Linear" and row_3.split()[3] == choices(advice)["3"]
    assert "float32 (fixed)" in next(line for line in lines if line.startswith("2 "))
    assert f"error {advice.error:.4g} measured" in table

    data = json.loads(advice.to_json())
    assert data["format"] == "dtype_policies.advice"
    assert data["error"] == advice.error and data["max_error"] == 0.02
    assert [row["path"] for row in data["modules"]] == ["0", "2", "3"]
    by_path = {row["path"]: row for row in data["modules"]}
    assert by_path["2"]["note"] == "normalization layer (float32 island)"
    assert by_path["0"]["bytes"]["float32"] == (32 * 64 + 64) * 4
    assert dtype_policies.deserialize(data["policy"]) == advice.policy_map

    assert data["model_bytes"]["chosen"] < data["model_bytes"]["float32"]
    assert data["model_bytes"]["float32"] == sum(t.nbytes for t in model.state_dict().values())
    assert data["forward_micros"]["float32"] > 0 and data["forward_micros"]["chosen"] > 0
    assert "whole model, float32 -> chosen:" in table

    path = advice.save(tmp_path / "map.json")
    assert saving.load_policy(path) == advice.policy_map
    assert json.loads(path.read_text())["advice"]["error"] == advice.error


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"max_error": 0}, ValueError, "max_error"),
        ({"max_error": -0.1}, ValueError, "max_error"),
        ({"max_error": float("nan")}, ValueError, "max_error"),
        ({"max_error": "0.1"}, TypeError, "of type str"),
        ({"max_error": None}, TypeError, "of type NoneType"),
        ({"repeats": 2.0}, TypeError, "of type float"),
        ({"candidates": ("int8", "int3")}, ValueError, "unknown candidate 'int3'"),
        ({"candidates": ("float8_e4m3fn",)}, ValueError, "unknown candidate"),
        ({"candidates": ()}, ValueError, "empty"),
        ({"candidates": 8}, TypeError, "candidates"),
        ({"candidates": None}, TypeError, "candidates"),
        ({"candidates": (8,)}, TypeError, "unknown candidate 8"),
        ({"objective": "speed"}, ValueError, "objective"),
        ({"inputs": []}, ValueError, "empty"),
        ({"inputs": iter(())}, ValueError, "empty"),
        ({"inputs": None}, ValueError, "None"),
        ({"inputs": 3.0}, TypeError, "float"),
        ({"inputs": torch.randn(4, 7)}, ValueError, "calling the model"),
        ({"metric": "mse"}, TypeError, "metric"),
        ({"max_error": float("inf")}, ValueError, "finite number"),  # JSON has no Infinity
        ({"repeats": True}, TypeError, "repeats"),
        ({"inputs": torch.full((4, 64), float("nan"))}, ValueError, "non-finite value"),
        ({"inputs": torch.randn(0, 64)}, ValueError, r"empty tensor of shape \(0, 64\)"),
    ],
)
def test_bad_arguments_raise_and_leave_the_model_alone(kwargs, error, match):
    model = fragile_mlp()
    before = snapshot(model)
    arguments = {"inputs": outlier_inputs(), "max_error": 0.02, **kwargs}
    with pytest.raises(error, match=match):
        advise(model, **arguments, progress=False)
    assert_unchanged(model, before)


def test_a_model_on_the_meta_device_is_refused_by_name():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 8))
    with pytest.raises(ValueError, match=r"'0\.weight' is on the meta device"):
        advise(model, torch.randn(2, 16), progress=False)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "int8_from_mixed_bfloat16"])
def test_a_model_that_already_has_policies_is_refused_by_name(policy):
    # measured against itself, its float32 "baseline" missed any budget, and
    # the advice went on top of the policies in force
    model = fragile_mlp()
    handle = dtype_policies.apply_policy(model, policy)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    policies = [getattr(m, "dtype_policy", None) for m in model.modules()]
    with pytest.raises(ValueError, match=rf"already computes by dtype policies .*'0' \({policy}\)"):
        advise(model, outlier_inputs(), max_error=0.02, progress=False)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert [getattr(m, "dtype_policy", None) for m in model.modules()] == policies
    handle.remove()
    quantized = fragile_mlp()
    dtype_policies.quantize(quantized, "int8")  # quantize() alone: measured as it is
    advice = advise(quantized, outlier_inputs(), max_error=0.02, **FAST)
    assert advice.error <= 0.02


class EncoderThenDecoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        layer = {"d_model": 32, "nhead": 4, "dim_feedforward": 64, "dropout": 0.0}
        self.enc = torch.nn.TransformerEncoderLayer(**layer, batch_first=True)
        self.dec = torch.nn.TransformerDecoderLayer(**layer, batch_first=True)

    def forward(self, x):
        return self.dec(x, self.enc(x))


def test_weights_an_encoder_layer_reads_itself_are_not_advised():
    """At inference `nn.TransformerEncoderLayer`'s fast path reads its
    `self_attn`'s weights itself (as its linears'): an entry for `self_attn`
    changed nothing there (measured 0.0 error). `nn.TransformerDecoderLayer`
    calls its attentions, which are measured."""
    torch.manual_seed(0)
    model = EncoderThenDecoder().eval()
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    advice = advise(model, x, candidates=("mixed_bfloat16",), objective="memory", **FAST)
    rows = {row.path: row for row in advice.modules}
    for name in ("self_attn", "linear1", "linear2"):
        assert rows[f"enc/{name}"].group is None
        assert rows[f"enc/{name}"].note == "weight read by its parent (TransformerEncoderLayer)"
    for parent in ("enc/self_attn", "dec/self_attn", "dec/multihead_attn"):  # its own parent
        assert rows[f"{parent}/out_proj"].note == "weight read by its parent (MultiheadAttention)"
    for name in ("self_attn", "multihead_attn", "linear1", "linear2"):
        assert rows[f"dec/{name}"].errors["mixed_bfloat16"] > 0, name
    assert all(key.startswith("dec/") for key in advice.policy_map)


def test_an_already_quantized_module_shows_its_policy():
    model = fragile_mlp()
    dtype_policies.quantize(model[2], "int8")
    advice = advise(model, outlier_inputs(), max_error=0.02, objective="memory", **FAST)
    row = next(row for row in advice.modules if row.path == "2")
    assert (row.group, row.policy, row.note) == (None, "int8_from_float32", "already quantized")
    line = next(line for line in advice.table().splitlines() if line.startswith("2 "))
    assert line.split()[2:4] == ["-", "int8_from_float32"]  # was "float32 (fixed)"
    assert "(fixed)" in line
    assert json.loads(advice.to_json())["modules"][1]["policy"] == "int8_from_float32"


def tiny_llama(tie: bool = False):
    return tiny_decoder("llama", tie=tie)


def test_llama_q_k_v_share_one_precision():
    model = tiny_llama()
    before = snapshot(model)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    advice = advise(model, {"input_ids": ids}, max_error=0.02, objective="memory", **FAST)
    assert_unchanged(model, before)
    groups = [set(group) for group in advice.groups]
    chosen = choices(advice)
    for layer in (0, 1):
        attention = f"model/layers/{layer}/self_attn/"
        qkv = {attention + name for name in ("q_proj", "k_proj", "v_proj")}
        assert qkv in groups
        assert len({chosen[path] for path in qkv}) == 1
        mlp = f"model/layers/{layer}/mlp/"
        assert {mlp + "gate_proj", mlp + "up_proj"} in groups
        assert {attention + "o_proj"} in groups
        for norm in ("input_layernorm", "post_attention_layernorm"):
            assert chosen[f"model/layers/{layer}/{norm}"] == "float32"
    assert any(choice in QUANTIZED for choice in chosen.values())
    assert advice.error <= 0.02

    logits = lambda module, ids: module(input_ids=ids).logits  # noqa: E731
    assert measured_error(model, advice, [ids], logits) <= 0.02


def test_tied_embedding_and_head_are_one_group():
    model = tiny_llama(tie=True)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    advice = advise(model, {"input_ids": ids}, max_error=0.02, objective="memory", **FAST)
    assert ["model/embed_tokens", "lm_head"] in advice.groups
    chosen = choices(advice)
    assert chosen["lm_head"] == chosen["model/embed_tokens"]
    assert advice.error <= 0.02
    logits = lambda module, ids: module(input_ids=ids).logits  # noqa: E731
    assert measured_error(model, advice, [ids], logits) <= 0.02


class TiedHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.relu(self.mid(self.emb(ids))))


def test_a_tied_weight_is_counted_once():
    """The table's and totals' bytes (and the memory objective's costs) were
    the tied table's twice: 7,488 bytes for a model of 4,288."""
    from dtype_policies.advisor.variants import model_bytes

    torch.manual_seed(0)
    model = TiedHead().eval()
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    advice = advise(model, ids, candidates=("int4", "int8", "mixed_bfloat16"), **FAST)
    assert advice.totals()["bytes_float32"] == advice.model_bytes["float32"] == 4288
    assert advice.totals()["bytes_chosen"] == advice.model_bytes["chosen"]
    rows = {row.path: row for row in advice.modules}
    # (on CPUs without native bfloat16 the note goes on to say why it is not advised)
    assert rows["head"].note.startswith("shares tensors with 'emb' (counted there)")
    counted = [(label, name) for label, name in advice.candidates if label in rows["emb"].bytes]
    assert {"int8", "int4"} <= {label for label, _ in counted}  # (mixed_bfloat16 not on avx2)
    for label, name in counted:  # the pair under each, as the map stores it
        applied = copy.deepcopy(model)
        dtype_policies.apply_policy(applied, DTypePolicyMap("float32", {"emb": name, "head": name}))
        pair = rows["emb"].bytes[label] + rows["head"].bytes[label]
        assert pair + rows["mid"].bytes["float32"] == model_bytes(applied), label


def test_a_tied_group_that_cannot_be_counted_under_a_candidate_goes_without_it(monkeypatch):
    from dtype_policies.advisor import runner

    counted = runner.group_bytes

    def fails_for_int8(modules, candidate, inputs, routers):
        if candidate.label == "int8":
            raise NotImplementedError("cannot store it")
        return counted(modules, candidate, inputs, routers)

    monkeypatch.setattr(runner, "group_bytes", fails_for_int8)
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    advice = advise(TiedHead().eval(), ids, candidates=("int8",), objective="memory", **FAST)
    rows = {row.path: row for row in advice.modules}
    for path in ("emb", "head"):
        assert rows[path].choice == "float32" and rows[path].errors["int8"] is None
        assert "no int8 (int8: cannot store it)" in rows[path].note
    assert rows["mid"].choice == "int8"  # no tie: counted module by module


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_q_k_v_are_measured_under_every_candidate(family):
    # The q/k/v group's outputs meet in attention: q and k after a float32
    # rotary table (and Qwen3's float32 q/k norms), v directly; a narrower
    # group hands its outputs back in float32, so every candidate runs.
    model = tiny_decoder(family, layers=1)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    advice = advise(model, {"input_ids": ids}, max_error=0.05, objective="memory", **FAST)
    rows = {row.path: row for row in advice.modules}
    for name in ("q_proj", "k_proj", "v_proj"):
        row = rows[f"model/layers/0/self_attn/{name}"]
        assert "failed" not in row.note, row.note
        for label in ("mixed_bfloat16", "int8", "int4"):
            assert row.errors[label] is not None and 0 < row.errors[label] < 0.5, (label, row)
    logits = lambda module, ids: module(input_ids=ids).logits  # noqa: E731
    assert measured_error(model, advice, [ids], logits) <= 0.05


def test_a_majority_float_policy_can_become_the_maps_default():
    from dtype_policies.advisor.runner import _with_common_default
    from dtype_policies.advisor.units import Skipped, Unit

    units = [Unit(path, torch.nn.Linear(2, 2)) for path in "abcde"]
    skipped = [
        Skipped("q", "Linear", "already quantized", "int8_from_float32"),
        Skipped("p", "Linear", "its weight is read by its parent"),
    ]
    bf16, int8 = "mixed_bfloat16", "int8_from_mixed_bfloat16"
    chosen = DTypePolicyMap("float32", {"a": bf16, "b": bf16, "c": int8, "d": bf16})
    common = _with_common_default(chosen, units, skipped)
    assert common.default_policy.name == "mixed_bfloat16"
    assert {key: policy.name for key, policy in common.policy_map.items()} == {
        "c": "int8_from_mixed_bfloat16",
        "e": "float32",  # left at float32 by the choice: kept so by an entry
        "q": "int8_from_float32",  # skipped modules keep what they compute by
        "p": "float32",
    }
    # no float policy over half the units: nothing to rewrite
    half = DTypePolicyMap("float32", {"a": bf16, "b": bf16})
    assert _with_common_default(half, units, skipped) is None
    quantized = {key: "int8_from_mixed_bfloat16" for key in "abc"}
    assert _with_common_default(DTypePolicyMap("float32", quantized), units, skipped) is None


class _NoHalfPrecision(torch.nn.Module):
    """Weightless code between the units that refuses bfloat16."""

    def forward(self, x):
        if x.dtype != torch.float32:
            raise RuntimeError(f"Unsupported dtype {x.dtype}")
        return x


def test_a_common_default_the_model_refuses_leaves_the_verified_map(monkeypatch):
    from dtype_policies.advisor import runner

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 32), _NoHalfPrecision(), torch.nn.Linear(32, 32)
    ).eval()
    tried = []

    def always_common(policy_map, units, skipped):
        tried.append(policy_map)
        return DTypePolicyMap("mixed_bfloat16", {})

    monkeypatch.setattr(runner, "_with_common_default", always_common)
    advice = dtype_policies.advise(model, torch.randn(8, 32), max_error=0.05, repeats=1)
    assert tried and advice.policy_map is not None
    assert advice.policy_map.default_policy.name == "float32"
    assert advice.error <= 0.05
    model_copy = copy.deepcopy(model)
    advice.apply(model_copy)
    model_copy(torch.randn(2, 32))  # the kept map runs


@pytest.mark.slow
def test_mixture_of_experts_experts_are_quantized_and_routers_stay_float():
    model = tiny_decoder("qwen3_moe")
    before = snapshot(model)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    advice = advise(
        model,
        {"input_ids": ids},
        max_error=0.05,
        objective="memory",
        candidates=("int4", "int8", "mixed_bfloat16"),
        **FAST,
    )
    assert_unchanged(model, before)
    rows = {row.path: row for row in advice.modules}
    for layer in (0, 1):
        experts = rows[f"model/layers/{layer}/mlp/experts"]
        router = rows[f"model/layers/{layer}/mlp/gate"]
        assert experts.group == router.group  # they read the same input
        float_bytes = experts.bytes["float32"]
        assert float_bytes == sum(
            p.numel() * 4 for p in model.model.layers[layer].mlp.experts.parameters()
        )
        assert 0 < experts.bytes["int8"] < float_bytes / 3
        assert 0 < experts.bytes["int4"] < experts.bytes["int8"]
        assert router.bytes["int4"] == router.bytes["float32"]  # computes with the float source
        assert experts.errors["int4"] is not None and experts.errors["int4"] > 0
    assert any(rows[f"model/layers/{i}/mlp/experts"].choice in QUANTIZED for i in (0, 1))
    assert advice.error <= 0.05

    deployed = copy.deepcopy(model)
    advice.apply(deployed)
    for layer in (0, 1):
        mlp = deployed.model.layers[layer].mlp
        if rows[f"model/layers/{layer}/mlp/experts"].choice in QUANTIZED:
            linear = mlp.experts.down_proj[0]  # one linear per expert
            assert quantization_of(linear).mode == rows[f"model/layers/{layer}/mlp/experts"].choice
        assert mlp.gate.weight.dtype == torch.float32
    logits = lambda module, ids: module(input_ids=ids).logits  # noqa: E731
    assert measured_error(model, advice, [ids], logits) <= 0.05


FACTORY = textwrap.dedent(
    """
    import torch

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)
        )

    def batches():
        generator = torch.Generator().manual_seed(0)
        return [torch.randn(8, 32, generator=generator) for _ in range(2)]

    class Classes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(32, 4)

        def forward(self, x):
            return self.linear(x).argmax(-1)

    def classes():
        return Classes()
    """
)


def cli(*args, cwd):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(cwd), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "dtype_policies", "advise", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )


@pytest.mark.slow  # a whole run in a fresh process: kept out of the default suite for its time
def test_cli_advise(tmp_path):
    (tmp_path / "advise_models.py").write_text(FACTORY)
    result = cli(
        "advise_models:mlp",
        "--inputs",
        "16x32",
        "--objective",
        "memory",
        "--max-error",
        "0.02",
        "--output",
        "map.json",
        "--json",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["target"] == "advise_models:mlp" and data["error"] <= 0.02
    assert "measured 1/2" in result.stderr  # progress
    policy_map = saving.load_policy(tmp_path / "map.json")
    assert isinstance(policy_map, DTypePolicyMap)
    assert dtype_policies.serialize(policy_map) == data["policy"]

    table = cli("advise_models:mlp", "--inputs", "advise_models:batches", "--quiet", cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert table.stdout.startswith("path") and "sensitivity int8" in table.stdout
    assert table.stderr.strip() == "" or "measured" not in table.stderr


def test_cli_advise_bad_argument_exits_with_one_line(tmp_path):
    (tmp_path / "advise_models.py").write_text(FACTORY)
    result = cli("advise_models:mlp", "--inputs", "16x32", "--max-error", "0", cwd=tmp_path)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert (
        lines[-1] == "dtype-policies advise: error: --max-error must be a number > 0. Received: 0.0"
    )
    assert "Traceback" not in result.stderr
    assert cli("advise_models:mlp", "--objective", "speed", cwd=tmp_path).returncode == 2


def test_cli_help_lists_advise_and_the_inputs_forms(capsys):
    from dtype_policies.cli import main

    assert main(["--help"]) == 0
    assert "advise" in capsys.readouterr().out
    assert main(["advise", "--help"]) == 0
    text = capsys.readouterr().out
    assert "[NAME=]SHAPE[:DTYPE[:HIGH]]" in text and "package.module:callable" in text


def test_int32_ids_refuse_a_vocabulary_beyond_their_range():
    from dtype_policies.cli.input_specs import random_batches
    from dtype_policies.cli.targets import CLIError

    model = torch.nn.Linear(2, 2)
    model.config = type("Config", (), {"vocab_size": 2**40})()
    [batch] = random_batches(["2x3:int64"], model, count=1, seed=0)
    assert batch.dtype == torch.int64 and int(batch.max()) < 2**40
    with pytest.raises(CLIError, match=f"the model's {2**40} token ids do not fit torch.int32"):
        random_batches(["2x3:int32"], model, count=1, seed=0)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--inputs", "16x32", "--candidates", "int8,int3"], "unknown candidate 'int3'"),
        (["--inputs", "16xq"], "cannot read '16xq'"),
        (["--inputs", "nonsense"], "cannot read 'nonsense'"),
        (["--inputs", "16x32:int64"], "cannot tell the range"),
        (["--inputs", "x=16x32", "8x8"], "name every SPEC"),
        (["--inputs", "16x32:float7"], "unknown dtype 'float7'"),
        (["--inputs", "advise_models:missing"], "has no attribute 'missing'"),
        (["--inputs", "16x32", "--candidates", "int9"], "'float8', 'gptq' (gptq/4/128)"),
        # numbers torch overflows on, named with their range (were "ValueError: Overflow ...")
        (
            ["--inputs", "16x32", "--seed", str(10**23)],
            f"--seed must be an integer from 0 to {2**64 - 1}. Received: {10**23}",
        ),
        (["--inputs", "16x32", "--seed", "-1"], "--seed must be an integer from 0 to"),
        (
            ["--inputs", "4x16:int64:" + "9" * 20],
            f"HIGH must be from 1 to {2**63 - 1} for int64. Received: {'9' * 20}",
        ),
        (["--inputs", "4x16:int32:4294967296"], "HIGH must be from 1 to 2147483648 for int32"),
        (
            ["--inputs", "99999999999x99999999999"],
            "'99999999999x99999999999' is 39,999,999,999,200,000,000,004 bytes; "
            "a tensor holds at most 9,223,372,036,854,775,807 bytes",
        ),
    ],
)
def test_cli_advise_bad_inputs_in_process(tmp_path, monkeypatch, capsys, args, message):
    (tmp_path / "advise_models.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    from dtype_policies.cli import main

    assert main(["advise", "advise_models:mlp", "--quiet", *args]) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("dtype-policies advise: error:")
    assert message in error[0]


def test_cli_advise_without_floating_outputs_says_what_the_cli_user_can_do(
    tmp_path, monkeypatch, capsys
):
    """It said "pass `metric=`", an option the command line does not have."""
    (tmp_path / "advise_models.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    from dtype_policies.cli import main

    assert main(["advise", "advise_models:classes", "--inputs", "4x32", "--quiet"]) == 1
    [error] = capsys.readouterr().err.strip().splitlines()
    assert error.startswith("dtype-policies advise: error: the model's outputs hold no floating")
    assert "give a TARGET factory whose model returns them" in error
    assert "metric=" not in error.replace("advise(model, inputs, metric=...) in Python", "")
    from advise_models import classes

    with pytest.raises(ValueError, match="pass `metric=`"):  # the Python API's own advice
        advise(classes(), torch.randn(4, 32), progress=False)


@pytest.mark.slow
def test_benchmark_mlp_advice_keeps_its_error_budget():
    """The benchmark's MLP end to end (its time is reported by
    `benchmarks/advisor_demo.py`, not asserted here): the applied advice's
    relative Frobenius error on the inputs it saw is the one it reports."""
    from dtype_policies.bench.workloads.mlp import mlp

    torch.manual_seed(0)
    model = mlp().eval()
    x = torch.randn(64, 1024)
    with torch.no_grad():
        reference = model(x)
    advice = advise(model, x, max_error=0.02, progress=False)
    assert 0 <= advice.error <= 0.02
    advice.apply(model)
    with torch.no_grad():
        out = model(x).float()
    measured = float((out - reference).norm() / reference.norm())
    assert measured <= 0.02
    assert measured == pytest.approx(float(advice.error), abs=2e-3)


class _TiedThroughAnUncalledTable(TiedHead):
    """T5's and BART's layout: `shared` holds the table the embedding and
    the head tie to, and the forward never calls `shared`."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = torch.nn.Embedding(50, 16)
        self.emb.weight = self.shared.weight
        self.head.weight = self.shared.weight


def test_an_uncalled_module_holding_a_tied_weight_takes_its_holders_policy():
    """`shared` was left float32 ("not called") while its tied holders were
    advised int8: applying the advice then left all three float (a tied
    weight takes one policy), and the table's bytes were a third of the
    model's real ones."""
    torch.manual_seed(0)
    model = _TiedThroughAnUncalledTable().eval()
    ids = torch.randint(0, 50, (4, 32))
    advice = advise(model, ids, max_error=0.5, candidates=("int8",), objective="memory", **FAST)
    assert choices(advice) == dict.fromkeys(("shared", "emb", "mid", "head"), "int8")
    applied = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no module falls back to float
        advice.apply(applied)
    assert all(quantization_of(m) is not None for m in (applied.shared, applied.emb, applied.head))
    stored = {(t.data_ptr(), t.nbytes): t for t in applied.state_dict().values()}
    size = sum(t.nbytes for t in stored.values())
    assert advice.model_bytes["chosen"] == size
    assert measured_error(model, advice, [ids]) == pytest.approx(advice.error, rel=1e-3)


@pytest.mark.parametrize("form", ["layers.Sequential", "layers.Dense", "nn.Sequential of layers"])
def test_a_model_of_this_librarys_layers_is_advised_as_a_torch_one(form):
    """Their paths start with the root layer's name: every candidate was
    marked unavailable ("the model failed: 'dense'", "not quantized by
    apply_policy") and the advice kept float32 everywhere, silently."""
    from dtype_policies import layers

    torch.manual_seed(0)
    model = {
        "layers.Sequential": lambda: layers.Sequential([layers.Dense(128), layers.Dense(16)]),
        "layers.Dense": lambda: layers.Dense(16),
        "nn.Sequential of layers": lambda: torch.nn.Sequential(layers.Dense(128), layers.Dense(16)),
    }[form]()
    x = torch.randn(16, 64)
    model(x)
    advice = advise(model, x, max_error=0.5, candidates=("int8",), objective="memory", **FAST)
    assert set(choices(advice).values()) == {"int8"}
    assert all(row.note == "" for row in advice.modules)
    applied = copy.deepcopy(model)
    advice.apply(applied)
    assert all(quantization_of(m) is not None for m in applied.modules() if hasattr(m, "kernel"))
    assert measured_error(model, advice, [x]) == pytest.approx(advice.error, rel=1e-3)


@pytest.mark.parametrize(
    ("metric", "error", "match"),
    [
        (lambda out, ref: None, TypeError, r"must return a number .* it returned None"),
        (lambda out, ref: "0.1", TypeError, r"it returned '0.1'"),
        (lambda out, ref: (out - ref).abs().amax(0)[:2], TypeError, r"it returned tensor"),
        (lambda out, ref: -1.0, ValueError, r"returned -1.0: .* never negative"),
    ],
)
def test_a_metric_returning_no_error_value_is_refused_naming_it(metric, error, match):
    """A string was taken (and the warning blamed the model), a negative
    value became the advice's error, None and a two-element tensor raised
    float()'s messages, which do not name `metric`."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(error, match=match):
        advise(model, torch.randn(8, 16), metric=metric, objective="memory", **FAST)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    tensor_metric = advise(
        model,
        torch.randn(8, 16),
        metric=lambda out, ref: (out - ref).norm() / ref.norm(),
        objective="memory",
        **FAST,
    )
    assert 0 <= tensor_metric.error < 0.02
