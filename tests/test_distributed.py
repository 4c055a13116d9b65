"""Policies under torch.distributed: FSDP2 (`distributed.fully_shard`), DDP,
`LossScaleOptimizer` agreeing across ranks, saving from a sharded model.

The 2-process tests share one run: a module fixture spawns 2 CPU processes
(gloo) that go through every scenario of `_distributed_workers` once
(about 15 s here); each test checks one scenario's results. The run is
bounded: a process that hangs is killed and the tests fail.

Tolerance. A single process computes each bfloat16 weight gradient over the
whole global batch and rounds it to bfloat16 once; each rank rounds the
gradient of its half, and the halves are averaged in float32. So gradients
differ by bfloat16 rounding (relative 2**-8), and after 5 steps of SGD with
momentum the parameters differ by a small fraction of how far they moved:
we require at most 2% of the largest parameter change of the single-process
run (measured: 0.35%, the same for FSDP2 and DDP; 0.47% for the model of
this library's layers). The forward itself is bit-identical (FSDP2 rounds
to bfloat16 before the all-gather exactly as the policy does after it), and
under the float32 policy the runs agree to float32 summation order (1e-5).
"""

from __future__ import annotations

import contextlib
import queue
import sys
import time
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dtype_policies
from dtype_policies import DTypePolicyMap, apply_policy, layers, quantize, saving
from dtype_policies._core.module_state import state_of
from dtype_policies.distributed import (
    describe_plan,
    fully_shard,
    shard_plan,
    to_mixed_precision_policy,
)
from dtype_policies.distributed.support import fsdp_refusal
from tiny_models import tiny_decoder

distributed = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available",
)
fsdp_on_cpu = pytest.mark.skipif(
    fsdp_refusal("cpu") is not None, reason=fsdp_refusal("cpu") or "FSDP2 runs on CPU"
)
"""FSDP2 itself runs on CPU here (torch 2.6's cannot: `fully_shard` says so)."""

