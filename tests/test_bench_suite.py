"""The benchmark suite's machinery (fast): the workload registry, the one
timer, the real-model text rules, and failing variants becoming rows."""

import itertools
import json
import os
import runpy
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dtype_policies._cpu import CPU_CLASSES, processor
from dtype_policies.bench import contention, harness, registry, runner, workloads
from dtype_policies.bench.realmodels import (
    catalogue,
    chart,
    engines,
    models,
    quality_table,
    text,
    variants,
)
from dtype_policies.bench.realmodels import table as realtable
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
    # Warm-up, then per round and variant one untimed call and two samples.
    assert order == ["a", "b"] + ["a", "a", "a", "b", "b", "b"] * 2
    assert [len(r) for r in samples["a"]] == [2, 2]
    # Each round's ratio first, then their median: drift between rounds cancels.
    drifting = {"ref": [[1.0], [4.0], [9.0]], "x": [[0.5], [2.0], [4.5]]}
    assert harness.paired_ratio(drifting, "ref", "x") == 2.0
    assert statistics.median([1.0, 4.0, 9.0]) / statistics.median([0.5, 2.0, 4.5]) == 2.0


def test_timer_pauses_between_variants_so_spinning_pools_go_idle():
    calls: list[tuple[str, float]] = []

    def slow() -> None:  # a call too long to be made again untimed
        calls.append(("slow", time.perf_counter()))
        time.sleep(harness._REWARM_S + 0.01)
        calls.append(("slow end", time.perf_counter()))

    variants = {"fast": lambda: calls.append(("fast", time.perf_counter())), "slow": slow}
    harness.measure_interleaved(variants, warmup=1, repeats=2, rounds=2)
    names = [name for name, _ in calls if name != "slow end"]
    assert names == ["fast", "slow"] + ["fast", "fast", "slow"] * 2
    # Every switch of variant waits `SETTLE_S` after the previous variant's last call.
    switches = [(a, b) for a, b in itertools.pairwise(calls) if a[0] != "slow" and a[0] != b[0]]
    assert len(switches) == 5  # 4 in the rounds, 1 in the warm-up that is not paused
    paused = [b[1] - a[1] for a, b in switches[1:]]
    assert all(gap >= harness.SETTLE_S for gap in paused), paused
    # A single variant is not paused.
    alone: list[float] = []
    harness.measure_interleaved(
        {"a": lambda: alone.append(time.perf_counter())}, repeats=3, rounds=3
    )
    assert max(b - a for a, b in itertools.pairwise(alone)) < harness.SETTLE_S


def test_a_variant_timed_by_its_own_clock_is_rewarmed_by_its_wall_time():
    """A decode step returns its per-token `Timed` (0.04 s) from a call of
    seconds: it was made again untimed in every round, doubling the table's
    time."""
    calls = {"decode": 0, "other": 0}

    def decode() -> harness.Timed:
        calls["decode"] += 1
        time.sleep(harness._REWARM_S + 0.01)
        return harness.Timed(0.01)

    def other() -> None:
        calls["other"] += 1

    harness.measure_interleaved({"decode": decode, "other": other}, warmup=1, repeats=2, rounds=2)
    assert calls == {"decode": 1 + 2, "other": 1 + 2 * 2}


def test_timer_batches_fast_calls_to_the_minimum_sample_time():
    count = []
    samples = harness.measure_interleaved(
        {"tiny": lambda: count.append(1)}, warmup=0, repeats=2, rounds=2, min_sample_s=0.01
    )
    assert len(count) > 4  # several calls per sample
    assert all(t < 0.01 for r in samples["tiny"] for t in r)  # seconds per call, not per sample


class _ScriptedLoad:
    """A `contention.LoadWindow` whose shares come from a script."""

    shares: list[float] = []

    def restart(self) -> None:
        pass

    def others_share(self) -> float:
        return type(self).shares.pop(0)


def _scripted_load(monkeypatch, shares):
    _ScriptedLoad.shares = list(shares)
    monkeypatch.setattr(contention, "LoadWindow", _ScriptedLoad)
    waits = []
    monkeypatch.setattr(
        contention, "wait_until_quiet", lambda max_wait_s: waits.append(max_wait_s) or True
    )
    return waits


