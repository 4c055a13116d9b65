"""`Layer`: a `torch.nn.Module` whose dtype policy does all the casting.

A layer casts the floating tensors among its call arguments to its compute
dtype, creates its weights in its variable dtype, and, inside `call`, reads
those weights in the compute dtype. A subclass that creates weights with
`add_weight` in `build` and computes in `call` supports mixed precision with no
casting code of its own.
"""

from __future__ import annotations

import functools
import inspect
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

from dtype_policies import constraints as constraints_lib
from dtype_policies import initializers as initializers_lib
from dtype_policies import regularizers as regularizers_lib
from dtype_policies._casting import (
    AutocastScope,
    call_in_scope,
    cast_inputs,
    cast_weight,
    current_scope,
    first_tensor,
    scope_for_call,
    warn_if_cpu_float16,
)
from dtype_policies._dtypes import is_float_dtype, standardize_dtype, to_torch_dtype
from dtype_policies._paths import named_module_paths
from dtype_policies.policies import DTypePolicy
from dtype_policies.policy_map import DTypePolicyMap
from dtype_policies.serialization import get as get_policy
from dtype_policies.serialization import serialize as serialize_policy

_name_counts: dict[str, int] = {}
_name_lock = threading.Lock()


def to_snake_case(name: str) -> str:
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def auto_name(class_name: str) -> str:
    """A process-unique default layer name: `dense`, `dense_1`, `dense_2`, ..."""
    base = to_snake_case(class_name)
    with _name_lock:
        count = _name_counts.get(base, 0)
        _name_counts[base] = count + 1
    return base if count == 0 else f"{base}_{count}"