TIMEOUT = 180  # seconds for the whole 2-process run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """`{scenario: {rank: result}}` from one 2-process run of every scenario."""
    import torch.multiprocessing as mp

    import _distributed_workers as workers

    tmp = tmp_path_factory.mktemp("distributed")
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(
            target=workers.run_all,
            args=(rank, str(tmp / "init"), str(tmp), results),
            daemon=True,
        )
        for rank in range(workers.WORLD)
    ]
    for process in processes:
        process.start()
    outcomes: dict[str, dict[int, object]] = {}
    expected = len(workers.SCENARIOS) * workers.WORLD
    deadline = time.monotonic() + TIMEOUT
    try:
        for _ in range(expected):
            remaining = deadline - time.monotonic()
            try:
                name, rank, data = results.get(timeout=max(remaining, 0.1))
            except queue.Empty:
                break
            outcomes.setdefault(name, {})[rank] = workers.decode(data)
        for process in processes:
            process.join(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    outcomes["_tmp"] = tmp
    return outcomes


def outcome(runs, name):
    results = runs.get(name)
    if results is None or len(results) != 2:
        pytest.fail(f"scenario {name} did not finish on both ranks in {TIMEOUT} s")
    for rank, result in results.items():
        if isinstance(result, str):
            pytest.fail(f"scenario {name} failed on rank {rank}:\n{result}")
    return results


@pytest.fixture(scope="module")
def reference():
    """The single-process `apply_policy` runs on the global batch."""
    import _distributed_workers as workers

    return {
        "mixed": workers.single_process_run(),
        "float32": workers.single_process_run("float32"),
        "keras": workers.single_process_run(
            workers.KERAS_POLICY, workers.make_keras_model, workers.KERAS_LR
        ),
    }


def assert_close_to_single_process(state, reference, relative, initial=None):
    single, initial = reference, initial or reference_initial()
    moved = max((single[k] - initial[k]).abs().max().item() for k in single)
    worst = max((state[k] - single[k]).abs().max().item() for k in single)
    assert set(state) == set(single)
    assert worst <= relative * moved, (worst, moved)
    return worst / moved


def reference_initial():
    import _distributed_workers as workers

    return workers.make_model().state_dict()


# ------------------------------------------------------- 2 processes, gloo


@distributed
@fsdp_on_cpu
def test_fsdp_training_matches_one_process(runs, reference):
    results = outcome(runs, "fsdp_training")
    for rank in (0, 1):
        ratio = assert_close_to_single_process(results[rank]["state"], reference["mixed"], 0.02)
        assert ratio > 0  # bfloat16 gradients of half batches do differ
    assert all(
        torch.equal(results[0]["state"][k], results[1]["state"][k]) for k in results[0]["state"]
    )


@distributed
@fsdp_on_cpu
def test_fsdp_keeps_float32_shards_and_computes_each_block_in_its_dtype(runs):
    result = outcome(runs, "fsdp_training")[0]
    for name, (kind, dtype, grad_kind, grad_dtype) in result["sharded"].items():
        assert (kind, dtype, grad_kind, grad_dtype) == (
            "DTensor",
            torch.float32,
            "DTensor",
            torch.float32,
        ), name
    bf16, f32 = torch.bfloat16, torch.float32
    assert result["seen"] == {
        # (unsharded weight type, its dtype in the forward, input dtype)
        "embed": ("Parameter", f32, torch.int64),  # looked up as stored
        "blocks.0.up": ("Parameter", bf16, bf16),
        "blocks.0.norm": ("Parameter", f32, bf16),  # a float32 island
        "blocks.0.down": ("Parameter", bf16, bf16),
        "blocks.1.up": ("Parameter", f32, f32),  # the float32 block
        "blocks.1.norm": ("Parameter", f32, f32),
        "blocks.1.down": ("Parameter", f32, f32),
        "blocks.2.up": ("Parameter", bf16, bf16),
        "blocks.2.norm": ("Parameter", f32, bf16),
        "blocks.2.down": ("Parameter", bf16, bf16),
        "head": ("Parameter", bf16, bf16),
    }
    assert result["fsdp_module"]
    assert result["classes"]["blocks.0"] == "FSDPBlock"  # a unit
    assert result["classes"]["blocks.0.norm"] == "FSDPLayerNorm"  # an island unit
    assert result["classes"]["blocks.0.up"] == "Linear"  # in its block's unit


@distributed
@fsdp_on_cpu
def test_fsdp_forward_is_bit_identical_to_one_process(runs):
    import _distributed_workers as workers

    result = outcome(runs, "fsdp_training")[0]
    model = workers.make_model()
    model.load_state_dict(result["state"])
    apply_policy(model, workers.POLICY)
    with torch.no_grad():
        assert torch.equal(model(result["probe"]), result["output"])


@distributed
@fsdp_on_cpu
def test_fsdp_float32_policy_matches_to_summation_order(runs, reference):
    results = outcome(runs, "fsdp_float32_training")
    single = reference["float32"]
    for rank in (0, 1):
        state = results[rank]["state"]
        for key in single:
            torch.testing.assert_close(state[key], single[key], rtol=1e-5, atol=1e-5)


@distributed
@fsdp_on_cpu
def test_fsdp_of_this_librarys_layers_matches_one_process(runs, reference):
    import _distributed_workers as workers

    results = outcome(runs, "fsdp_keras_layers")
    initial = workers.make_keras_model().state_dict()
    for rank in (0, 1):
        result = results[rank]
        assert_close_to_single_process(result["state"], reference["keras"], 0.02, initial)
        assert result["sharded"] == {("DTensor", torch.float32)}
    assert results[0]["plan"] == [
        ("0", None),  # the embedding table, looked up as stored
        ("1", torch.bfloat16),
        ("2", None),  # a float32 island
        ("3", None),  # float32 by the map
        ("5", torch.bfloat16),
        ("", torch.bfloat16),
    ]


@distributed
@fsdp_on_cpu
def test_torch_fully_shard_after_apply_policy_keeps_float32_masters(runs, reference):
    """The issue's report: FSDP2's lazy init read the parameters through the
    policy (getting bfloat16 casts) and the kept casts outlived FSDP2's
    refilled parameters. Both fixed, torch's own fully_shard composes."""
    results = outcome(runs, "torch_fully_shard_training")
    for rank in (0, 1):
        result = results[rank]
        assert result["dtypes"] == {torch.float32}
        assert result["fsdp_module"] and result["policy"] == "mixed_bfloat16"
        assert_close_to_single_process(result["state"], reference["mixed"], 0.02)


@distributed
def test_ddp_training_matches_one_process(runs, reference):
    results = outcome(runs, "ddp_training")
    for rank in (0, 1):
        assert_close_to_single_process(results[rank]["state"], reference["mixed"], 0.02)
        assert results[rank]["grads"] == {torch.float32}
    seen = results[0]["seen"]
    assert seen["blocks.0.up"] == ("Parameter", torch.float32, torch.bfloat16)
    assert seen["blocks.1.up"] == ("Parameter", torch.float32, torch.float32)
    assert all(
        torch.equal(results[0]["state"][k], results[1]["state"][k]) for k in results[0]["state"]
    )


@distributed
@fsdp_on_cpu
def test_fsdp_and_ddp_end_with_the_same_parameters(runs):
    """Both average the same per-rank bfloat16 gradients in float32."""
    fsdp = outcome(runs, "fsdp_training")[0]["state"]
    ddp = outcome(runs, "ddp_training")[0]["state"]
    assert set(fsdp) == set(ddp)
    assert all(torch.equal(fsdp[k], ddp[k]) for k in fsdp)


@distributed
@pytest.mark.parametrize(
    "name", [pytest.param("fsdp_loss_scale", marks=fsdp_on_cpu), "ddp_loss_scale"]
)
def test_an_inf_on_one_rank_makes_every_rank_skip(runs, name):
    results = outcome(runs, name)
    for rank in (0, 1):
        first, second = results[rank]["steps"]
        assert first["skipped"] and not first["changed"] and first["scale"] == 4.0, rank
        assert not second["skipped"] and second["changed"] and second["scale"] == 4.0, rank
        for step in (first, second):
            assert step["item"] == 1 and step["all_reduce"] == 1, step  # one host sync


@distributed
@fsdp_on_cpu
def test_a_save_from_fsdp_reloads_bit_exactly_in_one_process(runs):
    import _distributed_workers as workers

    result = outcome(runs, "fsdp_training")[0]
    model = saving.load(workers.make_model(), runs["_tmp"] / "fsdp")
    state = model.state_dict()
    assert set(state) == set(result["state"])
    assert all(torch.equal(state[k], result["state"][k]) for k in state)
    assert model.blocks[1].up.dtype_policy.name == "float32"
    assert model.blocks[0].norm.dtype_policy.name == "float32"  # an island
    with torch.no_grad():
        assert torch.equal(model(result["probe"]), result["output"])
    # The same file as a single-process save of the same model.
    single = workers.make_model()
    single.load_state_dict(result["state"])
    apply_policy(single, workers.POLICY)
    path = saving.save(single, runs["_tmp"] / "single")
    assert path.read_bytes() == (runs["_tmp"] / "fsdp" / "model.safetensors").read_bytes()


@distributed
@fsdp_on_cpu
def test_load_into_a_model_then_shard_it(runs):
    reference = outcome(runs, "fsdp_training")[0]
    results = outcome(runs, "load_then_shard")
    for rank in (0, 1):
        assert results[rank]["policy"] == "float32"
        assert torch.equal(results[rank]["output"], reference["output"])


@distributed
def test_ranks_applying_different_policies_refuse_to_shard(runs):
    results = outcome(runs, "mismatched_policies")
    for rank in (0, 1):
        result = results[rank]
        assert result["message"] is not None, rank  # raised on every rank
        assert "module 'blocks.1.up': rank 0 float32, rank 1 mixed_bfloat16" in result["message"]
        assert "unit 'blocks.1'" in result["message"]
        assert result["unchanged"] and result["policied"] == [] and result["sharded"] == []
    assert results[0]["message"] == results[1]["message"]


@distributed
@fsdp_on_cpu
def test_agreeing_ranks_pay_one_collective_at_setup(runs):
    for rank in (0, 1):
        counts = outcome(runs, "fsdp_setup_collectives")[rank]["counts"]
        gathers = counts["all_gather_into_tensor"] + counts.get("all_gather_single", 0)
        assert sum(counts.values()) == 1 and gathers == 1, counts


@distributed
def test_what_one_rank_refuses_every_rank_raises(runs):
    """The refusing rank raises its own error (as one process would); the
    other a PolicyMismatchError naming the rank and the error."""
    refusing, waiting = (outcome(runs, "refused_on_one_rank")[rank]["raised"] for rank in (0, 1))
    assert refusing is not None and refusing.startswith("ValueError"), refusing
    assert "int8_from_mixed_bfloat16" in refusing
    assert waiting is not None and waiting.startswith("PolicyMismatchError"), waiting
    assert "rank 0 refused it: ValueError" in waiting and "int8_from_mixed_bfloat16" in waiting


@distributed
@pytest.mark.parametrize(
    "case, named",
    [
        ("float32_modules", "ValueError: fully_shard(): float32_modules is an option"),
        ("rule", "KeyError"),
        ("reshard", "(option) reshard_after_forward: rank 0 True, rank 1 False"),
    ],
)
def test_what_one_rank_refuses_before_planning_every_rank_raises(runs, case, named):
    refusing, waiting = (
        outcome(runs, "refused_before_planning_on_one_rank")[rank][case] for rank in (0, 1)
    )
    if case == "reshard":  # no rank refused: the options differ
        assert refusing.startswith("PolicyMismatchError") and named in refusing, refusing
    else:
        assert refusing.startswith(named.split(":")[0]) and named in refusing, refusing
        named = f"rank 0 refused it: {named}"
    assert waiting.startswith("PolicyMismatchError") and named in waiting, waiting


@distributed
@fsdp_on_cpu
def test_a_save_rank_zero_cannot_write_raises_on_every_rank(runs):
    for rank in (0, 1):
        raised = outcome(runs, "unwritable_save_on_rank_zero")[rank]["raised"]
        assert raised is not None and "rank 0 could not write" in raised, (rank, raised)
        assert "NotADirectoryError" in raised


@distributed
@fsdp_on_cpu
def test_a_save_given_other_paths_on_other_ranks_returns_the_written_one(runs):
    results = outcome(runs, "save_to_a_directory_per_rank")
    assert results[0]["path"] == results[1]["path"] and "per-rank-0" in results[0]["path"]
    assert results[0]["exists"] and results[1]["exists"]
    assert not results[0]["warned"]
    assert "per-rank-1" in results[1]["warned"][0] and "per-rank-0" in results[1]["warned"][0]


@distributed
def test_a_rank_without_gradients_joins_the_loss_scale_agreement(runs):
    results = outcome(runs, "step_without_gradients_on_one_rank")
    for rank in (0, 1):
        assert results[rank]["skipped"] is True, rank
    assert results[0]["scale"] == results[1]["scale"]


# ------------------------------------------------------------ one process


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(10, 8),
        nn.ModuleList([nn.Linear(8, 8), nn.LayerNorm(8)]),
        nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8)),
        nn.Linear(8, 2),
    )


