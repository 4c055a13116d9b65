"""ONNX Runtime and OpenVINO on all-MiniLM-L6-v2 (encoder engines on the
run's thread count, `engines.run_threads`).

* ONNX Runtime: the float32 model exported with `torch.onnx.export`
  (dynamic batch and length), run as exported (float32) and after
  `onnxruntime.quantization.quantize_dynamic` (int8 weights, dynamic int8
  activations; without `quant_pre_process`, which fails on this model).
* OpenVINO: `openvino.convert_model` of the float32 model, compiled with the
  CPU plugin's defaults (bfloat16 inference on CPUs with native bfloat16,
  float32 elsewhere: the precision it compiled to is in the row's note), and
  after `nncf.compress_weights` (int8 weights).
Exported files go to a temporary directory per run.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from dtype_policies.bench.realmodels.engines import run_threads
from dtype_policies.bench.realmodels.variants import ENCODER, Calibration, Variant


class _LastHidden(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def _example() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1000, 2000, (2, 16))
    return ids, torch.ones_like(ids)


def export_onnx(model: torch.nn.Module, directory: Path) -> Path:
    path = directory / "minilm.onnx"
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length")
    shapes = {"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}}
    torch.onnx.export(
        _LastHidden(model).eval(),
        _example(),
        str(path),
        input_names=["input_ids", "attention_mask"],
        output_names=["last_hidden_state"],
        dynamic_shapes=shapes,
        dynamo=True,
        external_data=False,
    )
    return path


class OnnxRuntimeEncoder:
    def __init__(self, path: Path) -> None:
        import onnxruntime

        self.threads = run_threads()
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        # Its pool spin-waits between calls, as by default (turned off, it ran
        # 1.45-1.6x slower at 1 x 32); the timer pauses between variants so
        # that the spinning does not land on the next one (`harness.SETTLE_S`).
        self.session = onnxruntime.InferenceSession(
            str(path), options, providers=["CPUExecutionProvider"]
        )

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        feeds = {"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy()}
        return torch.from_numpy(self.session.run(None, feeds)[0])


def _onnx(int8: bool):
    def prepare(model: torch.nn.Module, calibration: Calibration) -> OnnxRuntimeEncoder:
        directory = Path(tempfile.mkdtemp(prefix="minilm-onnx-"))
        path = export_onnx(model, directory)
        if int8:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            quantized = directory / "minilm-int8.onnx"
            quantize_dynamic(str(path), str(quantized), weight_type=QuantType.QInt8)
            path = quantized
        return OnnxRuntimeEncoder(path)

    return prepare


class OpenVINOEncoder:
    def __init__(self, ov_model) -> None:
        import openvino

        core = openvino.Core()
        self.compiled = core.compile_model(
            ov_model, "CPU", {"INFERENCE_NUM_THREADS": run_threads(), "NUM_STREAMS": 1}
        )
        self.threads = int(self.compiled.get_property("INFERENCE_NUM_THREADS"))
        hint = self.compiled.get_property("INFERENCE_PRECISION_HINT")
        self.precision = hint.get_type_name() if hasattr(hint, "get_type_name") else str(hint)
        self.note = f"runs {self.precision}"

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.compiled([input_ids.numpy(), attention_mask.numpy()])
        return torch.from_numpy(np.asarray(out[0]))


def _openvino(int8_weights: bool):
    def prepare(model: torch.nn.Module, calibration: Calibration) -> OpenVINOEncoder:
        import openvino

        ov_model = openvino.convert_model(_LastHidden(model).eval(), example_input=_example())
        if int8_weights:
            import nncf

            ov_model = nncf.compress_weights(ov_model)
        return OpenVINOEncoder(ov_model)

    return prepare


VARIANTS: list[Variant] = [
    Variant(name, prepare, models=(ENCODER,), requires=requires, family=family, note=note)
    for name, prepare, requires, family, note in [
        ("onnxruntime float32", _onnx(False), ("onnxruntime", "onnxscript"), "onnxruntime", ""),
        (
            "onnxruntime int8 (quantize_dynamic)",
            _onnx(True),
            ("onnxruntime", "onnxscript"),
            "onnxruntime",
            "",
        ),
        (
            "openvino (CPU default precision)",
            _openvino(False),
            ("openvino",),
            "openvino",
            "",
        ),
        ("openvino + nncf int8 weights", _openvino(True), ("openvino", "nncf"), "openvino", ""),
    ]
]
