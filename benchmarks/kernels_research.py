"""Eager CPU kernels for quantized linear layers at Llama shapes.

`python -m benchmarks.kernels_research [--part timing,constraints,properties] [--quick]`

* timing: every eager path for bf16/float32 GEMM, int8 W8A8 dynamic, int8
  weight-only and int4 weight-only, at (K, N) in {1024x1024, 1024x2816,
  2816x1024, 1024x32000} and M in {1, 4, 16, 64, 512}; all paths of one
  (shape, M) are interleaved, `rounds` times, and the median per call is
  reported with its ratio to the bf16 `F.linear` of the same round. Full
  paths take bfloat16 activations and return bfloat16 (they include the
  activation quantization and the rescale); "kernel only" rows time the bare
  op on prepared inputs. Every path is checked against the float32 product
  with the dequantized weight.
* constraints: shape/dtype grids for `_weight_int8pack_mm`, `_int_mm`,
  `_weight_int4pack_mm_for_cpu` and oneDNN `qlinear_pointwise`, each case in
  a worker process so that a segfault is recorded, not fatal.
* properties: per op, does it run under `torch.inference_mode()`, does a
  gradient reach its float input, and does it trace with
  `torch.compile(fullgraph=True)` (each in its own process).

Writes `benchmarks/results/kernels_research.{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from dtype_policies.bench import harness

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = [(1024, 1024), (1024, 2816), (2816, 1024), (1024, 32000)]  # (K, N)
ROWS = [1, 4, 16, 64, 512]
BF16 = torch.bfloat16

# ---------------------------------------------------------------- quantization helpers


def quantize_weight_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel symmetric: (N, K) int8 and the (N,) float32 step
    (`W ~= q * step`)."""
    step = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0
    q = torch.clamp(torch.round(w / step[:, None]), -127, 127).to(torch.int8)
    return q, step


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager per-row symmetric int8 (what the library does without compile)."""
    x = x.float()
    step = (x.abs().amax(dim=-1, keepdim=True) + 1e-7) / 127.0
    return torch.clamp(torch.round(x / step), -127.0, 127.0).to(torch.int8), step


def quantize_rows_uint8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.float()
    step = (x.abs().amax(dim=-1, keepdim=True) + 1e-7) / 127.0
    q = torch.clamp(torch.round(x / step), -127.0, 127.0) + 128.0
    return q.to(torch.uint8), step


def quantize_rows_uint8_inplace(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same values with fewer temporaries: one float copy, in-place ops."""
    xf = x.float()
    step = xf.abs().amax(dim=-1, keepdim=True).add_(1e-7).div_(127.0)
    q = xf.div_(step).round_().add_(128.0).clamp_(1.0, 255.0).to(torch.uint8)
    return q, step


def quantize_weight_int4(w: torch.Tensor, group: int):
    """Asymmetric per group along K: unsigned values in [0, 15] (N, K) and
    bf16 scale/zero (K/group, N) such that `W ~= (u - 8) * scale + zero`
    (the convention of `_weight_int4pack_mm_for_cpu`)."""
    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((hi - lo).clamp_min(1e-8) / 15.0).to(BF16)
    s = scale.float()
    u = torch.clamp(torch.round((wg - lo[..., None]) / s[..., None]), 0, 15).to(torch.int32)
    zero = (lo + 8 * s).to(BF16)  # (u - 8) * s + zero = u * s + lo
    dequant = ((u.float() - 8) * s[..., None] + zero.float()[..., None]).reshape(n, k)
    scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()  # (G, N, 2)
    return u.reshape(n, k).contiguous(), scales_and_zeros, dequant


# ---------------------------------------------------------------- paths


