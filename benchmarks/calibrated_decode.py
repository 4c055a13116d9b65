"""Decode speed of the calibrated modes against round-to-nearest int4 at the
same group (they share the stored tensors and the packed kernel):

    python -m benchmarks.calibrated_decode [--group 64] [--rounds 4] [--compiled]

SmolLM2-135M under `mixed_bfloat16`: round-to-nearest int4/<group> of the
decoder layers' linears (the reference: the layers GPTQ and AWQ quantize),
int4/<group> of the whole model (its tied embedding and head too, int8 as
`quantize(model, "int4")` stores them), gptq/4/<group>, the same with
`activation_order=True`, and awq/4/<group>, each calibrated on 4 windows of
128 tokens of the calibration text (speed does not depend on the
calibration's quality); greedy `generate` of `--tokens` tokens after a
32-token prompt, batch 1, under `inference_mode`, eager or, with
`--compiled`, through `compile_for_generation` (each variant's first
`generate` compiles and is not timed). Rounds interleaved; each variant's
speed is the median of its per-round ratio to the reference in the same
round. `--variants` names the variants to run, comma-separated (the
reference always runs).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--variants", default="", help="comma-separated variant names")
    args = parser.parse_args(argv)
    from dtype_policies.quantizers import AWQConfig, GPTQConfig, Int4QuantizationConfig

    group = args.group
    small = {"num_samples": 4, "sequence_length": 128, "group_size": group}
    decoder_layers = lambda path, module: path.startswith("model.layers.")  # noqa: E731
    int4 = Int4QuantizationConfig(block_size=group)
    reference = f"int4/{group}, decoder layers"
    builders = {  # name -> (config from the calibration ids, filters)
        reference: (lambda ids: int4, decoder_layers),
        f"int4/{group}, whole model": (lambda ids: int4, None),
        f"gptq/4/{group}": (lambda ids: GPTQConfig([ids], None, **small), None),
        f"gptq/4/{group} activation order": (
            lambda ids: GPTQConfig([ids], None, activation_order=True, **small),
            None,
        ),
        f"awq/4/{group}": (lambda ids: AWQConfig([ids], None, **small), None),
    }
    chosen = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(builders))
    if unknown:  # before the model loads
        parser.error(f"unknown variants {unknown}; known: {list(builders)}")
    builders = {
        name: value
        for name, value in builders.items()
        if name == reference or not chosen or name in chosen
    }
    import torch

    from dtype_policies import apply_policy, compile_for_generation, quantize
    from dtype_policies.bench.realmodels import models, text

    torch.set_num_threads(args.threads)
    base, tokenizer = models.load_smollm2()
    ids = tokenizer(text.lm_calibration_text(), add_special_tokens=False)["input_ids"]
    ids = torch.tensor(ids)
    prompt = ids[:32][None]

    def ms_per_token(model: torch.nn.Module) -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            model.generate(
                prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False
            )
            return (time.perf_counter() - start) / args.tokens * 1000

    prepared = {}
    for name, (config, filters) in builders.items():
        model = copy.deepcopy(base)
        apply_policy(model, "mixed_bfloat16")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            quantize(model, config=config(ids), filters=filters, progress=False)
        model.eval()
        if args.compiled:
            compile_for_generation(model)
        start = time.perf_counter()
        ms_per_token(model)  # warm-up; compiled: the compilation
        print(f"{name}: first generate {time.perf_counter() - start:.1f} s", flush=True)
        prepared[name] = model
    times: dict[str, list[float]] = {name: [] for name in prepared}
    for _ in range(args.rounds):
        for name, model in prepared.items():
            times[name].append(ms_per_token(model))
    kind = "compiled" if args.compiled else "eager"
    print(f"\n| {kind} | ms per token | speed vs {reference} |\n|---|---:|---:|")
    for name, values in times.items():
        ratio = statistics.median(r / v for r, v in zip(times[reference], values))
        print(f"| {name} | {statistics.median(values):.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
