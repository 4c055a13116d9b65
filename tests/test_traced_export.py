"""What a policied or quantized module records under the tracers that make
programs to run elsewhere (`torch.export`, `torch.onnx.export`,
`torch.jit.trace`, `torch.fx`): plain ATen ops, the eager path's values,
with gradients recorded or not, before or after an eager call, for any
batch size."""

from __future__ import annotations

import io

import pytest
import torch

from dtype_policies import apply_policy, quantize
from dtype_policies.quantizers import (
    Float8QuantizationConfig,
    Int4QuantizationConfig,
    Int8QuantizationConfig,
)

VARIANTS = {
    "float32": None,
    "mixed_bfloat16": "mixed_bfloat16",
    "int8": ("int8", None),
    "int8_weight_only": ("int8", Int8QuantizationConfig(activation_quantizer=None)),
    "int8_from_mixed_bfloat16": ("mixed_bfloat16", "int8"),
    "int4/32": ("int4", Int4QuantizationConfig(block_size=32)),
    "float8": ("float8", None),
    "float8_weight_only": ("float8", Float8QuantizationConfig(scaling="weight_only")),
    "float8_dynamic": ("float8", Float8QuantizationConfig(scaling="dynamic")),
    "int4/32 W4A8": ("int4", Int4QuantizationConfig(block_size=32, activation_block_size=32)),
}


def _mlp(variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 64)
    ).eval()
    how = VARIANTS[variant]
    if isinstance(how, str):
        apply_policy(model, how)
    elif how is not None and how[0] == "mixed_bfloat16":
        apply_policy(model, how[0])
        quantize(model, how[1])
    elif how is not None:
        quantize(model, *how)
    return model


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm()).item()


def _library_ops(program: torch.export.ExportedProgram) -> list[str]:
    """The graph's calls that need this library or that exporters lack."""
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    return [t for t in targets if "dtype_policies" in t or t == "aten.view.dtype"]


def _check_export(variant: str, warm: bool, grad: bool) -> None:
    batch = torch.export.Dim("batch", min=1, max=64)
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(1))
    tolerance = 1e-6 if "bfloat16" not in variant else 2e-3
    if "W4A8" in variant:  # the kernel sums each group's integer products first
        tolerance = 1e-5
    model = _mlp(variant)
    if warm:
        with torch.no_grad():
            model(x[:3])
    with torch.set_grad_enabled(grad):
        program = torch.export.export(model, (x[:4],), dynamic_shapes=({0: batch},))
    assert _library_ops(program) == []
    for rows in (1, 4, 12):
        with torch.no_grad():
            eager, exported = model(x[:rows]), program.module()(x[:rows])
        assert exported.dtype == eager.dtype
        assert _relative(exported, eager) <= tolerance, rows


@pytest.mark.parametrize(
    "variant",
    ["int8", "int8_weight_only", "int8_from_mixed_bfloat16", "int4/32", "int4/32 W4A8", "float8"],
)
def test_export_with_gradients_equals_eager(variant):
    """Grad-enabled exports (torch.export's default) skipped the activations'
    rounding of eager (int8 weight-only from float32: 3.8e-3 relative, from
    mixed_bfloat16 8.6e-3), at every batch size of a dynamic batch."""
    _check_export(variant, warm=False, grad=True)


@pytest.mark.parametrize("variant", ["mixed_bfloat16", "int4/32"])
def test_export_after_an_eager_call_holds_plain_ops(variant):
    """After one eager call a no-grad export recorded this library's AVX2
    operator (mixed_bfloat16), and the kernels' row thresholds became shape
    guards on a dynamic batch (`Constraints violated`, int4)."""
    _check_export(variant, warm=True, grad=False)


@pytest.mark.slow
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_equals_eager_every_variant(variant, warm, grad):
    _check_export(variant, warm, grad)


