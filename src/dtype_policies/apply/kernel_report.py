"""Which product path each layer runs by on this CPU, for `inspect`, `bench`
and the docs: the same choices the kernels make (`_core.products`,
`quantization.kernels`), stated without running anything.

>>> import torch
>>> import dtype_policies
>>> from dtype_policies.apply.kernel_report import kernel_of
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 32))
>>> _ = dtype_policies.apply_policy(model, "float32")
>>> kernel_of(model[0])
'F.linear float32'
>>> kernel_of(model)
'-'
"""

from __future__ import annotations

from typing import cast

import torch

from dtype_policies import _native as native
from dtype_policies._core import products
from dtype_policies._core.compose import original_class
from dtype_policies._core.module_state import state_of
from dtype_policies._core.policy_module import fast_forward_of
from dtype_policies._cpu import Processor, processor
from dtype_policies.layers.dense import Dense
from dtype_policies.quantization.attach import quantization_of
from dtype_policies.quantization.kernels import int4, int4_native, int8, int8_native
from dtype_policies.quantization.schemes.base import QuantizedWeight


def _float_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The weight of a linear leaf that casts its own weights, if any."""
    if fast_forward_of(original_class(module)) is not None:
        return module._parameters.get("weight")
    if isinstance(module, Dense) and module._casts_own_weights:
        return module._parameters.get("kernel")
    return None


def kernel_of(module: torch.nn.Module) -> str:
    """The product path `module` runs by here, or `"-"` for modules without
    a linear product of their own."""
    state = state_of(module)
    if state is None or state.call is None:
        return "-"
    compute = state.call.compute
    quantized = quantization_of(module)
    if quantized is not None:
        # (a quantized policy computes in a floating dtype)
        return _quantized(module, quantized, cast(torch.dtype, compute))
    weight = _float_weight(module)
    if weight is None or compute is None or weight.dim() != 2:
        return "-"
    kind = products.kind_for(compute, weight.device, weight.numel())
    return products.describe(kind, compute, weight.numel())


def _quantized(module: torch.nn.Module, qw: QuantizedWeight, compute: torch.dtype) -> str:
    spec, config = qw.spec, qw.config
    if spec.role != "linear":
        return f"{qw.mode} lookup"
    device = next((b.device for b in module._buffers.values() if b is not None), None)
    on_cpu = device is not None and device.type == "cpu"
    cpu = processor()
    blocks = getattr(config, "activation_block_size", None)
    if qw.mode == "int8" and config.own_input_rounding:
        return "inputs rounded to int8 by the config's activation quantizer, float64 products"
    if qw.mode == "int8" and blocks is not None:
        weight_block = getattr(config, "block_size", None)
        weights = "" if weight_block is None else f", weight steps per {weight_block}"
        if device is not None and int8.blocked_kernel_applies(device):
            amx = ""
            if int8_native.blocked_suffix(cpu) == "amx":
                amx = f", its AMX copy from {int8_native.AMX_MIN_ROWS} rows"
            return (
                f"int8 {_instructions(cpu)} kernel{amx}, inputs rounded to int8 per {blocks}"
                f"{weights} (this library's)"
            )
        return (
            f"inputs rounded to int8 per {blocks}, times the int8 weight in floating point"
            + weights
        )
    if qw.mode == "int8" and config.weight_only:
        few = int8.WEIGHT_INT8PACK_MAX_ROWS
        if device is None or not on_cpu:
            return "int8 weight cast to the compute dtype per call"
        multiple = spec.in_features % 16 == 0 and spec.out_features % 16 == 0
        products_in = compute
        rest = ""
        if compute is torch.float32:  # `int8.bfloat16_rounded_product`
            products_in = torch.bfloat16
            rest = "inputs and sums rounded to bfloat16, "
        if products.native_half_products(products_in, cpu):
            rest += f"{str(products_in).removeprefix('torch.')} products"
        else:
            rest += "float32 products"
        half = compute in (torch.bfloat16, torch.float16)
        head = ""
        if multiple and half:
            head = f"_weight_int8pack_mm up to {few} rows, then "
        elif multiple and compute is torch.float32:
            rows = int8.float32_int8pack_max_rows(device, cpu)
            head = f"_weight_int8pack_mm on bfloat16-rounded inputs up to {rows} rows, then "
        return f"{head}int8 weight cast per call in cache-sized chunks, {rest}"
    if qw.mode == "int8":
        large = spec.in_features * spec.out_features >= int8.ONEDNN_MIN_ELEMENTS
        exact = cpu.exact_int8 or not on_cpu
        if device is not None and int8.native_applies(device, cpu):
            return "int8 AVX2 s8 x s8 kernel (this library's; exact without VNNI)"
        if on_cpu and int8.onednn_int8_applies(cast(torch.device, device), cpu) and large:
            if not exact:
                return "oneDNN u8 x s8 on sign-split activations (exact without VNNI)"
            if int8.signed_onednn_applies(cpu):
                return f"oneDNN u8 x s8 (AMX), s8 x s8 from {int8.ONEDNN_S8_MIN_ROWS} rows"
            if cpu.amx:
                return "oneDNN u8 x s8 (AMX)"
            return f"oneDNN u8 x s8 (VNNI) from {int8.ONEDNN_MIN_ROWS} rows, torch._int_mm below"
        return "torch._int_mm" if exact else "exact float products (no VNNI)"
    if qw.mode == "int4":
        if not on_cpu:
            return "int4 dequantized per call"
        layout = int4.Int4Layout.plan(spec.in_features, config.group_size)
        blocks = getattr(config, "activation_block_size", None)
        chosen = int4.cpu_kernel(blocks)
        if blocks is not None and chosen is None:
            return f"int4 W4A8: inputs rounded to int8 per {blocks}, dequantized per call"
        own_kernel = chosen in ("native", "native_q8")
        if blocks is not None:
            kernel = f"int4 {_instructions(cpu)} W4A8 kernel (this library's)"
            inputs = f"inputs rounded to int8 per {blocks}, integer products"
            if int4_native.q8_suffix(cpu) == "amx":
                inputs += f", its AMX copy from {int4_native.Q8_AMX_MIN_ROWS} rows"
        else:
            kernel = "int4 AVX2 kernel (this library's)" if own_kernel else "int4 packed kernel"
            inputs = "bfloat16 activations"
        text = f"{kernel}, group {layout.group}, {inputs}"
        if layout.spread:
            text += f", blocks padded to {layout.stride}"
        elif layout.padded_k != spec.in_features:
            text += f", K padded to {layout.padded_k}"
        if spec.out_features % 16 and not own_kernel:
            text += ", N padded to a multiple of 16"
        decoded_from = None
        if chosen is not None:
            elements = layout.padded_k * spec.out_features
            decoded_from = int4.decoded_min_rows(chosen, cpu, elements)
        if decoded_from is not None:
            gemms = "float32" if own_kernel else "bfloat16"
            text += f"; from {decoded_from} rows decoded into {gemms} GEMMs"
        from_rows = int4.dequantized_min_rows(spec.in_features * spec.out_features, cpu)
        if config.group_size <= 0 and from_rows is not None:
            text += f"; from {from_rows} rows one GEMM on the integer weights"
        return text
    if qw.mode == "float8":
        numel = spec.in_features * spec.out_features
        kind = products.kind_for(compute, device or torch.device("cpu"), numel)
        return f"kept float8 weight (no autograd), {products.describe(kind, compute, numel)}"
    return qw.mode


def _instructions(cpu: Processor) -> str:
    """The instruction set of the copy of this library's int8 and W4A8 kernels
    that runs on `cpu`."""
    return "AVX-512 VNNI" if native.operator_suffix(cpu) == "vnni" else "AVX2"
