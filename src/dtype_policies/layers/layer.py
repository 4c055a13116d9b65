"""`Layer`: a `torch.nn.Module` whose dtype policy does all the casting.

A layer casts the floating tensors among its call arguments to its compute
dtype, creates its weights in its variable dtype, and, inside `call`, reads
those weights in the compute dtype. A subclass that creates weights with
`add_weight` in `build` and computes in `call` supports mixed precision with no
casting code of its own. Calls run through the same call core as the modules
`apply_policy` prepares (`dtype_policies._core`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, cast

import torch
from torch.utils._pytree import tree_flatten

from dtype_policies import regularizers as regularizers_lib
from dtype_policies._core import sharded
from dtype_policies._core.call import read_weight, run_call
from dtype_policies._core.casting import first_tensor
from dtype_policies._core.checkpoints import check_before_loading, loads_as_torch
from dtype_policies._core.module_state import (
    STATE_KEY,
    ModuleState,
    Token,
    forget_kept_after_load,
    replace_top,
)
from dtype_policies._core.state import CallState, derive_call_state
from dtype_policies._dtypes import is_float_dtype
from dtype_policies._paths import named_module_paths
from dtype_policies.layers._build import BUILD_LOCK, build_arguments, wrap_build
from dtype_policies.layers._call_context import call_in_context, training_argument
from dtype_policies.layers._naming import auto_name
from dtype_policies.layers._weights import LayerWeights
from dtype_policies.policies import DTypePolicy, DTypePolicyMap
from dtype_policies.policies import get as get_policy
from dtype_policies.policies import serialize as serialize_policy


@dataclass(frozen=True)
class LayerApplication:
    """A layer's entry on its application stack (`ModuleState.applications`):
    the policy in force (a map resolves at `path`). The bottom entry is the
    layer's own (token `LAYER_OWN`); `apply_policy` pushes others on top."""

    policy: DTypePolicy
    path: str | None


LayerT = TypeVar("LayerT", bound="Layer")

LAYER_OWN = Token("LAYER_OWN")
"""The token of a layer's own policy, the bottom of its application stack."""

_CHILD_PLANNERS: list[Callable[[Any], None]] = []


def add_child_planner(planner: Callable[[Any], None]) -> None:
    """Calls `planner(layer)` whenever what a layer gives its torch children
    may have changed (its own policy, its path, its `autocast`): the upper
    floor that gives torch modules made inside a layer its policy
    (`apply.joining`) plans them again."""
    if planner not in _CHILD_PLANNERS:
        _CHILD_PLANNERS.append(planner)


def _warn_if_holding_weights(layer: torch.nn.Module, name: str, value: Any) -> None:
    """Weights kept in a container attribute are read as stored inside
    `call` (only attribute reads cast them): said once, when assigned."""
    items = value.values() if isinstance(value, dict) else value
    own = {id(p) for p in layer.__dict__.get("_parameters", {}).values() if p is not None}
    if own and any(id(item) in own for item in items):
        warnings.warn(
            f"{type(layer).__name__}.{name} holds weights of the layer in a "
            f"{type(value).__name__}: inside `call` they are read as stored, not in the "
            "compute dtype (only `self.<name>` reads cast). Read them by name instead: "
            "`getattr(self, name)`.",
            UserWarning,
            stacklevel=3,
        )


