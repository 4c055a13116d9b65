"""`DTypePolicyMap`: a dict from layer path to policy, with regex keys."""

from __future__ import annotations

import re
from collections.abc import Iterator, MutableMapping
from typing import Any

from dtype_policies.policies.dtype_policy import DTypePolicy
from dtype_policies.policies.serialization import deserialize, get, serialize


class DTypePolicyMap(DTypePolicy, MutableMapping):
    """A dict-like map from layer path to `DTypePolicy`.

    A path is a module path from the root with `/` separators, e.g.
    `"encoder/layers/0/attention"`. Keys are looked up as follows: an exact key
    wins; otherwise every key is tried as a regular expression with
    `re.fullmatch`; a path matched by more than one key is an error; a path
    matched by none gets `default_policy`. Because `.` in a regex matches `/`, a
    torch-style dotted key such as `"encoder.layers.0.attention"` matches the
    path `"encoder/layers/0/attention"` too.

    A map can be passed wherever a policy is accepted (a layer's `dtype`,
    `apply_policy`); each layer then resolves its own entry by its path. As a
    policy, the map's `compute_dtype`, `variable_dtype` and `quantization_mode`
    are those of its default policy.

    Args:
        default_policy: The policy of paths that match no key. `None` means the
            default policy in force when the map is created (see
            `dtype_policies.dtype_policy()`); that concrete policy is what
            `get_config()` writes.
        policy_map: Optional dict of initial entries `{path_or_regex: policy}`;
            values may be policies, names or serialized dicts.

    Example:

    >>> from dtype_policies import DTypePolicy, DTypePolicyMap
    >>> bfloat16 = DTypePolicy("bfloat16")
    >>> float16 = DTypePolicy("float16")
    >>> float32 = DTypePolicy("float32")
    >>> policy_map = DTypePolicyMap(default_policy=float32)
    >>> policy_map["encoder/layer_0/dense"] = bfloat16
    >>> policy_map["encoder/.*"] = float16
    >>> policy_map["decoder"] = bfloat16
    >>> policy_map["encoder/layer_0/dense"].name
    'bfloat16'
    >>> policy_map["encoder/attention/query"].name
    'float16'
    >>> policy_map["decoder/attention"].name
    'float32'
    >>> policy_map["encoder/attention/.*"] = bfloat16
    >>> try:
    ...     policy_map["encoder/attention/query"]
    ... except ValueError as e:
    ...     print(str(e).split(':')[0])
    Path 'encoder/attention/query' matches multiple dtype policy specification keys
    """

    _default_policy: DTypePolicy
    _policy_map: dict[str, DTypePolicy]
    _patterns: dict[str, re.Pattern[str]]
    _version: int
    __hash__ = None  # type: ignore[assignment]  # a mutable mapping
    is_map = True
    keras_module = "keras.dtype_policies"

    def __init__(
        self,
        default_policy: DTypePolicy | str | None = None,
        policy_map: dict[str, Any] | None = None,
    ) -> None:
        if isinstance(default_policy, DTypePolicyMap):
            raise ValueError("`default_policy` cannot be a `DTypePolicyMap`.")
        if policy_map is not None and not isinstance(policy_map, dict):
            raise TypeError(
                "If specified, `policy_map` must be a dict. "
                f"Received: policy_map={policy_map!r} of type {type(policy_map)}"
            )
        default = get(default_policy)
        if isinstance(default, DTypePolicyMap):
            if default_policy is not None:  # a map's serialized form
                raise ValueError(
                    "`default_policy` cannot be a `DTypePolicyMap` (nor its serialized "
                    f"form). Received: default_policy={default_policy!r}"
                )
            default = default.default_policy  # the default in force is itself a map
        self._set("_default_policy", default)
        self._set("_policy_map", {})
        self._set("_patterns", {})
        self._set("_version", 0)
        for key, value in (policy_map or {}).items():
            self[key] = value

    def __copy__(self) -> DTypePolicyMap:
        # A copy has entries of its own (the policies in them are immutable).
        clone = object.__new__(type(self))
        for attr, value in vars(self).items():
            object.__setattr__(clone, attr, dict(value) if isinstance(value, dict) else value)
        return clone

    # A map is mutable through its mapping methods; plain attributes stay read-only.
    def _bump_version(self) -> None:
        self._set("_version", self._version + 1)

    @property
    def name(self) -> str:
        return f"map_{self._default_policy.name}"

    # (read-only: a map's name follows its default policy's)
    @property
    def _name(self) -> str:  # type: ignore[override]
        return self.name

    @property
    def default_policy(self) -> DTypePolicy:
        """The policy of paths that match no key."""
        return self._default_policy

    @property
    def compute_dtype(self) -> str:
        return self._default_policy.compute_dtype

    @property
    def variable_dtype(self) -> str:
        return self._default_policy.variable_dtype

    @property
    def quantization_mode(self) -> str | None:
        return self._default_policy.quantization_mode

    @property
    def policy_map(self) -> dict[str, DTypePolicy]:
        """A copy of the explicit entries, in insertion order."""
        return dict(self._policy_map)

    def __getitem__(self, key: str) -> DTypePolicy:
        """The policy for the path `key` (see the class docstring for the rules)."""
        matched = self.matching_key(key)
        return self._default_policy if matched is None else self._policy_map[matched]

    def matching_key(self, path: str) -> str | None:
        """The key that decides `path`'s policy: `path` itself if it is a key,
        else the one key whose regex fullmatches it, else `None` (the default
        policy applies). Raises `ValueError` when several keys match.

        >>> from dtype_policies import DTypePolicyMap
        >>> DTypePolicyMap("float32", {"enc/.*": "bfloat16"}).matching_key("enc/attn")
        'enc/.*'
        """
        if path in self._policy_map:
            return path
        matching = [k for k, pattern in self._patterns.items() if pattern.fullmatch(path)]
        if len(matching) > 1:
            raise ValueError(
                f"Path '{path}' matches multiple dtype policy specification keys: "
                f"{matching}. Please make sure each path only matches at most one "
                "dtype policy specification key in the DTypePolicyMap."
            )
        return matching[0] if matching else None

    def __setitem__(self, key: str, policy: Any) -> None:
        if not isinstance(key, str):
            raise TypeError(
                f"DTypePolicyMap keys must be strings (layer paths or regexes). "
                f"Received: {key!r} of type {type(key)}"
            )
        if key in self._policy_map:
            raise ValueError(
                f"{key} already exist in the DTypePolicyMap with value "
                f"{self._policy_map[key]}. Please make sure to not use duplicated keys."
            )
        try:
            pattern = re.compile(key)
        except re.error as e:
            raise ValueError(
                f"DTypePolicyMap key {key!r} is not a valid regular expression ({e}). "
                "Escape literal characters with re.escape()."
            ) from None
        try:
            policy = get(policy)
        except Exception as e:  # Keras's message, with the key and the reason
            raise ValueError(
                "Cannot interpret the assigned value by `dtype_policies.get`. "
                f"Received: {policy!r} of type {type(policy)} for the key {key!r}: {e}"
            ) from None
        if isinstance(policy, DTypePolicyMap):
            raise ValueError(
                f"A DTypePolicyMap entry cannot itself be a DTypePolicyMap (key {key!r})."
            )
        self._policy_map[key] = policy
        self._patterns[key] = pattern
        self._bump_version()

    def __delitem__(self, key: str) -> None:
        self._policy_map.pop(key)
        del self._patterns[key]
        self._bump_version()

    _MISSING = object()

    def pop(self, key: str, default: Any = _MISSING) -> Any:
        """Removes the explicit entry `key` and returns its policy."""
        if key in self._policy_map:
            policy = self._policy_map[key]
            del self[key]
            return policy
        if default is DTypePolicyMap._MISSING:
            raise KeyError(key)
        return default

    def __contains__(self, key: object) -> bool:
        return key in self._policy_map

    def __iter__(self) -> Iterator[str]:
        return iter(self._policy_map)

    def __len__(self) -> int:
        return len(self._policy_map)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DTypePolicyMap):
            return NotImplemented if not isinstance(other, DTypePolicy) else False
        return (
            self._default_policy == other._default_policy and self._policy_map == other._policy_map
        )

    def get_config(self) -> dict[str, Any]:
        return {
            "default_policy": serialize(self._default_policy),
            "policy_map": {key: serialize(value) for key, value in self._policy_map.items()},
        }

    @classmethod
    def from_config(
        cls, config: dict[str, Any], custom_objects: dict[str, type] | None = None
    ) -> DTypePolicyMap:
        config = dict(config)
        default = config.pop("default_policy", None)
        if isinstance(default, dict):
            default = deserialize(default, custom_objects)
        entries = config.pop("policy_map", None) or {}
        if not isinstance(entries, dict):
            raise TypeError(
                "A DTypePolicyMap config's `policy_map` must be a dict of paths to policies. "
                f"Received: {entries!r} of type {type(entries).__name__}"
            )
        entries = {
            key: deserialize(value, custom_objects) if isinstance(value, dict) else value
            for key, value in entries.items()
        }
        if config:
            raise ValueError(f"Unrecognized DTypePolicyMap config keys: {sorted(config)}")
        return cls(default_policy=default, policy_map=entries)

    def __repr__(self) -> str:
        mapping = [(key, policy.name) for key, policy in self._policy_map.items()]
        return (
            f"<DTypePolicyMap at {hex(id(self))} "
            f"default_policy={self._default_policy.name}, mapping={mapping}>"
        )