class Case:
    """Inputs of one (M, K, N) shape, shared by the paths."""

    def __init__(self, m: int, k: int, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.m, self.k, self.n = m, k, n
        self.x32 = torch.randn(m, k, generator=g)
        self.xb = self.x32.to(BF16)
        self.w32 = torch.randn(n, k, generator=g) * 0.02
        self.wb = self.w32.to(BF16)
        self.q8, self.step8 = quantize_weight_int8(self.w32)
        self.w8_dequant = self.q8.float() * self.step8[:, None]
        self.q8_t = self.q8.t()  # (K, N) view
        self.q8_kn = self.q8.t().contiguous()


def _onednn_packed(case: Case) -> torch.Tensor:
    return torch.ops.onednn.qlinear_prepack(case.q8, [case.m, case.k])


def _torchao_linear(case: Case, config_name: str) -> torch.nn.Module:
    import torchao.quantization as tq

    linear = torch.nn.Linear(case.k, case.n, bias=False)
    with torch.no_grad():
        linear.weight.copy_(case.w32)
    linear = linear.to(BF16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tq.quantize_(linear, getattr(tq, config_name)())
    return linear


def path_builders() -> dict[str, tuple[str, Callable[[Case], tuple[Callable, torch.Tensor]]]]:
    """name -> (family, build(case) -> (call, reference float32 output))."""
    paths: dict = {}

    def add(name, family):
        def register(build):
            paths[name] = (family, build)
            return build

        return register

    # ---- references
    @add("bf16 F.linear", "reference")
    def _(c):
        return (lambda: F.linear(c.xb, c.wb)), c.xb.float() @ c.wb.float().t()

    @add("fp32 F.linear", "reference")
    def _(c):
        return (lambda: F.linear(c.x32, c.w32)), c.x32 @ c.w32.t()

    @add("bf16 mkldnn._linear_pointwise (prepacked)", "reference")
    def _(c):
        packed = torch.ops.mkldnn._reorder_linear_weight(c.wb, c.m)
        call = lambda: torch.ops.mkldnn._linear_pointwise(c.xb, packed, None, "none", [], "")  # noqa: E731
        return call, c.xb.float() @ c.wb.float().t()

    @add("fp32 mkl._mkl_linear (prepacked)", "reference")
    def _(c):
        packed = torch.ops.mkl._mkl_reorder_linear_weight(c.w32, c.m)
        call = lambda: torch.ops.mkl._mkl_linear(c.x32, packed, c.w32, None, c.m)  # noqa: E731
        return call, c.x32 @ c.w32.t()

    # ---- int8 W8A8 dynamic: kernels alone
    ref8 = lambda c: c.xb.float() @ c.w8_dequant.t()  # noqa: E731

    @add("int8 _int_mm kernel only (s8 x s8 -> s32)", "int8 dyn kernel")
    def _(c):
        xq, _ = quantize_rows_int8(c.xb)
        return (lambda: torch._int_mm(xq, c.q8_t)), None

    @add("int8 _int_mm kernel only, (K,N) contiguous weight", "int8 dyn kernel")
    def _(c):
        xq, _ = quantize_rows_int8(c.xb)
        return (lambda: torch._int_mm(xq, c.q8_kn)), None

    @add("int8 onednn.qlinear_pointwise kernel only (u8, fp32 out)", "int8 dyn kernel")
    def _(c):
        packed = _onednn_packed(c)
        xq, _ = quantize_rows_uint8(c.xb)
        zp = torch.zeros(1, dtype=torch.int32)
        step = c.step8.contiguous()

        def call():
            return torch.ops.onednn.qlinear_pointwise(
                xq, 1.0, 128, packed, step, zp, None, 1.0, 0, torch.float32, "none", [], ""
            )

        return call, None

    @add("int8 onednn.qlinear_pointwise kernel only (u8, bf16 out)", "int8 dyn kernel")
    def _(c):
        packed = _onednn_packed(c)
        xq, _ = quantize_rows_uint8(c.xb)
        zp = torch.zeros(1, dtype=torch.int32)
        step = c.step8.contiguous()

        def call():
            return torch.ops.onednn.qlinear_pointwise(
                xq, 1.0, 128, packed, step, zp, None, 1.0, 0, BF16, "none", [], ""
            )

        return call, None

    @add("int8 onednn.qlinear_pointwise kernel only (s8 act, zp 0, bf16 out)", "int8 dyn kernel")
    def _(c):
        packed = _onednn_packed(c)
        xq, _ = quantize_rows_int8(c.xb)
        zp = torch.zeros(1, dtype=torch.int32)
        step = c.step8.contiguous()

        def call():
            return torch.ops.onednn.qlinear_pointwise(
                xq, 1.0, 0, packed, step, zp, None, 1.0, 0, BF16, "none", [], ""
            )

        return call, None

    # ---- int8 W8A8 dynamic: element-wise passes alone
    @add("int8 eager per-row quantize to u8 (library, 7 ops)", "int8 dyn epilogue")
    def _(c):
        return (lambda: quantize_rows_uint8(c.xb)), None

    @add("int8 eager per-row quantize to u8 (in-place, 6 ops)", "int8 dyn epilogue")
    def _(c):
        return (lambda: quantize_rows_uint8_inplace(c.xb)), None

    @add("int8 quantize_per_tensor_dynamic (fused, fp32 in) + int_repr", "int8 dyn epilogue")
    def _(c):
        return (
            lambda: torch.quantize_per_tensor_dynamic(c.x32, torch.quint8, False).int_repr()
        ), None

    @add("int8 eager rescale fp32 (M,N) * row * col -> bf16", "int8 dyn epilogue")
    def _(c):
        y = torch.randn(c.m, c.n)
        rs, cs = torch.rand(c.m, 1), torch.rand(c.n)
        return (lambda: (y * rs * cs).to(BF16)), None

    @add("int8 eager rescale bf16 (M,N) *= row (in place)", "int8 dyn epilogue")
    def _(c):
        y = torch.randn(c.m, c.n).to(BF16)
        rs = torch.rand(c.m, 1).to(BF16)
        return (lambda: y.mul_(rs)), None

    # ---- int8 W8A8 dynamic: full paths (bf16 in, bf16 out)
    @add("int8 dyn: eager quant + _int_mm + eager rescale", "int8 dyn")
    def _(c):
        def call():
            xq, xs = quantize_rows_int8(c.xb)
            return (torch._int_mm(xq, c.q8_t).float() * xs * c.step8).to(BF16)

        return call, ref8(c)

    @add("int8 dyn: eager quant + onednn u8 fp32-out + rescale (library)", "int8 dyn")
    def _(c):
        packed = _onednn_packed(c)
        zp = torch.zeros(1, dtype=torch.int32)
        step = c.step8.contiguous()

        def call():
            xq, xs = quantize_rows_uint8(c.xb)
            y = torch.ops.onednn.qlinear_pointwise(
                xq, 1.0, 128, packed, step, zp, None, 1.0, 0, torch.float32, "none", [], ""
            )
            return (y * xs).to(BF16)

        return call, ref8(c)

    @add("int8 dyn: in-place quant + onednn u8 bf16-out + row mul_", "int8 dyn")
    def _(c):
        packed = _onednn_packed(c)
        zp = torch.zeros(1, dtype=torch.int32)
        step = c.step8.contiguous()

        def call():
            xq, xs = quantize_rows_uint8_inplace(c.xb)
            y = torch.ops.onednn.qlinear_pointwise(
                xq, 1.0, 128, packed, step, zp, None, 1.0, 0, BF16, "none", [], ""
            )
            return y.mul_(xs.to(BF16))

        return call, ref8(c)

    @add("int8 dyn: per-tensor quant + onednn fully fused (x_scale in op, bf16 out)", "int8 dyn")
    def _(c):
        # Per-tensor activation scale: equal to per-row when M == 1.
        packed = _onednn_packed(c)
        zp = torch.zeros(1, dtype=torch.int32)
        step = c.step8.contiguous()

        def call():
            xf = c.xb.float()
            s = xf.abs().amax().add_(1e-7).div_(127.0)
            xq = xf.div_(s).round_().add_(128.0).clamp_(1.0, 255.0).to(torch.uint8)
            return torch.ops.onednn.qlinear_pointwise(
                xq, s.item(), 128, packed, step, zp, None, 1.0, 0, BF16, "none", [], ""
            )

        # reference with per-tensor activation quantization
        xf = c.xb.float()
        s = (xf.abs().amax() + 1e-7) / 127.0
        xd = torch.clamp(torch.round(xf / s), -127, 127) * s
        return call, xd @ c.w8_dequant.t()

    @add("int8 dyn: quantize_per_tensor_dynamic + onednn fused (asym, bf16 out)", "int8 dyn")
    def _(c):
        packed = _onednn_packed(c)
        zp = torch.zeros(1, dtype=torch.int32)
        step = c.step8.contiguous()

        def call():
            qx = torch.quantize_per_tensor_dynamic(c.xb.float(), torch.quint8, False)
            return torch.ops.onednn.qlinear_pointwise(
                qx.int_repr(),
                qx.q_scale(),
                qx.q_zero_point(),
                packed,
                step,
                zp,
                None,
                1.0,
                0,
                BF16,
                "none",
                [],
                "",
            )

        qx = torch.quantize_per_tensor_dynamic(c.xb.float(), torch.quint8, False)
        return call, qx.dequantize() @ c.w8_dequant.t()

    def _dynamic(c, engine):
        previous = torch.backends.quantized.engine
        torch.backends.quantized.engine = engine
        try:
            wq = torch.quantize_per_channel(
                c.w8_dequant, c.step8.double(), torch.zeros(c.n, dtype=torch.long), 0, torch.qint8
            )
            packed = torch.ops.quantized.linear_prepack(wq, None)
        finally:
            torch.backends.quantized.engine = previous

        def call():
            return torch.ops.quantized.linear_dynamic(c.xb.float(), packed, False).to(BF16)

        return call, ref8(c)

    @add("int8 dyn: quantized.linear_dynamic, x86 engine (fp32 in, per-tensor)", "int8 dyn")
    def _(c):
        return _dynamic(c, "x86")

    @add("int8 dyn: quantized.linear_dynamic, fbgemm engine", "int8 dyn")
    def _(c):
        return _dynamic(c, "fbgemm")

    @add("int8 dyn: quantized.linear_dynamic, onednn engine", "int8 dyn")
    def _(c):
        return _dynamic(c, "onednn")

    @add("int8 dyn: library kernels.int8_linear, DTYPE_POLICIES_COMPILE=0", "int8 dyn")
    def _(c):
        return _library_int8(c, compiled=False), ref8(c)

    @add("int8 dyn: library kernels.int8_linear, compiled epilogues", "int8 dyn")
    def _(c):
        return _library_int8(c, compiled=True), ref8(c)

    @add("int8 dyn: torchao Int8DynamicActivationInt8Weight (eager)", "int8 dyn")
    def _(c):
        linear = _torchao_linear(c, "Int8DynamicActivationInt8WeightConfig")
        return (lambda: linear(c.xb)), ref8(c)

    # ---- int8 weight-only
    @add("int8 w-only: aten._weight_int8pack_mm", "int8 weight-only")
    def _(c):
        if not int8pack_safe(c.m, c.k, c.n):
            raise RuntimeError("skipped: unsafe shape (see constraints)")
        scales = c.step8.to(BF16)
        return (lambda: torch.ops.aten._weight_int8pack_mm(c.xb, c.q8, scales)), ref8(c)

    @add("int8 w-only: cast weight to bf16 + F.linear + col scale", "int8 weight-only")
    def _(c):
        scales = c.step8.to(BF16)
        return (lambda: F.linear(c.xb, c.q8.to(BF16)).mul_(scales)), ref8(c)

    @add("int8 w-only: torchao Int8WeightOnly (eager)", "int8 weight-only")
    def _(c):
        linear = _torchao_linear(c, "Int8WeightOnlyConfig")
        return (lambda: linear(c.xb)), ref8(c)

    # ---- int4 weight-only
    for group in (32, 64, 128, 256):

        def int4pack(c, group=group):
            if c.k % group:
                raise RuntimeError(f"K % {group} != 0")
            u, sz, dq = quantize_weight_int4(c.w32, group)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)

            def call():
                return torch.ops.aten._weight_int4pack_mm_for_cpu(c.xb, packed, group, sz)

            return call, c.xb.float() @ dq.t()

        add(f"int4/{group}: aten._weight_int4pack_mm_for_cpu", "int4")(int4pack)

    @add("int4/128: _weight_int4pack_mm_for_cpu, non-contiguous x", "int4")
    def _(c):
        u, sz, dq = quantize_weight_int4(c.w32, 128)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
        xt = c.xb.t().contiguous().t()  # same values, column-major

        def call():
            return torch.ops.aten._weight_int4pack_mm_for_cpu(xt, packed, 128, sz)

        return call, c.xb.float() @ dq.t()

    @add("int4/128: dequantize to bf16 (per call) + F.linear", "int4")
    def _(c):
        u, sz, dq = quantize_weight_int4(c.w32, 128)
        n, k = u.shape
        q = (u - 8).to(torch.int8).reshape(n, k // 128, 128)
        scale = sz[..., 0].t().contiguous()[..., None]  # (N, G, 1)
        zero = sz[..., 1].t().contiguous()[..., None]

        def call():
            w = torch.addcmul(zero, q.to(BF16), scale).reshape(n, k)
            return F.linear(c.xb, w)

        return call, c.xb.float() @ dq.t()

    @add("int4/128: library kernels.int4_linear", "int4")
    def _(c):
        from dtype_policies.quantization.kernels import int4
        from dtype_policies.quantizers import grouped_quantize_with_zero_point

        q_kn, scale, zero = grouped_quantize_with_zero_point(c.w32.t(), 128)
        q_nk = q_kn.t().contiguous()
        runtime = int4.Int4Runtime()
        runtime.refresh(q_nk, scale, zero, 128, (q_nk, scale, zero))
        dq = int4.dequantize_int4(q_nk, scale, zero, 128)

        def call():
            return int4.int4_linear(c.xb, q_nk, scale, zero, 128, None, BF16, runtime)

        return call, c.xb.float() @ dq.t()

    return paths


def _library_int8(c, compiled: bool):
    """The library's W8A8 kernel on the case's weight (`W = q8 * step8`, i.e.
    Keras's scale `1 / step8`), with the epilogues compiled or eager."""
    from dtype_policies.quantization.kernels import epilogues, int8

    runtime = int8.Int8Runtime()
    runtime.refresh(c.q8, 1.0 / c.step8, lambda q: q, prepack=True)

    def call():
        previous = epilogues.compile_epilogues_enabled()
        epilogues.set_compile_epilogues(compiled)
        try:
            return int8.int8_linear(c.xb, runtime, None, BF16)
        finally:
            epilogues.set_compile_epilogues(previous)

    return call


def int8pack_safe(m: int, k: int, n: int) -> bool:
    """Where bf16 `_weight_int8pack_mm` was found safe by the constraints part:
    K % 16 == 0 (and the activation's data pointer 32-byte aligned); otherwise
    it segfaults for M >= 2 and returns garbage for M == 1, at every N."""
    return k % 16 == 0


# ---------------------------------------------------------------- timing


def time_cell(calls: dict[str, Callable], rounds: int, target_s: float = 0.004) -> dict:
    """Seconds per call of each path in each round (the suite's interleaved timer;
    a sample is as many calls as take `target_s`)."""
    samples = harness.measure_interleaved(
        calls, warmup=1, repeats=rounds, rounds=rounds, min_sample_s=target_s
    )
    return {name: [times[0] for times in per_round] for name, per_round in samples.items()}


def run_timing(shapes, rows, rounds, paths_filter=None) -> list[dict]:
    paths = path_builders()
    rows_out = []
    for k, n in shapes:
        for m in rows:
            case = Case(m, k, n)
            calls, errors, notes = {}, {}, {}
            for name, (_family, build) in paths.items():
                if paths_filter and not any(p in name for p in paths_filter):
                    continue
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        call, reference = build(case)
                        out = call()
                    if reference is not None:
                        out = out[0] if isinstance(out, tuple) else out
                        err = (out.float() - reference).norm() / reference.norm()
                        notes[name] = f"rel.err {err.item():.1e}"
                        if not err < 0.05:
                            notes[name] += " WRONG"
                    calls[name] = call
                except Exception as e:
                    errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
            per_round = time_cell(calls, rounds)
            base = per_round["bf16 F.linear"]
            for name, times in per_round.items():
                ratios = [b / t for b, t in zip(base, times)]
                rows_out.append(
                    {
                        "path": name,
                        "family": paths[name][0],
                        "K": k,
                        "N": n,
                        "M": m,
                        "median_us": statistics.median(times) * 1e6,
                        "x_bf16": statistics.median(ratios),
                        "note": notes.get(name, ""),
                    }
                )
            for name, error in errors.items():
                rows_out.append(
                    {
                        "path": name,
                        "family": paths[name][0],
                        "K": k,
                        "N": n,
                        "M": m,
                        "median_us": None,
                        "x_bf16": None,
                        "note": error,
                    }
                )
            done = [r for r in rows_out if r["K"] == k and r["N"] == n and r["M"] == m]
            print(f"\n### K={k} N={n} M={m}", flush=True)
            for r in done:
                t = "-" if r["median_us"] is None else f"{r['median_us']:.1f}"
                x = "-" if r["x_bf16"] is None else f"{r['x_bf16']:.2f}"
                print(f"| {r['path']} | {t} | {x} | {r['note']} |", flush=True)
    return rows_out


# ---------------------------------------------------------------- constraints (worker processes)

_WORKER = r"""
import sys, torch, json
torch.set_num_threads(2)
from benchmarks.kernels_research import constraint_case
for line in open(sys.argv[1]):
    case = json.loads(line)
    print("START", flush=True)
    try:
        result = constraint_case(case)
    except Exception as e:
        result = "error: " + (type(e).__name__ + ": " + str(e)).splitlines()[0][:120]
    print("DONE", json.dumps(result), flush=True)
"""


def constraint_case(case: dict) -> str:
    """Runs one case of an op; returns "ok", "ok WRONG (err)" or raises."""
    op, m, k, n = case["op"], case["M"], case["K"], case["N"]
    dtype = getattr(torch, case.get("dtype", "bfloat16"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dtype)
    offset = case.get("offset", 0)
    if offset:  # the same values at a storage offset of `offset` elements
        x = torch.cat([torch.zeros(offset, dtype=dtype), x.reshape(-1)])[offset:].view(m, k)
    w = torch.randn(n, k, generator=g) * 0.02
    if op == "int8pack":
        q, step = quantize_weight_int8(w)
        y = torch.ops.aten._weight_int8pack_mm(x, q, step.to(dtype))
        ref = x.float() @ (q.float() * step[:, None].to(dtype).float()).t()
    elif op == "int_mm":
        xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
        wq = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=g)
        y = torch._int_mm(xq, wq)
        ref = (xq.double() @ wq.double()).float()
    elif op == "int4pack":
        group = case["group"]
        u, sz, dq = quantize_weight_int4(w, group)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
        if case.get("noncontig"):
            x = x.t().contiguous().t()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz.to(dtype))
        ref = x.float() @ dq.t()
    elif op == "qlinear":
        q, step = quantize_weight_int8(w)
        packed = torch.ops.onednn.qlinear_prepack(q, [m, k])
        if case.get("act") == "s8":
            xq, xs = quantize_rows_int8(x)
            zp = 0
        else:
            xq, xs = quantize_rows_uint8(x)
            zp = 128
        out_dtype = getattr(torch, case.get("out", "float32"))
        y = torch.ops.onednn.qlinear_pointwise(
            xq,
            1.0,
            zp,
            packed,
            step,
            torch.zeros(1, dtype=torch.int32),
            None,
            1.0,
            0,
            out_dtype,
            "none",
            [],
            "",
        )
        y = y.float() * xs
        ref = x.float() @ (q.float() * step[:, None]).t()
    else:
        raise ValueError(op)
    err = ((y.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    return "ok" if err < 0.02 else f"WRONG rel.err {err:.2e}"


def run_cases(cases: list[dict]) -> list[str]:
    """Runs cases in a worker process, restarting it after a crash (the case
    that crashed is reported with its signal)."""
    results: list[str] = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    while len(results) < len(cases):
        pending = cases[len(results) :]
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            f.write("".join(json.dumps(c) + "\n" for c in pending))
        proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, f.name],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        started = False
        for line in proc.stdout:
            if line.startswith("START"):
                started = True
            elif line.startswith("DONE"):
                results.append(json.loads(line[5:]))
                started = False
        code = proc.wait()
        os.unlink(f.name)
        if len(results) < len(cases):
            results.append(f"CRASH (exit {code})" if started else f"worker exit {code}")
    return results


def constraint_grids(quick: bool) -> list[dict]:
    cases = []
    ms = (
        [1, 2, 3, 4, 5, 8, 15, 16, 17, 64]
        if quick
        else [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 32, 64, 512]
    )
    ks = [8, 16, 24, 32, 48, 1000, 1008, 1016, 1020, 1024, 1025, 2816]
    for dtype in ("bfloat16", "float16", "float32"):
        for k in ks if dtype == "bfloat16" else [1000, 1024]:
            for n in [1024, 1000, 17] if dtype == "bfloat16" else [1024]:
                for m in ms:
                    cases.append({"op": "int8pack", "M": m, "K": k, "N": n, "dtype": dtype})
    for offset in (1, 8, 16, 32):
        for m in [1, 3, 16]:
            for k in [1024, 1000]:
                cases.append({"op": "int8pack", "M": m, "K": k, "N": 1024, "offset": offset})
    for m in [1, 2, 16, 17, 32]:
        for k in [1, 7, 8, 16, 17, 1000, 1024]:
            for n in [1, 7, 8, 17, 1024]:
                cases.append({"op": "int_mm", "M": m, "K": k, "N": n, "dtype": "float32"})
    for group in (16, 32, 64, 128, 256, 512):
        for k in [256, 1024, 2816, 1000, 96, 160]:
            for n in [1024, 1008, 1000, 17, 32]:
                for m in [1, 3, 16, 512]:
                    if k % group and group != 32:
                        continue
                    cases.append({"op": "int4pack", "M": m, "K": k, "N": n, "group": group})
    for dtype in ("bfloat16", "float16", "float32"):
        for m in [1, 16]:
            cases.append(
                {"op": "int4pack", "M": m, "K": 1024, "N": 1024, "group": 128, "dtype": dtype}
            )
    for m in [1, 16, 512]:
        cases.append({"op": "int4pack", "M": m, "K": 1024, "N": 1024, "group": 128, "noncontig": 1})
        for offset in (1, 8):
            cases.append(
                {"op": "int4pack", "M": m, "K": 1024, "N": 1024, "group": 128, "offset": offset}
            )
    for act in ("u8", "s8"):
        for out in ("float32", "bfloat16"):
            for k in [1000, 1017, 1024]:
                for n in [17, 1000, 1024]:
                    for m in [1, 3, 16]:
                        cases.append(
                            {"op": "qlinear", "M": m, "K": k, "N": n, "act": act, "out": out}
                        )
    return cases


# ---------------------------------------------------------------- properties

_PROPERTY = r"""
import sys, json, torch, warnings
warnings.simplefilter("ignore")
torch.set_num_threads(2)
from benchmarks.kernels_research import property_call
name, check, m = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    print("RESULT", property_call(name, check, m))
except Exception as e:
    print("RESULT", "no: " + (type(e).__name__ + ": " + str(e)).splitlines()[0][:150])
"""

PROPERTY_OPS = [
    "bf16 F.linear",
    "int8 _int_mm kernel only (s8 x s8 -> s32)",
    "int8 dyn: eager quant + _int_mm + eager rescale",
    "int8 dyn: in-place quant + onednn u8 bf16-out + row mul_",
    "int8 dyn: quantized.linear_dynamic, x86 engine (fp32 in, per-tensor)",
    "int8 dyn: library kernels.int8_linear, DTYPE_POLICIES_COMPILE=0",
    "int8 dyn: torchao Int8DynamicActivationInt8Weight (eager)",
    "int8 w-only: aten._weight_int8pack_mm",
    "int8 w-only: torchao Int8WeightOnly (eager)",
    "int4/128: aten._weight_int4pack_mm_for_cpu",
    "int4/128: library kernels.int4_linear",
]


def property_call(name: str, check: str, m: int) -> str:
    """One property of one path at K = N = 1024 with M rows."""
    _family, build = path_builders()[name]
    case = Case(m, 1024, 1024)
    if check == "inference_mode":
        call, _ = build(case)  # weights prepared outside, as a loaded model's are
        with torch.inference_mode():
            case.xb = torch.randn(m, 1024).to(BF16)
            case.x32 = case.xb.float()
            call()
            call()
        return "yes"
    if check == "autograd":
        call, _ = build(case)
        case.xb = case.xb.clone().requires_grad_(True)
        case.x32 = case.x32.clone().requires_grad_(True)
        out = call()
        out = out[0] if isinstance(out, tuple) else out
        if not out.requires_grad:
            return "no: output has no grad_fn (not differentiable)"
        out.float().sum().backward()
        grad = case.xb.grad if case.xb.grad is not None else case.x32.grad
        if grad is None:
            return "no: no gradient reached the input"
        if grad.abs().sum() == 0:
            return "no: gradient is zero (round has zero derivative)"
        return "yes"
    if check == "compile":
        call, _ = build(case)
        torch.compiler.reset()
        compiled = torch.compile(lambda: call(), fullgraph=True)
        compiled()
        compiled()
        return "yes"
    raise ValueError(check)


def run_properties(ops: list[str]) -> dict:
    results: dict = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for name in ops:
        results[name] = {}
        for check, m in (("inference_mode", 1), ("autograd", 16), ("compile", 16)):
            try:
                done = subprocess.run(
                    [sys.executable, "-c", _PROPERTY, name, check, str(m)],
                    capture_output=True,
                    text=True,
                    timeout=600,
                    env=env,
                )
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")]
                out = lines[-1][7:] if lines else f"process exit {done.returncode}"
            except subprocess.TimeoutExpired:
                out = "timeout"
            results[name][check] = out
            print(f"| {name} | {check} M={m} | {out} |", flush=True)
    return results


# ---------------------------------------------------------------- report


def markdown(data: dict) -> str:
    """Per (K, N): one row per path, one column per M, "us (x bf16)"."""
    out = []
    timing = data.get("timing", [])
    order = {shape: index for index, shape in enumerate(SHAPES)}
    shapes = sorted({(r["K"], r["N"]) for r in timing}, key=lambda s: (order.get(s, len(order)), s))
    for k, n in shapes:
        cells = [r for r in timing if (r["K"], r["N"]) == (k, n)]
        rows = sorted({r["M"] for r in cells})
        out += [f"**K={k} N={n}**: median us per call (x bf16 F.linear)", ""]
        out.append("| path | " + " | ".join(f"M={m}" for m in rows) + " |")
        out.append("|---|" + "---:|" * len(rows))
        paths = list(dict.fromkeys(r["path"] for r in cells))
        for path in paths:
            entries = []
            for m in rows:
                r = next((r for r in cells if r["path"] == path and r["M"] == m), None)
                if r is None or r["median_us"] is None:
                    entries.append("-" if r is None else "err")
                else:
                    flag = " WRONG" if "WRONG" in r["note"] else ""
                    entries.append(f"{r['median_us']:.0f} ({r['x_bf16']:.2f}){flag}")
            out.append(f"| {path} | " + " | ".join(entries) + " |")
        out.append("")
    bad = [c for c in data.get("constraints", []) if c["result"] != "ok"]
    if data.get("constraints"):
        out += ["**Constraint cases that are not ok**", "", "| case | result |", "|---|---|"]
        for c in bad:
            case = ", ".join(f"{key}={v}" for key, v in c.items() if key != "result")
            out.append(f"| {case} | {c['result']} |")
        out.append("")
    if data.get("properties"):
        out += [
            "**Properties** (K=N=1024)",
            "",
            "| path | inference_mode (M=1) | autograd to x (M=16) | compile fullgraph (M=16) |",
            "|---|---|---|---|",
        ]
        for name, checks in data["properties"].items():
            out.append(
                f"| {name} | {checks.get('inference_mode')} | {checks.get('autograd')} | "
                f"{checks.get('compile')} |"
            )
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="timing,constraints,properties")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--paths", default="", help="comma-separated substrings of path names")
    parser.add_argument("--shapes", default="", help="e.g. 1024x1024,1024x32000 (K x N)")
    parser.add_argument("--rows", default="", help="e.g. 1,16")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    parts = args.part.split(",")
    shapes = (
        [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        if args.shapes
        else SHAPES
    )
    rows = [int(v) for v in args.rows.split(",")] if args.rows else ROWS
    data: dict = {"torch": torch.__version__, "threads": args.threads}
    if "timing" in parts:
        print("## timing: path | median us | x bf16 F.linear | check", flush=True)
        filters = [p for p in args.paths.split(",") if p]
        data["timing"] = run_timing(shapes, rows, 3 if args.quick else args.rounds, filters)
    if "constraints" in parts:
        cases = constraint_grids(args.quick)
        results = run_cases(cases)
        data["constraints"] = [{**c, "result": r} for c, r in zip(cases, results)]
        print("\n## constraints (cases that are not ok)", flush=True)
        for c, r in zip(cases, results):
            if r != "ok":
                print(c, r, flush=True)
    if "properties" in parts:
        print("\n## properties", flush=True)
        data["properties"] = run_properties(PROPERTY_OPS)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    suffix = "" if set(parts) == {"timing", "constraints", "properties"} else "_" + "_".join(parts)
    with open(output / f"kernels_research{suffix}.json", "w") as f:
        json.dump(data, f, indent=1)
    (output / f"kernels_research{suffix}.md").write_text(markdown(data))
    print(f"\nWrote {output / f'kernels_research{suffix}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
