"""CPU classes: the processor description, and the paths chosen from it give
the values they promise on every class this machine can emulate.

In-process emulation (`_cpu.emulate`) switches this library's choices only;
torch's and oneDNN's own kernels keep the machine's instructions. `.ci/run`
also runs the whole suite with torch and oneDNN capped (`ONEDNN_MAX_CPU_ISA`,
`ATEN_CPU_CAPABILITY`), and `test_int8_and_bfloat16_under_real_avx2_caps`
does so for the cases that fail on real AVX2 hardware.
"""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import dtype_policies
from dtype_policies import _compat, _cpu, apply_policy, quantize
from dtype_policies._core import products
from dtype_policies._core.module_state import STATE_KEY
from dtype_policies.quantization import Int4QuantizationConfig, Int8QuantizationConfig
from dtype_policies.quantization.kernels import int4 as int4_kernels
from dtype_policies.quantization.kernels import int8 as int8_kernels
from dtype_policies.quantizers import abs_max_quantize

X86 = _cpu.processor().architecture == "x86_64"
# The classes this machine can stand in for (its own and every smaller one).
CLASSES = [
    name
    for name, features in _cpu.CPU_CLASSES.items()
    if name != "generic" and features <= _cpu.processor().features
]


pytestmark = pytest.mark.filterwarnings("ignore::dtype_policies.CPUFloat16Warning")


@pytest.fixture(params=CLASSES)
def cpu_class(request):
    with _cpu.emulate(request.param) as info:
        yield info


def test_processor_is_read_once_and_describes_itself():
    info = _cpu.processor()
    assert _cpu.processor() is info
    assert info.name in _cpu.CPU_CLASSES and info.name in info.describe()
    assert info.torch_isa == torch.backends.cpu.get_cpu_capability()


