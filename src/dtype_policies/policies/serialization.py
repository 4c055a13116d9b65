"""`get`, `serialize` and `deserialize` for dtype policies, in the Keras 3 dict format.

A serialized policy is `{"module", "class_name", "config", "registered_name"}`
exactly as Keras 3 writes it, so configs move between Keras and this library.
"""

from __future__ import annotations

from typing import Any, cast, overload

from dtype_policies._dtypes import standardize_dtype
from dtype_policies._modes import KERAS_ONLY_MODES, keras_only_modes, refusal
from dtype_policies.policies import _default_state
from dtype_policies.policies.dtype_policy import KERAS_MODULES, POLICY_CLASSES, DTypePolicy
from dtype_policies.policies.names import parse_policy_name


def get(identifier: Any) -> DTypePolicy:
    """Returns a policy for `identifier`.

    Accepts `None` (the default policy in force), a policy or `DTypePolicyMap`
    (returned as is), a policy name (`"mixed_bfloat16"`, `"int8_from_float32"`,
    `"int4/128_from_mixed_bfloat16"`, ...), a serialized dict, a Keras 3
    policy object (read by its config), or a dtype (a torch or numpy dtype,
    or the Python type `float`).

    >>> import torch
    >>> from dtype_policies import get
    >>> get("mixed_bfloat16")
    <DTypePolicy "mixed_bfloat16">
    >>> get("int8_from_mixed_bfloat16")
    <QuantizedDTypePolicy "int8_from_mixed_bfloat16">
    >>> get(torch.float16)
    <DTypePolicy "float16">
    >>> get("int8")  # a plain dtype name is a plain policy
    <DTypePolicy "int8">
    """
    if identifier is None:
        return default_policy()
    if isinstance(identifier, DTypePolicy):
        return identifier
    if isinstance(identifier, dict):
        return deserialize(identifier)
    if isinstance(identifier, str):
        return parse_policy_name(identifier)
    if is_keras_policy(identifier):  # the same policy here
        if type(identifier).__name__ == "DTypePolicyMap":
            return _from_keras_map(identifier)
        config = identifier.get_config()
        return deserialize({"class_name": type(identifier).__name__, "config": config})
    try:
        return DTypePolicy(standardize_dtype(identifier))
    except (ValueError, TypeError):
        raise ValueError(
            "Cannot interpret `dtype` argument. Expected a string or an instance of "
            f"DTypePolicy. Received: dtype={identifier!r}"
        ) from None


def is_keras_policy(identifier: Any) -> bool:
    """Whether `identifier` is a Keras policy object (a `keras.DTypePolicy`,
    one of its quantized classes, a `DTypePolicyMap`), told apart without
    importing Keras."""
    cls = type(identifier)
    return cls.__module__.startswith("keras") and cls.__name__.endswith(
        ("DTypePolicy", "DTypePolicyMap")
    )


def _from_keras_map(keras_map: Any) -> DTypePolicy:
    """A Keras `DTypePolicyMap` as it is now: its default in force (Keras's
    global policy where it was given none) and each entry's policy. Not by
    its `get_config()`: where its default is deferred, that sets every
    entry's name to None in place (resolved again at load), which emptied the
    caller's map and read its entries as this library's default policy."""
    policy_map_class = POLICY_CLASSES["DTypePolicyMap"]  # registered when defined
    entries = {key: get(keras_map[key]) for key in keras_map}
    return cast(DTypePolicy, policy_map_class(get(keras_map.default_policy), entries))


@overload
def serialize(dtype_policy: None) -> None: ...
@overload
def serialize(dtype_policy: DTypePolicy) -> dict[str, Any]: ...
def serialize(dtype_policy: DTypePolicy | None) -> dict[str, Any] | None:
    """Returns the Keras 3 dict form of `dtype_policy` (`None` for `None`, as
    Keras; the argument's name is Keras's).

    >>> from dtype_policies import serialize, QuantizedDTypePolicy
    >>> serialize(QuantizedDTypePolicy("int8", "float32"))  # doctest: +NORMALIZE_WHITESPACE
    {'module': 'keras.dtype_policies', 'class_name': 'QuantizedDTypePolicy',
     'config': {'mode': 'int8', 'source_name': 'float32'}, 'registered_name': None}
    """
    policy = dtype_policy
    if policy is None:
        return None
    if not isinstance(policy, DTypePolicy):
        raise TypeError(
            f"serialize() expects a DTypePolicy. Received: {policy!r} of type {type(policy)}"
        )
    cls = type(policy)
    module = KERAS_MODULES.get(cls)
    registered_name = None
    if module is None:  # a user subclass
        module = cls.__module__
        registered_name = f"{cls.__module__}>{cls.__name__}"
    return {
        "module": module,
        "class_name": cls.__name__,
        "config": policy.get_config(),
        "registered_name": registered_name,
    }


