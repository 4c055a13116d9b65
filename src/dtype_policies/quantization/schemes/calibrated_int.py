"""What GPTQ and AWQ share: the statistics of a weight's inputs, and storage
and products on int4's (2, 3 and 4 bits) and int8's (8 bits) plain tensors
and kernels.

Stored, for a weight `<w>` with K inputs and N outputs in groups of `block`
input features (`block = K` for `group_size=-1`), G = ceil(K / block):

* `<w>_int4` (int8, two values per byte along the last axis of the weight's
  own orientation, values `q` in [-8, 7]; 2 and 3 bits use [-2, 1] and
  [-4, 3]) or `<w>_int8` (int8, one value per byte, [-128, 127]);
* `<w>_scale`, `<w>_zero` (float32): `zero` is real-valued; laid out like
  the weight with the groups in place of the input axis ((N, G) for an
  `nn.Linear`, (G, N) for an (in, out) kernel), as grouped int4;
* `<w>_g_idx` (float32, (K,)): the group of each input feature (Keras's
  `g_idx`): `arange(K) // block`, or a permutation of it when the columns
  were quantized in activation order;

with `W[n, k] ~= (q[n, k] - zero[n, g_idx[k]]) * scale[n, g_idx[k]]`: the
same tensors and convention as grouped int4 (`schemes.int4`), so that 2-4
bits run exactly as round-to-nearest int4 does. Keras's unsigned levels `u`
in `[0, 2**bits - 1]` and zero points `z` are stored as `u - 2**(bits - 1)`
and `z - 2**(bits - 1)`.

Products: 2-4 bits run on the int4 kernel (`kernels.int4`) with the same
`Int4Runtime` as int4 (the packed kernel at every shape); a permuted `g_idx`
(activation order) is folded into the packed weight, costing one gather of
the activations per call. AWQ divides the activations by its per-input
scales first (one elementwise pass). 8 bits per channel run on the int8
weight-only kernel plus a rank-one correction for the zero point
(`x @ ((q - z) s)ᵀ = (x @ (q s)ᵀ) - x.sum(-1) (z s)`); 8 bits in groups
dequantize and multiply (correct, not fast).
"""

from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from typing import Any, ClassVar, NamedTuple, TypeVar

import torch
import torch.nn.functional as F

from dtype_policies._compat import compiling
from dtype_policies._core.casting import float32_values, plus_bias
from dtype_policies._cpu import processor
from dtype_policies.quantization.kernels import int4 as int4_kernels
from dtype_policies.quantization.kernels import int8 as int8_kernels
from dtype_policies.quantization.kernels import tensor_key
from dtype_policies.quantization.schemes.base import (
    ActivationStatistics,
    QuantizedWeight,
    Scheme,
    WeightSpec,
)
from dtype_policies.quantization.schemes.int4 import _laid_out, default_g_idx
from dtype_policies.quantizers.gptq import quantize_rtn
from dtype_policies.quantizers.gptq_config import TokenCalibrationConfig
from dtype_policies.quantizers.math import dequantize_grouped, packed_int4, unpack_int4

# The mode's configuration (GPTQConfig, AWQConfig): both calibrate on tokens.
TokenConfigT = TypeVar("TokenConfigT", bound=TokenCalibrationConfig)