@pytest.mark.skipif(not X86, reason="oneDNN's x86 ISA caps")
def test_detect_honours_onednn_isa_cap(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    info = _cpu.detect()
    assert info.features <= _cpu.CPU_CLASSES["avx2"]
    assert not info.exact_int8 and not info.native_bf16 and not info.onednn_bf16
    if info.name == "avx2" and info.capped_by:  # a lowered class names what lowered it:
        # oneDNN's cap, or torch's own when it is set too (it applies first)
        assert "ONEDNN_MAX_CPU_ISA=AVX2" in info.capped_by or any(
            cap.startswith("ATEN_CPU_CAPABILITY") for cap in info.capped_by
        ), info.capped_by


def test_class_variable_names_a_class(monkeypatch):
    monkeypatch.setenv(_cpu.CLASS_VARIABLE, "pentium4")
    with pytest.raises(ValueError, match=r"pentium4.*Expected one of .*'avx2'"):
        _cpu.detect()
    monkeypatch.setenv(_cpu.CLASS_VARIABLE, "AVX2 ")
    assert _cpu.detect().name in ("avx2", "generic")


def test_a_class_beyond_this_cpu_warns_and_stays_within_it():
    foreign = "neon" if X86 else "avx2"
    with pytest.warns(RuntimeWarning, match="cannot use"):
        info = _cpu.detect(foreign)
    assert info.features <= _cpu.CPU_CLASSES[foreign]


def test_emulate_restores_the_detected_processor():
    before = _cpu.processor()
    with _cpu.emulate(CLASSES[0] if CLASSES else "generic") as info:
        assert _cpu.processor() is info
    assert _cpu.processor() is before


def _exact_int8(xq, q_nk):
    return (xq.double() @ q_nk.double().t()).float()


@pytest.mark.parametrize("rows", [0, 1, 3, 16, 40])
@pytest.mark.parametrize("data", ["random", "extreme"])
@pytest.mark.parametrize(("n", "k"), [(48, 200), (512, 520)])  # below / above oneDNN's size
def test_int8_products_are_exact_on_every_class(cpu_class, rows, data, n, k):
    """Extreme data (every activation and weight at +-127) is what saturates
    16-bit pair sums without VNNI."""
    torch.manual_seed(rows)
    if data == "extreme":
        weight = torch.full((n, k), 0.05)
        weight[::2] = -0.05
        x = torch.full((rows, k), 3.0)
        x[:, 1::3] = -3.0
    else:
        weight, x = torch.randn(n, k) * 0.05, torch.randn(rows, k)
    q, scale = abs_max_quantize(weight, axis=1)
    scale = scale[:, 0]
    runtime = int8_kernels.Int8Runtime()
    runtime.refresh(q, scale, lambda data: data, True)
    out = int8_kernels.int8_linear(x, runtime, None, torch.float32)
    xq, xs = abs_max_quantize(x, axis=-1)
    reference = _exact_int8(xq, q) / (xs * scale)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-6)
    assert runtime.exact == cpu_class.exact_int8
    path = runtime.w8a8_path(max(rows, 1))
    large = n * k >= int8_kernels.ONEDNN_MIN_ELEMENTS
    if int8_kernels.native_applies(torch.device("cpu"), cpu_class):
        assert path == "native" and runtime.w8a8_paths() == ("native", "float")
    elif not cpu_class.exact_int8:
        assert path == ("onednn_split" if large and X86 else "float")
    else:
        assert path in (("onednn", "onednn_s8", "int_mm") if large else ("int_mm",))
        signed = int8_kernels.signed_onednn_applies(cpu_class)
        assert (path == "onednn_s8") == (large and signed and rows >= 16)
    for path in runtime.w8a8_paths():  # every exact path the library has here
        forced = int8_kernels.int8_linear(x, runtime, None, torch.float32, path)
        torch.testing.assert_close(forced, reference, atol=1e-5, rtol=1e-6)
    bf16 = int8_kernels.int8_linear(x.bfloat16(), runtime, None, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and bf16.shape == (rows, n)


@pytest.mark.skipif("amx" not in CLASSES, reason="oneDNN's int8 paths by AMX need an AMX CPU")
@pytest.mark.parametrize("takes_int8", [True, False])
def test_int8_activations_go_to_onednn_only_where_torch_takes_them(monkeypatch, takes_int8):
    """torch 2.6's `qlinear_pointwise` refuses int8 activations: there AMX
    keeps uint8 ones at every row count (`_compat`)."""
    if takes_int8 and not _compat.ONEDNN_QLINEAR_TAKES_INT8_ACTIVATIONS:
        pytest.skip(f"torch {torch.__version__}'s qlinear_pointwise refuses int8 activations")
    monkeypatch.setattr(int8_kernels, "ONEDNN_QLINEAR_TAKES_INT8_ACTIVATIONS", takes_int8)
    torch.manual_seed(0)
    q, scale = abs_max_quantize(torch.randn(512, 520) * 0.05, axis=1)
    x = torch.randn(40, 520)
    with _cpu.emulate("amx"):
        runtime = int8_kernels.Int8Runtime()
        runtime.refresh(q, scale[:, 0], lambda data: data, True)
        out = int8_kernels.int8_linear(x, runtime, None, torch.float32)
    assert ("onednn_s8" in runtime.w8a8_paths()) == takes_int8
    assert runtime.w8a8_path(40) == ("onednn_s8" if takes_int8 else "onednn")
    assert runtime.w8a8_path(1) == "onednn"
    xq, xs = abs_max_quantize(x, axis=-1)
    torch.testing.assert_close(out, _exact_int8(xq, q) / (xs * scale[:, 0]), atol=1e-5, rtol=1e-6)
    if not takes_int8:
        with pytest.raises(ValueError, match="'onednn_s8' does not run"):
            int8_kernels.int8_linear(x, runtime, None, torch.float32, "onednn_s8")


def test_exact_float_product_switches_to_float64_beyond_float32_integers():
    k = int8_kernels.FLOAT32_EXACT_TERMS + 7
    xq = torch.full((1, k), 127, dtype=torch.int8)
    q = torch.full((2, k), 127, dtype=torch.int8)
    out = int8_kernels.exact_float_product(xq, q)
    exact = torch.tensor(k * 127 * 127, dtype=torch.float64).float()  # rounded once
    assert out.dtype == torch.float32 and torch.equal(out[0], exact.expand(2))


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "bfloat16", "mixed_float16"])
def test_half_precision_linears_on_every_class(cpu_class, policy):
    """Large enough to be prepacked where that is native (>= 65,536 weights);
    odd K and N; 0, 1, few and many rows; 3-D and strided inputs."""
    torch.manual_seed(0)
    model = nn.Linear(257, 301)
    dtype = torch.float16 if policy == "mixed_float16" else torch.bfloat16
    weight, bias = model.weight.detach().to(dtype).float(), model.bias.detach().to(dtype).float()
    apply_policy(model, policy)
    base = torch.randn(2, 70, 257)
    inputs = [base[0, :0], base[0, :1], base[0, :3], base[0], base, base[:, ::7], base[:, -1]]
    with torch.no_grad():
        for x in inputs:
            out = model(x)
            reference = (x.to(dtype).float() @ weight.t() + bias).to(dtype)
            assert out.dtype == dtype and out.shape == (*x.shape[:-1], 301)
            torch.testing.assert_close(out.float(), reference.float(), atol=2e-2, rtol=1e-2)
    kind = products.product_kind(model.weight.detach().to(dtype), kept=True)
    if not products.native_half_products(dtype, cpu_class):
        assert kind == "float32_products"
    elif dtype is torch.bfloat16 and cpu_class.onednn_bf16:
        assert kind == "onednn_prepacked"