def test_the_mismatch_message_names_each_differing_module_and_rank():
    from dtype_policies.distributed.agreement import describe_policies, mismatch_message

    model, other = _called_model(), _called_model()
    apply_policy(model, DTypePolicyMap("mixed_bfloat16", {"2/0": "float32"}))
    apply_policy(other, "mixed_bfloat16", float32_modules=())
    descriptions = [describe_policies(m, shard_plan(m)) for m in (model, other)]
    message = mismatch_message(descriptions, [0, 3])
    assert "module '2.0': rank 0 float32, rank 3 mixed_bfloat16" in message
    assert "module '1.1': rank 0 float32, rank 3 mixed_bfloat16" in message  # an island
    assert "module '0'" not in message  # agreeing modules are not named
    # another width on one rank: named (gloo aborted the process mid-collective)
    wider = nn.Sequential(nn.Linear(8, 18))
    descriptions = [
        describe_policies(m, shard_plan(m)) for m in (nn.Sequential(nn.Linear(8, 16)), wider)
    ]
    message = mismatch_message(descriptions, [0, 1])
    assert (
        "hold different models: parameter '0.bias': rank 0 shape (16,), rank 1 shape (18,)"
        in message
    )


def test_to_mixed_precision_policy():
    mp = to_mixed_precision_policy("mixed_bfloat16")
    assert (mp.param_dtype, mp.reduce_dtype, mp.output_dtype, mp.cast_forward_inputs) == (
        torch.bfloat16,
        torch.float32,
        None,
        True,
    )
    mp = to_mixed_precision_policy(torch.float16, cast_forward_inputs=False)
    # reduced in the dtype computed in: `None`, on torch 2.6 (which sets it) and later
    assert (mp.param_dtype, mp.reduce_dtype, mp.cast_forward_inputs) == (
        torch.float16,
        None,
        False,
    )
    with pytest.raises(ValueError, match="'int8_from_mixed_bfloat16' is a quantized policy"):
        to_mixed_precision_policy("int8_from_mixed_bfloat16")
    with pytest.raises(TypeError, match="DTypePolicyMap"):
        to_mixed_precision_policy(DTypePolicyMap("mixed_bfloat16"))
    with pytest.raises(ValueError, match="int32"):
        to_mixed_precision_policy("int32")
    with pytest.raises(ValueError, match="invalid policy"):
        to_mixed_precision_policy("mixed_nothing")


