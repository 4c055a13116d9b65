"""The benchmark suite's machinery (fast): the workload registry, the one
timer, the real-model text rules, and failing variants becoming rows."""

import statistics

import pytest
import torch

from dtype_policies._cpu import CPU_CLASSES, processor
from dtype_policies.bench import harness, registry, workloads
from dtype_policies.bench.realmodels import chart, quality_table, text, variants
from dtype_policies.bench.realmodels.variants import Calibration, Variant


def test_every_workload_is_registered_in_table_order():
    keys = list(workloads.WORKLOADS)
    assert keys[:3] == ["mlp_train", "mlp_inference", "mlp_decode"]
    assert {"llm_decode", "llm_prefill", "smollm2", "minilm"} <= set(keys)
    for workload in workloads.WORKLOADS.values():
        assert (workload.build is None) != (workload.run is None), workload.key


def test_register_refuses_a_duplicate_and_a_workload_without_one_way_to_run():
    with pytest.raises(ValueError, match="'mlp_train' is already registered"):
        registry.register("mlp_train", "again", lambda: ({}, {}))
    with pytest.raises(ValueError, match="exactly one of `build` and `run`"):
        registry.register("neither", "no way to run")
    assert "neither" not in workloads.WORKLOADS


def test_timer_interleaves_rounds_and_pairs_ratios_per_round():
    order = []
    calls = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    samples = harness.measure_interleaved(calls, warmup=1, repeats=4, rounds=2)
    assert order == ["a", "b"] + ["a", "a", "b", "b"] * 2
    assert [len(r) for r in samples["a"]] == [2, 2]
    # Each round's ratio first, then their median: drift between rounds cancels.
    drifting = {"ref": [[1.0], [4.0], [9.0]], "x": [[0.5], [2.0], [4.5]]}
    assert harness.paired_ratio(drifting, "ref", "x") == 2.0
    assert statistics.median([1.0, 4.0, 9.0]) / statistics.median([0.5, 2.0, 4.5]) == 2.0


def test_timer_batches_fast_calls_to_the_minimum_sample_time():
    count = []
    samples = harness.measure_interleaved(
        {"tiny": lambda: count.append(1)}, warmup=0, repeats=2, rounds=2, min_sample_s=0.01
    )
    assert len(count) > 4  # several calls per sample
    assert all(t < 0.01 for r in samples["tiny"] for t in r)  # seconds per call, not per sample


def test_machine_info_records_the_cpu_class():
    info = harness.machine_info()
    assert info["cpu_class"] == processor().name and info["cpu_class"] in CPU_CLASSES
    assert {"cpu", "threads", "torch", "date"} <= set(info)


def test_sentence_rule_and_text_check(tmp_path, monkeypatch):
    sentences = text.encoder_sentences()
    assert len(sentences) == 200 and len(set(sentences)) == 200
    assert all(len(s.split()) >= 4 for s in sentences)
    fake = tmp_path / "GPL-3"
    fake.write_text("not the license")
    monkeypatch.setattr(text, "EVALUATION_TEXT", fake)
    text.evaluation_text.cache_clear()
    try:
        with pytest.raises(text.TextUnavailable, match=r"has SHA-256 .* not the 3972dc97"):
            text.evaluation_text()
    finally:
        text.evaluation_text.cache_clear()


def _raises(model, calibration):
    raise RuntimeError("kernel exploded\nsecond line")


def test_a_failing_or_missing_variant_is_a_row_not_a_crash():
    calibration = Calibration("minilm", tokenizer=None)
    base = torch.nn.Linear(2, 2)
    row, engine = quality_table.prepare_and_score(Variant("boom", _raises), base, calibration)
    assert engine is None and row["status"] == "failed: RuntimeError: kernel exploded"
    missing = Variant("peer", _raises, requires=("no_such_package_xyz",))
    row, engine = quality_table.prepare_and_score(missing, base, calibration)
    assert engine is None and row["status"] == "not installed: no_such_package_xyz"
    line = quality_table.markdown_row("minilm", row)
    assert line == "| peer: not installed: no_such_package_xyz | - | - | - |"


def test_variants_are_data_and_selection_keeps_the_reference():
    names = [v.name for v in variants.select(None, "smollm2")]
    assert names[0] == "float32" and len(names) == len(set(names))
    assert {"int4/32", "int4/128 scale_search", "float8 dynamic", "llama.cpp Q4_1"} <= set(names)
    assert "onnxruntime int8 (quantize_dynamic)" not in names  # an encoder peer
    chosen = [v.name for v in variants.select("int4/32,int8", "smollm2")]
    assert chosen == ["float32", "int4/32", "int8"]
    with pytest.raises(ValueError, match=r"unknown variants \['int3'\]"):
        variants.select("int3", "minilm")


def test_ours_prepares_the_policy_and_quantization_it_names():
    prepare = variants.ours("int4/32", mode="int4", block_size=32).prepare
    model = prepare(torch.nn.Sequential(torch.nn.Linear(64, 8)), Calibration("minilm", None))
    policy = model[0].dtype_policy
    assert policy.name == "int4/32_from_mixed_bfloat16"
    assert policy.quantization_config.block_size == 32
    with torch.inference_mode():
        assert model(torch.randn(3, 64)).shape == (3, 8)


def test_chart_frontier_keeps_only_undominated_points():
    found = [("a", "x", 1.0, 5.0), ("b", "x", 2.0, 3.0), ("c", "y", 3.0, 4.0), ("d", "y", 4.0, 1.0)]
    assert [p[0] for p in chart.frontier(found)] == ["a", "b", "d"]