def test_emulated_bfloat16_multiplies_one_row_by_its_weight_and_more_in_float32(cpu_class):
    """Without native bfloat16 products only one row reads the bfloat16 weight
    (by oneDNN where its bfloat16 runs, on a kept weight); two rows already
    multiply in float32 the rounded values. Every path gives the values of a
    bfloat16 product with float32 accumulation, and an input gradient where
    one is asked for (oneDNN's product has none: it is used only without)."""
    if cpu_class.native_bf16:
        pytest.skip("native bfloat16: prepacked oneDNN at every row count")
    torch.manual_seed(0)
    model = nn.Linear(576, 4096)  # above ONEDNN_GEMV_MIN_ELEMENTS
    assert 576 * 4096 >= products.ONEDNN_GEMV_MIN_ELEMENTS
    rounded = model.weight.detach().bfloat16().float()
    bias = model.bias.detach().bfloat16().float()
    apply_policy(model, "mixed_bfloat16")
    x = torch.randn(products.KERNEL_ROWS + 1, 576)
    counts = (1, 2, 3, products.KERNEL_ROWS + 1)
    with torch.no_grad():
        outputs = [model(x[:rows]) for rows in counts[:-1]]
        product = model.__dict__[STATE_KEY].casts.pair[5]
        # the AVX2 kernel multiplies up to KERNEL_ROWS rows by the bfloat16
        # weight; without it torch does one row and float32 products the rest
        assert product.kernel == products.bf16_kernel(cpu_class)
        assert products.FEW_ROWS == 1 and (product._float32 is None) == product.kernel
        outputs.append(model(x))
    assert product.kind == "float32_products" and product._float32 is not None
    assert product.onednn == products.onednn_gemv(torch.bfloat16, cpu_class)
    for rows, out in zip(counts, outputs):
        reference = (x[:rows].bfloat16().float() @ rounded.t() + bias).bfloat16()
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), reference.float(), atol=1e-2, rtol=8e-3)
    x1 = x[:1].clone().requires_grad_()
    model(x1).float().sum().backward()
    expected = (rounded.sum(0)).bfloat16().float()
    torch.testing.assert_close(x1.grad, expected[None], atol=6e-2, rtol=1e-2)
    small = nn.Linear(576, 576)  # below it: torch's product at one row
    apply_policy(small, "mixed_bfloat16")
    with torch.no_grad():
        small(x[:1])
    assert not small.__dict__[STATE_KEY].casts.pair[5].onednn


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_half_precision_training_step_on_every_class(cpu_class, policy):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 8))
    model = copy.deepcopy(reference)
    apply_policy(model, policy)
    x = torch.randn(24, 64)
    dtype = torch.float16 if policy == "mixed_float16" else torch.bfloat16
    with torch.autocast("cpu", dtype=dtype):
        expected = reference(x)
    expected.float().sum().backward()
    out = model(x)
    out.float().sum().backward()
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=2e-2)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert mine.grad.dtype == torch.float32
        torch.testing.assert_close(mine.grad, theirs.grad, atol=5e-2, rtol=3e-2)


VARIANTS = [
    ("float32", None, None),
    ("mixed_bfloat16", None, None),
    ("mixed_float16", None, None),
    ("float32", "int8", None),
    ("mixed_bfloat16", "int8", None),
    ("float32", "int8", Int8QuantizationConfig(activation_quantizer=None)),
    ("mixed_bfloat16", "int8", Int8QuantizationConfig(activation_quantizer=None)),
    ("float32", "int4", None),
    ("mixed_bfloat16", "int4", Int4QuantizationConfig(block_size=40)),
    ("mixed_float16", "int4", Int4QuantizationConfig(block_size=-1)),
    ("float32", "float8", None),
    ("mixed_bfloat16", "float8", None),
    ("mixed_float16", "float8", None),
]