def test_shard_plan_units_and_dtypes():
    model = _model()
    apply_policy(model, DTypePolicyMap("mixed_bfloat16", {"3": "float32"}))
    plan = [(u.name, u.param_dtype, u.reduce_dtype, u.reason) for u in shard_plan(model)]
    bf16, f32 = torch.bfloat16, torch.float32
    assert plan == [  # innermost first, the model last
        ("1.0", bf16, f32, "block"),  # the items of a ModuleList are blocks
        ("1.1", None, None, "block"),  # a float32 island: as stored
        ("2.2", None, None, "reads as stored"),  # an island inside a bfloat16 block
        ("0", None, None, "block"),  # the embedding table, looked up as stored
        ("2", bf16, f32, "block"),
        ("3", None, None, "block"),  # float32 by the map
        ("", bf16, f32, "root"),
    ]
    assert "2.2: param as stored, reduce as stored (reads as stored)" in describe_plan(
        shard_plan(model)
    )
    custom = shard_plan(model, units=[nn.Sequential, "Embedding"])
    # Outside the blocks, the model's unit (bfloat16) splits off what reads otherwise.
    assert [u.name for u in custom] == ["2.2", "1.1", "0", "2", "3", ""]
    with pytest.raises(TypeError, match="units"):
        shard_plan(model, units=[3])


def test_a_units_rule_that_matches_nothing_warns_naming_it():
    model = _called_model()
    apply_policy(model, "mixed_bfloat16")
    with pytest.warns(UserWarning, match=r"the units rule 'DecoderLayer' matches no module"):
        plan = shard_plan(model, units=["DecoderLayer", nn.Sequential])
    assert [u.name for u in plan] == ["1.1", "2.2", "1", "2", "0", ""]  # the rules that matched
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shard_plan(model, units=[nn.Sequential])  # every rule matches: quiet


def test_shard_plan_holds_a_tied_parameter_in_the_unit_enclosing_its_modules():
    model = _model()
    model[3].weight = model[1][0].weight  # tied across two blocks
    apply_policy(model, "mixed_bfloat16")
    plan = {unit.name: (unit.param_dtype, unit.reason) for unit in shard_plan(model)}
    # the two blocks are no units of their own; the model's holds the tie, as stored
    assert plan == {
        "0": (None, "block"),
        "1.1": (None, "block"),
        "2": (torch.bfloat16, "block"),
        "2.2": (None, "reads as stored"),
        "": (None, "as stored: '3.weight' is tied to '1.0.weight'"),
    }


def test_a_tied_table_inside_a_block_of_a_transformers_lm_is_held_by_the_model():
    """The embedding inside the `model` block, the head beside it (a tied
    Llama): the block is no unit of its own and the model's unit holds the
    table, as stored; units given per decoder layer keep theirs."""
    model = tiny_decoder(tie=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    apply_policy(model, "mixed_bfloat16")
    plan = {unit.name: unit.param_dtype for unit in shard_plan(model)}
    assert plan == {"": None}
    plan = {unit.name: unit.param_dtype for unit in shard_plan(model, units=["LlamaDecoderLayer"])}
    assert plan["model.layers.0"] == plan["model.layers.1"] == torch.bfloat16
    assert plan[""] is None and "model.embed_tokens" not in plan


def test_a_tied_embedding_and_lm_head_of_other_dtypes_are_one_unit():
    """The embedding reads its table as stored, the head in bfloat16: no
    `units=` could keep them together before (it raised)."""

    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(37, 12)
            self.body = nn.Linear(12, 12)
            self.head = nn.Linear(12, 37, bias=False)
            self.head.weight = self.embed.weight

    for units in (None, [nn.Linear], [nn.Embedding, nn.Linear]):
        model = TiedLM()
        apply_policy(model, "mixed_bfloat16")
        plan = {unit.name: unit.param_dtype for unit in shard_plan(model, units=units)}
        assert plan[""] is None and "embed" not in plan and "head" not in plan, (units, plan)


class FSDPModule:
    """Stands for torch's FSDPModule, whose subclass FSDP2 puts in front of a
    module's class: `FSDP<cls>(FSDPModule, cls)`."""

    _orig_cls_mro_index = 2


def test_fully_shard_refuses_a_sharded_model_before_changing_it():
    model = _model()
    model.__class__ = type("FSDPSequential", (FSDPModule, nn.Sequential), {})
    with pytest.raises(ValueError, match="sharded already"):
        fully_shard(model, "mixed_bfloat16")
    assert not hasattr(model[3], "dtype_policy")


@pytest.mark.parametrize(
    "policy, message",
    [
        ("int8_from_mixed_bfloat16", r"'int8_from_mixed_bfloat16' is a quantized policy"),
        (
            DTypePolicyMap("mixed_bfloat16", {"3": "float8_from_mixed_bfloat16"}),
            r"'float8_from_mixed_bfloat16' \(map entry '3'\)",
        ),
        (DTypePolicyMap("int4_from_float32"), r"map entry 'the default'"),
    ],
)
def test_fully_shard_refuses_quantized_policies_before_changing_the_model(policy, message):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message) as error:
        fully_shard(model, policy)
    assert "FSDP2 training of quantized models is not supported" in str(error.value)
    assert not any(hasattr(m, "dtype_policy") for m in model.modules())
    state = model.state_dict()
    assert set(state) == set(before) and all(torch.equal(state[k], before[k]) for k in state)


