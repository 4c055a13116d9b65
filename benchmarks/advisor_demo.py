"""The precision advisor on a Hugging Face Llama built from a config.

    PYTHONPATH=src python -m benchmarks.advisor_demo [--layers 2] [--hidden 512] [--rounds 15]

Builds `LlamaForCausalLM` (random weights, seed 0; hidden 512, intermediate
1408, 8 heads, vocab 8000, 2 layers by default), runs
`dtype_policies.advise` on a prefill batch of 4 x 128 token ids with
`max_error=0.02` for both objectives, then measures every variant on a second,
independent batch: the advised maps (latency, memory), every module
`mixed_bfloat16`, the whole model in `bfloat16` (weights too), and every
module `int8` (from mixed_bfloat16, embeddings and head included). Per
variant: the median and the fastest forward time over interleaved rounds
(every variant once per round, the order rotating) and their ratios to float32, the stored bytes of
the state dict (tied tensors counted once) and the relative error of the
logits against float32. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import warnings

import torch

from dtype_policies import advise, apply_policy, quantize
from dtype_policies.advisor import relative_error
from dtype_policies.advisor.variants import model_bytes
from dtype_policies.bench import harness


def build_llama(layers: int, hidden: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=8000,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval()


def variants(model: torch.nn.Module, advice: dict) -> dict[str, torch.nn.Module]:
    out = {"float32": model}
    for objective, chosen in advice.items():
        advised = copy.deepcopy(model)
        chosen.apply(advised)
        out[f"advised ({objective})"] = advised
    mixed = copy.deepcopy(model)
    apply_policy(mixed, "mixed_bfloat16")
    out["mixed_bfloat16 everywhere"] = mixed
    out["bfloat16 everywhere (weights too)"] = copy.deepcopy(model).to(torch.bfloat16)
    int8 = copy.deepcopy(model)
    apply_policy(int8, "mixed_bfloat16")
    quantize(int8, "int8")
    out["int8 everywhere"] = int8
    return out


def forward_ms(models: dict[str, torch.nn.Module], ids: torch.Tensor, rounds: int) -> dict:
    """Per variant: (median, fastest) milliseconds per forward, interleaved
    rounds of the suite's timer."""

    def forward(model):
        def call():
            with torch.inference_mode():
                model(input_ids=ids)

        return call

    calls = {name: forward(model) for name, model in models.items()}
    samples = harness.measure_interleaved(calls, warmup=1, repeats=rounds, rounds=rounds)
    flat = {name: [t * 1e3 for r in per_round for t in r] for name, per_round in samples.items()}
    return {name: (statistics.median(v), min(v)) for name, v in flat.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--max-error", type=float, default=0.02)
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)

    model = build_llama(args.layers, args.hidden)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8000, (4, 128), generator=generator)
    held_out = torch.randint(0, 8000, (4, 128), generator=generator)
    advice, seconds = {}, {}
    for objective in ("latency", "memory"):
        seconds[objective], advice[objective] = harness.time_call(
            lambda objective=objective: advise(
                model, {"input_ids": ids}, max_error=args.max_error, objective=objective
            )
        )

    models = variants(model, advice)
    times = forward_ms(models, held_out, args.rounds)
    with torch.inference_mode():
        reference = model(input_ids=held_out).logits
        errors = {
            name: relative_error(m(input_ids=held_out).logits.float(), reference)
            for name, m in models.items()
        }

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"{when}; torch {torch.__version__}, {torch.get_num_threads()} threads; Llama "
        f"{args.layers} layers, hidden {args.hidden}; advise on 4 x 128 token ids, "
        f"max_error={args.max_error}; measured on another 4 x 128 batch, "
        f"median of {args.rounds} interleaved rounds\n"
    )
    for objective, chosen in advice.items():
        counts: dict[str, int] = {}
        for row in chosen.measured:
            counts[row.choice] = counts.get(row.choice, 0) + 1
        print(
            f"- advise(objective={objective!r}): {seconds[objective]:.1f} s; "
            f"error {chosen.error:.4f} on the advice batch; modules per choice: "
            + ", ".join(f"{label} {n}" for label, n in sorted(counts.items()))
        )
    print()
    print(
        "| variant | forward ms, median | speed vs float32 | forward ms, fastest "
        "| speed vs float32 | stored MB | error vs float32 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    (base_median, base_fastest), base_bytes = times["float32"], model_bytes(model)
    for name, m in models.items():
        median, fastest = times[name]
        size = model_bytes(m)
        print(
            f"| {name} | {median:.1f} | {base_median / median:.2f}x | {fastest:.1f} | "
            f"{base_fastest / fastest:.2f}x | {size / 1e6:.1f} ({base_bytes / size:.2f}x "
            f"smaller) | {errors[name]:.4f} |"
        )
    print()
    print(advice["latency"].table())


if __name__ == "__main__":
    main()
