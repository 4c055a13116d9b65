"""Every registered quantization mode appears everywhere the package lists
modes (names, policies, configs, kinds, checkpoints, summary, command line,
saving), derived from its one record; unknown modes raise everywhere."""

import pytest

import dtype_policies
from dtype_policies._modes import KERAS_ONLY_MODES, keras_only_modes, registered_modes
from dtype_policies.quantizers import AWQConfig, GPTQConfig, validate_and_resolve_config

from .everywhere import INPUTS, assert_everywhere

TOLERANCE = {"int8": 0.05, "float8": 0.1, "int4": 0.25, "gptq": 0.25, "awq": 0.25}
CALIBRATED = {  # the models of `everywhere` take float inputs: the dataset is model inputs
    "gptq": lambda: GPTQConfig([INPUTS, INPUTS.flip(0)], None, group_size=8),
    "awq": lambda: AWQConfig([INPUTS, INPUTS.flip(0)], None, group_size=8),
}


@pytest.mark.parametrize("record", registered_modes(), ids=lambda r: r.name)
def test_every_registered_mode_appears_everywhere(record, tmp_path):
    if record.calibrated:
        assert record.name in CALIBRATED, "give this test a calibration dataset for the new mode"
        config = CALIBRATED[record.name]()
    else:
        config = record.default_config()
    assert_everywhere(record, config, tmp_path, TOLERANCE.get(record.name, 0.25))


@pytest.mark.parametrize("name", ["int7", "float7", "", "int8x"])
def test_an_unknown_mode_raises_everywhere(name):
    with pytest.raises(ValueError, match="Invalid quantization mode"):
        validate_and_resolve_config(name, None)
    with pytest.raises(ValueError, match="Invalid quantization mode"):
        dtype_policies.QuantizedDTypePolicy(name, "float32")
    with pytest.raises(ValueError):
        dtype_policies.get(f"{name}_from_float32")
    with pytest.raises(ValueError, match="Invalid quantization mode"):
        dtype_policies.quantize(__import__("torch").nn.Linear(2, 2), name)


@pytest.mark.parametrize("name", keras_only_modes())
def test_keras_modes_not_implemented_are_refused_by_name(name):
    """gptq, awq, ternary: recognised (Keras's names), refused with one message."""
    message = f"'{name}'.*Keras mode that dtype_policies does not implement"
    for policy in (f"{name}/4/128_from_float32", f"{name}_from_float32"):
        with pytest.raises(ValueError, match=message):
            dtype_policies.get(policy)
    with pytest.raises(ValueError, match=message):
        dtype_policies.deserialize(
            {"class_name": KERAS_ONLY_MODES[name], "config": {"mode": name, "source_name": "x"}}
        )
    with pytest.raises(ValueError, match=message):
        validate_and_resolve_config(name, None)
    assert name not in dtype_policies.QUANTIZATION_MODES
