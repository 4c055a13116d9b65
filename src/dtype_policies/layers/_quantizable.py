"""`QuantizableLayer`: Keras's `quantize()` flow for `Dense`, `EinsumDense` and
`Embedding`, on the library's one transactional attach path
(`dtype_policies.quantization.attach`)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

from dtype_policies._core.module_state import STATE_KEY, quantization_of
from dtype_policies._modes import mode_record
from dtype_policies.layers.layer import Layer
from dtype_policies.policies import (
    DTypePolicy,
    DTypePolicyMap,
    QuantizedDTypePolicy,
    policy_for_config,
)
from dtype_policies.policies import get as get_policy
from dtype_policies.quantization import attach
from dtype_policies.quantization.calibration import plan_calibrated
from dtype_policies.quantization.kinds import (
    ModuleKind,
    SpecFunction,
    kind_of,
    register_module_kind,
)
from dtype_policies.quantization.modules import (
    adapt_state_dict,
    apply_keeping_stored_dtypes,
)
from dtype_policies.quantization.schemes import QuantizedWeight
from dtype_policies.quantization.schemes.base import NonFiniteWeightError, WeightSpec
from dtype_policies.quantization.weight_copy import read_weight
from dtype_policies.quantization.weight_guard import QuantizedWeightGuard
from dtype_policies.quantizers.config import (
    QuantizationConfig,
    deserialize_config,
    serialize_config,
    validate_and_resolve_config,
)


class QuantizableLayer(QuantizedWeightGuard, Layer):
    """A layer with `quantize(mode, config=None, type_check=True)`.

    Subclasses register their weight's kind with `register_layer_kind`; their
    `call` dispatches to `self._quantized.linear(...)` (or `.lookup`) once
    quantized.
    """

    _casts_buffers = False  # its buffers are the tensors it stores

    def __init__(self, *, quantization_config: Any = None, **kwargs: Any) -> None:
        # a policy given to the layer itself, not the default in force
        self._policy_given = kwargs.get("dtype") is not None
        super().__init__(**kwargs)
        self.quantization_config: QuantizationConfig | None = deserialize_config(
            quantization_config
        )

    @property
    def _quantized(self) -> QuantizedWeight | None:
        return self.__dict__[STATE_KEY].quantization

    @property
    def is_quantized(self) -> bool:
        return self.__dict__[STATE_KEY].quantization is not None

    @property
    def quantization_mode(self) -> str | None:
        quantized = self._quantized
        if quantized is not None:
            return quantized.mode
        if self.built:  # built and float: its policy's mode was not taken
            return None
        return self._policy_mode()

    def _policy_mode(self, policy: DTypePolicy | None = None) -> str | None:
        """The quantization mode of `policy` (default: the policy in force),
        if this kind of layer takes it."""
        mode = (policy if policy is not None else self._resolve_policy()).quantization_mode
        if mode is None:
            return None
        kind = kind_of(self)
        if kind is None:  # each QuantizableLayer class registers one (`register_layer_kind`)
            raise TypeError(
                f"{type(self).__name__} has no quantizable kind: register it with "
                "`register_layer_kind`."
            )
        return mode if kind.supports(mode) else None

    def _keeps_quantization(self, policy: DTypePolicy) -> bool:
        """Whether `policy` (a policy for this built layer, or its map's entry)
        asks the quantization the layer has: none for a float layer; for a
        quantized one its mode and configuration, the float source free (a
        name that changes the source alone, or one whose configuration, as a
        built layer reads it, is the layer's)."""
        mode = self._policy_mode(policy)
        had = quantization_of(self)
        if had is None:
            return mode is None
        if mode != had.mode:
            return False
        before = self.__dict__[STATE_KEY].call.policy
        if _mode_string(policy) == _mode_string(before):
            return True
        return _config_asked_by(policy) == had.config

    def _check_map_edit(self) -> None:
        """A built layer follows its map's edits of float dtypes; an edit of
        its quantization (quantizing a float layer, another mode or
        configuration, or float again) would leave the map saying one thing
        and the layer computing another: refused, until the edit is undone."""
        if not self.built:
            return
        entry = self._resolve_policy()
        if self._keeps_quantization(entry):
            return
        before = self.__dict__[STATE_KEY].call.policy
        had = quantization_of(self)
        built = f"quantized as '{before.name}'" if had is not None else f"as '{before.name}'"
        raise ValueError(
            f"Layer '{self.name}': its DTypePolicyMap now resolves its path '{self._path}' to "
            f"'{entry.name}', edited since the layer was built {built}. An edit of the map "
            "changes a built layer's float dtypes, not its quantization: undo the edit"
            + (
                f", or set `layer.dtype_policy = '{entry.name}'` (which quantizes the layer "
                "and writes its entry)."
                if had is None
                else "; a quantized layer keeps its mode and configuration."
            )
        )

    def _no_float_compute(self) -> RuntimeError:
        """The error of a quantized call without a floating compute dtype
        (a quantized policy computes in its float source's)."""
        return RuntimeError(
            f"Layer '{self.name}' is quantized but its policy "
            f"'{self._resolve_policy().name}' has no floating compute dtype."
        )

    def _missing_weight(self, name: str) -> RuntimeError:
        """The error of a built layer's weight found missing (deleted)."""
        return RuntimeError(f"Layer '{self.name}' has no '{name}' parameter: was it deleted?")

    def _check_before_build(self) -> None:
        """Keras's error for a mode this kind of layer cannot take, raised
        before `build` creates any weight (the layer stays unbuilt)."""
        wanted = self._resolve_policy().quantization_mode
        kind = kind_of(self)
        own = self._policy_given and not self._dtype_policy.is_map
        if wanted is not None and own and kind is not None and not kind.supports(wanted):
            raise NotImplementedError(
                f"Invalid quantization mode. Expected one of {kind.modes}. "
                f"Received: quantization_mode={wanted}"
            )

    def quantize(
        self, mode: str | None = None, config: Any = None, type_check: bool = True
    ) -> None:
        """Quantizes this built layer's weights in place.

        Args:
            mode: A quantization mode (`"int8"`, `"int4"`, `"float8"`, ...; not
                needed when `config` is given).
            config: The mode's config (`Int8QuantizationConfig`, ...); `None`
                means the mode's default. A calibrated mode's config holds its
                calibration data: the layer is calibrated on it as a model of
                one block (without data, its scheme quantizes the weight
                alone, where it can: GPTQ and AWQ round to nearest on their
                grid, with a warning; Keras keeps the float kernel until a
                model-level calibration instead).
            type_check: Refuse subclasses (whose `call` may not dispatch to the
                quantized product); pass `False` to quantize one anyway.

        On success the layer's policy becomes `"<mode>_from_<previous>"` (unless
        it already was a quantized policy). On any error the layer is left
        exactly as it was.
        """
        config = validate_and_resolve_config(mode, config)
        path = self._path or ""
        with self._naming_self():
            if mode_record(config.mode).calibrated and getattr(config, "dataset", None) is not None:
                checked = attach.check(self, config, path=path, type_check=type_check)
                calibration = plan_calibrated(self, [(path, checked)], config)
                if not calibration.plans:
                    raise ValueError(
                        f"Layer '{self.name}' is outside its config's quantization_layer_structure."
                    )
                planned = calibration.plans[0]
            else:
                planned = attach.plan(self, config, path=path, type_check=type_check)
        attach.commit(planned)

    @contextlib.contextmanager
    def _naming_self(self) -> Iterator[None]:
        """A weight refused for its values is named by this layer's name
        (`quantize()` names it by its path)."""
        try:
            yield
        except NonFiniteWeightError as e:
            raise NonFiniteWeightError(f"Layer '{self.name}': {e}") from None

    def _quantize_from_policy(self) -> None:
        """Once built under a quantized policy: quantize the new weights as
        the policy says (a calibrated mode gets placeholder tensors, filled by
        loading a checkpoint: Keras's loading path). A layer that cannot take
        the mode (an `EinsumDense` whose equation is no matrix product under
        int8) computes with the policy's float source."""
        mode = self._policy_mode()
        if self.is_quantized or not self.built:
            return
        if mode is None:
            # Keras's error for the layer's own policy (`_check_before_build`
            # raised it for a lazy build); a quantized *default* policy
            # leaves such a layer float
            self._check_before_build()
            return
        given = config = self.quantization_config
        if config is None or config.mode != mode:
            config = _quantized(self._resolve_policy()).quantization_config
        try:
            checked = attach.check(
                self,
                config,
                path=self._path or "",
                type_check=False,
                # a calibrated mode's placeholders do not read the float weights
                needs_values=not mode_record(mode).calibrated,
            )
        except NotImplementedError as e:
            if self._policy_given and not self._dtype_policy.is_map:  # asked of this layer
                warnings.warn(
                    f"Layer '{self.name}' cannot take its policy "
                    f"'{self._resolve_policy().name}': {e} It computes with the policy's "
                    "float source.",
                    UserWarning,
                    stacklevel=3,
                )
            return
        if mode_record(mode).calibrated:
            tensors = checked.scheme.placeholder_tensors(
                checked.spec, config, checked.weight.device
            )
            attach.commit(attach.plan(self, config, type_check=False, tensors=tensors))
            quantized = self._quantized
            assert quantized is not None
            quantized.placeholder = (
                f"Layer '{self.name}' was built under the policy '{self._resolve_policy().name}' "
                f"and holds no calibrated {mode.upper()} weights yet: load a checkpoint into it "
                "(load_state_dict, saving.load), or build it under its float source policy "
                f"and calibrate it with .quantize('{mode}', config=...)."
            )
        else:
            self.quantize(mode, config, type_check=False)
        # As Keras: the config is what the layer was given (`None`: the policy's).
        self.quantization_config = given

    def _after_build(self) -> None:
        super()._after_build()
        self._quantize_from_policy()

    @property
    def dtype_policy(self) -> Any:
        return super().dtype_policy

    @dtype_policy.setter
    def dtype_policy(self, value: Any) -> None:
        """Sets the policy; a quantized policy on a built float layer quantizes
        it as Keras's `quantize(policy.quantization_mode)` does (the bare
        legacy `"int4_from_X"` with int4's default config, block 128; a policy
        carrying settings, such as `"int4/64_from_X"`, with its own). Any
        error leaves the layer and its policy unchanged."""
        policy = get_policy(value)
        self._refuse_if_sharded(policy)
        quantized = self._quantized
        resolved = (
            policy[self._path]
            if isinstance(policy, DTypePolicyMap) and self._path is not None
            else policy
        )
        entry = resolved.default_policy if isinstance(resolved, DTypePolicyMap) else resolved
        if quantized is not None and self.built and not self._keeps_quantization(entry):
            asked = f"a map resolving it to '{entry.name}'" if policy.is_map else f"'{policy.name}'"
            raise ValueError(
                f"Layer '{self.name}' is quantized in mode '{quantized.mode}' "
                f"('{self.__dict__[STATE_KEY].call.policy.name}'); it cannot take the policy "
                f"{asked}. Build a new layer instead."
            )
        mode = resolved.quantization_mode
        if policy.is_map and self._path is None:
            mode = None
        if not self.built or quantized is not None or mode is None:
            self._assign_policy(policy)
            return
        kind = kind_of(self)
        if kind is not None and not kind.supports(mode) and not policy.is_map:
            # as the constructor (`_quantize_from_policy`) and Keras's `quantize`
            raise NotImplementedError(
                f"Invalid quantization mode. Expected one of {kind.modes}. "
                f"Received: quantization_mode={mode}"
            )
        if kind is None or not kind.supports(mode):
            self._assign_policy(policy)  # computes with the policy's float source
            return
        record = mode_record(mode)
        if record.calibrated:
            raise ValueError(
                f"Implicitly enabling {mode.upper()} quantization by setting `dtype_policy` "
                f"to '{resolved.name}' is not supported. {mode.upper()} requires a "
                f"calibration dataset and a `{record.config_class.__name__}` object.\n\n"
                f"Please use the `.quantize('{mode}', config=...)` method on the layer or "
                "model instead."
            )
        resolved = _quantized(resolved)
        config = _config_asked_by(resolved)
        with self._naming_self():
            module_plan = attach.plan(
                self, config, path=self._path or "", type_check=False, source=resolved.source_policy
            )
        with attach.committing((module_plan,)):  # raises before the policy changes, if at all
            self._set_policy(policy)
            attach.commit(module_plan)

    def _refuse_quantized_policy_once_built(self, policy: Any) -> None:
        """The setter above quantizes a built layer instead."""

    def __getattr__(self, name: str) -> Any:
        quantized = quantization_of(self)
        if (
            quantized is not None
            and name == quantized.weight_name
            and not quantized.scheme.keeps_float_weight
        ):
            values = quantized.integer_values(self)  # Keras: the quantized integer values
            return read_weight(self, quantized, values, "the integer values of")
        if quantized is not None and name == "g_idx":  # Keras's name, without the weight's
            g_idx = self.__dict__["_buffers"].get(f"{quantized.weight_name}_g_idx")
            if g_idx is not None:
                return g_idx
        return super().__getattr__(name)

    def _adapt_checkpoint(self, state_dict: dict, prefix: str) -> None:
        quantized = self._quantized
        if quantized is not None:
            adapt_state_dict(self, quantized, state_dict, prefix)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return apply_keeping_stored_dtypes(self, fn, super()._apply, args, kwargs)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["quantization_config"] = serialize_config(self.quantization_config)
        return config


def _mode_string(policy: DTypePolicy) -> str:
    """The part of a quantized policy's name before `_from_` ("" for a float one)."""
    return policy.name.rpartition("_from_")[0] if policy.quantization_mode else ""


def _config_asked_by(policy: DTypePolicy) -> Any:
    """The configuration a built layer given `policy` quantizes by: the bare
    legacy `"int4_from_X"` (and every plain `<mode>_from_X`) its mode's
    default, a policy carrying settings (`"int4/64_from_X"`) its own."""
    quantized = _quantized(policy)
    if type(quantized) is QuantizedDTypePolicy:
        return mode_record(quantized.quantization_mode).default_config()
    return quantized.quantization_config


def _quantized(policy: DTypePolicy) -> QuantizedDTypePolicy:
    """`policy`, which has a quantization mode: every policy with one is a
    `QuantizedDTypePolicy` (a map's mode is its default's, never asked here)."""
    if not isinstance(policy, QuantizedDTypePolicy):
        raise TypeError(
            f"The policy '{policy.name}' has the quantization mode "
            f"'{policy.quantization_mode}' but is no QuantizedDTypePolicy."
        )
    return policy


def _after_quantized(layer: QuantizableLayer, plan: attach.Plan) -> None:
    """Keras's bookkeeping once a layer's weight is quantized: the float
    weight's tracking goes, the config is kept, and the policy becomes
    `<mode>_from_<policy>` unless it already was quantized."""
    name = plan.spec.weight
    if not plan.scheme.keeps_float_weight:
        layer._autocast_weight_names.discard(name)
        for table in (
            layer._declared_trainable,
            layer._weight_regularizers,
            layer._weight_constraints,
        ):
            table.pop(name, None)
    layer.quantization_config = plan.config
    policy = layer._resolve_policy()
    if policy.quantization_mode is None:
        layer._set_policy(policy_for_config(plan.config, policy.name))
    layer._refresh_policy_state()


LayerT = TypeVar("LayerT", bound=QuantizableLayer)


def register_layer_kind(
    cls: type[LayerT], spec: Callable[[LayerT, str], WeightSpec], role: str
) -> None:
    """Registers a quantizable layer class whose weight has `role` (`"linear"`,
    `"embedding"`): it supports every mode that quantizes such weights.
    Subclasses need `type_check=False`."""
    # A kind's functions are called with modules of its class (`kind_of`), and
    # `after_commit` with the `attach.Plan` that quantized them.
    register_module_kind(
        cls,
        ModuleKind(
            cast(SpecFunction, spec),
            role,
            exact=True,
            forward=None,
            after_commit=cast(Callable[[Any, object], None], _after_quantized),
        ),
    )
