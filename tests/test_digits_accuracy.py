"""mixed_bfloat16 on a real data set (scikit-learn's digits, shipped offline)
reaches float32's accuracy within 1 point."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dtype_policies import apply_policy

datasets = pytest.importorskip("sklearn.datasets")
model_selection = pytest.importorskip("sklearn.model_selection")


def _data():
    digits = datasets.load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    return model_selection.train_test_split(x, y, test_size=0.3, random_state=0, stratify=y)


def _train_and_score(model, x_train, x_test, y_train, y_test):
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(15):
        order = torch.randperm(len(x_train), generator=generator)
        for start in range(0, len(order), 64):
            batch = order[start : start + 64]
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x_train[batch]).float(), y_train[batch]).backward()
            optimizer.step()
    with torch.no_grad():
        return (model(x_test).argmax(1) == y_test).float().mean().item()


@pytest.mark.slow  # trains a classifier: kept out of the default suite for its time
def test_digits_mixed_bfloat16_within_one_point_of_float32():
    torch.manual_seed(0)
    x_train, x_test, y_train, y_test = _data()
    base = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.LayerNorm(128), nn.Linear(128, 10))
    accuracy32 = _train_and_score(copy.deepcopy(base), x_train, x_test, y_train, y_test)
    mixed = copy.deepcopy(base)
    apply_policy(mixed, "mixed_bfloat16")
    accuracy16 = _train_and_score(mixed, x_train, x_test, y_train, y_test)
    assert accuracy32 > 0.94
    assert abs(accuracy16 - accuracy32) <= 0.01, (accuracy32, accuracy16)


@pytest.mark.slow  # trains a classifier: kept out of the default suite for its time
@pytest.mark.parametrize(("mode", "allowed_loss"), [("int8", 0.01), ("int4", 0.02)])
def test_digits_quantized_classifier_keeps_accuracy(mode, allowed_loss):
    from dtype_policies import quantize

    torch.manual_seed(0)
    x_train, x_test, y_train, y_test = _data()
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    accuracy32 = _train_and_score(model, x_train, x_test, y_train, y_test)
    apply_policy(model, "mixed_bfloat16")
    quantize(model, mode)
    with torch.no_grad():
        quantized = (model(x_test).argmax(1) == y_test).float().mean().item()
    assert accuracy32 > 0.94
    assert accuracy32 - quantized <= allowed_loss, (accuracy32, quantized)