class InputStatistics:
    """What GPTQ and AWQ gather about one weight's inputs (`ActivationStatistics`):
    the sum of `XᵀDX` (float32; GPTQ's Hessian, AWQ's output error; `D` the
    rows' weights, all ones unless calibration weighs some rows up) with the
    sum of the weights, the row count, and per input feature the sum and the
    maximum of |x| (AWQ's activation magnitudes, unweighted), each only if
    asked for.

    Weights fed the same rows object (the q/k/v projections of one input)
    share the work: it is done once per batch of rows. Rows that come in
    bfloat16 (a model computing in bfloat16) on a CPU with native bfloat16
    products get their `XᵀX` from a bfloat16 product of 512-row chunks
    (float32 accumulation inside, each chunk's result rounded to bfloat16,
    then summed in float32): 3-4x faster, a relative error near 2**-9 per
    chunk that averages out over the calibration set.
    """

    def __init__(
        self, in_features: int, *, gram: bool = True, mean_abs: bool = False, max_abs: bool = False
    ) -> None:
        self.in_features = in_features
        self.rows = 0
        self.weight_sum = 0.0
        self.gram = torch.zeros(in_features, in_features) if gram else None
        self.abs_sum = torch.zeros(in_features, dtype=torch.float64) if mean_abs else None
        self.abs_max = torch.zeros(in_features) if max_abs else None

    def update(self, rows: torch.Tensor, row_weights: torch.Tensor | None = None) -> None:
        if rows.dim() != 2 or rows.shape[1] != self.in_features:
            raise ValueError(
                f"Input rows of shape {tuple(rows.shape)} do not match input features "
                f"({self.in_features})."
            )
        if row_weights is not None and row_weights.shape != (rows.shape[0],):
            raise ValueError(
                f"Row weights of shape {tuple(row_weights.shape)} do not match "
                f"{rows.shape[0]} rows."
            )
        if rows.shape[0] == 0:
            return
        moments = _shared_moments(rows, row_weights)
        if self.gram is not None:
            self.gram += moments.gram()
        if self.abs_sum is not None:
            self.abs_sum += moments.abs_sum()
        if self.abs_max is not None:
            torch.maximum(self.abs_max, moments.abs_max(), out=self.abs_max)
        self.rows += rows.shape[0]
        self.weight_sum += rows.shape[0] if row_weights is None else float(row_weights.sum())

    @property
    def hessian(self) -> torch.Tensor:
        """`2 XᵀDX / sum(D)` (Keras's and the reference GPTQ's `2 XᵀX / n`
        when every weight is 1), symmetrised as Keras does."""
        if self.gram is None:
            raise RuntimeError("These statistics were gathered without XᵀX (gram=False).")
        return (self.gram + self.gram.t()) / 2 * (2.0 / max(self.weight_sum, 1.0))

    @property
    def mean_abs(self) -> torch.Tensor:
        if self.abs_sum is None:
            raise RuntimeError("These statistics were gathered without |x| (mean_abs=False).")
        return (self.abs_sum / max(self.rows, 1)).float()

    def check_finite(self) -> None:
        """Raises `ValueError` if the inputs held inf or NaN, or overflowed
        float32 in the statistics (read off what was gathered, per input)."""
        gathered = [t for t in (self.gram, self.abs_sum, self.abs_max) if t is not None]
        if self.gram is not None:
            gathered[0] = self.gram.diagonal()  # a non-finite input makes its own row so
        if not all(bool(torch.isfinite(t).all()) for t in gathered):
            raise ValueError(
                "its calibration inputs hold inf or NaN (or overflow float32 when squared): "
                "the model overflows on the calibration data in its compute dtype; check "
                "the data, or calibrate from a float32 model"
            )


def input_statistics(statistics: ActivationStatistics) -> InputStatistics:
    """`statistics` as the `InputStatistics` that GPTQ's and AWQ's
    `new_statistics` make, which their `quantize_calibrated` reads."""
    if not isinstance(statistics, InputStatistics):
        raise TypeError(
            "GPTQ and AWQ quantize from the InputStatistics their `new_statistics` makes; "
            f"got {type(statistics).__name__}"
        )
    return statistics


GRAM_CHUNK = 512
GRAM_BLOCK = 384
"""Inputs per block of `symmetric_gram`'s products (the whole Gram matrix in
one product below `1.5 * GRAM_BLOCK` inputs). Measured on 4096 rows (AMD Zen
3, 2 threads, float32): 0.89x one product's time at K = 576 (2 blocks),
0.68x at K = 1536 (4 blocks)."""


def symmetric_gram(x: torch.Tensor) -> torch.Tensor:
    """`xᵀx` (in `x`'s dtype) from the products of its diagonal and upper
    blocks only, the lower ones mirrored: for K inputs in b blocks,
    `(b + 1) / 2b` of one product's operations (5/8 at K = 1536).

    >>> x = torch.randn(64, 1000)
    >>> torch.allclose(symmetric_gram(x), x.t() @ x, rtol=1e-4, atol=1e-3)
    True
    """
    k = x.shape[1]
    count = max(1, round(k / GRAM_BLOCK))
    if count == 1:
        return x.t() @ x
    edges = [round(i * k / count) for i in range(count + 1)]
    gram = torch.empty(k, k, dtype=x.dtype)
    for start, stop in itertools.pairwise(edges):
        torch.mm(x[:, start:stop].t(), x[:, start:], out=gram[start:stop, start:])
        gram[start:, start:stop] = gram[start:stop, start:].t()
    return gram