@overload
def deserialize(config: None, custom_objects: dict[str, type] | None = None) -> None: ...
@overload
def deserialize(
    config: dict[str, Any], custom_objects: dict[str, type] | None = None
) -> DTypePolicy: ...
def deserialize(
    config: dict[str, Any] | None, custom_objects: dict[str, type] | None = None
) -> DTypePolicy | None:
    """Rebuilds a policy from its dict form (as written by `serialize` or
    Keras 3); `None` for `None`, as Keras.

    >>> from dtype_policies import deserialize
    >>> deserialize({"module": "keras", "class_name": "DTypePolicy",
    ...              "config": {"name": "mixed_float16"}, "registered_name": None})
    <DTypePolicy "mixed_float16">
    """
    if config is None:
        return None
    if not isinstance(config, dict):
        raise TypeError(
            f"deserialize() expects a dict. Received: {config!r} of type {type(config)}"
        )
    if "class_name" not in config:
        raise ValueError(
            f"A serialized dtype policy needs the key 'class_name'. Received: {config!r}"
        )
    class_name = config["class_name"]
    if class_name in _TF_KERAS_CLASSES and class_name not in (custom_objects or {}):
        return _from_tf_keras(class_name, config.get("config"))
    # (a policy class, or any class given in `custom_objects` with a `from_config`)
    cls: Any = (custom_objects or {}).get(class_name) or POLICY_CLASSES.get(class_name)
    if cls is None and config.get("registered_name"):
        cls = (custom_objects or {}).get(config["registered_name"])
    if cls is None:
        refused = {KERAS_ONLY_MODES[mode]: mode for mode in keras_only_modes()}
        if class_name in refused:
            raise refusal(refused[class_name], f"the Keras policy class '{class_name}'")
        raise ValueError(
            f"Unknown dtype policy class '{class_name}'. Expected one of "
            f"{sorted(POLICY_CLASSES)} or a class given in `custom_objects`."
        )
    inner = config.get("config")
    if inner is None:  # none: the class's defaults, as Keras reads it
        inner = {}
    if not isinstance(inner, dict):
        raise TypeError(f"The 'config' of a serialized policy must be a dict. Received: {inner!r}")
    if getattr(cls, "is_map", False):
        return cls.from_config(inner, custom_objects)
    try:
        return cls.from_config(inner)
    except TypeError as e:
        raise TypeError(f"Cannot rebuild {class_name} from config={inner!r}: {e}") from None


# tf.keras's `mixed_precision.Policy` and its experimental `PolicyV1`, as its
# own `deserialize` reads them: one class, the loss scale of TF 2.3 and
# earlier configs dropped (loss scaling is the optimizer's).
_TF_KERAS_CLASSES = ("Policy", "PolicyV1")


def _from_tf_keras(class_name: str, inner: Any) -> DTypePolicy:
    if not isinstance(inner, dict) or not isinstance(inner.get("name"), str):
        raise ValueError(
            f"A serialized tf.keras {class_name} needs a 'config' with a 'name' string. "
            f"Received: config={inner!r}"
        )
    unknown = sorted(set(inner) - {"name", "loss_scale"})
    if unknown:
        raise TypeError(
            f"Cannot rebuild {class_name} from config={inner!r}: unexpected keys {unknown} "
            "(a tf.keras policy has 'name' and, before TF 2.4, 'loss_scale')"
        )
    return POLICY_CLASSES["Policy"](inner["name"])


def default_policy() -> DTypePolicy:
    """The default policy in force: the innermost `policy_scope`, else the
    process-wide one (`float32` until `set_dtype_policy` is called).

    >>> from dtype_policies import policy_scope
    >>> with policy_scope("mixed_bfloat16"):
    ...     default_policy()
    <DTypePolicy "mixed_bfloat16">
    >>> default_policy()
    <DTypePolicy "float32">
    """
    current = _default_state.current()
    return current if current is not None else _FLOAT32


_FLOAT32 = DTypePolicy("float32")