class Layer(LayerWeights, torch.nn.Module):
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
    # Floating buffers in the variable dtype read in the compute dtype inside
    # `call` (not in quantizable layers, whose buffers are what they store).
    _casts_buffers: ClassVar[bool] = True
    # `call`'s `training` argument (`_call_context.training_argument`), per class
    _call_training_argument: ClassVar[Any]

    # Leaf layers whose own `call` reads its weights in the compute dtype
    # directly need no autocast scope (a class's or an instance's setting;
    # Dense decides per instance).
    _casts_own_weights: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._call_training_argument = training_argument(cls)
        build = cls.__dict__.get("build")
        if build is not None and not getattr(build, "_dtype_policies_wrapped", False):
            cls.build = wrap_build(build)  # type: ignore[method-assign]  # wrapped on purpose

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
            raise ValueError(  # Keras's type and message
                f"Unrecognized keyword arguments passed to {type(self).__name__}: {kwargs}"
            )
        if name is not None and (not isinstance(name, str) or not name or "/" in name):
            raise ValueError(
                f"A layer name must be a non-empty string without '/'. Received: name={name!r}"
            )
        policy = get_policy(dtype)
        super().__init__()
        self._init_weight_tracking()
        self.__dict__[STATE_KEY] = ModuleState([(LAYER_OWN, LayerApplication(policy, None))])
        self.name = name or auto_name(type(self).__name__)
        self.built = False
        self._build_device: torch.device | None = None
        self._autocast = bool(autocast if experimental is None else experimental)
        self._trainable = bool(trainable)
        self._activity_regularizer = regularizers_lib.get(activity_regularizer)
        self._losses: list[torch.Tensor] = []
        self._refresh_policy_state()

    # ------------------------------------------------------------------ policy

    @property
    def dtype_policy(self) -> DTypePolicy:
        """The layer's policy (a `DTypePolicyMap` if one was given)."""
        return self._dtype_policy

    @dtype_policy.setter
    def dtype_policy(self, value: Any) -> None:
        """Sets the policy. A quantized policy on a built layer that has no
        `quantize` (a container such as `MultiHeadAttention`, a normalization
        layer) raises as Keras's does, with the policy unchanged: the layer
        would otherwise quantize nothing and say nothing. Unbuilt, such a layer
        computes with the policy's float source (a container hands the policy
        to the sublayers it builds)."""
        self._assign_policy(value)

    def _assign_policy(self, value: Any) -> None:
        """The `dtype_policy` setter's body (subclasses overriding the
        property call it as the base setter)."""
        policy = get_policy(value)
        self._refuse_if_sharded(policy)
        self._refuse_quantized_policy_once_built(policy)
        self._set_policy(policy)
        self._on_policy_change()

    def _refuse_quantized_policy_once_built(self, policy: DTypePolicy) -> None:
        """Layers with a `quantize` (`QuantizableLayer`) quantize instead."""
        mode = None if policy.is_map else policy.quantization_mode
        if mode is not None and self.built:
            if mode == "gptq":  # Keras checks this one before calling `quantize`
                raise ValueError(
                    f"Implicitly enabling GPTQ quantization by setting `dtype_policy` to "
                    f"'{policy.name}' is not supported. GPTQ requires a calibration dataset "
                    "and a `GPTQConfig` object.\n\nPlease use the `.quantize('gptq', "
                    "config=...)` method on the layer or model instead."
                )
            raise NotImplementedError(
                f"Layer {type(self).__name__} does not have a `quantize` method "
                f"implemented. Received: dtype_policy={policy.name!r} on the built layer "
                f"'{self.name}'; quantize its sublayers, or give the policy before it is built."
            )

    def _arguments_named_by(self) -> Callable[..., Any]:
        """The method whose signature names a call's arguments: `call` (the
        casting of inputs saturates an additive mask passed by position)."""
        return self.call

    def _refuse_if_sharded(self, policy: DTypePolicy) -> None:
        """A policy cannot change under FSDP2 (as `apply_policy` cannot)."""
        name = sharded.class_under_fsdp(type(self)).__name__
        sharded.refuse_sharded(self, f"{name}.dtype_policy = {policy.name!r}")

    def _set_policy(self, policy: DTypePolicy) -> None:
        """Sets the policy in force (inside a map, this layer's entry); a
        policy its torch children cannot take (an int8 child under float16)
        raises with the layer and its children as they were."""
        current = self._dtype_policy
        in_map = current.is_map and self._path is not None and not policy.is_map
        entries: Any = current  # a map when `in_map`
        before = entries[self._path] if in_map and self._path in entries else None
        self._put_policy(current, policy, in_map)
        try:
            self._refresh_policy_state()
            self._plan_children()
        except Exception:
            self._put_policy(current, before if in_map else current, in_map)
            self._refresh_policy_state()
            self._plan_children()
            raise

    def _put_policy(self, current: Any, policy: DTypePolicy | None, in_map: bool) -> None:
        if not in_map:
            self._dtype_policy = policy  # type: ignore[assignment]
            return
        if self._path in current:
            del current[self._path]
        if policy is not None:
            current[self._path] = policy

    def _plan_children(self) -> None:
        for planner in _CHILD_PLANNERS:
            planner(self)

    def _on_policy_change(self) -> None:
        """Hook for subclasses (quantizable layers quantize when built)."""

    @property
    def _dtype_policy(self) -> DTypePolicy:
        """The policy in force (a map when one was given): the top entry of the
        application stack, the layer's own unless `apply_policy` pushed one."""
        return self.__dict__[STATE_KEY].top.policy

    @_dtype_policy.setter
    def _dtype_policy(self, policy: DTypePolicy) -> None:
        replace_top(self, LayerApplication(policy, self._path))

    @property
    def _path(self) -> str | None:
        """The path the policy in force resolves at (see `path`)."""
        return self.__dict__[STATE_KEY].top.path

    @_path.setter
    def _path(self, path: str | None) -> None:
        replace_top(self, LayerApplication(self._dtype_policy, path))

    def _resolve_policy(self) -> DTypePolicy:
        policy = self._dtype_policy
        if policy.is_map:
            policy_map = cast(DTypePolicyMap, policy)
            return policy_map[self._path] if self._path is not None else policy_map.default_policy
        return policy

    def _refresh_policy_state(self) -> None:
        """Re-derives the call state from the policy and the layer's weights."""
        policy = self._resolve_policy()
        d = self.__dict__
        state = d[STATE_KEY]
        autocast_names = set(self._autocast_weight_names)
        if policy.compute_dtype != policy.variable_dtype:  # Keras's autocast scope
            autocast_names |= d.get("_mixed_weight_names", set())
        names = frozenset(name for name in autocast_names if self._parameters.get(name) is not None)
        buffer_names = frozenset(self._autocast_buffer_names(policy, state))
        state.call = derive_call_state(
            policy,
            # Keras's rule: a layer's call opens its autocast scope whether or not it
            # has weights yet: sublayers and weights made later, in `call`, read in
            # the compute dtype from their first call.
            has_weights=True,
            weight_names=names | buffer_names,
            buffer_names=buffer_names,
            autocast=self._autocast,
            cast_inputs=self._autocast and not self._is_container,
            casts_own_weights=self._is_container or self._casts_own_weights,
            convert_arrays=not self._is_container,
        )
        policy_or_map = self._dtype_policy
        d["_map_version"] = (
            cast(DTypePolicyMap, policy_or_map)._version if policy_or_map.is_map else None
        )
        state.casts.clear()

    def _autocast_buffer_names(self, policy: DTypePolicy, state: ModuleState) -> Iterator[str]:
        """The floating buffers registered in the variable dtype, which read in
        the compute dtype inside `call` as `apply_policy` casts a torch
        module's (not the tensors a quantized layer stores)."""
        if not (self._casts_buffers and self._buffers and is_float_dtype(policy.variable_dtype)):
            return
        variable = policy.torch_variable_dtype
        quantization = state.quantization
        stored = quantization.stored_names if quantization is not None else frozenset()
        registered = self.__dict__.get("_autocast_buffers")  # (not in older pickles)
        for name, buffer in self._buffers.items():
            if buffer is None or name in stored or not buffer.is_floating_point():
                continue
            if name in registered if registered is not None else buffer.dtype == variable:
                yield name

    def _check_map_edit(self) -> None:
        """Raises when an edit of the policy map asks of this built layer what
        only its own routes do (`QuantizableLayer`: a change of quantization)."""

    @property
    def _call_state(self) -> CallState:
        if (
            self._map_version is not None
            # (a map's `_version`: `_map_version` is set only for a map)
            and self._dtype_policy._version != self._map_version  # type: ignore[attr-defined]
        ):
            self._check_map_edit()
            self._refresh_policy_state()
            self._plan_children()  # the map may give them other entries now
        return self.__dict__[STATE_KEY].call

    @property
    def _compute_torch_dtype(self) -> torch.dtype | None:
        """The compute dtype as a torch dtype (`None` when it is not floating)."""
        return self._call_state.compute

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
        return None

    @property
    def autocast(self) -> bool:
        return self._autocast

    @autocast.setter
    def autocast(self, value: bool) -> None:
        self._autocast = bool(value)
        self._refresh_policy_state()
        self._plan_children()

    @property
    def path(self) -> str | None:
        """The layer's `/`-joined path: its name if it is the root layer, else
        its parent's path and the attribute it is stored under. Set when the
        layer (or a parent) is first built; `None` before."""
        return self._path

    def _assign_paths(self) -> None:
        placed = []
        if self._path is None:
            self._path = self.name
            placed.append(self)
        for path, module in named_module_paths(self, self._path):
            if isinstance(module, Layer) and module is not self and module._path is None:
                module._path = path
                module._refresh_policy_state()
                placed.append(module)
        for layer in placed:  # a map is read at their torch children's paths now
            layer._plan_children()

    # ------------------------------------------------------------------ build

    def build(self, *input_shapes: Any) -> None:
        """Creates the layer's weights; called with the input shape(s) on the
        first call unless called explicitly before. Override in subclasses."""

    def _finish_build(self) -> None:
        self.built = True
        if not self._trainable:  # the weights and sublayers `build` made freeze too
            self.trainable = False
        self._assign_paths()
        self._refresh_policy_state()
        self._plan_children()  # the torch modules `build` made, at their paths
        self._after_build()
        self.__dict__.get("_fresh_weight_names", set()).clear()  # now another name is an alias
        # built by `build(shape)` too: a call (compiled ones included) skips the build lock
        self.__dict__["_build_done"] = True

    def _after_build(self) -> None:
        """Hook run once after `build` (quantizable layers quantize here)."""

    def _check_before_build(self) -> None:
        """Hook run before `build`: what it raises leaves the layer unbuilt."""

    def _build_on_first_call(self, args: tuple, kwargs: dict[str, Any]) -> None:
        first = first_tensor((args, kwargs))
        self._build_device = first.device if first is not None else None
        shape_args, shape_kwargs = build_arguments(self, args, kwargs)
        self.build(*shape_args, **shape_kwargs)
        if not self.built:  # a `build` that was not wrapped (e.g. set on the instance)
            self._finish_build()

    # ------------------------------------------------------------------ weights

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, (list, tuple, dict)) and not isinstance(value, torch.nn.Module):
            _warn_if_holding_weights(self, name, value)
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        # Reached only when normal lookup fails: parameters, buffers, submodules.
        d = self.__dict__
        state = d.get(STATE_KEY)
        call = None if state is None else state.call
        if state is not None and call is not None and name in call.weight_names:
            parameter = d["_parameters"].get(name)
            if parameter is not None and not sharded.as_is(d, parameter):
                return read_weight(state.casts, name, parameter, False)
            buffer = d["_buffers"].get(name)
            if buffer is not None and name in call.buffer_names:
                return read_weight(state.casts, name, buffer, True)
        return super().__getattr__(name)

    _is_fsdp_managed_module = sharded.fsdp_managed

    def train(self, mode: bool = True) -> Layer:
        self.__dict__[STATE_KEY].casts.clear()  # a switch of mode drops kept casts (weight_casts)
        return super().train(mode)

    @loads_as_torch
    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        check_before_loading(self, state_dict, prefix, args, kwargs)  # the whole subtree, once
        self._adapt_checkpoint(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        forget_kept_after_load(self)

    def _adapt_checkpoint(self, state_dict: dict, prefix: str) -> None:
        """Rewrites this layer's own entries of a checkpoint (quantized layers)."""

    def _apply(self, fn: Callable, *args: Any, **kwargs: Any) -> Layer:
        # `.to()`, `.double()`, ... may change weight dtypes: re-derive call state.
        result = super()._apply(fn, *args, **kwargs)
        self._refresh_policy_state()
        return result

    # ------------------------------------------------------------------ call

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)

    def call(self, *args: Any, **kwargs: Any) -> Any:
        """The layer's computation. Override in subclasses."""
        raise NotImplementedError(f"Layer {type(self).__name__} does not implement `call`.")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # as Keras: `training` reaches `call` only if it takes it, and the
        # layers it calls without one (`call_in_context`)
        training = kwargs.pop("training", None)
        if not (self.built and self.__dict__.get("_build_done")):
            with BUILD_LOCK:  # another thread's first call may be building it
                if not self.built:
                    self._build_on_first_call(args, kwargs)
                self.__dict__["_build_done"] = self.built
        return call_in_context(self, args, kwargs, training)

    def _call(self, args: tuple, kwargs: dict) -> Any:
        outputs = run_call(self._call_state, super().__call__, args, kwargs, self)
        if self._activity_regularizer is not None:
            self.add_loss(self._activity_losses_of(outputs))
        return outputs

    def _activity_losses_of(self, outputs: Any) -> list[torch.Tensor]:
        """Keras's activity losses: one per output tensor, divided by its batch
        size (its first dimension; the loss itself for a scalar)."""
        losses = []
        for output in tree_flatten(outputs)[0]:
            if not isinstance(output, torch.Tensor):
                continue
            loss = self._activity_regularizer(output)
            if output.dim() > 0:
                batch = output.shape[0]
                loss = loss / batch if batch else torch.zeros_like(loss)
            losses.append(loss)
        return losses

    # ------------------------------------------------------------------ config

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments of this layer, JSON-friendly."""
        _ = self._call_state  # a map edited since: followed, or refused as a call would
        config: dict[str, Any] = {
            "name": self.name,
            "trainable": self.trainable,
            "dtype": serialize_policy(self._dtype_policy),
        }
        if self._activity_regularizer is not None:
            config["activity_regularizer"] = regularizers_lib.serialize(self._activity_regularizer)
        return config

    @classmethod
    def from_config(cls: type[LayerT], config: dict[str, Any]) -> LayerT:
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


Layer.build = wrap_build(Layer.build)  # type: ignore[method-assign]  # wrapped on purpose
Layer._call_training_argument = training_argument(Layer)


def resolved_policy(layer: Layer) -> DTypePolicy:
    """The policy `layer` computes by now: its own, or the entry of its map
    for its path, or what an `apply_policy` in force gave it (never a map)."""
    return layer._resolve_policy()


__all__ = ["DTypePolicyMap", "Layer"]