class _Moments:
    """The moments of one batch of rows (the Gram matrix with the rows'
    weights), each computed on first use, while the rows are alive (they are
    held weakly: the last moments stay cached after calibration, the
    activations do not)."""

    def __init__(self, rows: torch.Tensor, row_weights: torch.Tensor | None = None) -> None:
        self._rows = weakref.ref(rows)
        self.row_weights = row_weights
        self._gram: torch.Tensor | None = None
        self._abs_sum: torch.Tensor | None = None
        self._abs_max: torch.Tensor | None = None

    @property
    def rows(self) -> torch.Tensor:
        rows = self._rows()
        if rows is None:
            raise RuntimeError("The rows of these moments are gone: compute them while alive.")
        return rows

    def gram(self) -> torch.Tensor:
        if self._gram is None:
            rows = self.rows
            if self.row_weights is not None:  # XᵀDX = (√D X)ᵀ(√D X)
                rows = rows.float() * self.row_weights.float().sqrt()[:, None]
            if rows.dtype == torch.bfloat16 and processor().native_bf16:
                gram = torch.zeros(rows.shape[1], rows.shape[1])
                for start in range(0, rows.shape[0], GRAM_CHUNK):
                    gram += symmetric_gram(rows[start : start + GRAM_CHUNK]).float()
            else:
                gram = symmetric_gram(rows.float())
            self._gram = gram
        return self._gram

    def abs_sum(self) -> torch.Tensor:
        if self._abs_sum is None:
            self._abs_sum = self.rows.abs().float().sum(0).double()
        return self._abs_sum

    def abs_max(self) -> torch.Tensor:
        if self._abs_max is None:
            self._abs_max = self.rows.abs().amax(0).float()
        return self._abs_max


_last = threading.local()  # per thread: (weakref to rows, their moments, rows' version)


def _shared_moments(rows: torch.Tensor, row_weights: torch.Tensor | None = None) -> _Moments:
    """The moments of `rows`, shared while the same rows object (unchanged)
    comes again with the same weights object."""
    last: tuple[weakref.ref, _Moments, int | None] | None = getattr(_last, "moments", None)
    if last is not None:
        ref, moments, version = last
        if ref() is rows and version == _version_of(rows) and moments.row_weights is row_weights:
            return moments
    moments = _Moments(rows, row_weights)
    _last.moments = (weakref.ref(rows), moments, _version_of(rows))
    return moments


def _version_of(rows: torch.Tensor) -> int | None:
    """The rows' version counter; None for an inference tensor (rows made
    under `torch.inference_mode()` have none, and the forward of one block
    call does not write into its own inputs)."""
    return None if rows.is_inference() else rows._version


def signed_offset(bits: int) -> int:
    """What Keras's unsigned levels lose to become the stored signed ones."""
    return 2 ** (bits - 1)


