"""Weight creation and tracking for layers (Keras's `add_weight`, trainable
flags, regularization losses and constraints), as a mixin of `Layer`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from dtype_policies import constraints as constraints_lib
from dtype_policies import initializers as initializers_lib
from dtype_policies import regularizers as regularizers_lib
from dtype_policies._core.compose import ModuleMixin
from dtype_policies._core.module_state import STATE_KEY, quantization_of
from dtype_policies._dtypes import is_float_dtype, standardize_dtype, to_torch_dtype
from dtype_policies.layers._call_context import checked_losses


class LayerWeights(ModuleMixin):  # `Layer` combines it with `torch.nn.Module`
    """The weight-tracking half of `Layer` (see `Layer.add_weight`)."""

    # Written by `_init_weight_tracking`.
    _autocast_weight_names: set[str]
    _fresh_weight_names: set[str]
    _declared_trainable: dict[str, bool]
    _weight_regularizers: dict[str, Any]
    _weight_constraints: dict[str, Any]

    if TYPE_CHECKING:  # what `Layer` provides
        name: str
        _trainable: bool
        _build_device: torch.device | None
        _losses: list[torch.Tensor]

        @property
        def _path(self) -> str | None: ...
        @_path.setter
        def _path(self, path: str | None) -> None: ...
        @property
        def variable_dtype(self) -> str: ...
        def _refresh_policy_state(self) -> None: ...
        def _assign_paths(self) -> None: ...

    def _init_weight_tracking(self) -> None:
        d = self.__dict__
        d["_autocast_weight_names"] = set()
        d["_fresh_weight_names"] = set()  # made by add_weight, not yet named by an attribute
        d["_declared_trainable"] = {}
        d["_weight_regularizers"] = {}
        d["_weight_constraints"] = {}

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
        aggregation: str | None = "none",
        overwrite_with_gradient: bool = False,
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
            autocast: Whether reads inside `call` give it in the compute dtype
                (a floating weight of a dtype other than the variable dtype:
                under a mixed policy, as Keras's variables).
            regularizer: Optional regularizer; its loss is in `layer.losses`,
                computed on the weight in its own (variable) dtype.
            constraint: Optional constraint applied by `apply_constraints()`.
            name: The attribute name it is registered under. Assigning the
                result to an attribute registers it under that attribute name.
            aggregation: Keras's multi-replica aggregation (`None`, `"none"`,
                `"mean"`, `"sum"`, `"only_first_replica"`), validated as Keras
                does and kept as the parameter's `aggregation` attribute; torch's
                data-parallel wrappers average gradients whatever it says.
            overwrite_with_gradient: Keras's flag for variables an optimizer
                overwrites with their gradient; only `False` (torch's optimizers
                always step from gradients): `True` raises `NotImplementedError`.

        Positional arguments follow Keras 3 (`shape, initializer, dtype`), or the
        tf.keras form (`name, shape, dtype, initializer`) when the first one is a
        string.
        """
        if "experimental_autocast" in kwargs:
            autocast = kwargs.pop("experimental_autocast")
        if kwargs:
            raise TypeError(f"add_weight() got unexpected keyword arguments: {sorted(kwargs)}")
        if aggregation not in (None, "none", "mean", "sum", "only_first_replica"):
            raise ValueError(
                "Invalid value for argument `aggregation`. Expected one of `None`, `'none'`, "
                f"`'mean'`, `'sum'`, `'only_first_replica'`. Received: aggregation={aggregation}"
            )
        if not isinstance(overwrite_with_gradient, bool):
            raise TypeError(
                f"`overwrite_with_gradient` must be a boolean. Received: {overwrite_with_gradient}"
            )
        if overwrite_with_gradient:
            raise NotImplementedError(
                "add_weight(overwrite_with_gradient=True) is not supported: torch's optimizers "
                "update every parameter from its gradient. Keep such a value in a buffer "
                "(register_buffer) and write it in your layer's call."
            )
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
        # every argument checked before anything is registered
        regularizer = None if regularizer is None else regularizers_lib.get(regularizer)
        constraint = None if constraint is None else constraints_lib.get(constraint)
        value = self._initial_value(initializer, shape, torch_dtype)
        name = self._unique_weight_name(name)
        requires_grad = bool(trainable and self._trainable and value.is_floating_point())
        parameter = torch.nn.Parameter(value, requires_grad=requires_grad)
        parameter.aggregation = aggregation or "none"  # type: ignore[attr-defined]
        self.register_parameter(name, parameter)
        self.__dict__.setdefault("_fresh_weight_names", set()).add(name)  # (older pickles)
        self._declared_trainable[name] = bool(trainable)
        if regularizer is not None:
            self._weight_regularizers[name] = regularizer
        if constraint is not None:
            self._weight_constraints[name] = constraint
        if not (autocast and floating) and name in self._autocast_weight_names:
            self._autocast_weight_names.discard(name)
            self._refresh_policy_state()  # `register_parameter` refreshed it with the name
        elif autocast and floating and name not in self._autocast_weight_names:
            # As Keras's variables: a floating weight of another dtype (float16,
            # float64) reads in the compute dtype when the policy is mixed.
            self.__dict__.setdefault("_mixed_weight_names", set()).add(name)
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
        if isinstance(value, LayerWeights) and value._path is None:
            path = self._path if STATE_KEY in self.__dict__ else None
            if path is not None:  # a sublayer added after this layer got its path
                value._path = f"{path}/{name}"
                value._assign_paths()
        if isinstance(value, torch.nn.Parameter):
            parameters = self.__dict__.get("_parameters")
            if parameters is not None:
                fresh = self.__dict__.get("_fresh_weight_names", set())
                for existing, parameter in parameters.items():
                    if parameter is value and existing in fresh:
                        # `self.kernel = self.add_weight(...)`: the weight takes the
                        # attribute's name, once; a later name for it is an
                        # alias, as in torch (a tied weight)
                        fresh.discard(existing)
                        if existing != name:
                            self._rename_weight(existing, name)
                            return
                        break
        super().__setattr__(name, value)
        frozen = not self.__dict__.get("_trainable", True)
        if frozen and isinstance(value, torch.nn.Module) and not isinstance(value, LayerWeights):
            _set_torch_trainable(value, False)  # made inside a frozen layer
        state = self.__dict__.get(STATE_KEY)
        if isinstance(value, torch.nn.Module) and state is not None and state.call is not None:
            self._refresh_policy_state()  # whether the layer has weights may change

    def register_parameter(self, name: str, param: torch.nn.Parameter | None) -> None:
        # As Keras's variables: a weight registered on a layer in its variable
        # dtype (by `add_weight`, or `self.w = torch.nn.Parameter(...)`) reads
        # in the compute dtype inside `call` (`add_weight(autocast=False)`
        # opts out; a float64 weight of a float32 layer stays float64), and is
        # trainable as the layer is.
        registered = self._parameters.get(name) if "_parameters" in self.__dict__ else None
        super().register_parameter(name, param)  # type: ignore[misc]
        names = self.__dict__.get("_autocast_weight_names")
        if names is None:
            return
        if param is not None and param.dtype == to_torch_dtype(self.variable_dtype):
            names.add(name)
        else:
            names.discard(name)
        if param is not None and param.is_floating_point():
            if param is not registered:  # the same one again (`self.kernel = add_weight(...)`)
                self._declared_trainable[name] = param.requires_grad
            if not self._trainable:
                param.requires_grad_(False)
        if self.__dict__.get(STATE_KEY) is not None:
            self._refresh_policy_state()

    def register_buffer(
        self, name: str, tensor: torch.Tensor | None, persistent: bool = True
    ) -> None:
        super().register_buffer(name, tensor, persistent)  # type: ignore[misc]
        # As a weight: a floating buffer registered in the variable dtype reads
        # in the compute dtype, decided now (a later `.double()` or policy
        # change keeps it so, as `apply_policy` keeps a module's).
        names = self.__dict__.setdefault("_autocast_buffers", set())
        if (
            tensor is not None
            and tensor.is_floating_point()
            and self.__dict__.get(STATE_KEY) is not None
            and tensor.dtype == to_torch_dtype(self.variable_dtype)
        ):
            names.add(name)
        else:
            names.discard(name)
        if self.__dict__.get(STATE_KEY) is not None:
            self._refresh_policy_state()  # a floating buffer reads in the compute dtype

    def _rename_weight(self, old: str, new: str) -> None:
        """Re-registers weight `old` under the attribute name `new`, in place.
        A weight already named `new` (`self.kernel = self.add_weight(...)`
        again) keeps its place under the name `old` had, as Keras keeps every
        weight it made: the attribute is the new one's."""
        # what else held the name goes, as torch's `__setattr__` of a parameter does
        self.__dict__.pop(new, None)
        for registry in ("_buffers", "_modules"):
            self.__dict__[registry].pop(new, None)
        self.__dict__["_non_persistent_buffers_set"].discard(new)
        names = {old: new, new: old}
        self.__dict__["_parameters"] = {
            names.get(key, key): value for key, value in self._parameters.items()
        }
        for table in (
            self._declared_trainable,
            self._weight_regularizers,
            self._weight_constraints,
        ):
            moved = {names[key]: table.pop(key) for key in (old, new) if key in table}
            table.update(moved)
        self.__dict__[STATE_KEY].casts.clear()
        for held in (self._autocast_weight_names, self.__dict__.get("_mixed_weight_names", set())):
            present = {key for key in (old, new) if key in held}
            held.difference_update(present)  # type: ignore[attr-defined]
            held.update(names[key] for key in present)  # type: ignore[attr-defined]
        self._refresh_policy_state()

    @property
    def weights(self) -> list[torch.Tensor]:
        """All weights of the layer and its sublayers: its parameters, then
        the stored tensors of its quantized weights (as Keras lists a
        quantized layer's integer kernel and scales among its variables)."""
        return list(self.parameters()) + self._quantized_tensors()

    @property
    def trainable_weights(self) -> list[torch.Tensor]:
        """The parameters that train: none in a layer whose `trainable` is
        False, whatever its sublayers say (Keras's)."""
        if not self._trainable:
            return []
        return [p for p in self.parameters() if p.requires_grad]

    @property
    def non_trainable_weights(self) -> list[torch.Tensor]:
        """The parameters that do not train, then the stored tensors of
        quantized weights (int8/int4 values, scales, zero points; float8's
        scales and histories, which Keras counts as trainable because its
        optimizer overwrites them: here the forward updates them)."""
        frozen: list[torch.Tensor] = [
            p for p in self.parameters() if not (p.requires_grad and self._trainable)
        ]
        return frozen + self._quantized_tensors()

    def _quantized_tensors(self) -> list[torch.Tensor]:
        found: list[torch.Tensor] = []
        for module in self.modules():
            quantized = quantization_of(module)
            if quantized is None:
                continue
            for name in quantized.buffer_names:
                tensor = module._buffers.get(name)
                if tensor is not None:
                    found.append(tensor)
        return found

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
            # the torch modules made inside it: frozen, then as they were
            for child in layer.children():
                if not isinstance(child, LayerWeights):
                    _set_torch_trainable(child, bool(value))

    def _layers_in_tree(self) -> Iterator[Any]:
        for module in self.modules():
            if isinstance(module, LayerWeights):
                yield module

    def _flatten_layers(self, include_self: bool = True, recursive: bool = True) -> list[Any]:
        """This layer (optionally) and its sublayers, depth first (Keras's helper)."""
        if recursive:
            found = list(self._layers_in_tree())
        else:
            found = [self, *(m for m in self.children() if isinstance(m, LayerWeights))]
        return found if include_self else found[1:]

    def add_loss(self, loss: Any) -> None:
        """Adds a loss (a tensor, or a structure of tensors) to this layer's
        `losses`, as Keras's `add_loss`: called inside `call`, it belongs to
        the current forward (the outermost layer call clears the losses of
        its layer tree first).

        Example:

        >>> import torch
        >>> from dtype_policies import layers
        >>> class Penalised(layers.Layer):
        ...     def call(self, x):
        ...         self.add_loss(x.abs().mean())
        ...         return x
        >>> shared = Penalised()
        >>> model = layers.Sequential([shared, layers.Dense(2), shared])
        >>> _ = model(torch.ones(1, 3))
        >>> len(model.losses)  # both calls of the shared layer
        2
        """
        self._losses.extend(checked_losses(loss))

    def __getstate__(self) -> dict[str, Any]:
        """The layer's state for pickle and `copy.deepcopy`, without the
        losses of its last forward (tensors of that forward's graph, which
        deepcopy refuses; a copy starts with none, as after `__init__`)."""
        base = getattr(super(), "__getstate__", None)
        state = base() if base is not None else self.__dict__
        if state.get("_losses"):
            state = {**state, "_losses": []}
        return state

    def _clear_losses(self) -> None:
        for layer in self._layers_in_tree():
            layer._losses.clear()

    @property
    def losses(self) -> list[torch.Tensor]:
        """The losses of this layer and its sublayers, in Keras's order: the
        ones added during the last forward (`add_loss`, and each activity
        regularizer's: one per output tensor, divided by its batch size),
        then the regularizers' of the trainable weights (on the weights in
        their variable dtype)."""
        layers = list(self._layers_in_tree())
        losses = [loss for layer in layers for loss in layer._losses]
        for layer in layers:
            for name, regularizer in layer._weight_regularizers.items():
                weight = layer._parameters[name]
                if weight.requires_grad:  # Keras: the trainable weights' only
                    losses.append(regularizer(weight))
        return losses

    @torch.no_grad()
    def apply_constraints(self) -> None:
        """Projects constrained weights (this layer and sublayers) in place.
        Call it after `optimizer.step()`."""
        for layer in self._layers_in_tree():
            for name, constraint in layer._weight_constraints.items():
                parameter = layer._parameters[name]
                parameter.copy_(constraint(parameter))


_DECLARED = "_dtype_policies_declared_trainable"  # a torch parameter's flag before freezing


def _set_torch_trainable(module: torch.nn.Module, trainable: bool) -> None:
    """Freezes (or gives back as they were) the parameters of a torch module
    made inside a layer, and of its torch submodules."""
    for submodule in module.modules():
        if isinstance(submodule, LayerWeights):
            continue  # a layer of its own below a torch container: its setter's business
        for parameter in submodule._parameters.values():
            if parameter is None or not parameter.is_floating_point():
                continue
            if trainable:
                parameter.requires_grad_(parameter.__dict__.pop(_DECLARED, parameter.requires_grad))
            else:
                parameter.__dict__.setdefault(_DECLARED, parameter.requires_grad)
                parameter.requires_grad_(False)
