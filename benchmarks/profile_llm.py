"""Where the time of one Llama decode step (or one prefill forward) goes.

`python -m benchmarks.profile_llm [--variants a,b] [--prefill] [--steps 8]`

Per variant (names of `benchmarks.workloads.LLM_VARIANTS`): the unprofiled
wall time of one step (median), the number of module calls per step, and a
torch.profiler breakdown into GEMM kernels, attention, casts (`_to_copy`),
the library's int8 quantize/rescale passes (`_run_fused`, annotated here),
other aten ops and the rest (Python and dispatch: wall time minus the self
time of all aten/custom ops). Then the top Python functions by own time from
cProfile.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
import warnings
from collections import defaultdict

import torch

from dtype_policies.bench import harness
from dtype_policies.bench.harness import Timed
from dtype_policies.bench.workloads import llm as workloads

GEMM = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::_int_mm",
    "onednn::qlinear_pointwise",
    "aten::_weight_int4pack_mm_for_cpu",
    "aten::_weight_int8pack_mm",
    "mkldnn::_linear_pointwise",
    "aten::linear_backward",
)
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_softmax")
CASTS = ("aten::_to_copy", "aten::copy_", "aten::to", "aten::empty_strided")
EPILOGUE = "dp::quantize_rescale"


def _annotate_epilogues() -> None:
    from dtype_policies.quantization import kernels

    original = kernels._run_fused
    if getattr(original, "_annotated", False):
        return

    def run_fused(fn, *args):
        with torch.profiler.record_function(EPILOGUE):
            return original(fn, *args)

    run_fused._annotated = True
    kernels._run_fused = run_fused


def _step(model, kind: str, context):
    """A callable running one decode step (1 new token on a 16-token cache) or
    one prefill forward."""
    if kind == "prefill":
        ids = torch.randint(0, 32000, workloads.LLM_PREFILL)

        def prefill():
            with context():
                return model(input_ids=ids, use_cache=False)

        return prefill
    from transformers import DynamicCache

    prompt = torch.randint(0, 32000, (1, workloads.LLM_PROMPT))
    token = prompt[:, -1:]

    def decode():
        with context():
            cache = DynamicCache(config=model.config)
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
            start = time.perf_counter()
            with torch.profiler.record_function("dp::decode_step"):
                model(input_ids=token, past_key_values=cache, use_cache=True)
            return Timed(time.perf_counter() - start)  # the step alone, not the prompt

    return decode


def profile_variant(name: str, kind: str, steps: int) -> None:
    context, compile_setting = workloads.LLM_VARIANTS[name]
    model = workloads._llm_variant(name)
    run = _step(model, kind, context)
    with workloads._epilogue_compile(compile_setting):
        samples = harness.measure_interleaved({name: run}, warmup=3, repeats=steps, rounds=1)
        wall = statistics.median(samples[name][0])

        calls = [0]
        handle = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda m, a: calls.__setitem__(0, calls[0] + 1)
        )
        run()
        handle.remove()
        module_calls = calls[0]
        if kind == "decode":  # the prompt's forward was counted too
            module_calls //= 2

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                run()
    events = prof.events()
    if kind == "decode":
        # only the ops inside the decode step (not the prompt forward)
        windows = [
            (e.time_range.start, e.time_range.end) for e in events if e.name == "dp::decode_step"
        ]

        def inside(e):
            return any(s <= e.time_range.start and e.time_range.end <= t for s, t in windows)

        profiled_wall = sum(t - s for s, t in windows) / len(windows) / 1e3
    else:
        windows = None

        def inside(e):
            return True

        profiled_wall = None
    buckets: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    epilogue_total = 0.0
    for e in events:
        if not inside(e):
            continue
        if e.name == EPILOGUE:
            epilogue_total += e.cpu_time_total
            continue
        if e.name.startswith("dp::") or e.name.startswith("## "):
            continue
        self_us = e.self_cpu_time_total
        if e.name in GEMM:
            bucket = "GEMM"
        elif e.name in ATTENTION:
            bucket = "attention"
        elif e.name in CASTS:
            bucket = "casts (_to_copy)"
        elif "Torch-Compiled" in e.name or "CompiledFunction" in e.name or "inductor" in e.name:
            bucket = "compiled regions"
        else:
            bucket = "other aten ops"
        buckets[bucket] += self_us
        counts[bucket] += 1
    per = steps
    total_ops = sum(buckets.values()) / per / 1e3
    if profiled_wall is None:
        profiled_wall = wall * 1e3
    print(f"\n### {name} ({kind})")
    print(f"unprofiled wall per step: {wall * 1e3:.2f} ms; module calls per step: {module_calls}")
    print(f"profiled wall per step: {profiled_wall:.2f} ms")
    print("| bucket | ms/step | share of profiled wall | op calls/step |")
    print("|---|---:|---:|---:|")
    for bucket in ("GEMM", "attention", "casts (_to_copy)", "compiled regions", "other aten ops"):
        ms = buckets[bucket] / per / 1e3
        print(f"| {bucket} | {ms:.2f} | {ms / profiled_wall:.0%} | {counts[bucket] / per:.0f} |")
    rest = profiled_wall - total_ops
    print(f"| Python + dispatch (wall - ops) | {rest:.2f} | {rest / profiled_wall:.0%} | |")
    if epilogue_total:
        ms = epilogue_total / per / 1e3
        print(
            f"| (of which int8 quantize/rescale, incl. its ops) | {ms:.2f} | "
            f"{ms / profiled_wall:.0%} | |"
        )
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    print("```\n" + table + "\n```")

    profiler = cProfile.Profile()
    with workloads._epilogue_compile(compile_setting):
        profiler.enable()
        for _ in range(steps):
            run()
        profiler.disable()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(14)
    lines = [ln for ln in stream.getvalue().splitlines() if ln.strip()]
    print("```\ncProfile, top own time over", steps, "runs (decode: prompt forward included)")
    print("\n".join(lines[4:22]) + "\n```", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variants",
        default="whole model bfloat16;dtype_policies mixed_bfloat16;"
        "dtype_policies int8_from_mixed_bfloat16, no_grad;"
        "dtype_policies int4/128_from_mixed_bfloat16",
        help="';'-separated names from benchmarks.workloads.LLM_VARIANTS",
    )
    parser.add_argument("--prefill", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    _annotate_epilogues()
    names = [n.strip() for n in args.variants.split(";") if n.strip()]
    warnings.simplefilter("ignore")
    for name in names:
        profile_variant(name, "prefill" if args.prefill else "decode", args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
