"""`assert_everywhere(record, config)`: a quantization mode appears everywhere
the package lists modes, derived from its one record. Used for every
registered mode and for the toy modes the tests register themselves."""

from __future__ import annotations

import argparse
import copy
import warnings
from collections import OrderedDict

import torch
import torch.nn as nn

import dtype_policies
from dtype_policies import cli, layers, quantizers, saving
from dtype_policies._modes import QuantizationMode, mode_record, quantized_suffixes
from dtype_policies.apply import summary
from dtype_policies.policies import policy_for_config
from dtype_policies.quantization.attach import quantization_of
from dtype_policies.quantization.kinds import kind_of_class
from dtype_policies.quantizers import (
    deserialize_config,
    serialize_config,
    validate_and_resolve_config,
)

KINDS = (
    (nn.Linear, "linear"),
    (layers.Dense, "linear"),
    (layers.EinsumDense, "linear"),
    (nn.Embedding, "embedding"),
    (layers.Embedding, "embedding"),
)
INPUTS = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))


def linear_model() -> nn.Module:
    """A torch `Linear`, a `Dense` and an `EinsumDense`, built."""
    torch.manual_seed(0)
    model = nn.Sequential(
        OrderedDict(
            linear=nn.Linear(16, 32),
            act=nn.GELU(),
            dense=layers.Dense(32, name="dense"),
            einsum=layers.EinsumDense("ab,bc->ac", output_shape=16, name="einsum"),
        )
    )
    model(INPUTS)
    return model


def embedding_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(table=nn.Embedding(40, 16), head=nn.Linear(16, 4)))


def cli_quantize_choices() -> tuple[str, ...]:
    """The `--quantize` choices of `dtype-policies inspect`, read from the parser."""
    root = cli.parser()
    commands = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in commands.choices["inspect"]._actions if a.dest == "quantize")
    return tuple(action.choices)


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.float() - reference.float()).norm() / reference.float().norm())


def quietly(function, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return function(*args, **kwargs)


def assert_names_and_configs(record: QuantizationMode, config) -> None:
    name = record.name
    assert (
        name in dtype_policies.QUANTIZATION_MODES
        and name in quantizers.QUANTIZATION_MODES
        and mode_record(name) is record
    )
    policy = dtype_policies.get(policy_for_config(config, "mixed_bfloat16").name)
    assert policy.quantization_mode == name and policy.compute_dtype == "bfloat16"
    assert dtype_policies.deserialize(dtype_policies.serialize(policy)) == policy
    assert isinstance(policy.quantization_config, record.config_class)
    assert isinstance(config, record.config_class) and config.mode == name
    assert deserialize_config(serialize_config(config)) == config
    if record.calibrated:
        try:
            validate_and_resolve_config(name, None)
        except ValueError as e:
            assert record.config_class.__name__ in str(e)
        else:
            raise AssertionError(f"{name}: a calibrated mode needs a config")
    else:
        assert type(validate_and_resolve_config(name, None)) is record.config_class
    assert validate_and_resolve_config(None, config) is config
    quantized = policy_for_config(config, "float32")
    assert quantized.quantization_mode == name and quantized.source_name == "float32"
    assert dtype_policies.get(quantized.name).quantization_mode == name
    for cls, role in KINDS:
        assert kind_of_class(cls).supports(name) == (role in record.roles), (cls, name)
    assert (name in cli_quantize_choices()) == (not record.calibrated)
    if record.data_suffix is not None:
        assert record.data_suffix in quantized_suffixes()


def quantize_all(model: nn.Module, config) -> dtype_policies.quantization.QuantizationReport:
    return quietly(dtype_policies.quantize, model, config=config)


def cases(record: QuantizationMode):
    """`(model factory, inputs, paths quantized)` for each role the mode quantizes."""
    ids = torch.randint(0, 40, (4, 7), generator=torch.Generator().manual_seed(1))
    found = []
    if "linear" in record.roles:
        found.append((linear_model, INPUTS, ["linear", "dense", "einsum"]))
    if "embedding" in record.roles:
        paths = ["table", "head"] if "linear" in record.roles else ["table"]
        found.append((embedding_model, ids, paths))
    return found


def assert_quantizes(record: QuantizationMode, config, tmp_path, tolerance: float) -> None:
    """Quantize, summary, stored names, state_dict and `saving` round trips."""
    for index, (build, inputs, expected) in enumerate(cases(record)):
        model = build()
        with torch.no_grad():
            reference = model(inputs)
        report = quantize_all(model, config)
        assert [path for path, *_ in report.quantized] == expected, report.render()
        assert all(mode == record.name for _, mode, _ in report.quantized)
        with torch.no_grad():
            out = model(inputs)
        assert relative_error(out, reference) < tolerance
        assert record.label_of(config) in summary(model)
        for path in expected:
            qw = quantization_of(model.get_submodule(path))
            assert qw is not None and qw.mode == record.name
            if record.stored_suffixes:  # float8's state has fixed names instead
                for buffer in qw.stored_names:
                    assert buffer.startswith(qw.weight_name + "_"), buffer
                    assert buffer[len(qw.weight_name) :] in record.stored_suffixes, buffer
        # state_dict: refused by a float model, loaded by one quantized the same way.
        fresh = build()
        if record.data_suffix is not None:
            try:
                fresh.load_state_dict(model.state_dict())
            except (ValueError, RuntimeError) as e:  # ours, or torch's strict loading
                assert record.data_suffix in str(e)
            else:
                raise AssertionError("a quantized checkpoint loaded into a float model")
        quantize_all(fresh, config)
        fresh.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert torch.equal(fresh(inputs), out)
        # saving: into a float model of the same architecture, bit-exact.
        saving.save(model, tmp_path / f"{record.name}-{index}")
        loaded = build()
        saving.load(loaded, tmp_path / f"{record.name}-{index}")
        with torch.no_grad():
            assert torch.equal(loaded(inputs), out)
            assert torch.equal(copy.deepcopy(model)(inputs), out)


def assert_everywhere(record: QuantizationMode, config, tmp_path, tolerance: float = 0.25):
    assert_names_and_configs(record, config)
    assert_quantizes(record, config, tmp_path, tolerance)