@pytest.mark.parametrize("units, message", [([42], r"Received: 42")])
def test_a_plan_refused_after_the_policy_leaves_the_model_as_it_was(units, message):
    """The plan is made from the applied policies; when it is refused (a bad
    `units` entry) the policy is removed again."""
    model = _model()
    model[3].weight = model[1][0].weight  # tied across two blocks
    classes = [type(m) for m in model.modules()]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises((ValueError, TypeError), match=message):
        fully_shard(model, "mixed_bfloat16", units=units)
    assert not any(hasattr(m, "dtype_policy") for m in model.modules())
    assert [type(m) for m in model.modules()] == classes
    state = model.state_dict()
    assert set(state) == set(before) and all(torch.equal(state[k], before[k]) for k in state)
    x = torch.randn(4, 8)
    assert model[2](x).dtype == torch.float32


def _policy_state(model):
    """What the policies left on each module: its class, the policy in force,
    how many applications it has, and the model's output."""
    torch.manual_seed(3)
    with torch.no_grad():
        output = model(torch.randint(0, 10, (2, 3)))
    return output, [
        (
            type(m).__name__,
            getattr(getattr(state_of(m), "call", None), "policy", None),
            len(getattr(state_of(m), "applications", ())),
        )
        for m in model.modules()
    ]


