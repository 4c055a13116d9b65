"""What a quantization scheme is, and the per-module state it runs with.

A `Scheme` (one per mode, one file each) turns a float weight into plain
stored tensors and computes with them. A `WeightSpec` says where a module's
weight is and how it is oriented. A `QuantizedWeight` binds the two to one
module: it is what a quantized module keeps (besides its stored buffers), and
its runtime caches are derived from the buffers, never stored.

A calibrated scheme (its mode's record says `calibrated=True`: GPTQ's
Hessian, AWQ's channel statistics) computes its stored tensors from the
activations the weight sees on calibration data: `new_statistics` gives an
accumulator that `quantization.calibration` feeds with the weight's input
rows, block by block, and `quantize_calibrated` turns weight and statistics
into the stored tensors (a pure function, as `quantize`).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch

from dtype_policies._core.casting import (
    float32_values,
    functorch_wrapped,
    straight_through,
    tracing,
)
from dtype_policies._core.checkpoints import foreign_module_buffers
from dtype_policies._derivatives import derivative_free, functorch_active
from dtype_policies._modes import mode_record, stored_suffixes
from dtype_policies.quantizers.config import QuantizationConfig

# The configuration class a scheme is given (each mode has its own: a scheme
# reads its fields, e.g. int4's `group_size`).
ConfigT = TypeVar("ConfigT", bound=QuantizationConfig)

LAYOUTS = ("out_in", "in_out")
ROLES = ("linear", "embedding")


@dataclass(frozen=True)
class WeightSpec:
    """Where a module's quantizable weight is, and its orientation.

    Attributes:
        weight: The parameter's name (`"weight"`, `"kernel"`, `"embeddings"`).
        layout: `"out_in"` for an (N, K) matrix (torch's `nn.Linear`,
            embedding tables as (rows, features)), `"in_out"` for (K, N)
            (Keras's `Dense`, transformers' `Conv1D`).
        role: `"linear"` (a product with the input's last axis) or
            `"embedding"` (rows looked up).
        in_features, out_features: K and N (for embeddings: features and rows).
        bias: The bias parameter's name, if any.
        float_shape: The float parameter's shape.
        permutation: For einsum kernels, the permutation that puts the
            contracted axes first before flattening to (K, N).
        contract: For float8 on non-matmul einsums: the float contraction
            `contract(x, kernel)`.
    """

    weight: str
    layout: str
    role: str
    in_features: int
    out_features: int
    bias: str | None = None
    float_shape: tuple[int, ...] = ()
    permutation: tuple[int, ...] | None = None
    contract: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def matrix(self, weight: torch.Tensor) -> torch.Tensor:
        """The float weight as a 2-D matrix in this layout."""
        if self.permutation is not None:
            return weight.permute(self.permutation).reshape(self.in_features, self.out_features)
        return weight

    def nk(self, matrix: torch.Tensor) -> torch.Tensor:
        """A 2-D matrix in this layout, viewed as (N, K)."""
        return matrix.t() if self.layout == "in_out" else matrix

    def from_nk(self, w_nk: torch.Tensor) -> torch.Tensor:
        """An (N, K) matrix back in the float parameter's shape."""
        matrix = w_nk.t() if self.layout == "in_out" else w_nk
        if self.permutation is None:
            return matrix
        permuted = [self.float_shape[i] for i in self.permutation]
        inverse = [0] * len(self.permutation)
        for position, axis in enumerate(self.permutation):
            inverse[axis] = position
        return matrix.reshape(permuted).permute(inverse)


class ActivationStatistics(Protocol):
    """What a calibrated scheme accumulates about one weight's inputs."""

    def update(self, rows: torch.Tensor, row_weights: torch.Tensor | None = None) -> None:
        """Adds a batch of the weight's input rows: `(M, K)` in the floating
        dtype they came in (bfloat16 under a mixed_bfloat16 policy), `K` the
        weight's `in_features` (the product's contracted axis). Weights fed
        the same input get the same rows object: never modify it.
        `row_weights` (float32 `(M,)`, or None for all ones) says how much
        each row's output error counts (calibration weighs the attention
        sink's rows up; see `quantization.calibration`)."""


class Scheme(abc.ABC, Generic[ConfigT]):
    """One quantization mode: storage, dequantization and products.

    Class attributes:
        mode: The mode's name (its record's).
        roles: The weight roles it quantizes (`"linear"`, `"embedding"`).
        keeps_float_weight: The float weight stays a parameter (float8).
        general_contraction: It computes any einsum contraction with the
            weight (`WeightSpec.contract`), not only matrix products.
        calibrated_on_quantized_outputs: In calibration, the next block's
            inputs are this block's outputs with its weights quantized (GPTQ)
            rather than float (`False`).
    """

    mode: ClassVar[str]
    roles: ClassVar[tuple[str, ...]] = ("linear",)
    keeps_float_weight: ClassVar[bool] = False
    general_contraction: ClassVar[bool] = False
    calibrated_on_quantized_outputs: ClassVar[bool] = True

    @abc.abstractmethod
    def buffer_names(self, spec: WeightSpec, config: ConfigT) -> tuple[str, ...]:
        """The names of the buffers this scheme registers on the module."""

    def data_name(self, spec: WeightSpec, config: ConfigT) -> str | None:
        """The buffer holding the weight's integer values (`None`: a scheme
        that keeps its weight in a float format)."""
        suffix = self.data_suffix(config)
        return None if suffix is None else spec.weight + suffix

    def data_suffix(self, config: ConfigT) -> str | None:
        """What `data_name` appends to the weight's name (its record's)."""
        return mode_record(self.mode).data_suffix

    @abc.abstractmethod
    def quantize(
        self, weight: torch.Tensor, spec: WeightSpec, config: ConfigT
    ) -> dict[str, torch.Tensor]:
        """The buffers to store for the float `weight` (a pure function)."""

    @abc.abstractmethod
    def stored_shapes(
        self, spec: WeightSpec, config: ConfigT
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The shape and dtype of each buffer `quantize` stores for `spec`."""

    def output_chunk(self, spec: WeightSpec, config: ConfigT) -> int | None:
        """A number of consecutive outputs whose stored values `quantize`
        computes from those outputs' weights alone, so that a large weight
        is quantized chunks of a multiple of it at a time
        (`quantize_by_outputs`); `None` (the default): from the whole
        weight."""
        return None

    def new_statistics(self, spec: WeightSpec, config: ConfigT) -> ActivationStatistics:
        """A calibrated scheme's fresh accumulator for the inputs of the weight `spec`."""
        raise NotImplementedError(f"mode '{self.mode}' does not calibrate on activations")

    def quantize_calibrated(
        self,
        weight: torch.Tensor,
        spec: WeightSpec,
        config: ConfigT,
        statistics: ActivationStatistics,
    ) -> dict[str, torch.Tensor]:
        """A calibrated scheme's buffers for the float `weight`, given the
        statistics of its inputs (a pure function)."""
        raise NotImplementedError(f"mode '{self.mode}' does not calibrate on activations")

    def placeholder_tensors(
        self, spec: WeightSpec, config: ConfigT, device: torch.device | None = None
    ) -> dict[str, torch.Tensor]:
        """Stored tensors of the right shapes holding no quantization (integers
        0, floats 1): what a layer built with a calibrated mode's policy holds
        until a checkpoint is loaded into it (Keras's loading path)."""
        return {
            name: (torch.ones if dtype.is_floating_point else torch.zeros)(
                shape, dtype=dtype, device=device
            )
            for name, (shape, dtype) in self.stored_shapes(spec, config).items()
        }

    def upgrade_checkpoint(
        self, spec: WeightSpec, config: ConfigT, state_dict: dict, prefix: str
    ) -> None:
        """Rewrites, in `state_dict`, this weight's tensors stored by an
        earlier version into today's format (default: nothing to do)."""
        return None

    def new_runtime(self) -> Any:
        """Derived per-module data (packed kernel layouts); rebuilt after copies."""
        return None

    def refresh_kept(self, module: torch.nn.Module, qw: QuantizedWeight[ConfigT]) -> None:
        """Makes the derived data of `new_runtime` current for the stored
        tensors, eagerly, where a traced product reads choices of it that a
        trace cannot make from the values (the int4 kernels' plans)."""
        return None

    def check_shapes(self, spec: WeightSpec, config: ConfigT) -> None:
        """Raises `NotImplementedError` for shapes this scheme cannot handle."""
        return None

    @abc.abstractmethod
    def dequantize(self, module: torch.nn.Module, qw: QuantizedWeight[ConfigT]) -> torch.Tensor:
        """The float32 (N, K) weight the stored tensors stand for, read from
        `module._buffers` alone (a backward hands it the tensors its forward
        read in a stand-in for the module)."""

    def integer_values(self, module: torch.nn.Module, qw: QuantizedWeight[ConfigT]) -> torch.Tensor:
        """The stored integer values as an (N, K) int8 matrix."""
        raise NotImplementedError(f"mode '{self.mode}' keeps a float weight")

    @abc.abstractmethod
    def linear(
        self,
        module: torch.nn.Module,
        qw: QuantizedWeight[ConfigT],
        x2: torch.Tensor,
        bias: torch.Tensor | None,
        compute: torch.dtype,
    ) -> torch.Tensor:
        """`x2 @ W.T + bias` for a 2-D `x2` (M, K), in `compute` (no autograd)."""

    def forward(
        self,
        module: torch.nn.Module,
        qw: QuantizedWeight[ConfigT],
        x: torch.Tensor,
        bias: torch.Tensor | None,
        compute: torch.dtype,
    ) -> torch.Tensor:
        """The layer's product with the quantized weight over `x`'s last axis,
        with the straight-through gradient (through the dequantized weight) to
        `x` and `bias`, as Keras's custom gradients do."""
        if x.dtype is not compute and x.is_floating_point():
            x = x.to(compute)
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if tracing():
            needs_grad = torch.is_grad_enabled() and (
                x2.requires_grad or (bias is not None and bias.requires_grad)
            )
            y = self.traced_linear(module, qw, x2, bias, compute, needs_grad)
        elif derivative_free(x2, bias):
            y = self.linear(module, qw, x2, bias, compute)
        elif functorch_active():
            # torch.func transforms (grad, jvp, vmap, ...) need plain ops: the
            # kernels have no batching rule
            y = self.traced_linear(module, qw, x2, bias, compute, needs_grad=True)
        else:  # reverse mode, forward mode (`torch.autograd.forward_ad`), or both
            stored = tuple(module._buffers.get(name) for name in qw.buffer_names)
            y = _StraightThrough.apply(x2, bias, module, qw, compute, *stored)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])

    def traced_linear(
        self,
        module: torch.nn.Module,
        qw: QuantizedWeight[ConfigT],
        x2: torch.Tensor,
        bias: torch.Tensor | None,
        compute: torch.dtype,
        needs_grad: bool,
    ) -> torch.Tensor:
        """The product in plain ops on the stored tensors, for compilers,
        tracers and functorch: by default the product with the dequantized
        weight, whose gradient is the straight-through one."""
        weight = self.dequantize(module, qw).to(compute)
        return torch.nn.functional.linear(x2, weight, None if bias is None else bias.to(compute))

    def lookup(
        self,
        module: torch.nn.Module,
        qw: QuantizedWeight[ConfigT],
        ids: torch.Tensor,
        compute: torch.dtype,
    ) -> torch.Tensor:
        """The rows `ids` of an embedding table, in `compute`."""
        raise NotImplementedError(f"mode '{self.mode}' does not quantize embeddings")


