"""`dtype-policies demo`: what each precision costs and gives, on a real data
set shipped offline (scikit-learn's handwritten digits)."""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from typing import Any

import torch
import torch.nn as nn

from dtype_policies.apply import apply_policy, model_totals
from dtype_policies.cli import output
from dtype_policies.cli.options import SEED_RANGE, check_range, common_options
from dtype_policies.cli.targets import CLIError
from dtype_policies.quantization import quantize


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        parents=[common_options()],
        help="train on scikit-learn's digits in float32 and mixed_bfloat16, quantize, compare",
        description="Trains the same MLP on scikit-learn's digits (offline) in float32 and "
        "mixed_bfloat16, quantizes it to int8 and int4, and prints accuracy, train step "
        "time, inference time, speed against float32 and weight size.",
    )
    parser.add_argument(
        "--epochs", type=int, default=None, help="training epochs (default 12; 1 with --quick)"
    )
    parser.add_argument(
        "--hidden", type=int, default=None, help="hidden width (default 1024; 128 with --quick)"
    )
    parser.add_argument("--quick", action="store_true", help="a reduced run (seconds)")
    parser.add_argument(
        "--seed", type=int, default=0, help=f"{SEED_RANGE[0]} to {SEED_RANGE[1]} (default 0)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(run=run)


def _data(seed: int) -> tuple[torch.Tensor, ...]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise CLIError(
            "the demo needs scikit-learn (it ships the digits data set): "
            "pip install 'dtype-policies[cli]'"
        ) from None
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    split = int(0.8 * len(x))
    return x[order[:split]], y[order[:split]], x[order[split:]], y[order[split:]]


def _model(hidden: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(64, hidden),
        nn.GELU(),
        nn.Linear(hidden, hidden),
        nn.GELU(),
        nn.LayerNorm(hidden),
        nn.Linear(hidden, 10),
    )


def _train(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, seed: int, label: str
) -> list[float]:
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step_times = []
    batch = 64
    warm = copy.deepcopy(model)  # first calls pay one-time costs: not timed
    for _ in range(3):
        warm(x[:batch]).float().sum().backward()
    for _ in output.progress(range(epochs), epochs, f"training {label:>15s}: epoch"):
        order = torch.randperm(len(x))
        for start in range(0, len(x), batch):
            index = order[start : start + batch]
            began = time.perf_counter()
            loss = nn.functional.cross_entropy(model(x[index]).float(), y[index])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step_times.append(time.perf_counter() - began)
    return step_times


def _evaluate(
    models: dict[str, nn.Module], x: torch.Tensor, y: torch.Tensor, rounds: int
) -> dict[str, tuple[float, float]]:
    """Accuracy and median inference seconds per model, timed in interleaved
    rounds (each round times every model once), so that drift on a shared
    machine hits all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in models}
    accuracy = {}
    with torch.inference_mode():
        for name, model in models.items():
            model.eval()
            accuracy[name] = (model(x).argmax(-1) == y).float().mean().item()
        for _ in range(rounds):
            for name, model in models.items():
                began = time.perf_counter()
                model(x)
                times[name].append(time.perf_counter() - began)
    return {name: (accuracy[name], statistics.median(times[name])) for name in models}


def _megabytes(model: nn.Module) -> float:
    return model_totals(model)[1] / 2**20


def run(args: argparse.Namespace) -> int:
    epochs, hidden, repeats = (1, 128, 3) if args.quick else (12, 1024, 30)
    epochs = epochs if args.epochs is None else args.epochs  # given values win, --quick or not
    hidden = hidden if args.hidden is None else args.hidden
    if epochs < 1 or hidden < 1:
        raise CLIError(f"--epochs and --hidden must be positive (got {epochs}, {hidden})")
    check_range("--seed", args.seed, *SEED_RANGE)
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = _data(args.seed)
    torch.manual_seed(args.seed)
    initial = _model(hidden)

    float32 = copy.deepcopy(initial)
    float32_steps = _train(float32, x_train, y_train, epochs, args.seed, "float32")
    mixed = copy.deepcopy(initial)
    apply_policy(mixed, "mixed_bfloat16")
    mixed_steps = _train(mixed, x_train, y_train, epochs, args.seed, "mixed_bfloat16")

    variants: dict[str, tuple[nn.Module, list[float] | None]] = {
        "float32": (float32, float32_steps),
        "mixed_bfloat16": (mixed, mixed_steps),
    }
    for mode in ("int8", "int4"):
        quantized = copy.deepcopy(mixed)
        with warnings.catch_warnings():  # the norm layer is skipped, as expected
            warnings.simplefilter("ignore", UserWarning)
            quantize(quantized, mode)
        variants[f"{mode} (from mixed_bfloat16)"] = (quantized, None)

    measured = _evaluate(
        {name: model for name, (model, _) in variants.items()}, x_test, y_test, repeats
    )
    results: list[dict[str, Any]] = []
    for name, (model, steps) in variants.items():
        accuracy, seconds = measured[name]
        results.append(
            {
                "variant": name,
                "accuracy": accuracy,
                "train_step_ms": statistics.median(steps) * 1e3 if steps else None,
                "inference_ms": seconds * 1e3,
                "weight_mb": _megabytes(model),
            }
        )
    reference = results[0]["inference_ms"]
    for result in results:
        result["speed_vs_float32"] = reference / result["inference_ms"]
    if args.json:
        output.print_json({"data": "scikit-learn digits", "epochs": epochs, "results": results})
        return 0
    output.print_table(
        f"Digits ({len(x_train)} train / {len(x_test)} test), MLP 64-{hidden}-{hidden}-10, "
        f"{epochs} epoch(s), {torch.get_num_threads()} threads",
        ["variant", "accuracy", "train step ms", "inference ms", "x float32", "weights MB"],
        [
            [
                r["variant"],
                f"{r['accuracy']:.4f}",
                "-" if r["train_step_ms"] is None else f"{r['train_step_ms']:.2f}",
                f"{r['inference_ms']:.2f}",
                f"{r['speed_vs_float32']:.2f}",
                f"{r['weight_mb']:.2f}",
            ]
            for r in results
        ],
        numeric=5,
        footer="inference: the whole test set in one batch, median of interleaved rounds",
    )
    return 0
