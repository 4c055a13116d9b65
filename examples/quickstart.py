"""Quickstart: dtype policies on a real (small) data set, offline.

Trains the same MLP on scikit-learn's digits twice, in float32 and under
`mixed_bfloat16` (float32 master weights, bfloat16 compute) via
`apply_policy`, and compares accuracy and speed; quantizes the trained model
to int8 and int4; then builds a model from this library's Keras-style layers
with a per-path policy map.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import copy
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import dtype_policies
from dtype_policies import DTypePolicyMap, apply_policy, layers, quantize


def load_data():
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=0, stratify=y
    )
    return x_train, x_test, y_train, y_test


def train(model, x_train, y_train, epochs=20, batch_size=64):
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for _ in range(epochs):
        order = torch.randperm(len(x_train), generator=generator)
        for index in range(0, len(order), batch_size):
            batch = order[index : index + batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x_train[batch]).float(), y_train[batch])
            loss.backward()
            optimizer.step()
    return time.perf_counter() - start


@torch.no_grad()
def accuracy(model, x, y):
    return (model(x).argmax(dim=1) == y).float().mean().item()


def main() -> None:
    torch.manual_seed(0)
    x_train, x_test, y_train, y_test = load_data()
    base = nn.Sequential(
        nn.Linear(64, 256),
        nn.GELU(),
        nn.LayerNorm(256),
        nn.Linear(256, 256),
        nn.GELU(),
        nn.Linear(256, 10),
    )

    float32_model = copy.deepcopy(base)
    seconds32 = train(float32_model, x_train, y_train)
    accuracy32 = accuracy(float32_model, x_test, y_test)

    mixed_model = copy.deepcopy(base)
    handle = apply_policy(mixed_model, "mixed_bfloat16")
    seconds16 = train(mixed_model, x_train, y_train)
    accuracy16 = accuracy(mixed_model, x_test, y_test)

    print("digits (1797 images, 8x8), MLP 64-256-256-10, 20 epochs of Adam")
    print(f"  float32         test accuracy {accuracy32:.4f}  ({seconds32:.2f} s)")
    print(f"  mixed_bfloat16  test accuracy {accuracy16:.4f}  ({seconds16:.2f} s)")
    print(
        f"  parameters stay {mixed_model[0].weight.dtype}; outputs are "
        f"{mixed_model(x_test[:1]).dtype}; LayerNorm kept in float32: {handle.float32_paths}"
    )
    print()
    print(dtype_policies.summary(mixed_model))

    # Quantize the trained mixed-precision model (weights int8 or int4, compute bfloat16).
    print()
    for mode in ("int8", "int4"):
        quantized = copy.deepcopy(mixed_model)
        with warnings.catch_warnings():  # the report below says what was skipped
            warnings.simplefilter("ignore", UserWarning)
            report = quantize(quantized, mode)
        policy = report.quantized[0][2]
        print(
            f"  {policy:30s} test accuracy {accuracy(quantized, x_test, y_test):.4f}  "
            f"({report.num_quantized} layers quantized, LayerNorm skipped)"
        )
    handle.remove()

    # Keras-style layers, one policy map for the whole model: the head in float32.
    policy = DTypePolicyMap("mixed_bfloat16", {"classifier/2": "float32"})
    model = layers.Sequential(
        [
            layers.Dense(128, activation="relu", dtype=policy),
            layers.Dropout(0.1, dtype=policy),
            layers.Dense(10, dtype=policy),
        ],
        name="classifier",
    )
    model(x_train[:1])
    train(model, x_train, y_train)
    model.eval()
    print()
    print(f"layers.Sequential with {policy!r}")
    for layer in model.layers:
        print(f"  {layer.path:14s} {type(layer).__name__:8s} computes in {layer.compute_dtype}")
    print(f"  test accuracy {accuracy(model, x_test, y_test):.4f}")


if __name__ == "__main__":
    main()
