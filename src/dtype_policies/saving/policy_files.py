"""Policies and policy maps as reviewable JSON files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dtype_policies._version import __version__
from dtype_policies.policies import DTypePolicy, deserialize, get, serialize
from dtype_policies.saving.atomic import write_atomically

POLICY_FILE_FORMAT = "dtype_policies.policy"
POLICY_FILE_VERSION = 1


def save_policy(policy: Any, path: str | os.PathLike) -> Path:
    """Writes a policy or `DTypePolicyMap` (or a name) to a JSON file, in the
    Keras dict format, atomically. Returns the path.

    >>> import pathlib, tempfile
    >>> from dtype_policies import DTypePolicyMap
    >>> from dtype_policies.saving import load_policy, save_policy
    >>> plan = DTypePolicyMap(
    ...     "mixed_bfloat16", {"lm_head": "float32", "layers/.*/mlp/.*": "int8_from_mixed_bfloat16"}
    ... )
    >>> path = save_policy(plan, pathlib.Path(tempfile.mkdtemp()) / "plan.json")
    >>> load_policy(path) == plan
    True
    """
    policy = get(policy)
    text = json.dumps(
        {
            "format": POLICY_FILE_FORMAT,
            "format_version": POLICY_FILE_VERSION,
            "library_version": __version__,
            "policy": serialize(policy),
        },
        indent=2,
    )
    path = Path(path)
    write_atomically(path, lambda temporary: Path(temporary).write_text(text + "\n"))
    return path


def load_policy(path: str | os.PathLike) -> DTypePolicy:
    """Reads a policy or `DTypePolicyMap` written by `save_policy`. A file
    holding just a serialized policy dict (Keras's format) is read too.

    >>> import json, pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "keras_policy.json"
    >>> _ = path.write_text(json.dumps({"class_name": "DTypePolicy",
    ...                                 "config": {"name": "mixed_bfloat16"}}))
    >>> load_policy(path)
    <DTypePolicy "mixed_bfloat16">
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested too deeply
        raise ValueError(f"'{path}' is not a JSON policy file: {e}") from None
    if isinstance(data, dict) and data.get("format") == POLICY_FILE_FORMAT:
        version = data.get("format_version")
        if (
            not isinstance(version, int)
            or isinstance(version, bool)
            or not 1 <= version <= POLICY_FILE_VERSION
        ):
            raise ValueError(
                f"'{path}' has policy file version {version!r}; this dtype_policies reads "
                f"versions 1 to {POLICY_FILE_VERSION}."
            )
        data = data.get("policy")
    elif isinstance(data, dict) and isinstance(data.get("format"), str):
        raise ValueError(
            f"'{path}' is a {data['format']!r} document, not a policy file (format "
            f"{POLICY_FILE_FORMAT!r}); the advisor writes its map as a policy file with "
            "`dtype-policies advise ... --output FILE` (or `advice.save(FILE)`)."
        )
    if not isinstance(data, dict):
        raise ValueError(
            f"'{path}' does not hold a serialized policy. Received: {_shortened(data)}"
        )
    try:
        return deserialize(data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"'{path}': {_shortened(e)}") from None


def _shortened(value: object, limit: int = 300) -> str:
    """`value`'s text for an error message, cut at `limit` characters (a
    file's whole content would make the message unreadable)."""
    text = repr(value) if not isinstance(value, Exception) else str(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