class CalibratedIntScheme(Scheme[TokenConfigT]):
    """Storage and products of GPTQ and AWQ (see the module docstring);
    subclasses compute the stored values (`quantize_calibrated`)."""

    roles = ("linear",)
    extra_buffers: ClassVar[tuple[str, ...]] = ()  # AWQ: ("awq_scales",)

    # -- storage ---------------------------------------------------------
    def bits(self, config: TokenConfigT) -> int:
        return config.weight_bits

    def data_suffix(self, config: TokenConfigT) -> str:
        return "_int8" if self.bits(config) == 8 else "_int4"

    def buffer_names(self, spec: WeightSpec, config: TokenConfigT) -> tuple[str, ...]:
        w = spec.weight
        names = (w + self.data_suffix(config), f"{w}_scale", f"{w}_zero", f"{w}_g_idx")
        return names + tuple(f"{w}_{extra}" for extra in self.extra_buffers)

    def stored_shapes(self, spec: WeightSpec, config: TokenConfigT) -> dict:
        k, n = spec.in_features, spec.out_features
        rows, columns = (k, n) if spec.layout == "in_out" else (n, k)
        if self.bits(config) <= 4:
            columns = (columns + 1) // 2
        groups = -(-k // config.block_size(k))
        grid = (n, groups) if spec.layout == "out_in" else (groups, n)
        data, scale, zero, g_idx, *extras = self.buffer_names(spec, config)
        shapes = {
            data: ((rows, columns), torch.int8),
            scale: (grid, torch.float32),
            zero: (grid, torch.float32),
            g_idx: ((k,), torch.float32),
        }
        shapes.update({name: ((k,), torch.float32) for name in extras})
        return shapes

    def placeholder_tensors(
        self, spec: WeightSpec, config: TokenConfigT, device: torch.device | None = None
    ) -> dict[str, torch.Tensor]:
        tensors = super().placeholder_tensors(spec, config, device)
        g_idx = self.buffer_names(spec, config)[3]
        k = spec.in_features
        tensors[g_idx] = default_g_idx(k, config.block_size(k), device)
        return tensors

    def stored_tensors(
        self,
        spec: WeightSpec,
        config: TokenConfigT,
        levels: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        g_idx: torch.Tensor,
        extras: tuple[torch.Tensor, ...] = (),
    ) -> dict[str, torch.Tensor]:
        """The buffers for Keras-convention results: unsigned (N, K) `levels`,
        (N, G) `scale` and `zero`, each input's group `g_idx`."""
        offset = signed_offset(self.bits(config))
        q_nk = (levels.to(torch.int32) - offset).to(torch.int8)
        data = q_nk.t() if spec.layout == "in_out" else q_nk
        if self.bits(config) <= 4:
            data = packed_int4(data.contiguous(), axis=-1)
        names = self.buffer_names(spec, config)
        tensors = {
            names[0]: data.contiguous(),
            names[1]: _laid_out(spec, scale.float().t()),
            names[2]: _laid_out(spec, (zero.float() - offset).t()),
            names[3]: g_idx.float().contiguous(),
        }
        tensors.update({name: e.float().contiguous() for name, e in zip(names[4:], extras)})
        return tensors

    def quantize(
        self, weight: torch.Tensor, spec: WeightSpec, config: TokenConfigT
    ) -> dict[str, torch.Tensor]:
        """Without calibration data: round to nearest on the mode's grid (what
        the calibrated algorithm gives with no information about the inputs)."""
        warnings.warn(
            f"{config.mode.upper()} without calibration data: the weight is rounded to nearest "
            f"on {config.mode.upper()}'s grid, without the calibrated search. To calibrate it, "
            f"quantize the float model with `{type(config).__name__}(dataset, tokenizer, ...)` "
            "(a module is quantized once: a rounded one stays as it is).",
            UserWarning,
            stacklevel=4,  # the caller of Layer.quantize
        )
        w_nk = spec.nk(spec.matrix(weight.detach())).float()
        levels, scale, zero, g_idx = quantize_rtn(
            w_nk,
            bits=self.bits(config),
            group_size=config.block_size(w_nk.shape[1]),
            grid=config.grid,
        )
        extras = tuple(torch.ones(spec.in_features) for _ in self.extra_buffers)
        return self.stored_tensors(spec, config, levels, scale, zero, g_idx, extras)

    def new_statistics(self, spec: WeightSpec, config: TokenConfigT) -> InputStatistics:
        return InputStatistics(spec.in_features)  # XᵀX (GPTQ's Hessian)

    # -- reading ---------------------------------------------------------
    def _stored(
        self, module: torch.nn.Module, qw: QuantizedWeight[TokenConfigT]
    ) -> list[torch.Tensor]:
        """The stored tensors, scale and zero as (G, N) (views for an (out, in) weight)."""
        buffers = module._buffers
        # `attach` registers each of `qw.buffer_names` as a tensor (torch types
        # a module's buffers as optional: a plain buffer may be set to None)
        # (not `typing.cast(list[torch.Tensor], ...)`: torch 2.6's Dynamo cannot
        # build the generic alias inside a compiled call)
        stored: list[torch.Tensor] = [buffers[name] for name in qw.buffer_names]  # type: ignore[misc]
        if qw.spec.layout == "out_in":
            stored[1], stored[2] = stored[1].t(), stored[2].t()
        return stored

    def integer_values(
        self, module: torch.nn.Module, qw: QuantizedWeight[TokenConfigT]
    ) -> torch.Tensor:
        data = self._stored(module, qw)[0]
        spec = qw.spec
        if self.bits(qw.config) <= 4:
            length = spec.out_features if spec.layout == "in_out" else spec.in_features
            data = unpack_int4(data, length, axis=-1)
        return spec.nk(data)

    def input_divisor(
        self, module: torch.nn.Module, qw: QuantizedWeight[TokenConfigT]
    ) -> torch.Tensor | None:
        """A per-input-feature divisor of the activations (AWQ's scales)."""
        return None

    def dequantize(
        self, module: torch.nn.Module, qw: QuantizedWeight[TokenConfigT]
    ) -> torch.Tensor:
        weight = self._grouped_weight(module, qw)
        divisor = self.input_divisor(module, qw)
        return weight if divisor is None else weight / divisor.float()[None, :]

    # -- products --------------------------------------------------------
    def new_runtime(self) -> None:
        return None  # made on first use, by width (`_int4_linear`, `_int8_linear`)

    def _key_tensors(self, module: torch.nn.Module, qw: QuantizedWeight[TokenConfigT]) -> tuple:
        """The module's own stored buffers (never per-call views)."""
        buffers = module._buffers
        return tuple(buffers[name] for name in qw.buffer_names)

    def linear(self, module, qw, x2, bias, compute):
        divisor = self.input_divisor(module, qw)
        if divisor is not None:  # divided in float32, rounded once to `compute`
            x2 = _divided(x2, divisor.float(), compute)
        if self.bits(qw.config) <= 4:
            return self._int4_linear(module, qw, x2, bias, compute)
        return self._int8_linear(module, qw, x2, bias, compute)

    def _current_int4_runtime(self, module, qw) -> tuple[int4_kernels.Int4Runtime, Any]:
        """The weight's int4 runtime with a plan of its stored tensors, and
        their integer values when this call read them."""
        block = qw.config.block_size(qw.spec.in_features)
        runtime = qw.runtime  # once: `clear_cast_caches` may replace it meanwhile
        if not isinstance(runtime, int4_kernels.Int4Runtime):
            runtime = qw.runtime = int4_kernels.Int4Runtime()

        def read() -> tuple[Any, Any, Any, Any]:
            _, scale, zero, g_idx, *_ = self._stored(module, qw)
            return self.integer_values(module, qw), scale, zero, g_idx

        q_nk = runtime.current(self._key_tensors(module, qw), read, block)
        return runtime, q_nk

    def refresh_kept(self, module, qw):
        # A frozen graph packs the weight itself but takes the plan's choice of
        # whether `g_idx` permutes the blocks: it must be of these values.
        if (
            self.bits(qw.config) <= 4
            and qw.spec.role == "linear"
            and qw.placeholder is None
            and self._stored(module, qw)[1].device.type == "cpu"
        ):
            with torch.no_grad():
                self._current_int4_runtime(module, qw)

    def _int4_linear(self, module, qw, x2, bias, compute):
        """As round-to-nearest int4: the same runtime, kernel and paths."""
        _, scale, zero, g_idx, *_ = self._stored(module, qw)
        block = qw.config.block_size(qw.spec.in_features)
        runtime, q_nk = self._current_int4_runtime(module, qw)
        path = int4_kernels.int4_path(runtime, x2.shape[0], block)
        if path not in int4_kernels.KERNELS and q_nk is None:
            q_nk = self.integer_values(module, qw)
        return int4_kernels.int4_linear(
            x2, q_nk, scale, zero, block, bias, compute, runtime, path, g_idx
        )

    def _int8_linear(self, module, qw, x2, bias, compute):
        runtime = qw.runtime
        if not isinstance(runtime, _Int8Runtime):
            runtime = qw.runtime = _Int8Runtime()
        state = runtime.current(self, module, qw)
        if bias is not None and bias.dtype != compute:
            bias = bias.to(compute)
        if state.zero_step is not None:  # per channel: int8 weight-only, then the zero points
            y = int8_kernels.int8_weight_only_linear(x2, state.int8, None, torch.float32)
            y = y - float32_values(x2).sum(-1, keepdim=True) * state.zero_step[None, :]
            y = y.to(compute)
            return plus_bias(y, bias)
        return F.linear(x2.to(compute), self._grouped_weight(module, qw).to(compute), bias)

    def _grouped_weight(self, module, qw) -> torch.Tensor:
        """The (N, K) weight without the input divisor (applied to `x`)."""
        _, scale, zero, g_idx, *_ = self._stored(module, qw)
        q_kn = self.integer_values(module, qw).t()
        block = qw.config.block_size(qw.spec.in_features)
        return dequantize_grouped(q_kn, scale, zero, block, g_idx).t()

    def traced_linear(self, module, qw, x2, bias, compute, needs_grad):
        divisor = self.input_divisor(module, qw)
        if self.bits(qw.config) > 4 or x2.device.type != "cpu":
            return super().traced_linear(module, qw, x2, bias, compute, needs_grad)
        if divisor is not None:
            x2 = (float32_values(x2) / divisor.float()).to(compute)
        _, scale, zero, g_idx, *_ = self._stored(module, qw)
        block = qw.config.block_size(qw.spec.in_features)
        q_nk = self.integer_values(module, qw)
        if needs_grad:
            bfloat16_pairs = int4_kernels.torch_kernel_here()
            weight = int4_kernels.kernel_weight(q_nk, scale, zero, block, g_idx, bfloat16_pairs)
            return int4_kernels.int4_linear_traceable(x2, weight, bias, compute)
        runtime = qw.runtime if isinstance(qw.runtime, int4_kernels.Int4Runtime) else None
        return int4_kernels.int4_linear_traced(
            x2, q_nk, scale, zero, block, bias, compute, runtime, g_idx
        )


class _Int8State(NamedTuple):
    key: tuple
    int8: int8_kernels.Int8Runtime
    zero_step: torch.Tensor | None  # per channel: zero * scale; None: grouped


class _Int8Runtime:
    """8-bit derived data, rebuilt when the stored tensors change; published
    as one immutable state."""

    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state: _Int8State | None = None

    def current(self, scheme, module, qw) -> _Int8State:
        stored = scheme._key_tensors(module, qw)
        key = tensor_key(*stored)
        state = self._state
        if state is not None and state.key == key:
            return state
        _, scale, zero, *_ = scheme._stored(module, qw)
        int8 = int8_kernels.Int8Runtime()
        zero_step = None
        if scale.shape[0] == 1:
            with torch.inference_mode(False), torch.no_grad():
                q_nk = scheme.integer_values(module, qw)
                step = (1.0 / scale.float()[0]).contiguous()
                zero_step = (zero.float()[0] * scale.float()[0]).contiguous()
                int8.refresh(q_nk.contiguous(), step, lambda t: t, False)
        state = _Int8State(key, int8, zero_step)
        self._state = state
        return state


DIVISION_CHUNK = 1 << 18
"""Elements per piece of a large input's division (1 MB of float32): each
piece's temporaries come back from the C heap, where one float32 copy of the
whole input is a fresh mapping whose pages fault in on every call (AWQ's
division of a 4096 x 1536 bfloat16 input took 10-20 ms inside a model that
way, against 1.7-2.3 ms alone)."""


def _divided(x: torch.Tensor, divisor: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """`(x / divisor).to(compute)`, divided in float32 and rounded once; a
    large CPU input without gradients piece by piece, into its result."""
    if (
        x.numel() <= DIVISION_CHUNK
        or x.dim() != 2
        or x.device.type != "cpu"
        or x.requires_grad
        or compiling()
    ):
        return _float32_divided(x, divisor).to(compute)
    out = torch.empty(x.shape, dtype=compute, device=x.device)
    rows = max(1, DIVISION_CHUNK // max(x.shape[1], 1))
    for start in range(0, x.shape[0], rows):
        out[start : start + rows] = _float32_divided(x[start : start + rows], divisor)
    return out


def _float32_divided(x: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """`x / divisor` in float32, in place on `x`'s float32 copy when it makes one."""
    values = x.float()
    return values.div_(divisor) if values is not x else values / divisor