def test_a_contended_round_is_timed_again_and_the_quieter_attempt_kept(monkeypatch):
    # Round 1: 40% taken by others, retimed at 3% (kept); round 2 quiet.
    waits = _scripted_load(monkeypatch, [0.4, 0.03, 0.0])
    values = iter([5.0, 1.0, 2.0])
    with harness.retiming_contended_rounds(retries=2, max_wait_s=7.0) as log:
        samples = harness.measure_interleaved(
            {"a": lambda: harness.Timed(next(values))}, warmup=0, repeats=2, rounds=2, label="t"
        )
    assert samples["a"] == [[1.0], [2.0]]
    assert samples.others_share == [0.03, 0.0] and samples.retimed == 1 and waits == [7.0]
    assert log == [("t", samples)] and samples.contention_note() == ""


def test_a_round_busy_in_every_attempt_keeps_the_least_busy_and_is_reported(monkeypatch):
    waits = _scripted_load(monkeypatch, [0.5, 0.3, 0.6])
    values = iter([5.0, 1.0, 9.0])
    with harness.retiming_contended_rounds(retries=2, max_wait_s=1.0):
        samples = harness.measure_interleaved(
            {"a": lambda: harness.Timed(next(values))}, warmup=0, repeats=1, rounds=1
        )
    assert samples["a"] == [[1.0]] and samples.others_share == [0.3] and len(waits) == 2
    assert samples.contention_note() == (
        "contended: other processes took up to 30% of the CPU in 1 of 1 rounds "
        "(2 rounds timed again)"
    )


def test_a_machine_busy_for_good_waits_once_and_unknown_load_is_said(monkeypatch):
    waits = []

    def never_quiet(max_wait_s):
        waits.append(max_wait_s)
        return False

    _ScriptedLoad.shares = [0.5, 0.5, 0.5, 0.5, 0.5]
    monkeypatch.setattr(contention, "LoadWindow", _ScriptedLoad)
    monkeypatch.setattr(contention, "wait_until_quiet", never_quiet)
    with harness.retiming_contended_rounds(retries=2, max_wait_s=1.0):
        samples = harness.measure_interleaved(
            {"a": lambda: harness.Timed(1.0)}, warmup=0, repeats=3, rounds=3
        )
    assert waits == [1.0] and samples.retimed == 1  # then no more waiting
    unknown = harness.Samples(a=[[1.0]])
    unknown.others_share, unknown.retimed = [None], 0
    assert unknown.contention_note().startswith("load unknown")
    section = runner.load_section([("t", unknown)])
    assert "0 of 1 timed tables" in section and "Load not measured" in section


def test_rounds_too_short_to_read_are_judged_by_the_whole_table_s_load(monkeypatch):
    # Each round unreadable (None); the window over the table reads 30%, then 1%.
    _scripted_load(monkeypatch, [None, None, 0.3, None, None, 0.01])
    busy = harness.measure_interleaved(
        {"a": lambda: harness.Timed(1.0)}, warmup=0, repeats=2, rounds=2
    )
    assert busy.others_share == [None, None] and busy.table_share == 0.3
    assert busy.contention_note() == (
        "contended: other processes took 30% of the CPU over the table's 2 rounds "
        "(each too short to read alone)"
    )
    quiet = harness.measure_interleaved(
        {"a": lambda: harness.Timed(1.0)}, warmup=0, repeats=2, rounds=2
    )
    assert quiet.table_share == 0.01 and quiet.contention_note() == ""


def test_a_table_of_unknown_load_is_not_called_busy():
    from dtype_policies.bench.realmodels import table

    unknown = "load unknown: /proc/stat unreadable or rounds too short to read it"
    text = table.markdown(
        {"model": "minilm", "rows": [], "workloads": {}, "contended": {"b1x32": unknown}},
        "MiniLM",
    )
    assert "**b1x32: machine load not measured**" in text and "busy" not in text


def test_outside_the_runner_contention_is_recorded_never_waited_for(monkeypatch):
    waits = _scripted_load(monkeypatch, [0.9, 0.9])
    samples = harness.measure_interleaved(
        {"a": lambda: harness.Timed(1.0)}, warmup=0, repeats=2, rounds=2
    )
    assert samples["a"] == [[1.0], [1.0]] and samples.retimed == 0 and waits == []
    assert samples.others_share == [0.9, 0.9]
    assert "up to 90% of the CPU in 2 of 2 rounds" in samples.contention_note()