class QuantizedWeight(Generic[ConfigT]):
    """The quantization of one module's weight: scheme, spec and config, plus
    derived runtime data. Stored tensors live in the module's buffers."""

    def __init__(
        self,
        scheme: Scheme[ConfigT],
        spec: WeightSpec,
        config: ConfigT,
        float_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.scheme = scheme
        self.spec = spec
        self.config = config
        self.float_dtype = float_dtype  # the dtype of the float weight it replaced
        self.path = ""  # the module's path in the model quantize() was given, for errors
        self.runtime = scheme.new_runtime()
        # Stored tensors that are placeholders until a checkpoint is loaded (a
        # layer built under a calibrated policy): a call then raises.
        self.placeholder: str | None = None
        # read on every product: named once (spec and config do not change)
        self.buffer_names: tuple[str, ...] = tuple(scheme.buffer_names(spec, config))

    @property
    def mode(self) -> str:
        return self.scheme.mode

    @property
    def weight_name(self) -> str:
        return self.spec.weight

    @property
    def stored_names(self) -> frozenset[str]:
        return frozenset(self.buffer_names)

    @property
    def data_name(self) -> str | None:
        """The buffer holding the integer values (`Scheme.data_name`)."""
        return self.scheme.data_name(self.spec, self.config)

    def linear(
        self,
        module: torch.nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        compute: torch.dtype,
    ) -> torch.Tensor:
        """`x @ W + bias` over `x`'s last axis (see `Scheme.forward`)."""
        if self.placeholder is not None:
            raise RuntimeError(self.placeholder)
        if not x.is_floating_point():
            # torch's float product refuses them too; the kernels would convert
            # integers and drop a complex input's imaginary part
            raise TypeError(
                f"a layer quantized in mode {self.mode!r} computes on floating-point inputs; "
                f"got an input of "
                f"dtype {x.dtype} and shape {tuple(x.shape)}"
            )
        in_features = self.spec.in_features  # 0: a general contraction (`spec.contract`)
        if in_features and x.shape[-1] != in_features:
            # as torch's float product refuses it (the kernels would pad or cut the input)
            raise RuntimeError(
                f"a {self.mode} layer with {in_features} input features got an input of "
                f"shape {tuple(x.shape)}: its last axis must be {in_features}"
            )
        return self.scheme.forward(module, self, x, bias, compute)

    def lookup(self, module: torch.nn.Module, ids: torch.Tensor, compute: torch.dtype):
        if self.placeholder is not None:
            raise RuntimeError(self.placeholder)
        if ids.dtype not in (torch.int32, torch.int64):
            ids = ids.long()
        # a float table refuses negative ids; indexing the stored rows would wrap
        if not tracing() and not functorch_wrapped(ids) and ids.numel() and bool((ids < 0).any()):
            raise IndexError(f"index out of range in self (a negative id: {int(ids.min())})")
        return self.scheme.lookup(module, self, ids, compute)

    def dequantized(self, module: torch.nn.Module) -> torch.Tensor:
        """The float32 weight in the float parameter's shape."""
        return self.spec.from_nk(self.scheme.dequantize(module, self))

    def check_checkpoint(self, module: torch.nn.Module, state_dict: dict, prefix: str) -> None:
        """Raises `ValueError` naming the keys if `state_dict` holds this
        weight stored by another mode, or by this mode with another layout
        (int4 per channel against grouped, another block size); reads only."""
        name = self.weight_name
        expected = self.scheme.stored_shapes(self.spec, self.config)
        other_modes_buffers = foreign_module_buffers(
            module, state_dict, prefix, frozenset(expected)
        )
        own = {prefix + buffer for buffer in expected}  # float8's state is not under the weight
        state_dict = {
            k: v for k, v in state_dict.items() if k.startswith(prefix + name) or k in own
        }
        self.scheme.upgrade_checkpoint(self.spec, self.config, state_dict, prefix)
        path = prefix[:-1] or "(root)"
        foreign = [
            prefix + name + suffix
            for suffix in stored_suffixes()
            if prefix + name + suffix in state_dict and name + suffix not in expected
        ] + other_modes_buffers
        if foreign:
            raise ValueError(
                f"The checkpoint holds {foreign}, stored by another quantization mode or "
                f"configuration, but the module at '{path}' is quantized in mode "
                f"'{self.mode}' ({self.config}; it expects {sorted(prefix + n for n in expected)})."
                " Quantize the model the same way before loading; nothing was loaded."
            )
        mismatched = []
        for buffer, (shape, dtype) in expected.items():
            value = state_dict.get(prefix + buffer)
            if isinstance(value, torch.Tensor) and (
                tuple(value.shape) != tuple(shape) or value.dtype != dtype
            ):
                mismatched.append(
                    f"'{prefix + buffer}': {tuple(value.shape)} {value.dtype} "
                    f"(expected {tuple(shape)} {dtype})"
                )
        if mismatched:
            raise ValueError(
                f"The checkpoint's {', '.join(mismatched)} do not fit the module at '{path}', "
                f"quantized in mode '{self.mode}' ({self.config}): it was quantized with another "
                "configuration. Quantize the model the same way before loading; nothing was loaded."
            )
        self._check_complete(state_dict, prefix)
        self._check_stored_values(state_dict, prefix)
        self._check_float_weight(state_dict, prefix)

    def check_values(self, module: torch.nn.Module) -> None:
        """What `check_checkpoint` asks of a checkpoint's values (finite
        stored tensors; a kept float weight finite), read off `module`: for
        loaders that fill its tensors themselves (transformers'
        `from_pretrained`)."""
        state = {n: module._buffers[n] for n in self.stored_names if n in module._buffers}
        if self.scheme.keeps_float_weight:
            state[self.weight_name] = module._parameters[self.weight_name]
        self._check_stored_values(state, "")
        self._check_float_weight(state, "")

    def _check_complete(self, state_dict: dict, prefix: str) -> None:
        """A quantized weight's stored tensors load together: integers beside
        the module's old scales (a checkpoint missing one of them, loaded
        with `strict=False`) would be another weight, silently."""
        if self.scheme.keeps_float_weight:  # float8's scaling state: torch's missing keys
            return
        present = sorted(prefix + n for n in self.stored_names if prefix + n in state_dict)
        missing = sorted(prefix + n for n in self.stored_names if prefix + n not in state_dict)
        if present and missing:
            raise ValueError(
                f"The checkpoint holds {present} but not {missing} of the weight of the module "
                f"at '{prefix[:-1] or '(root)'}', quantized in mode '{self.mode}': a quantized "
                "weight's stored tensors load together (new integers beside the old scales "
                "would be another weight), even with strict=False; nothing was loaded."
            )

    def _check_stored_values(self, state_dict: dict, prefix: str) -> None:
        """Stored scales, offsets and scaling state are finite (one inf or NaN
        poisons every output its row or group reaches) and group indices
        name groups that exist (`invalid_stored_values`)."""
        for name in sorted(self.stored_names):
            value = state_dict.get(prefix + name)
            if not isinstance(value, torch.Tensor):
                continue
            found = invalid_stored_values(name, value, state_dict, prefix, self.spec.layout)
            if found is not None:
                raise ValueError(
                    f"Cannot load '{prefix + name}' into the quantized module: it holds "
                    f"{found}; stored scales are positive, offsets and scaling state finite "
                    "and group indices in range (a corrupted checkpoint?); nothing was loaded."
                )

    def _check_float_weight(self, state_dict: dict, prefix: str) -> None:
        """A float checkpoint's weight (no stored tensors beside it), which
        loading quantizes (`modules.adapt_state_dict`): the float shape the
        module was quantized from, finite values; the float weight a mode
        keeps (float8's, quantized at each call): finite values, as
        `quantize()` asks."""
        key = prefix + self.weight_name
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            return
        if not self.scheme.keeps_float_weight:  # a kept one is quantized at each call
            if any(prefix + name in state_dict for name in self.stored_names):
                return
            if tuple(value.shape) != self.spec.float_shape:
                raise ValueError(
                    f"Cannot load '{key}' of shape {tuple(value.shape)} into the module "
                    f"quantized from a weight of shape {self.spec.float_shape}."
                )
        try:
            check_finite(value, self.weight_name)
        except ValueError as e:
            raise ValueError(f"Cannot load '{key}' into the quantized module: {e}.") from None

    def integer_values(self, module: torch.nn.Module) -> torch.Tensor:
        """The integer values in the float parameter's shape (Keras's `kernel`)."""
        return self.spec.from_nk(self.scheme.integer_values(module, self))

    def refresh_kept(self, module: torch.nn.Module) -> None:
        """Makes what the kernels keep of the stored tensors current, before
        a graph with frozen weights is traced (`compile_for_inference`,
        `compile_for_generation`): the graph reads it."""
        self.scheme.refresh_kept(module, self)

    def forget_kept(self) -> None:
        """Drops what the kernels keep of the stored tensors (packed layouts),
        so that the next call reads them again: for writes torch's version
        counters do not see (`clear_cast_caches`)."""
        self.runtime = self.scheme.new_runtime()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["runtime"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("path", "")  # pickled by an earlier version
        self.runtime = self.scheme.new_runtime()
        if "buffer_names" not in state:  # pickled by an earlier version
            self.buffer_names = tuple(self.scheme.buffer_names(self.spec, self.config))
        from dtype_policies.quantization.adapters import guard_peft  # above this module

        guard_peft()  # a quantized weight unpickled in a fresh process: as `attach`'s

    def __deepcopy__(self, memo: dict) -> QuantizedWeight[ConfigT]:
        copied = QuantizedWeight(self.scheme, self.spec, self.config, self.float_dtype)
        copied.path = self.path
        return copied

    def __repr__(self) -> str:
        return f"QuantizedWeight(mode={self.mode!r}, weight={self.weight_name!r}, {self.config})"


class _StraightThrough(torch.autograd.Function):
    """The quantized product forward; its derivatives through the dequantized
    weight (Keras's custom gradient): backward `grad_x = grad_y @ W`,
    `grad_bias = sum(grad_y)`; forward mode `t_y = t_x @ W.T + t_bias`. `W`
    is dequantized from the stored tensors the forward read (`stored`, the
    module's buffers at that call: `torch.func.functional_call` swaps them in
    for the call only), never from what the module holds later."""

    @staticmethod
    def forward(x2, bias, module, qw, compute, *stored):  # type: ignore[override]
        return qw.scheme.linear(module, qw, x2, bias, compute)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[override]
        _, _, _, ctx.qw, _, *stored = inputs
        ctx.output_like = (output.shape, output.dtype)
        ctx.save_for_backward(*stored)
        ctx.save_for_forward(*stored)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ _dequantized(ctx).to(grad.dtype)
        if ctx.needs_input_grad[1]:
            grad_bias = grad.sum(0)
        # one `None` per stored tensor, counted without unpacking them again:
        # non-reentrant activation checkpointing allows a single unpack
        return (grad_x, grad_bias, None, None, None) + (None,) * len(ctx.qw.buffer_names)

    @staticmethod
    def jvp(ctx, tangent_x, tangent_bias, *_):  # type: ignore[override]
        shape, dtype = ctx.output_like
        if tangent_x is not None:
            tangent = tangent_x.to(dtype) @ _dequantized(ctx).to(dtype).t()
        else:
            tangent = torch.zeros(shape, dtype=dtype, device=tangent_bias.device)
        if tangent_bias is not None:
            tangent = tangent + tangent_bias.to(dtype)
        return tangent


class StoredTensors:
    """The stored tensors one forward read, standing in for their module in
    `Scheme.dequantize` (which reads a module's `_buffers` alone)."""

    __slots__ = ("_buffers",)

    def __init__(self, buffers: dict[str, torch.Tensor]) -> None:
        self._buffers = buffers


def _dequantized(ctx: Any) -> torch.Tensor:
    """The float32 (N, K) weight of the stored tensors `ctx` saved."""
    qw = ctx.qw
    stored = StoredTensors(dict(zip(qw.buffer_names, ctx.saved_tensors)))
    return qw.scheme.dequantize(stored, qw)  # type: ignore[arg-type]


def quantizer_rounded_product(
    x2: torch.Tensor,
    quantizer: Any,
    q_nk: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    compute: torch.dtype,
) -> torch.Tensor:
    """`x2 @ W.T + bias` with `x2`'s rows rounded by an activation
    quantizer's own rule (Keras's: `q = clip(round(x * s), value_range)`,
    `x ~= q / s`) and `W ~= q_nk / scale[:, None]` per output channel: the
    integer products exact in float64, the gradient straight through the
    inputs' rounding. bfloat16 inputs and bias enter by their values
    (Inductor drops a fused bfloat16 cast pair otherwise)."""
    x = float32_values(x2)
    xq, x_scale = quantizer(x.detach(), axis=-1)
    x_scale = x_scale.float()
    xq = straight_through(x * x_scale, xq.float())
    products = (xq.double() @ q_nk.double().t()).float()
    y = products / (x_scale * scale.float()[None, :])
    if bias is not None:
        y = y + float32_values(bias)
    return y.to(compute)


def invalid_stored_values(
    name: str, values: torch.Tensor, state: dict, prefix: str, layout: str
) -> str | None:
    """What is wrong with the values of a quantized weight's stored tensor
    `prefix + name` (`state` holds its siblings), or `None`: inf or NaN in a
    float tensor; a scale (`*_scale`, `*_scales`: every mode's are positive,
    a weight's all-zero row or group included) that is 0, which divides to
    inf, or negative, which flips the weight's sign; a group index
    (`<w>_g_idx`) that is no integer in `[0, groups)`, the groups counted by
    its `<w>_scale` (laid out as `layout`), which would gather another
    group's scales or fail deep in a kernel."""
    if not values.is_floating_point():
        return None
    found = non_finite_values(values)
    if found is None and name.endswith(("_scale", "_scales")):
        found = _not_positive(values)
    if found is not None or not name.endswith("_g_idx"):
        return found
    scale = state.get(prefix + name[: -len("_g_idx")] + "_scale")
    if not isinstance(scale, torch.Tensor) or scale.dim() != 2:
        return None
    groups = scale.shape[1 if layout == "out_in" else 0]
    with torch.no_grad():
        bad = (values != values.round()) | (values < 0) | (values >= groups)
        if not bool(bad.any()):
            return None
        index = int(bad.nonzero()[0][0])
        return (
            f"{int(bad.sum())} group index(es) that are no integer from 0 to {groups - 1} "
            f"(first: {float(values[index])} at index {index})"
        )


def _not_positive(values: torch.Tensor) -> str | None:
    with torch.no_grad():
        bad = values <= 0
        if not bool(bad.any()):
            return None
        index = tuple(int(i) for i in bad.nonzero()[0])
        return (
            f"{int(bad.sum())} scale(s) that are not positive (first: {float(values[index])} "
            f"at index {list(index)})"
        )


def non_finite_values(values: torch.Tensor) -> str | None:
    """How many of `values` are inf or NaN and where the first is, or `None`
    if all are finite."""
    with torch.no_grad():
        finite = torch.isfinite(values)
        if bool(finite.all()):
            return None
        bad = ~finite
        index = tuple(int(i) for i in bad.nonzero()[0])
        return (
            f"{int(bad.sum())} non-finite value(s) (first: {float(values[index])} at index "
            f"{list(index)})"
        )


class NonFiniteWeightError(ValueError):
    """A weight to quantize holds inf or NaN. Its message names the weight;
    each route that quantizes names the module (`quantize()` and
    `apply_policy` by its path, a layer's own `quantize` by its name)."""


# The float32 bytes of weights quantized at once by `quantize_by_outputs`.
CHUNK_BYTES = 64 << 20


def quantize_by_outputs(
    scheme: Scheme[ConfigT],
    weight: torch.Tensor,
    spec: WeightSpec,
    config: ConfigT,
    chunk_bytes: int | None = None,
) -> dict[str, torch.Tensor]:
    """`scheme.quantize(weight, spec, config)`, the same tensors, computed a
    chunk of outputs at a time for a scheme whose outputs quantize
    independently (`Scheme.output_chunk`), so that its float32 copies and
    per-input temporaries take a chunk's memory, not the weight's several
    times over (the default int8 on Llama-3.2-1B's 128256 x 2048 table: a
    peak of 4.5 GB for a 1 GB float32 weight, 5.5 GB for its bfloat16 half).
    Each stored tensor is joined along the one axis where a chunk's shape
    differs from the whole weight's (`stored_shapes`); one of the same shape
    (int4's `g_idx`, the inputs' groups) must come out the same from every
    chunk.

    >>> import torch
    >>> from dtype_policies.quantization.schemes.int8 import Int8Scheme
    >>> from dtype_policies.quantizers.config import Int8QuantizationConfig
    >>> w = torch.randn(300, 64)
    >>> spec = WeightSpec("weight", "out_in", "linear", 64, 300)
    >>> config = Int8QuantizationConfig(block_size=32, activation_block_size=32)
    >>> whole = Int8Scheme().quantize(w, spec, config)
    >>> chunked = quantize_by_outputs(Int8Scheme(), w, spec, config, chunk_bytes=64 * 4 * 64)
    >>> all(torch.equal(chunked[name], whole[name]) for name in whole)
    True
    """
    n, k = spec.out_features, max(spec.in_features, 1)
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    unit = scheme.output_chunk(spec, config)
    if unit is None or 4 * k * unit > 16 * chunk_bytes:
        return scheme.quantize(weight, spec, config)
    unit = math.lcm(unit, 64)  # even: int4's packed pairs of outputs
    outputs = max(1, chunk_bytes // (4 * k) // unit) * unit
    if n <= outputs:
        return scheme.quantize(weight, spec, config)
    matrix = spec.matrix(weight.detach())
    axis = 1 if spec.layout == "in_out" else 0

    def part_spec(count: int) -> WeightSpec:
        shape = (k, count) if spec.layout == "in_out" else (count, k)
        return dataclasses.replace(spec, out_features=count, permutation=None, float_shape=shape)

    whole_shapes = scheme.stored_shapes(spec, config)
    part_shapes = scheme.stored_shapes(part_spec(outputs), config)
    joins: dict[str, int | None] = {}
    for name, (shape, _) in whole_shapes.items():
        differing = [d for d, (a, b) in enumerate(zip(shape, part_shapes[name][0])) if a != b]
        if len(differing) > 1 or len(shape) != len(part_shapes[name][0]):
            return scheme.quantize(weight, spec, config)  # not joined along one axis
        joins[name] = differing[0] if differing else None
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in whole_shapes}
    for start in range(0, n, outputs):
        count = min(outputs, n - start)
        stored = scheme.quantize(matrix.narrow(axis, start, count), part_spec(count), config)
        for name, tensor in stored.items():
            parts[name].append(tensor)
    joined = {}
    for name, tensors in parts.items():
        axis_of_outputs = joins[name]
        if axis_of_outputs is not None:
            joined[name] = torch.cat(tensors, dim=axis_of_outputs)
        elif all(torch.equal(tensor, tensors[0]) for tensor in tensors[1:]):
            joined[name] = tensors[0]
        else:  # a value of the whole weight after all: quantized whole
            return scheme.quantize(weight, spec, config)
    return joined


def not_prepared(module: torch.nn.Module) -> RuntimeError:
    """The error of a quantized forward without the state `quantize()` gives
    its module (a call state of a quantized policy, with a float compute
    dtype; float8's scales)."""
    return RuntimeError(
        f"This {type(module).__name__} has a quantized forward but no call state of a "
        "quantized policy: quantize modules with `dtype_policies.quantize`. (If another "
        "thread is quantizing this model or applying a policy to it now, this call raced "
        "it: make such changes while no other thread calls the model.)"
    )


def check_finite(weight: torch.Tensor, name: str) -> None:
    """Every mode derives its scales from the weight's range, so one NaN or
    infinity would silently poison the whole row or group it sits in: refused."""
    found = non_finite_values(weight)
    if found is not None:
        raise NonFiniteWeightError(
            f"its weight '{name}' holds {found}; quantization needs finite weights"
        )
