"""The peers, measured in the same run where installed: each a `Variant`
whose `prepare` uses the other library on a fresh float32 copy of the model.

Torch-module peers (run on the whole model in bfloat16, as this library's
variants compute in bfloat16): torchao (int8 dynamic, int8 weight-only, and
int4 through `PrototypeInt4WeightOnlyConfig`, the int4 config that runs on
CPU), hqq (calibration-free int4 group 64 and int8, the block linears; the
LM head stays bf16 as hqq's own model wrapper does), optimum-quanto (int8 /
int4 weights, every linear). Engine peers (`engines_llamacpp`,
`engines_onnx`): llama.cpp on GGUFs of the same SmolLM2, ONNX Runtime and
OpenVINO on MiniLM.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from dtype_policies.bench.realmodels import engines_llamacpp, engines_onnx
from dtype_policies.bench.realmodels.variants import BOTH, Calibration, Variant


def _torchao(config_name: str, module: str = "torchao.quantization", **kwargs):
    def prepare(model: torch.nn.Module, calibration: Calibration) -> torch.nn.Module:
        import importlib

        from torchao.quantization import quantize_

        config = getattr(importlib.import_module(module), config_name)(**kwargs)
        model = model.to(torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_(model, config)
        return model.eval()

    return prepare


def _block_linears(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    """(parent, name, linear) of every nn.Linear inside the transformer blocks
    (not the LM head, not a pooler)."""
    found = []
    for path, parent in model.named_modules():
        if ".layers." not in f".{path}." and ".layer." not in f".{path}.":
            continue
        for name, child in parent.named_children():
            if type(child) is torch.nn.Linear:
                found.append((parent, name, child))
    return found


def _hqq(bits: int, group_size: int | None):
    def prepare(model: torch.nn.Module, calibration: Calibration) -> torch.nn.Module:
        from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

        config = BaseQuantizeConfig(nbits=bits, group_size=group_size)
        model = model.to(torch.bfloat16)
        for parent, name, linear in _block_linears(model):
            quantized = HQQLinear(linear, config, compute_dtype=torch.bfloat16, device="cpu")
            setattr(parent, name, quantized)
        return model.eval()

    return prepare


def _contiguous_inputs(module: torch.nn.Module, args: tuple) -> tuple:
    return tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)


def _quanto(weights: str):
    def prepare(model: torch.nn.Module, calibration: Calibration) -> torch.nn.Module:
        import optimum.quanto as quanto

        model = model.to(torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quanto.quantize(model, weights=getattr(quanto, weights))
            quanto.freeze(model)
        if weights == "qint4":
            # quanto's int4 linear hands torch's int4 kernel its input as it
            # comes, and the kernel refuses a strided one (MiniLM at 32 x 128).
            for module in model.modules():
                if isinstance(module, quanto.QLinear):
                    module.register_forward_pre_hook(_contiguous_inputs)
        return model.eval()

    return prepare


def _peer(
    name: str,
    prepare: Callable,
    requires: str,
    family: str,
    models: tuple[str, ...] = BOTH,
    note: str = "",
) -> Variant:
    return Variant(name, prepare, models=models, requires=(requires,), family=family, note=note)


PEERS: list[Variant] = [
    _peer(
        "torchao int8 dynamic",
        _torchao("Int8DynamicActivationInt8WeightConfig"),
        "torchao",
        "torchao",
    ),
    _peer("torchao int8 weight-only", _torchao("Int8WeightOnlyConfig"), "torchao", "torchao"),
    _peer(
        "torchao int4/32",
        _torchao(
            "PrototypeInt4WeightOnlyConfig", "torchao.prototype.quantization.int4", group_size=32
        ),
        "torchao",
        "torchao",
        note="PrototypeInt4WeightOnlyConfig",
    ),
    _peer(
        "torchao int4/128",
        _torchao(
            "PrototypeInt4WeightOnlyConfig", "torchao.prototype.quantization.int4", group_size=128
        ),
        "torchao",
        "torchao",
        note="PrototypeInt4WeightOnlyConfig",
    ),
    _peer("hqq int4/64", _hqq(4, 64), "hqq", "hqq", note="block linears"),
    _peer("hqq int4/128", _hqq(4, 128), "hqq", "hqq", note="block linears"),
    _peer("hqq int8", _hqq(8, None), "hqq", "hqq", note="block linears, per channel"),
    _peer("quanto int8 weights", _quanto("qint8"), "optimum.quanto", "optimum-quanto"),
    _peer(
        "quanto int4 weights",
        _quanto("qint4"),
        "optimum.quanto",
        "optimum-quanto",
        note="inputs made contiguous",
    ),
]
PEERS += [*engines_llamacpp.VARIANTS, *engines_onnx.VARIANTS]
"""The peers, in table order."""