def _called_model():
    """`_model()` whose every module is called: a Sequential for the list."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(10, 8),
        nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)),
        nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8)),
        nn.Linear(8, 8),
    )


@pytest.mark.parametrize("units, error", [([42], TypeError)])  # a bad `units` entry
def test_a_refused_plan_keeps_the_application_made_before(units, error):
    """fully_shard(model, policy) over a model policied before: when the plan
    is refused, the earlier application is in force again, as it was."""
    model = _called_model()
    model[3].weight = model[1][0].weight  # tied across two blocks
    earlier = apply_policy(model, DTypePolicyMap("mixed_bfloat16", {"2/0": "float32"}))
    before = _policy_state(model)
    with pytest.raises(error):
        fully_shard(model, "mixed_float16", units=units)
    after = _policy_state(model)
    assert torch.equal(after[0], before[0]) and after[0].dtype == torch.bfloat16
    assert after[1] == before[1]
    assert not earlier.removed and model.dtype_policy.name == "mixed_bfloat16"
    earlier.remove()  # the earlier handle still undoes its application
    assert not any(hasattr(m, "dtype_policy") for m in model.modules())


@contextlib.contextmanager
def _group_of_one(tmp_path):
    """A gloo process group of this process alone, as torchrun would start one."""
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@distributed
@fsdp_on_cpu
def test_a_shard_over_an_earlier_application_replaces_it(tmp_path):
    model = _called_model()
    earlier = apply_policy(model, "mixed_bfloat16")
    with _group_of_one(tmp_path):
        fully_shard(model, "float32")
        assert earlier.removed
        assert {len(state_of(m).applications) for m in model.modules()} == {1}
        assert model[2][0].dtype_policy.name == "float32"
        assert model(torch.randint(0, 10, (2, 3))).dtype == torch.float32


@distributed
@fsdp_on_cpu
def test_summary_of_a_sharded_model_counts_full_sizes_by_the_original_classes(tmp_path):
    """`summary()` read a DTensor's storage pointer: torch's RuntimeError
    ("invalid python storage") on every model `fully_shard` had sharded."""
    from dtype_policies.apply.summary import model_totals, module_summaries

    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    expected = [(r.class_name, r.parameters) for r in module_summaries(model)]
    totals = model_totals(model)
    with _group_of_one(tmp_path):
        fully_shard(model, "mixed_bfloat16")
        for _ in range(2):  # before and after a step
            assert "Total: 212 parameters, 848 bytes" in dtype_policies.summary(model)
            rows = module_summaries(model)
            assert [(r.class_name, r.parameters) for r in rows] == expected
            assert [r.policy for r in rows] == ["mixed_bfloat16"] * 3
            assert model_totals(model) == totals
            model(torch.randn(2, 8)).sum().backward()


@distributed
@fsdp_on_cpu
def test_a_data_parallel_wrapper_is_refused_by_fully_shard_with_nothing_changed(tmp_path):
    model = nn.DataParallel(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    with (
        _group_of_one(tmp_path),
        pytest.raises(ValueError, match=r"\(model\) is a data-parallel wrapper"),
    ):
        fully_shard(model, "mixed_bfloat16")
    assert not any(hasattr(m, "dtype_policy") for m in model.modules())
    assert all(type(p) is nn.Parameter for p in model.parameters())


class _HeadReadsTheTable(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.mlp = nn.Embedding(50, 16), nn.Linear(16, 16)

    def forward(self, ids):
        return F.linear(self.mlp(self.wte(ids)), self.wte.weight)


@distributed
@fsdp_on_cpu
def test_a_module_its_parent_reads_shares_the_parents_unit_when_named(tmp_path):
    """A tied head read as `F.linear(h, self.wte.weight)`: `wte`, a unit of
    its own, stayed sharded when its parent read it (torch's "got mixed
    torch.Tensor and DTensor", and `units=` could not avoid it)."""
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    reference = _HeadReadsTheTable()
    apply_policy(reference, "mixed_bfloat16")
    expected = reference(ids)
    with _group_of_one(tmp_path):
        model = fully_shard(_HeadReadsTheTable(), "mixed_bfloat16")
        with pytest.raises(RuntimeError, match=r"mixed torch\.Tensor and DTensor") as raised:
            model(ids)
        if sys.version_info >= (3, 11):
            assert "read_by_parent=[...]" in raised.value.__notes__[0]
        model = fully_shard(
            _HeadReadsTheTable(),
            "mixed_bfloat16",
            read_by_parent=[lambda name, module: name == "wte"],
        )
        assert torch.equal(model(ids), expected)
        with pytest.warns(UserWarning, match="read_by_parent rule 'nothing' matches no module"):
            shard_plan(_HeadReadsTheTable(), read_by_parent=["nothing"])


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(37, 12)
        self.body = nn.Linear(12, 12)
        self.head = nn.Linear(12, 37, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.body(self.embed(ids)))


@distributed
@fsdp_on_cpu
def test_a_sharded_tied_lm_trains_as_in_one_process(tmp_path):
    ids = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(1))

    def step(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        loss = torch.nn.functional.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            return model(ids).float()

    single = _TiedLM()
    apply_policy(single, "mixed_bfloat16")
    expected = step(single)
    with _group_of_one(tmp_path):
        model = fully_shard(_TiedLM(), "mixed_bfloat16")
        assert model.head.weight is model.embed.weight
        output = step(model)
    assert torch.equal(output, expected)


class _AttentionBlock(nn.Module):
    """nn.MultiheadAttention reads `out_proj.weight` itself, never calling it."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.ff = nn.Linear(8, 8)

    def forward(self, x):
        return self.ff(self.attn(x, x, x, need_weights=False)[0])


def test_an_encoder_layer_is_gathered_in_its_compute_dtype():
    """Its fast path reads its self_attn's and linears' weights (folded into
    its unit) and its norms' (float32 islands, left units of their own): the
    layer is gathered in bfloat16, not as stored."""
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    apply_policy(model, "mixed_bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        plan = {u.name: (u.param_dtype, u.reason) for u in shard_plan(model)}
    for i in (0, 1):
        assert plan[f"layers.{i}"] == (torch.bfloat16, "block")
        assert plan[f"layers.{i}.norm1"] == plan[f"layers.{i}.norm2"] == (None, "reads as stored")
        assert f"layers.{i}.self_attn" not in plan and f"layers.{i}.linear1" not in plan


def _attention_model():
    torch.manual_seed(0)
    return nn.Sequential(_AttentionBlock(), nn.Linear(8, 2))


@distributed
@fsdp_on_cpu
@pytest.mark.parametrize(
    "policy, units, attention",
    [
        ("mixed_bfloat16", [nn.Linear, _AttentionBlock], None),  # out_proj picked by `units`
        # out_proj split off by its policy: its parent becomes the unit, as stored
        (DTypePolicyMap("mixed_bfloat16", {".*out_proj": "float32"}), None, ("0.attn", None)),
    ],
)
def test_a_module_its_parent_reads_stays_in_its_parents_unit(tmp_path, policy, units, attention):
    single = _attention_model()
    apply_policy(single, policy)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    with _group_of_one(tmp_path), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fully_shard(_attention_model(), policy, units=units)
        names = [(u.name, u.param_dtype) for u in shard_plan(model, units=units)]
        output = model(x)
        output.float().sum().backward()  # torch's DTensor error, before
    assert "0.attn.out_proj" not in [name for name, _ in names]
    assert attention is None or attention in names
    assert "FSDP" not in type(model[0].attn.out_proj).__name__
    messages = [str(w.message) for w in caught if "picks" in str(w.message)]
    assert bool(messages) == (units is not None)  # a picked module kept in its parent: said
    with torch.no_grad():
        assert torch.equal(output, single(x))  # the forward of one process, bit for bit
    assert model[0].attn.out_proj.weight.grad is not None


@distributed
def test_a_torch_whose_fsdp2_cannot_run_on_cpu_is_refused_before_sharding(tmp_path, monkeypatch):
    """torch 2.6's FSDP2 failed inside its first forward on CPU: `fully_shard`
    says so (the torch version, what is needed) before it shards, the
    model as it was."""

    class StreamOfTorch26:  # torch 2.6's CPU stand-in: no record_event, no wait_event
        def wait_stream(self, stream) -> None:
            pass

    monkeypatch.setattr(torch.cpu, "Stream", StreamOfTorch26)
    model = _called_model()
    earlier = apply_policy(model, "mixed_bfloat16")
    before = _policy_state(model)
    refused = pytest.raises(RuntimeError, match=r"torch 2\.\d+.*FSDP2 cannot run on CPU")
    with _group_of_one(tmp_path), refused as error:
        fully_shard(model, "float32")
    assert "record_event/wait_event" in str(error.value) and "torch>=2.7" in str(error.value)
    after = _policy_state(model)
    assert torch.equal(after[0], before[0]) and after[1] == before[1] and not earlier.removed
    assert not any("FSDP" in type(m).__name__ for m in model.modules())


@distributed
@fsdp_on_cpu
def test_loading_into_a_sharded_model_is_refused_before_changing_it(tmp_path):
    """The checkpoint's policies (another map) would go over FSDP2 units
    planned for the model's: refused, the sharded model left as it was."""
    saved = _called_model()
    apply_policy(saved, DTypePolicyMap("mixed_bfloat16", {"3": "float32"}))
    path = saving.save(saved, tmp_path / "saved")
    with _group_of_one(tmp_path):
        model = fully_shard(_called_model(), "mixed_bfloat16")
        before, policies = _policy_state(model)
        weights = {k: v.full_tensor() for k, v in model.state_dict().items()}
        with pytest.raises(saving.CheckpointError, match=r"the target is sharded .*'0.weight'"):
            saving.load(model, path)
        assert _policy_state(model)[1] == policies and model[3].dtype_policy.name != "float32"
        assert torch.equal(_policy_state(model)[0], before)
        assert all(torch.equal(v.full_tensor(), weights[k]) for k, v in model.state_dict().items())


@distributed
@fsdp_on_cpu
@pytest.mark.parametrize(
    "change",
    ["dtype_policy float32", "dtype_policy int8_from_mixed_bfloat16", "quantize int8",
     "quantize float8"],
)  # fmt: skip
def test_a_layer_s_policy_cannot_change_under_fsdp2(change, tmp_path):
    """`layer.dtype_policy = ...` on a sharded model: accepted, the layer
    computed from bfloat16-gathered weights in float32 (and an int8 policy
    failed inside DTensor); `layer.quantize(mode)`: float8 went through (a
    unit planned to gather bfloat16 weights trained as float8), int8 failed
    inside DTensor after a misleading `type_check` error. Both refused as
    `apply_policy` and `quantize()` are, nothing changed."""
    from dtype_policies import layers

    how, value = change.split()
    torch.manual_seed(0)
    model = nn.Sequential(layers.Dense(16), layers.Dense(4))
    model(torch.randn(1, 8))
    with _group_of_one(tmp_path):
        fully_shard(model, "mixed_bfloat16")
        weights = {k: v.full_tensor() for k, v in model.state_dict().items()}
        if how == "dtype_policy":
            with pytest.raises(ValueError, match=rf"Dense.dtype_policy = '{value}': the model is"):
                model[1].dtype_policy = value
        else:
            for type_check in (True, False):
                with pytest.raises(ValueError, match=r"quantizing '1': the model is sharded by"):
                    model[1].quantize(value, type_check=type_check)
        assert model[1].dtype_policy.name == "mixed_bfloat16"
        state = model.state_dict()
        assert set(state) == set(weights)
        assert all(torch.equal(v.full_tensor(), weights[k]) for k, v in state.items())


class _WithTemperature(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.temperature = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        return self.linear(x) / self.temperature


@distributed
@fsdp_on_cpu
def test_a_scalar_parameter_is_refused_before_any_unit_is_sharded(tmp_path):
    """torch's fully_shard refuses scalar parameters, in the unit holding
    one: the units before it were sharded and the new policy in force, with
    no way back (sharding again and apply_policy both refused)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _WithTemperature(), nn.Linear(8, 8))
    earlier = apply_policy(model, "float32")
    scalar = r"'1\.temperature' is a scalar.*Nothing was changed"
    with _group_of_one(tmp_path), pytest.raises(ValueError, match=scalar):
        fully_shard(model, "mixed_bfloat16")
    assert not any("FSDP" in type(m).__name__ for m in model.modules())
    assert model[2].dtype_policy.name == "float32" and not earlier.removed


@distributed
@fsdp_on_cpu
def test_torch_refusing_the_first_unit_leaves_the_policies_as_they_were(tmp_path):
    """An option torch's fully_shard refuses (`reshard_after_forward` not a
    factor of the group's size) raises at the first unit, after the policy
    was applied: it is lifted again, the earlier one in force."""
    model = _called_model()
    earlier = apply_policy(model, "float32")
    before, policies = _policy_state(model)
    with _group_of_one(tmp_path), pytest.raises(ValueError, match="reshard_after_forward"):
        fully_shard(model, "mixed_bfloat16", reshard_after_forward=3)
    after, policies_after = _policy_state(model)
    assert policies_after == policies and torch.equal(after, before) and not earlier.removed
    assert not any("FSDP" in type(m).__name__ for m in model.modules())


def test_float32_modules_without_a_policy_is_refused():
    """With None no policy is applied, so float32_modules could not act."""
    model = _called_model()
    earlier = apply_policy(model, "mixed_bfloat16")
    before = _policy_state(model)
    with pytest.raises(ValueError, match=r"float32_modules=\[<class .*Linear'>\]"):
        fully_shard(model, None, float32_modules=[nn.Linear])
    after = _policy_state(model)
    assert torch.equal(after[0], before[0]) and after[1] == before[1] and not earlier.removed


def test_without_a_process_group_nothing_is_applied():
    model = _model()
    with pytest.raises(RuntimeError, match="no process group"):
        fully_shard(model, "mixed_bfloat16")  # torch's rendezvous error came after the policy
    assert not any(hasattr(m, "dtype_policy") for m in model.modules())
    assert model[2](torch.randn(4, 8)).dtype == torch.float32


def test_fully_shard_refuses_a_quantized_model():
    model = _model()
    apply_policy(model, DTypePolicyMap("mixed_bfloat16", {"3": "int8_from_mixed_bfloat16"}))
    with pytest.raises(ValueError, match=r"quantized modules: '3' \(int8\)"):
        fully_shard(model, None)
    with pytest.raises(ValueError, match=r"shard_plan\(\)"):
        shard_plan(model)
    assert not any("FSDP" in type(m).__name__ for m in model.modules())


@distributed
@fsdp_on_cpu
@pytest.mark.parametrize("change", ["remove", "float32", "int8_policy", "quantize"])
def test_policies_cannot_change_under_fsdp2(change, tmp_path):
    """FSDP2's units gather each weight in the dtype planned at sharding: a
    removed or replaced policy left them gathering bfloat16 weights for a
    float32 computation (a dtype error, or float32 outputs of bfloat16
    weights), and quantize() failed inside torch. Each is refused first."""
    from dtype_policies import quantize

    model = _called_model()
    handle = apply_policy(model, "mixed_bfloat16")
    with _group_of_one(tmp_path):
        fully_shard(model, None)
        before = _policy_state(model)
        attempt = {
            "remove": handle.remove,
            "float32": lambda: apply_policy(model, "float32"),
            "int8_policy": lambda: apply_policy(model, "int8_from_mixed_bfloat16"),
            "quantize": lambda: quantize(model, "int8"),
        }[change]
        with pytest.raises(ValueError, match=r"sharded by FSDP2 \('\(model\)'.*Nothing was"):
            attempt()
        after = _policy_state(model)
        assert torch.equal(after[0], before[0]) and after[1] == before[1]
        assert not handle.removed


def test_a_class_stacked_on_a_policied_module_survives_refreshes():
    """`.to()`, `quantize()` and `remove()` re-compose the class under FSDP2's."""
    layer = nn.Linear(4, 4)
    handle = apply_policy(layer, "mixed_bfloat16")
    composed = type(layer)
    layer.__class__ = type(f"FSDP{composed.__name__}", (FSDPModule, composed), {})
    layer.float()  # `_apply` refreshes the policy state
    assert isinstance(layer, FSDPModule) and type(layer).__name__ == "FSDPLinear"
    assert layer(torch.ones(1, 4)).dtype == torch.bfloat16
    handle.remove()
    assert isinstance(layer, FSDPModule) and isinstance(layer, nn.Linear)
    assert layer(torch.ones(1, 4)).dtype == torch.float32
    assert not hasattr(layer, "dtype_policy")


def test_the_fsdp_marker_turns_kept_casts_off():
    layer = nn.Linear(4, 4)
    apply_policy(layer, "mixed_bfloat16")
    with torch.no_grad():
        layer(torch.ones(1, 4))
    assert state_of(layer).casts.pair is not None  # a cast is kept
    layer._is_fsdp_managed_module = True  # what FSDP2 sets on the modules it manages
    assert layer._is_fsdp_managed_module is True
    assert not state_of(layer).casts.enabled and state_of(layer).casts.pair is None
    layer.float()  # a refresh keeps them off
    assert not state_of(layer).casts.enabled
    with torch.no_grad():
        layer(torch.ones(1, 4))
    assert state_of(layer).casts.pair is None


def test_sharded_weights_of_managed_modules_are_read_as_they_are():
    """FSDP2's lazy init reads `module.weight` inside the root's call: a
    sharded (DTensor) weight comes back as is, an unsharded one is cast."""

    class Sharded(nn.Parameter):  # stands for a DTensor parameter
        pass

    model = nn.Sequential(nn.Linear(4, 4))
    apply_policy(model, "mixed_bfloat16")
    inner = model[0]
    inner._is_fsdp_managed_module = True
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(inner.weight))
    inner._parameters["weight"] = Sharded(torch.ones(4, 4))
    model(torch.ones(1, 4))
    inner._parameters["weight"] = nn.Parameter(torch.ones(4, 4))
    model(torch.ones(1, 4))
    assert (type(seen[0]), seen[0].dtype) == (Sharded, torch.float32)
    assert seen[1].dtype == torch.bfloat16


def test_importing_the_package_does_not_load_fsdp():
    import subprocess
    import sys

    code = (
        "import sys, dtype_policies, dtype_policies.distributed; "
        "print('torch.distributed.fsdp' in sys.modules, 'torch._dynamo' in sys.modules)"
    )
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    # nor Dynamo (about a second; on torch 2.6 it imports FSDP): a decorator
    # of the loss scale optimizer's did, at import
    assert output.stdout.strip() == "False False", output.stderr
    assert dtype_policies.distributed.fully_shard is fully_shard


@distributed
@fsdp_on_cpu
def test_a_layer_not_built_yet_is_refused_by_fully_shard(tmp_path):
    """A Keras-style layer creates its weights at its first call, after the
    sharding: they stayed whole on every rank, their gradients never
    reduced, and the ranks drifted apart (0.5 after 3 SGD steps), silently."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), layers.Dense(4))
    with (
        _group_of_one(tmp_path),
        pytest.raises(ValueError, match=r"'1' not built yet.*Nothing was changed"),
    ):
        fully_shard(model, "mixed_bfloat16")
    assert not any(hasattr(m, "dtype_policy") and m is not model[1] for m in model.modules())
    assert all(type(p) is nn.Parameter for p in model.parameters())


@distributed
def test_loading_a_quantizing_checkpoint_under_ddp_is_refused_before_changing_it(tmp_path):
    """DDP's gradient buckets hold the float weights the checkpoint's int8
    replaces: the load passed, and the second training step failed inside
    DDP ("Expected to have finished reduction in the prior iteration")."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    quantize(source[0], "int8")
    path = saving.save(source, tmp_path / "model")
    float_path = saving.save(nn.Sequential(nn.Linear(16, 32), nn.GELU()), tmp_path / "float")
    with _group_of_one(tmp_path):
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        ddp = DistributedDataParallel(model)
        with pytest.raises(ValueError, match=r"load\(\).*DistributedDataParallel.*saving\.load"):
            saving.load(ddp, path)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        assert model[0].__class__ is nn.Linear and not hasattr(model[0], "dtype_policy")
        plain = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.GELU()))
        saving.load(plain, float_path)  # a float checkpoint loads under DDP as before


def test_a_loss_scale_optimizer_can_keep_its_skips_to_its_own_rank():
    from dtype_policies import optimizers
    from dtype_policies.optimizers.loss_scale_optimizer import _sync_group

    sgd = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    assert optimizers.LossScaleOptimizer(sgd, process_group=False)._process_group is False
    assert _sync_group(False) is None
    with pytest.raises(TypeError, match=r"process_group.*Received: process_group='world'"):
        optimizers.LossScaleOptimizer(sgd, process_group="world")


def test_a_peft_model_s_default_unit_is_the_model_its_tuner_holds():
    """PeftModel calls `base_model.model` directly: the default unit
    `base_model` (LoraModel) was never called, its shards never gathered,
    and the first forward failed ("got mixed torch.Tensor and DTensor")."""
    peft = pytest.importorskip("peft")
    from dtype_policies.distributed import shard_plan

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["0", "2"]))
    assert [unit.name for unit in shard_plan(model)] == ["base_model.model", ""]