@pytest.mark.parametrize(("source", "mode", "config"), VARIANTS)
def test_every_policy_and_mode_agrees_across_classes(source, mode, config):
    """Each class's paths give the values of the detected class's paths."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(72, 35), nn.GELU(), nn.Linear(35, 300), nn.Linear(300, 260))
    model = copy.deepcopy(base)
    apply_policy(model, source)
    if mode is not None:
        quantize(model, mode, config)
    x = torch.randn(2, 9, 72)
    with torch.inference_mode():
        expected = model(x).float()
        for name in CLASSES:
            with _cpu.emulate(name):
                for rows in (x[:, :1], x):
                    out = model(rows).float()
                    want = expected[:, : rows.shape[1]]
                    error = ((out - want).norm() / want.norm()).item()
                    assert error < (1e-5 if source == "float32" and mode != "int4" else 2e-2), (
                        name,
                        error,
                    )


@pytest.mark.slow
def test_compiled_and_eager_agree_under_an_emulated_class():
    if "avx2" not in CLASSES:
        pytest.skip("no AVX2 on this machine")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    apply_policy(model, "mixed_bfloat16")
    quantize(model, "int8")
    x = torch.randn(20, 64)
    with _cpu.emulate("avx2"), torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model)(x)
    torch.testing.assert_close(compiled.float(), eager.float(), atol=3e-2, rtol=3e-2)


_AVX2_SCRIPT = """
import warnings
import torch, torch.nn as nn
import dtype_policies
from dtype_policies import _cpu, apply_policy, quantize
from dtype_policies.quantization.kernels import int8 as k
from dtype_policies.quantizers import abs_max_quantize
info = _cpu.processor()
assert info.name == "avx2" and not info.exact_int8 and not info.native_bf16, info
for n, K in ((48, 256), (512, 520)):  # the AVX2 kernel, or exact float products / oneDNN split
    w = torch.full((n, K), 0.05); w[::2] = -0.05
    q, s = abs_max_quantize(w, axis=1)
    rt = k.Int8Runtime(); rt.refresh(q, s[:, 0], lambda d: d, True)
    native = k.native_applies(torch.device("cpu"), info)
    paths = ("native", "float") if native else ("onednn_split", "float")
    assert rt.w8a8_paths() == paths, rt.w8a8_paths()
    for rows in (1, 3, 16, 40):
        x = torch.full((rows, K), 2.0); x[:, ::3] = -2.0
        xq, xs = abs_max_quantize(x, axis=-1)
        want = (xq.double() @ q.double().t()).float() / (xs * s[:, 0])
        for path in (None, *rt.w8a8_paths()):
            got = k.int8_linear(x, rt, None, torch.float32, path)
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-6), (n, rows, path)
model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 256))
apply_policy(model, "mixed_bfloat16")
with torch.no_grad():
    assert model(torch.randn(64, 512)).dtype == torch.bfloat16
quantize(model, "int8")
with torch.no_grad():
    assert model(torch.randn(64, 512)).dtype == torch.bfloat16
print("ok")
"""


@pytest.mark.skipif(
    not X86 or "avx2" not in CLASSES or bool(os.environ.get("ONEDNN_MAX_CPU_ISA")),
    reason="needs an x86 CPU with AVX2, not already capped",
)
def test_int8_and_bfloat16_under_real_avx2_caps(tmp_path):
    """torch and oneDNN capped to AVX2 (their saturating int8 kernels, no
    bfloat16 prepacking): int8 stays exact and bfloat16 never crashes."""
    inductor = str(tmp_path / "inductor")  # never a cache shared across classes
    env = {**os.environ, **_cpu.EMULATION["avx2"], "TORCHINDUCTOR_CACHE_DIR": inductor}
    done = subprocess.run(
        [sys.executable, "-c", _AVX2_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def _inspect_model():
    return nn.Sequential(nn.Linear(576, 192), nn.ReLU(), nn.Linear(192, 64))


def test_inspect_prints_the_cpu_class_and_each_layers_kernel(capsys):
    from dtype_policies import cli

    target = f"{__name__}:_inspect_model"
    assert cli.main(["inspect", target, "--policy", "mixed_bfloat16", "--quantize", "int4"]) == 0
    text = capsys.readouterr().out
    assert f"CPU class: {_cpu.processor().name}" in text
    kernel = {"native": "int4 AVX2 kernel (this library's)", "packed": "int4 packed kernel"}
    assert f"0: {kernel[int4_kernels.cpu_kernel()]}, group 64, bfloat16 activations" in text
    with _cpu.emulate(CLASSES[0]):
        assert cli.main(["inspect", target, "--policy", "mixed_bfloat16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cpu"].startswith(CLASSES[0])
    kernels = {row["path"]: row["kernel"] for row in data["modules"]}
    assert kernels["1"] == "-" and kernels["0"] != "-"


@pytest.mark.skipif("avx2" not in CLASSES, reason="no AVX2 on this machine")
def test_advisor_does_not_pick_emulated_bfloat16_for_speed_at_many_rows():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    with _cpu.emulate("avx2"):
        advice = dtype_policies.advise(
            model,
            torch.randn(32, 64),
            max_error=0.05,
            candidates=("mixed_bfloat16",),
            progress=False,
            repeats=1,
        )
    assert all(row.choice == "float32" for row in advice.measured)
    assert all("no native bfloat16 products" in row.note for row in advice.measured)
    assert advice.cpu.startswith("avx2") and "measured on CPU class avx2" in advice.table()