def test_load_window_sees_a_busy_process_and_not_its_own_work():
    spin = "import time\nend = time.perf_counter() + 1.5\nwhile time.perf_counter() < end: pass"
    busy = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)  # the child's interpreter has started
        window = contention.LoadWindow()
        time.sleep(0.8)
        share = window.others_share()
    finally:
        busy.wait()
    cores = os.cpu_count() or 1
    assert share is not None and share >= 0.6 / cores


def test_load_window_does_not_count_this_process_s_own_work(monkeypatch):
    # The machine is busy exactly as long as this process works: others took nothing.
    monkeypatch.setattr(contention, "_machine_busy_s", lambda: 100.0 + contention._own_cpu_s())
    window = contention.LoadWindow()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        pass
    own = window.others_share()
    assert own is not None and own < 0.01
    monkeypatch.setattr(contention, "_machine_busy_s", lambda: None)  # no /proc/stat
    assert contention.LoadWindow().others_share() is None


def test_bench_refuses_negative_contended_retries(capsys):
    with pytest.raises(SystemExit):
        runner.main(["--contended-retries", "-1"])
    assert "--contended-retries must be at least 0, not -1" in capsys.readouterr().err


def test_runner_retimes_contended_rounds_unless_quick_and_reports_the_load(tmp_path, monkeypatch):
    entered = []
    real = harness.retiming_contended_rounds
    monkeypatch.setattr(
        harness, "retiming_contended_rounds", lambda retries: entered.append(retries) or real(0)
    )
    threads = torch.get_num_threads()
    try:
        for extra in (["--quick"], ["--quick", "--contended-retries", "3"]):
            argv = ["--workloads", "overhead_grad", "--threads", "1", "--output", str(tmp_path)]
            assert runner.main(argv + extra) == 0
    finally:
        torch.set_num_threads(threads)
    assert entered == [0, 3]
    data = json.loads((tmp_path / "latest.json").read_text())
    [load] = data["machine_load"]
    assert load["table"] == "overhead_grad" and load["retimed"] == 0
    assert len(load["others_share"]) == 2  # one per round of a quick run
    assert "**Machine load**" in (tmp_path / "latest.md").read_text()


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
    names = [v.name for v in catalogue.select(None, "smollm2")]
    assert names[0] == "float32" and len(names) == len(set(names))
    assert {"int4/32", "int4/128 scale_search", "float8 dynamic", "llama.cpp Q4_1"} <= set(names)
    assert "onnxruntime int8 (quantize_dynamic)" not in names  # an encoder peer
    chosen = [v.name for v in catalogue.select("int4/32,int8", "smollm2")]
    assert chosen == ["float32", "int4/32", "int8"]
    with pytest.raises(ValueError, match=r"unknown variants \['int3'\]"):
        catalogue.select("int3", "minilm")


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


def test_one_call_timer_honours_a_time_the_call_reports():
    seconds, out = harness.time_call(lambda: harness.Timed(0.25))
    assert seconds == 0.25 and isinstance(out, harness.Timed)
    seconds, out = harness.time_call(lambda: "done")
    assert 0 <= seconds < 1 and out == "done"