def test_export_records_the_straight_through_gradient():
    """With gradients, the exported int8 products' gradient to their inputs
    is the eager one (through the dequantized weight), W8A8 and weight-only."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    for variant in ("int8", "int8_weight_only"):
        model = _mlp(variant)
        program = torch.export.export(model, (x.clone().requires_grad_(True),))
        grads = []
        for run in (model, program.module()):
            leaf = x.clone().requires_grad_(True)
            run(leaf).sum().backward()
            grads.append(leaf.grad)
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


def test_jit_trace_of_float8_saves_and_loads():
    """float8's Python autograd functions were recorded: `jit.save` failed."""
    model = _mlp("float8")
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    traced = torch.jit.trace(model, (x,), check_trace=False)
    buffer = io.BytesIO()
    torch.jit.save(traced, buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_fx_symbolic_trace_keeps_policied_modules_as_leaves():
    """A policied module under `symbolic_trace` is one `call_module` node (its
    call runs by its policy); it raised a raw TypeError on the fx Proxy."""
    model = _mlp("int4/32")
    holder = torch.nn.Sequential(model)  # the root itself not policied
    graph = torch.fx.symbolic_trace(holder)
    called = [n.target for n in graph.graph.nodes if n.op == "call_module"]
    assert "0.0" in called and "0.2" in called
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(graph(x), model(x))


def test_fx_symbolic_trace_of_a_policied_root_says_what_to_use():
    model = _mlp("mixed_bfloat16")
    with pytest.raises(TypeError, match=r"torch\.export\.export.*mixed_bfloat16|mixed_bfloat16"):
        torch.fx.symbolic_trace(model)


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant", ["int8", "int8_weight_only", "int4/32", "int4/32 W4A8", "float8", "float8_dynamic"]
)
def test_onnx_export_runs_on_onnxruntime(variant):
    """ONNX export failed on `aten.view.dtype` (the traced bfloat16 rounding),
    and on dynamic float8's maximum over every dimension left unnamed."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    model = _mlp(variant)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(5))
    program = torch.onnx.export(
        model, (x,), dynamo=True, verbose=False, dynamic_shapes=({0: torch.export.Dim("b")},)
    )
    session = ort.InferenceSession(program.model_proto.SerializeToString())
    for rows in (1, 5):
        out = session.run(None, {session.get_inputs()[0].name: x[:rows].numpy()})[0]
        with torch.no_grad():
            eager = model(x[:rows])
        assert _relative(torch.from_numpy(out), eager) <= (1e-5 if "W4A8" in variant else 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_onnx_export_of_a_quantized_embedding_runs_on_onnxruntime(mode):
    """The int4 table's unpacking shifted int16 values, which the exporter
    writes as an int16 `Where` ONNX Runtime's CPU provider does not have."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 32), torch.nn.Linear(32, 8))
    quantize(model, mode)
    ids = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(2))
    program = torch.onnx.export(model, (ids,), dynamo=True, verbose=False)
    session = ort.InferenceSession(program.model_proto.SerializeToString())
    out = session.run(None, {session.get_inputs()[0].name: ids.numpy()})[0]
    with torch.no_grad():
        assert _relative(torch.from_numpy(out), model(ids)) <= 1e-6


class _Exporting(torch.nn.Module):
    """`x + 1` where `casting.exporting()` holds, `x - 1` elsewhere."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from dtype_policies._core.casting import exporting

        return x + 1 if exporting() else x - 1


TRACERS = {
    "eager": (False, lambda m, x: m(x)),
    "compile": (False, lambda m, x: torch.compile(m, backend="eager", fullgraph=True)(x)),
    "compile_aot": (False, lambda m, x: torch.compile(m, backend="aot_eager", fullgraph=True)(x)),
    "export": (True, lambda m, x: torch.export.export(m, (x,)).module()(x)),
    "export_non_strict": (
        True,
        lambda m, x: torch.export.export(m, (x,), strict=False).module()(x),
    ),
    "jit_trace": (True, lambda m, x: torch.jit.trace(m, (x,), check_trace=False)(x)),
    "fx": (True, lambda m, x: torch.fx.symbolic_trace(m)(x)),
}


@pytest.mark.parametrize("tracer", list(TRACERS))
def test_exporting_holds_under_the_exporters_and_not_under_torch_compile(tracer):
    """On every supported torch (2.6 has no `torch.compiler.is_exporting`):
    `torch.compile` runs the library's own path (its kernels, its autograd
    functions), the exporters the plain one."""
    expected, trace = TRACERS[tracer]
    torch._dynamo.reset()
    out = trace(_Exporting(), torch.zeros(3))
    assert out.tolist() == ([1.0] * 3 if expected else [-1.0] * 3)