def _shape_of(value: Any) -> Any:
    """The shape(s) of a call argument: a tuple for a tensor or array, the same
    nesting for lists, tuples and dicts, `None` for anything else."""
    if isinstance(value, torch.Tensor) or (hasattr(value, "shape") and hasattr(value, "dtype")):
        return tuple(int(d) for d in value.shape)
    if isinstance(value, dict):
        return {key: _shape_of(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        shapes = [_shape_of(item) for item in value]
        return type(value)(*shapes) if hasattr(value, "_fields") else type(value)(shapes)
    return None


def _wrap_build(build: Callable) -> Callable:
    """Makes a subclass's `build` set up paths, policy and device, and run once."""

    @functools.wraps(build)
    def wrapped(self: Layer, *args: Any, **kwargs: Any) -> None:
        if self.built:
            return
        if self.__dict__.get("_building"):  # a subclass's build calling super().build()
            build(self, *args, **kwargs)
            return
        self.__dict__["_building"] = True
        try:
            self._assign_paths()
            self._refresh_policy_state()
            build(self, *args, **kwargs)
        finally:
            self.__dict__["_building"] = False
        self.built = True
        self._assign_paths()
        self._after_build()

    wrapped._dtype_policies_wrapped = True
    return wrapped


class Layer(torch.nn.Module):
    """Base class of layers whose dtype policy casts inputs and weights.

    Args:
        dtype: The layer's dtype policy: a `DTypePolicy`, a policy name such as
            `"mixed_bfloat16"`, a torch dtype, a serialized policy dict, or a
            `DTypePolicyMap` (the layer then uses the entry for its `path`).
            `None` takes the default policy in force at construction (see
            `dtype_policies.dtype_policy()` and `policy_scope`).
        autocast: Whether to cast floating call arguments to the compute dtype
            and to read weights created with `autocast=True` in the compute
            dtype inside `call`.
        name: The layer's name, used as its path when it is the root of a
            model. Defaults to a unique snake-case name of the class.
        trainable: Whether the layer's weights are trainable.
        activity_regularizer: Optional regularizer applied to the outputs of
            each call; its value is reported in `losses`.

    Subclasses create weights in `build(input_shape)` with `add_weight` and
    compute in `call(...)`:

    >>> import torch
    >>> from dtype_policies.layers import Layer
    >>> class SimpleDense(Layer):
    ...     def __init__(self, units, **kwargs):
    ...         super().__init__(**kwargs)
    ...         self.units = units
    ...     def build(self, input_shape):
    ...         self.kernel = self.add_weight(shape=(input_shape[-1], self.units))
    ...     def call(self, inputs):
    ...         return inputs @ self.kernel  # kernel is bfloat16 here
    >>> layer = SimpleDense(10, dtype="mixed_bfloat16")
    >>> layer(torch.ones(2, 4)).dtype
    torch.bfloat16
    >>> layer.kernel.dtype  # outside `call`, the float32 parameter itself
    torch.float32
    """

    # Containers neither cast inputs nor open autocast scopes: their sublayers do.
    _is_container: ClassVar[bool] = False
    # Leaf layers whose own `call` reads its weights in the compute dtype
    # directly need no autocast scope (set per instance by such layers).
    _casts_own_weights = False
    # Quantization modes this layer class implements (filled in by subclasses).
    _supported_quantization_modes: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        build = cls.__dict__.get("build")
        if build is not None and not getattr(build, "_dtype_policies_wrapped", False):
            cls.build = _wrap_build(build)

    def __init__(
        self,
        *,
        dtype: Any = None,
        autocast: bool = True,
        name: str | None = None,
        trainable: bool = True,
        activity_regularizer: Any = None,
        **kwargs: Any,
    ) -> None:
        experimental = kwargs.pop("experimental_autocast", None)
        if kwargs:
            raise TypeError(
                f"Unrecognized keyword arguments passed to {type(self).__name__}: {kwargs}"
            )
        if name is not None and (not isinstance(name, str) or not name or "/" in name):
            raise ValueError(
                f"A layer name must be a non-empty string without '/'. Received: name={name!r}"
            )
        policy = get_policy(dtype)
        super().__init__()
        d = self.__dict__
        d["_autocast_weight_names"] = set()
        d["_declared_trainable"] = {}
        d["_weight_regularizers"] = {}
        d["_weight_constraints"] = {}
        d["_small_weight_casts"] = {}
        self.name = name or auto_name(type(self).__name__)
        self.built = False
        self._path: str | None = None
        self._build_device: torch.device | None = None
        self._dtype_policy = policy
        self._autocast = bool(autocast if experimental is None else experimental)
        self._trainable = bool(trainable)
        self._activity_regularizer = regularizers_lib.get(activity_regularizer)
        self._activity_losses: list[torch.Tensor] = []
        self._refresh_policy_state()

    # ------------------------------------------------------------------ policy

    @property
    def dtype_policy(self) -> DTypePolicy:
        """The layer's policy (a `DTypePolicyMap` if one was given)."""
        return self._dtype_policy

    @dtype_policy.setter
    def dtype_policy(self, value: Any) -> None:
        policy = get_policy(value)
        current = self._dtype_policy
        if isinstance(current, DTypePolicyMap) and self._path is not None:
            if isinstance(policy, DTypePolicyMap):
                self._dtype_policy = policy
            else:
                if self._path in current:
                    del current[self._path]
                current[self._path] = policy
        else:
            self._dtype_policy = policy
        self._refresh_policy_state()
        self._on_policy_change()

    def _on_policy_change(self) -> None:
        """Hook for subclasses (quantizable layers quantize when built)."""

    def _resolve_policy(self) -> DTypePolicy:
        policy = self._dtype_policy
        if isinstance(policy, DTypePolicyMap):
            return policy[self._path] if self._path is not None else policy.default_policy
        return policy

    def _refresh_policy_state(self) -> None:
        policy = self._resolve_policy()
        compute = policy.compute_dtype
        compute_is_float = is_float_dtype(compute)
        compute_torch = to_torch_dtype(compute) if compute_is_float else None
        input_dtype = self.input_dtype
        input_cast = None
        if self._autocast and not self._is_container and is_float_dtype(input_dtype):
            input_cast = to_torch_dtype(input_dtype)
        d = self.__dict__
        d["_effective_policy"] = policy
        d["_compute_torch_dtype"] = compute_torch
        d["_input_cast_dtype"] = input_cast
        # "Mixed": weights must be cast to the compute dtype when read in `call`.
        # Besides the policy saying so, that is the case when a built layer's
        # weights have another dtype (its policy was changed, or `.to()` was used).
        d["_is_mixed"] = compute_is_float and (
            compute != policy.variable_dtype
            or any(
                parameter is not None and parameter.dtype != compute_torch
                for name, parameter in self._parameters.items()
                if name in self._autocast_weight_names
            )
        )
        d["_own_scope"] = AutocastScope(compute_torch) if compute_torch is not None else None
        d["_check_cpu_float16"] = compute_torch is torch.float16
        d["_map_version"] = (
            self._dtype_policy._version if isinstance(self._dtype_policy, DTypePolicyMap) else None
        )

    @property
    def compute_dtype(self) -> str:
        """The dtype this layer computes in, e.g. `"bfloat16"`."""
        return self._resolve_policy().compute_dtype

    @property
    def variable_dtype(self) -> str:
        """The dtype of the weights this layer creates, e.g. `"float32"`."""
        return self._resolve_policy().variable_dtype

    @property
    def dtype(self) -> str:
        """Alias of `variable_dtype`."""
        return self.variable_dtype

    @property
    def input_dtype(self) -> str:
        """The dtype floating call arguments are cast to (the compute dtype)."""
        return self._resolve_policy().compute_dtype

    @property
    def quantization_mode(self) -> str | None:
        """The quantization mode this layer runs with, or `None`.

        A quantized policy on a layer that cannot be quantized (a container, a
        normalization layer, ...) gives `None`: such a layer computes with the
        policy's float source.
        """
        mode = self._resolve_policy().quantization_mode
        return mode if mode in self._supported_quantization_modes else None

    @property
    def autocast(self) -> bool:
        return self._autocast

    @autocast.setter
    def autocast(self, value: bool) -> None:
        self._autocast = bool(value)
        self._refresh_policy_state()

    @property
    def path(self) -> str | None:
        """The layer's `/`-joined path: its name if it is the root layer, else
        its parent's path and the attribute it is stored under. Set when the
        layer (or a parent) is first built; `None` before."""
        return self._path

    def _assign_paths(self) -> None:
        if self._path is None:
            self._path = self.name
        for path, module in named_module_paths(self, self._path):
            if isinstance(module, Layer) and module is not self and module._path is None:
                module._path = path
                module._refresh_policy_state()

    # ------------------------------------------------------------------ build

    def build(self, *input_shapes: Any) -> None:
        """Creates the layer's weights; called with the input shape(s) on the
        first call unless called explicitly before. Override in subclasses."""

    def _after_build(self) -> None:
        """Hook run once after `build` (quantizable layers quantize here)."""

    def _build_shapes(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        parameters = [
            p
            for p in inspect.signature(self.build).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        shape_names = [p.name for p in parameters if p.name.endswith("_shape")]
        if len(parameters) <= 1 or len(shape_names) < 2:
            first = args[0] if args else next(iter(kwargs.values()), None)
            return ((_shape_of(first),), {}) if parameters else ((), {})
        bound = inspect.signature(self.call).bind_partial(*args, **kwargs).arguments
        shapes = {name: _shape_of(bound.get(name[: -len("_shape")])) for name in shape_names}
        return (), shapes

    def _build_on_first_call(self, args: tuple, kwargs: dict[str, Any]) -> None:
        first = first_tensor((args, kwargs))
        self._build_device = first.device if first is not None else None
        shape_args, shape_kwargs = self._build_shapes(args, kwargs)
        self.build(*shape_args, **shape_kwargs)
        if not self.built:  # a `build` that was not wrapped (e.g. set on the instance)
            self.built = True
            self._assign_paths()
            self._after_build()

    # ------------------------------------------------------------------ weights

    def add_weight(
        self,
        *args: Any,
        shape: Any = None,
        initializer: Any = None,
        dtype: Any = None,
        trainable: bool = True,
        autocast: bool = True,
        regularizer: Any = None,
        constraint: Any = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> torch.nn.Parameter:
        """Creates a weight, registers it as a `torch.nn.Parameter` and returns it.

        Args:
            shape: The weight's shape; `None` means a scalar.
            initializer: A name (`"glorot_uniform"`, `"he_normal"`, `"zeros"`,
                `"ones"`, ...), an initializer object or callable
                `(shape, dtype) -> tensor`, or a number. Defaults to
                `"glorot_uniform"` for floating weights and `"zeros"` otherwise.
            dtype: Defaults to the layer's variable dtype.
            trainable: Whether the optimizer should update it (`requires_grad`).
            autocast: Whether reads inside `call` give it in the compute dtype.
            regularizer: Optional regularizer; its loss is in `layer.losses`,
                computed on the weight in its own (variable) dtype.
            constraint: Optional constraint applied by `apply_constraints()`.
            name: The attribute name it is registered under. Assigning the
                result to an attribute registers it under that attribute name.

        Positional arguments follow Keras 3 (`shape, initializer, dtype`), or the
        tf.keras form (`name, shape, dtype, initializer`) when the first one is a
        string.
        """
        if "experimental_autocast" in kwargs:
            autocast = kwargs.pop("experimental_autocast")
        if kwargs:
            raise TypeError(f"add_weight() got unexpected keyword arguments: {sorted(kwargs)}")
        given = {"shape": shape, "initializer": initializer, "dtype": dtype, "name": name}
        if args:
            order = (
                ("name", "shape", "dtype", "initializer")
                if isinstance(args[0], str)
                else ("shape", "initializer", "dtype")
            )
            if len(args) > len(order):
                raise TypeError(
                    f"add_weight() takes at most {len(order)} positional arguments "
                    f"but {len(args)} were given."
                )
            for key, value in zip(order, args):
                if given[key] is not None:
                    raise ValueError(f"add_weight() got multiple values for argument '{key}'.")
                given[key] = value
        shape, initializer, dtype, name = (
            given["shape"],
            given["initializer"],
            given["dtype"],
            given["name"],
        )
        shape = self._standardize_weight_shape(shape, name)
        dtype_name = self.variable_dtype if dtype is None else standardize_dtype(dtype)
        torch_dtype = to_torch_dtype(dtype_name)
        floating = is_float_dtype(dtype_name)
        if initializer is None:
            initializer = "glorot_uniform" if floating else "zeros"
        value = self._initial_value(initializer, shape, torch_dtype)
        name = self._unique_weight_name(name)
        requires_grad = bool(trainable and self._trainable and value.is_floating_point())
        parameter = torch.nn.Parameter(value, requires_grad=requires_grad)
        self.register_parameter(name, parameter)
        self._declared_trainable[name] = bool(trainable)
        if autocast and floating:
            self._autocast_weight_names.add(name)
        if regularizer is not None:
            self._weight_regularizers[name] = regularizers_lib.get(regularizer)
        if constraint is not None:
            self._weight_constraints[name] = constraints_lib.get(constraint)
        self._refresh_policy_state()
        return parameter

    def _standardize_weight_shape(self, shape: Any, name: str | None) -> tuple[int, ...]:
        if shape is None:
            return ()
        if isinstance(shape, int):
            shape = (shape,)
        try:
            dims = tuple(shape)
        except TypeError:
            raise TypeError(f"Weight shape must be a tuple of ints. Received: {shape!r}") from None
        if any(d is None or not isinstance(d, int) or d < 0 for d in dims):
            raise ValueError(
                f"Weight '{name or 'variable'}' of layer '{self.name}' needs a fully defined "
                f"shape of non-negative ints. Received: shape={shape!r}"
            )
        return dims

    def _initial_value(self, initializer: Any, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        device = self._weight_device()
        if isinstance(initializer, torch.Tensor):
            if tuple(initializer.shape) != shape:
                raise ValueError(
                    f"Initial value has shape {tuple(initializer.shape)}, expected {shape}."
                )
            return initializer.detach().to(device=device, dtype=dtype).clone()
        init = initializers_lib.get(initializer)
        if isinstance(init, initializers_lib.Initializer):
            value = init(shape, dtype, device=device)
        else:
            value = torch.as_tensor(init(shape, dtype=dtype), device=device)
        if tuple(value.shape) != shape or value.dtype != dtype:
            value = value.to(dtype).reshape(shape)
        return value

    def _weight_device(self) -> torch.device | None:
        if self._build_device is not None:
            return self._build_device
        first = next(iter(self._parameters.values()), None)
        return first.device if first is not None else None

    def _unique_weight_name(self, name: str | None) -> str:
        if name is not None:
            if not isinstance(name, str) or not name or "." in name:
                raise ValueError(
                    f"Weight names must be non-empty strings without '.'. Received: {name!r}"
                )
            if name in self._parameters or name in self._buffers or name in self._modules:
                raise ValueError(f"Layer '{self.name}' already has a weight or sublayer '{name}'.")
            return name
        base, index = "variable", 0
        name = base
        while name in self._parameters or hasattr(self, name):
            index += 1
            name = f"{base}_{index}"
        return name

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, Layer) and value._path is None:
            path = self.__dict__.get("_path")
            if path is not None:  # a sublayer added after this layer got its path
                value._path = f"{path}/{name}"
                value._assign_paths()
        if isinstance(value, torch.nn.Parameter):
            parameters = self.__dict__.get("_parameters")
            if parameters is not None:
                for existing, parameter in parameters.items():
                    if parameter is value and existing != name:
                        self._rename_weight(existing, name)
                        return
        super().__setattr__(name, value)

    def _rename_weight(self, old: str, new: str) -> None:
        """Re-registers weight `old` under the attribute name `new`, in place."""
        if new in self._parameters:
            raise ValueError(f"Layer '{self.name}' already has a weight named '{new}'.")
        self._parameters = {
            (new if key == old else key): value for key, value in self._parameters.items()
        }
        for table in (
            self._declared_trainable,
            self._weight_regularizers,
            self._weight_constraints,
        ):
            if old in table:
                table[new] = table.pop(old)
        self._small_weight_casts.pop(old, None)
        if old in self._autocast_weight_names:
            self._autocast_weight_names.discard(old)
            self._autocast_weight_names.add(new)

    def __getattr__(self, name: str) -> Any:
        # Reached only when normal lookup fails: parameters, buffers, submodules.
        parameters = self.__dict__.get("_parameters")
        if parameters is not None and name in parameters:
            parameter = parameters[name]
            if parameter is not None and name in self.__dict__["_autocast_weight_names"]:
                scope = current_scope()
                if scope is not None and scope.dtype is not None and parameter.dtype != scope.dtype:
                    return cast_weight(self.__dict__["_small_weight_casts"], name, parameter, scope)
            return parameter
        return super().__getattr__(name)

    def __getstate__(self) -> dict[str, Any]:
        # Weight casts made in grad mode are graph nodes, not copyable state.
        state = self.__dict__.copy()
        state["_small_weight_casts"] = {}
        return state

    def _apply(self, fn: Callable, *args: Any, **kwargs: Any) -> Layer:
        # `.to()`, `.double()`, ... may change weight dtypes: re-derive call state.
        result = super()._apply(fn, *args, **kwargs)
        self._small_weight_casts.clear()
        self._refresh_policy_state()
        return result

    @property
    def weights(self) -> list[torch.nn.Parameter]:
        """All weights of the layer and its sublayers."""
        return list(self.parameters())

    @property
    def trainable_weights(self) -> list[torch.nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    @property
    def non_trainable_weights(self) -> list[torch.nn.Parameter]:
        return [p for p in self.parameters() if not p.requires_grad]

    @property
    def trainable(self) -> bool:
        return self._trainable

    @trainable.setter
    def trainable(self, value: bool) -> None:
        for layer in self._layers_in_tree():
            layer._trainable = bool(value)
            for name, parameter in layer._parameters.items():
                if parameter is not None and parameter.is_floating_point():
                    parameter.requires_grad_(
                        bool(value) and layer._declared_trainable.get(name, True)
                    )

    def _layers_in_tree(self) -> Iterator[Layer]:
        for module in self.modules():
            if isinstance(module, Layer):
                yield module

    def _flatten_layers(self, include_self: bool = True, recursive: bool = True) -> list[Layer]:
        """This layer (optionally) and its sublayers, depth first (Keras's helper)."""
        if recursive:
            found = list(self._layers_in_tree())
        else:
            found = [self, *(m for m in self.children() if isinstance(m, Layer))]
        return found if include_self else found[1:]

    @property
    def losses(self) -> list[torch.Tensor]:
        """Regularization losses of this layer and its sublayers: weight
        regularizers (on the weights in their variable dtype) and the activity
        regularizers of the last call."""
        losses = []
        for layer in self._layers_in_tree():
            for name, regularizer in layer._weight_regularizers.items():
                losses.append(regularizer(layer._parameters[name]))
            losses.extend(layer._activity_losses)
        return losses

    @torch.no_grad()
    def apply_constraints(self) -> None:
        """Projects constrained weights (this layer and sublayers) in place.
        Call it after `optimizer.step()`."""
        for layer in self._layers_in_tree():
            for name, constraint in layer._weight_constraints.items():
                parameter = layer._parameters[name]
                parameter.copy_(constraint(parameter))

    # ------------------------------------------------------------------ call

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)

    def call(self, *args: Any, **kwargs: Any) -> Any:
        """The layer's computation. Override in subclasses."""
        raise NotImplementedError(f"Layer {type(self).__name__} does not implement `call`.")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.built:
            self._build_on_first_call(args, kwargs)
        if self._map_version is not None and self._dtype_policy._version != self._map_version:
            self._refresh_policy_state()
        args, kwargs = cast_inputs(args, kwargs, self._input_cast_dtype)
        if self._check_cpu_float16:
            first = first_tensor((args, kwargs))
            if first is not None:
                warn_if_cpu_float16(first.device)
        scope = (
            None
            if self._is_container or self._casts_own_weights
            else scope_for_call(
                self._is_mixed, self._autocast, self._compute_torch_dtype, self._own_scope
            )
        )
        outputs = call_in_scope(super().__call__, scope, args, kwargs)
        if self._activity_regularizer is not None:
            self._activity_losses = [self._activity_regularizer(outputs)]
        return outputs

    # ------------------------------------------------------------------ config

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments of this layer, JSON-friendly."""
        config: dict[str, Any] = {
            "name": self.name,
            "trainable": self.trainable,
            "dtype": serialize_policy(self._dtype_policy),
        }
        if self._activity_regularizer is not None:
            config["activity_regularizer"] = regularizers_lib.serialize(self._activity_regularizer)
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Layer:
        """Builds a layer from `get_config()` output."""
        try:
            return cls(**config)
        except Exception as e:
            raise TypeError(
                f"Error when deserializing class '{cls.__name__}' using config={config}.\n\n"
                f"Exception encountered: {e}"
            ) from e

    def extra_repr(self) -> str:
        return f"name={self.name!r}, dtype_policy={self._resolve_policy().name!r}"


Layer.build = _wrap_build(Layer.build)