def test_every_result_row_records_the_cpu_class_and_threads(tmp_path):
    from dtype_policies.bench import runner

    threads = torch.get_num_threads()
    try:
        argv = ["--workloads", "overhead_grad", "--quick", "--threads", "1"]
        assert runner.main([*argv, "--output", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    data = json.loads((tmp_path / "latest.json").read_text())
    assert data["machine"]["threads"] == "1"
    for row in data["results"]:
        assert row["machine"] == harness.row_machine(data["machine"]), row["variant"]
        assert row["machine"]["cpu_class"] in CPU_CLASSES and row["machine"]["threads"] == "1"


def test_runner_refuses_zero_threads(capsys):
    from dtype_policies.bench import runner

    with pytest.raises(SystemExit):
        runner.main(["--workloads", "overhead_grad", "--threads", "0"])
    assert "--threads must be at least 1, not 0" in capsys.readouterr().err


def test_benchmarks_module_names_itself_in_its_usage(monkeypatch, capsys):
    root = Path(__file__).resolve().parent.parent
    monkeypatch.syspath_prepend(str(root))
    for argv, usage in (
        (["--help"], "usage: python -m benchmarks [-h]"),
        (["quality", "--help"], "usage: python -m benchmarks quality [-h]"),
    ):
        monkeypatch.setattr(sys, "argv", ["benchmarks", *argv])
        with pytest.raises(SystemExit) as exited:
            runpy.run_module("benchmarks", run_name="__main__")
        shown = capsys.readouterr().out
        assert exited.value.code == 0
        assert shown.startswith(usage), shown.splitlines()[0]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield 1
    torch.set_num_threads(threads)


def test_torch_engines_run_on_the_run_threads(one_thread):
    assert engines.run_threads() == one_thread
    assert engines.TorchEncoder(torch.nn.Linear(2, 2)).threads == one_thread
    assert engines.TorchLM(torch.nn.Linear(2, 2)).threads == one_thread


def _tiny_encoder_onnx(path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Cast", ["input_ids"], ["last_hidden_state"], to=TensorProto.FLOAT)],
        "tiny",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "t"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["b", "t"]),
        ],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["b", "t"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_onnxruntime_engine_runs_on_the_run_threads(tmp_path, one_thread):
    pytest.importorskip("onnxruntime")
    from dtype_policies.bench.realmodels import engines_onnx

    engine = engines_onnx.OnnxRuntimeEncoder(_tiny_encoder_onnx(tmp_path / "tiny.onnx"))
    assert engine.threads == one_thread
    assert engine.session.get_session_options().intra_op_num_threads == one_thread
    ids = torch.tensor([[3, 4]])
    assert engine.hidden(ids, torch.ones_like(ids)).tolist() == [[3.0, 4.0]]


def test_openvino_engine_runs_on_the_run_threads_and_names_its_precision(one_thread):
    openvino = pytest.importorskip("openvino")
    from dtype_policies.bench.realmodels import engines_onnx

    class Tiny(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            return (input_ids * attention_mask).float()

    ids = torch.tensor([[3, 4]])
    ov_model = openvino.convert_model(Tiny(), example_input=(ids, torch.ones_like(ids)))
    engine = engines_onnx.OpenVINOEncoder(ov_model)
    assert engine.threads == one_thread
    assert engine.note == f"runs {engine.precision}"
    assert engine.hidden(ids, torch.ones_like(ids)).tolist() == [[3.0, 4.0]]


def test_llamacpp_engine_runs_on_the_run_threads(one_thread):
    pytest.importorskip("llama_cpp")
    from dtype_policies.bench.realmodels import engines_llamacpp, models

    try:
        path = models.smollm2_gguf()
    except models.ModelUnavailable as e:
        pytest.skip(str(e))
    engine = engines_llamacpp.LlamaCppLM(path)
    assert engine.threads == one_thread
    for context in (engine._all, engine._last):
        assert context.context_params.n_threads == one_thread
        assert context.context_params.n_threads_batch == one_thread
    assert engine.build == engines_llamacpp.build_features() and "AVX" in engine.build
    assert engine.decode(torch.tensor([[1, 2, 3, 4]]), 3) > 0


def _table_rows():
    rows = []
    for name, family, ms, perplexity in [
        ("float32", "dtype-policies", 40.0, 24.9),
        ("int8", "dtype-policies", 20.0, 25.1),
        ("int4/32", "dtype-policies", 12.0, 25.0),
        ("llama.cpp Q8_0", "llama.cpp", 15.0, 24.93),
        ("llama.cpp Q4_0", "llama.cpp", 9.0, 30.9),
        ("hqq int4/64", "hqq", 30.0, 29.2),
    ]:
        rows.append(
            {
                "variant": name,
                "family": family,
                "note": "",
                "status": "ok",
                "perplexity": perplexity,
                "decode_ms": ms,
                "prefill_ms": ms * 20,
                "cpu_class": "avx512",
                "cpu_flags": "avx2 avx512f",
                "threads": "1",
            }
        )
    rows[3]["engine_build"] = "AVX2 AVX512 REPACK"
    return rows


def test_table_names_the_cpu_class_threads_and_llamacpp_build():
    table = {
        "model": "smollm2",
        "rows": _table_rows(),
        "workloads": {"decode": "ms/token", "prefill": "ms"},
    }
    text_ = realtable.markdown(table, "SmolLM2")
    assert "CPU class avx512 (avx2 avx512f), 1 threads for every engine." in text_
    assert "llama.cpp build: AVX2 AVX512 REPACK." in text_


def test_chart_draws_both_speed_panels_with_labels_apart(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = {"model": "smollm2", "rows": _table_rows()}
    path = chart.draw(table, tmp_path / "smollm2.png", "CPU class avx512, 2026-11-26")
    assert path == tmp_path / "smollm2.png" and path.stat().st_size > 10_000
    figure, axes = plt.subplots()
    found = chart.points(table, "decode_ms")
    axes.scatter([p[2] for p in found], [p[3] for p in found])
    axes.set_xscale("log")
    axes.set_yscale("log")
    chart.place_labels(axes, found, set())
    renderer = figure.canvas.get_renderer()
    boxes = [text_.get_window_extent(renderer) for text_ in axes.texts]
    assert len(boxes) == len(found)
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    plt.close(figure)


def test_chart_labels_read_as_their_own_points_or_have_a_leader_line():
    """A crowded row of points at one quality (SmolLM2's decode at 6.6-15.5 ms
    and 24.9-25.1 perplexity, 2026-12-07): a label whose middle is nearer
    another point than its own would name that point; it gets a leader line."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [6.6, 8.5, 10.1, 10.5, 10.6, 12.7, 14.7, 15.5, 33.8, 41.4, 47.3]
    found = [
        (f"variant number {i} compiled", "ours" if i % 2 else "peer", t, 24.9 + 0.02 * (i % 3))
        for i, t in enumerate(times)
    ] + [("far away", "peer", 100.0, 34.0)]
    figure, axes = plt.subplots(figsize=(8, 7), dpi=110)
    axes.scatter([p[2] for p in found], [p[3] for p in found])
    axes.set_xscale("log")
    axes.set_yscale("log")
    chart.place_labels(axes, found, set())
    renderer = figure.canvas.get_renderer()
    centres = {p[0]: tuple(axes.transData.transform((p[2], p[3]))) for p in found}
    leaders = 0
    for text_ in axes.texts:
        box = text_.get_window_extent(renderer)
        distances = {name: chart._distance(box, centre) for name, centre in centres.items()}
        if text_.arrow_patch is not None:
            leaders += 1
        else:
            assert min(distances, key=distances.__getitem__) == text_.get_text()
    assert len(axes.texts) == len(found) and leaders >= 1
    plt.close(figure)


def test_a_cliff_is_timed_by_its_probes_alone_and_a_compiling_first_call_is_not_one(monkeypatch):
    from dtype_policies.bench.realmodels import speed

    calls = {"float32": 0, "cliff": 0, "compiles": 0}

    def call_of(engine, workload, tokens=0):
        def call():
            calls[engine] += 1
            if engine == "compiles":  # a compiled variant: only its first call is slow
                return harness.Timed(10.0 if calls[engine] == 1 else 0.5)
            return harness.Timed(1.0 if engine == "float32" else 10.0)

        return call

    monkeypatch.setattr(speed, "call_of", call_of)
    rows = {name: {} for name in calls}
    realtable.time_workload({n: n for n in calls}, "b1x32", rows, True, lambda *a, **k: None)
    assert calls["cliff"] == 2 and calls["float32"] > 2 and calls["compiles"] > 2
    assert rows["cliff"] == {
        "b1x32_ms": 10_000.0,
        "b1x32_x_float32": 0.1,
        "b1x32_status": "one call (slow)",
    }
    assert rows["float32"]["b1x32_ms"] == 1000.0
    assert rows["compiles"] == {"b1x32_ms": 500.0, "b1x32_x_float32": 2.0}


def test_a_call_of_milliseconds_is_timed_in_samples_of_many_calls(monkeypatch):
    from dtype_policies.bench.realmodels import speed

    calls = {"float32": 0, "fast": 0}

    def call_of(engine, workload, tokens=0):
        def call():
            calls[engine] += 1
            time.sleep(0.002 if engine == "float32" else 0.001)

        return call

    monkeypatch.setattr(speed, "call_of", call_of)
    rows = {name: {} for name in calls}
    realtable.time_workload({n: n for n in calls}, "b1x32", rows, True, lambda *a, **k: None)
    assert calls["fast"] > 2 * realtable.MIN_SAMPLE_S / 0.002  # several calls per sample
    assert 1.0 <= rows["fast"]["b1x32_ms"] < 3.0  # per call, not per sample


def test_selection_skips_variants_by_pattern_but_keeps_the_reference():
    names = [v.name for v in catalogue.select(None, "smollm2", skip="gptq/*,awq/*,float32")]
    assert names[0] == "float32" and "int4/32" in names
    assert not any(n.startswith(("gptq/", "awq/")) for n in names)
    assert "gptq/4/128" in [v.name for v in catalogue.select(None, "smollm2")]


def test_lm_scores_from_gathered_rows_match_the_full_log_probabilities(monkeypatch):
    from dtype_policies.bench.realmodels import quality

    torch.manual_seed(0)
    windows = torch.randint(0, 11, (2, 6))
    reference_logp = [torch.log_softmax(torch.randn(5, 11), -1) for _ in windows]
    top = [logp.topk(4, dim=-1) for logp in reference_logp]
    reference = {
        "top_ids": torch.cat([t.indices.to(torch.int32) for t in top]),
        "top_logp": torch.cat([t.values for t in top]),
    }
    monkeypatch.setattr(quality, "lm_windows", lambda: windows)
    monkeypatch.setattr(quality, "lm_reference", lambda: reference)

    same = quality.lm_scores_from_log_probs(reference_logp)
    targets = torch.cat(
        [logp.gather(1, w[1:, None])[:, 0] for logp, w in zip(reference_logp, windows)]
    )
    assert same["perplexity"] == pytest.approx(float(torch.exp(-targets.mean())), rel=1e-6)
    assert same["top1"] == 1.0
    assert same["kl"] == pytest.approx(0.0, abs=1e-6)

    other = [torch.log_softmax(torch.randn(5, 11), -1) for _ in windows]
    rows = [
        quality.lm_rows(logp, window, ids)
        for logp, window, ids in zip(other, windows, quality.reference_top_ids())
    ]
    assert set(rows[0]) == {"target_logp", "argmax", "top_logp"}
    assert rows[0]["top_logp"].shape == (5, 4)
    scores = quality.lm_scores_from_rows(rows)
    assert scores == quality.lm_scores_from_log_probs(other)
    assert scores["kl"] > 0.01
    argmax = torch.cat([logp.argmax(-1) for logp in other])
    assert scores["top1"] == pytest.approx(
        float((argmax == reference["top_ids"][:, 0]).float().mean())
    )


def test_cache_entries_made_at_once_by_several_workers_end_whole_and_alone(tmp_path):
    """Two test workers converting SmolLM2 at once: each writes its own copy,
    the first rename wins, the other copy is dropped (no error, no leftover)."""
    started = threading.Barrier(4)

    def write(directory):
        started.wait()
        (directory / "config.json").write_text("{}")

    results = []
    workers = [
        threading.Thread(target=lambda: results.append(models.publish(tmp_path / "m", write, True)))
        for _ in range(4)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert results == [tmp_path / "m"] * 4
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    assert (tmp_path / "m" / "config.json").read_text() == "{}"

    def fails(path):
        path.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        models.publish(tmp_path / "f.bin", fails)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_real_model_targets_are_judged_from_one_run_s_rounds_and_scores():
    from dtype_policies.bench.realmodels import targets

    table = {
        "model": "smollm2",
        "rows": [
            {"variant": "float32", "status": "ok", "perplexity": 25.0},
            {"variant": "int4/32", "status": "ok", "perplexity": 25.2},  # +0.8%
            {"variant": "int4/128", "status": "ok", "perplexity": 32.0},  # +28%
            {"variant": "int8", "status": "ok", "perplexity": 25.0, "top1": 0.94},
            {"variant": "int8 compiled", "status": "ok", "decode_ms": 8.0},
            {"variant": "llama.cpp Q8_0", "status": "ok", "decode_ms": 6.0},
            {"variant": "int4/32 W4A8 compiled", "status": "failed: boom"},
            {"variant": "llama.cpp Q4_0", "status": "ok", "decode_ms": 5.0},
        ],
        # two rounds: 0.75x then 0.85x -> median 0.80x (met at the line)
        "samples": {
            "decode": {
                "int8 compiled": [[0.008], [0.0068]],
                "llama.cpp Q8_0": [[0.006], [0.00578]],
                "llama.cpp Q4_0": [[0.005], [0.005]],
            }
        },
    }
    judged = {row["target"]: (row["measured"], row["met"]) for row in targets.evaluate(table)}
    assert judged["SmolLM2 decode, int8 compiled >= 0.8x llama.cpp Q8_0"] == ("0.80x", True)
    assert judged["SmolLM2 decode, int4/32 W4A8 compiled >= 0.8x llama.cpp Q4_0"] == (
        "not measured: int4/32 W4A8 compiled failed: boom",
        False,
    )
    assert judged["SmolLM2 int4/32 perplexity <= +1%"] == ("+0.8%", True)
    assert judged["SmolLM2 int4/128 perplexity <= +6%"] == ("+28.0%", False)
    assert judged["SmolLM2 int8 top-1 >= 0.95"] == ("0.9400", False)
    # not in the run: not judged
    assert not any("bfloat16" in label or "gptq" in label for label in judged)


def test_a_target_whose_peer_failed_or_that_missed_by_a_rounding_is_said_so():
    """A failed peer left its target out of the table (the docstring said
    failed); a variant that failed in its timing probe read "failed (ok)";
    0.7953 against 0.8 read "0.80x" beside "no"."""
    from dtype_policies.bench.realmodels import targets

    table = {
        "model": "smollm2",
        "rows": [
            {"variant": "float32", "status": "ok", "perplexity": 25.0},
            {"variant": "int4/128", "status": "ok", "perplexity": 26.51},  # +6.04%
            {"variant": "mixed_bfloat16 compiled", "status": "ok", "decode_ms": 12.2},
            {"variant": "llama.cpp BF16", "status": "ok", "decode_ms": 9.7},
            {"variant": "int8 compiled", "status": "ok", "decode_ms": 8.0},
            {"variant": "llama.cpp Q8_0", "status": "failed: RuntimeError: llama_decode -3"},
            {
                "variant": "int4/32 W4A8 compiled",
                "status": "ok",
                "decode_status": "failed: 60 of 64",
            },
            {"variant": "llama.cpp Q4_0", "status": "ok", "decode_ms": 5.0},
        ],
        "samples": {
            "decode": {
                "mixed_bfloat16 compiled": [[0.0122]],
                "llama.cpp BF16": [[0.0122 * 0.7953]],
                "int8 compiled": [[0.008]],
                "llama.cpp Q4_0": [[0.005]],
            }
        },
    }
    judged = {row["target"]: (row["measured"], row["met"]) for row in targets.evaluate(table)}
    assert judged["SmolLM2 decode, mixed_bfloat16 compiled >= 0.8x llama.cpp BF16"] == (
        "0.795x",
        False,
    )
    assert judged["SmolLM2 decode, int8 compiled >= 0.8x llama.cpp Q8_0"] == (
        "not measured: llama.cpp Q8_0 failed: RuntimeError: llama_decode -3",
        False,
    )
    assert judged["SmolLM2 decode, int4/32 W4A8 compiled >= 0.8x llama.cpp Q4_0"] == (
        "not measured: int4/32 W4A8 compiled failed: 60 of 64",
        False,
    )
    assert judged["SmolLM2 int4/128 perplexity <= +6%"] == ("+6.04%", False)
    assert not any("prefill" in label for label in judged)  # not timed in this run


def test_a_workload_that_raises_is_a_line_of_the_report_and_fails_the_run(
    tmp_path, monkeypatch, capsys
):
    """The shape sweep raised at its float8 case, and `python -m benchmarks`
    stopped there, writing nothing after ten minutes of other workloads."""

    def broken_build():
        raise AttributeError("'NoneType' object has no attribute 'kernel'")

    overhead = workloads.WORKLOADS["overhead_grad"]
    monkeypatch.setitem(
        workloads.WORKLOADS,
        "broken",
        registry.Workload("broken", "A broken workload", broken_build),
    )
    threads = torch.get_num_threads()
    try:
        argv = ["--workloads", "broken,overhead_grad", "--quick", "--threads", "1"]
        assert runner.main([*argv, "--output", str(tmp_path)]) == 1
    finally:
        torch.set_num_threads(threads)
    report = (tmp_path / "latest.md").read_text()
    assert "**A broken workload**: failed: AttributeError: 'NoneType' object" in report
    assert overhead.title in report  # the workloads after it ran
    data = json.loads((tmp_path / "latest.json").read_text())
    assert {row["workload"] for row in data["results"]} == {"overhead_grad"}
    assert "Failed: workloads broken" in capsys.readouterr().out


def test_a_failing_accuracy_section_is_a_line_and_a_crashed_workload_s_targets_say_so(
    tmp_path, monkeypatch, capsys
):
    """The MLP accuracy and memory sections ran outside the workloads'
    guard (a failure wrote nothing), and a crashed workload's targets
    vanished from the table."""
    from dtype_policies.bench.workloads import mlp

    def broken():
        raise RuntimeError("no accuracy today")

    monkeypatch.setattr(mlp, "quantization_accuracy", broken)
    import dataclasses

    for key in ("mlp_inference", "mlp_train"):  # nothing timed: a quick test
        failing = dataclasses.replace(workloads.WORKLOADS[key], build=broken)
        monkeypatch.setitem(workloads.WORKLOADS, key, failing)
    threads = torch.get_num_threads()
    try:
        argv = ["--workloads", "mlp_inference,mlp_train", "--quick", "--threads", "1"]
        assert runner.main([*argv, "--no-memory", "--output", str(tmp_path)]) == 1
    finally:
        torch.set_num_threads(threads)
    report = (tmp_path / "latest.md").read_text()
    assert "**MLP accuracy**: failed: RuntimeError: no accuracy today" in report
    data = json.loads((tmp_path / "latest.json").read_text())
    train_targets = [row for row in data["targets"] if "train" in row["target"].lower()]
    assert train_targets and all(
        row["measured"] == "not measured: the workload mlp_train failed" and not row["met"]
        for row in train_targets
    )
    assert "Failed: workloads mlp_inference, mlp_train, MLP accuracy" in capsys.readouterr().out


def test_a_figure_at_its_bound_or_not_finite_is_judged_in_words():
    assert harness.judged(0.7999999999, 0.8, at_least=True) == "0.7999999999x"
    assert harness.judged(float("inf"), 1.0, at_least=True) == "not measured (inf)"
    assert harness.judged(1.0600000001, 1.06, False, digits=1, percent=True) == "+6.00000001%"


def test_a_failed_measurement_writes_null_not_nan(tmp_path):
    """`NaN` is no JSON for strict parsers (jq, JSON.parse)."""
    import json

    from dtype_policies._json import strict

    text = json.dumps(strict({"ms": float("nan"), "rows": [1.0, float("-inf")]}), allow_nan=False)
    assert json.loads(text) == {"ms": None, "rows": [1.0, None]}


@pytest.mark.parametrize("case", workloads.shape_sweep.CASES, ids=lambda case: case[0])
def test_every_path_the_shape_sweep_times_computes_the_layers_outputs(case):
    """The sweep times each case's paths against each other: each must be the
    layer's product (its float8 case called a kernel API gone since
    2026-12-02, and `python -m benchmarks` crashed there, writing nothing)."""
    from dtype_policies._core.module_state import state_of
    from dtype_policies.bench.workloads.common import policied_copy

    sweep = workloads.shape_sweep
    _label, source, mode, config = case
    torch.manual_seed(0)
    base = torch.nn.Linear(160, 48).eval()
    x = torch.randn(3, 160)
    layer = policied_copy(base, source, mode, config)
    compute = state_of(layer).call.compute
    with torch.inference_mode():
        expected = layer(x).float()
    if mode is None:
        paths, chosen_name, chosen = sweep._float_paths(base, x, compute)
    else:
        paths, chosen_name, chosen = sweep._quantized_paths(layer, x, compute)
    if chosen is None:
        assert chosen_name in paths
    else:
        paths = {**paths, "chosen": chosen}
    assert len(paths) >= 2
    with torch.inference_mode():
        for name, run in paths.items():
            got = run().float()
            assert got.shape == expected.shape, name
            error = float((got - expected).norm() / expected.norm())
            assert error < 1e-2, (name, error)
