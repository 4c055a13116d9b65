"""`Sequential`: a plain stack of layers, each feeding the next."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch

from dtype_policies.layers.layer import Layer
from dtype_policies.layers.serialization import deserialize_layer, serialize_layer


def _accepts_training(module: torch.nn.Module) -> bool:
    call = module.call if isinstance(module, Layer) else module.forward
    try:
        return "training" in inspect.signature(call).parameters
    except (TypeError, ValueError):
        return False


class Sequential(Layer):
    """A stack of layers applied in order.

    Children are registered under their position (`"0"`, `"1"`, ...), as in
    `torch.nn.Sequential`, so `state_dict()` keys and layer paths
    (`"<name>/0"`, ...) depend only on the architecture, not on layer
    names. Each layer casts its own inputs; the container itself casts nothing.
    Any `torch.nn.Module` may be added, not only `Layer`s.

    >>> import torch
    >>> import dtype_policies
    >>> from dtype_policies.layers import Dense, Sequential
    >>> dtype_policies.set_dtype_policy("mixed_bfloat16")
    >>> model = Sequential([Dense(16, activation="relu"), Dense(4)], name="model")
    >>> model(torch.ones(2, 8)).dtype
    torch.bfloat16
    >>> [layer.path for layer in model.layers]
    ['model/0', 'model/1']
    >>> dtype_policies.set_dtype_policy("float32")
    """

    _is_container = True

    def __init__(self, layers: Iterable[torch.nn.Module] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._accepts_training: list[bool] = []
        for layer in layers or ():
            self.add(layer)

    def add(self, layer: torch.nn.Module) -> None:
        """Appends a layer (any `torch.nn.Module`)."""
        if not isinstance(layer, torch.nn.Module):
            raise TypeError(
                f"Sequential only accepts torch.nn.Module instances (layers). "
                f"Received: {layer!r} of type {type(layer)}"
            )
        setattr(self, str(len(self._modules)), layer)
        self._accepts_training.append(_accepts_training(layer))
        if self.built:
            self.built = False  # the new layer is built on the next call

    def pop(self) -> torch.nn.Module:
        """Removes and returns the last layer."""
        if not self._modules:
            raise IndexError("pop from an empty Sequential.")
        key = str(len(self._modules) - 1)
        layer = cast(torch.nn.Module, self._modules.pop(key))  # `add` takes modules only
        self._accepts_training.pop()
        return layer

    @property
    def layers(self) -> list[torch.nn.Module]:
        return list(cast("dict[str, torch.nn.Module]", self._modules).values())

    def __iter__(self) -> Iterator[torch.nn.Module]:
        return iter(cast("dict[str, torch.nn.Module]", self._modules).values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, index: int) -> torch.nn.Module:
        return self.layers[index]

    def build(self, input_shape: Any = None) -> None:
        """Builds every layer. Given an explicit shape, as Keras's symbolic
        pass: each layer is built on its input shape and hands on its
        `compute_output_shape`, no values computed (so a layer awaiting
        calibrated GPTQ/AWQ weights builds too); from the first layer
        without one, zeros of the shape so far (a `None` axis being 1) run
        through the rest of the stack."""
        if input_shape is None or self.__dict__.get("_building_from_call"):
            return
        shape = tuple(input_shape)
        self.__dict__["_build_input_shape"] = shape  # in the config, as Keras's
        outputs: torch.Tensor | None = None
        with torch.no_grad():
            for layer in self.layers:
                if (
                    outputs is None
                    and isinstance(layer, Layer)
                    and hasattr(layer, "compute_output_shape")
                ):
                    try:
                        output_shape = tuple(layer.compute_output_shape(shape))
                    except NotImplementedError:  # a nested stack holding a torch module
                        pass  # built by its call on zeros, below
                    else:
                        if not layer.built:
                            layer._build_device = self._build_device
                            layer.build(shape)
                        shape = output_shape
                        continue
                if outputs is None:
                    zeros_shape = tuple(1 if d is None else d for d in shape)
                    outputs = torch.zeros(zeros_shape, device=self._build_device)
                outputs = layer(outputs)

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        """Each layer's `compute_output_shape` in turn (a nested stack builds
        by shape too); NotImplementedError at a layer without one.

        >>> from dtype_policies import layers
        >>> layers.Sequential([layers.Dense(8), layers.Dense(3)]).compute_output_shape((None, 4))
        (None, 3)
        """
        shape = tuple(input_shape)
        for layer in self.layers:
            compute = getattr(layer, "compute_output_shape", None)
            if compute is None:
                raise NotImplementedError(
                    f"Sequential.compute_output_shape: the layer {type(layer).__name__} has no "
                    "compute_output_shape"
                )
            shape = tuple(compute(shape))
        return shape

    def _build_on_first_call(self, args: tuple, kwargs: dict[str, Any]) -> None:
        # Layers build themselves on their first call; nothing to run up front.
        if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):  # Keras's one input
            self.__dict__["_build_input_shape"] = tuple(args[0].shape)
        self.__dict__["_building_from_call"] = True
        try:
            super()._build_on_first_call(args, kwargs)
        finally:
            self.__dict__["_building_from_call"] = False

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        outputs = inputs
        for layer, accepts_training in zip(self._modules.values(), self._accepts_training):
            if accepts_training and training is not None:
                outputs = layer(outputs, training=training)
            else:
                outputs = layer(outputs)
        return outputs

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["layers"] = [serialize_layer(layer) for layer in self.layers]
        shape = self.__dict__.get("_build_input_shape")
        if shape is not None and self.built:  # `from_config` builds the stack again
            config["build_input_shape"] = shape
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Sequential:
        config = dict(config)
        items = list(config.pop("layers", []))
        input_shape = config.pop("build_input_shape", None)  # Keras's, once built
        if items and isinstance(items[0], dict) and items[0].get("class_name") == "InputLayer":
            # Keras's `keras.Input(shape)` first: its shape builds the stack
            input_config = items.pop(0).get("config", {})
            input_shape = input_config.get("batch_shape") or input_config.get("batch_input_shape")
        layers = [deserialize_layer(item) for item in items]
        model = super().from_config({**config, "layers": layers})
        if input_shape is not None:
            model.build(tuple(input_shape))
        return model
