"""The candidate policies of `advise`, from the most to the least aggressive,
with float32 always last (the model as given)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from dtype_policies._dtypes import is_float_dtype
from dtype_policies.policies import DTypePolicy, Int4DTypePolicy, QuantizedDTypePolicy, get

DEFAULT_CANDIDATES = ("int4", "int8", "mixed_bfloat16")
DEFAULT_SOURCE = "mixed_bfloat16"
# Calibrated candidates (calibrated on the inputs each module received in the
# advisor's recorded pass): a bare mode name means 4 bits in groups of 128.
CALIBRATED_DEFAULTS = {"gptq": "gptq/4/128", "awq": "awq/4/128"}
FLOAT32 = DTypePolicy("float32")
ACCEPTED = (
    "a mode, quantized from mixed_bfloat16: 'int8', 'int4' (int4/128), 'int4/<block size>', "
    "'float8', 'gptq' (gptq/4/128), 'gptq/<bits>/<group size>', 'awq' (awq/4/128), "
    "'awq/4/<group size>'; a float policy: 'mixed_bfloat16', 'mixed_float16', "
    "'bfloat16', 'float16', 'float32'; or a full quantized name such as "
    "'int8_from_mixed_bfloat16'"
)
"""What `parse_candidate` accepts as a name, for error messages."""


@dataclass(frozen=True)
class Candidate:
    """A policy a module may get.

    Attributes:
        label: The name as given (`"int8"`), used in tables.
        policy: The policy (`int8_from_mixed_bfloat16`).
        rank: 0 for float32, higher for more aggressive candidates.
    """

    label: str
    policy: DTypePolicy
    rank: int

    @property
    def mode(self) -> str | None:
        return self.policy.quantization_mode


def parse_candidate(spec: object) -> DTypePolicy:
    """One candidate: a mode name (`"int8"`, `"int4"`, `"int4/64"`,
    `"float8"`, `"gptq"`, `"gptq/4/64"`, `"awq"`: quantized from
    mixed_bfloat16; gptq and awq calibrated on each module's recorded
    inputs), a float policy name
    (`"mixed_bfloat16"`, `"bfloat16"`), a full quantized name
    (`"int4/-1_from_mixed_bfloat16"`) or a policy object."""
    policy: DTypePolicy
    if isinstance(spec, str):
        name = spec.strip()
        try:
            policy = _named(name)
        except (TypeError, ValueError) as e:
            # a known form says what is wrong in it; any other name, what is accepted
            prefix, slash, _ = name.partition("/")
            known = "_from_" in name or bool(slash and prefix in ("int4", *CALIBRATED_DEFAULTS))
            detail = f": {e}" if known else f"; accepted: {ACCEPTED}."
            raise ValueError(f"advise(): unknown candidate {spec!r}{detail}") from None
    elif isinstance(spec, DTypePolicy):
        policy = spec
    elif isinstance(spec, torch.dtype):  # as wherever a policy name is taken
        policy = get(spec)
    else:
        raise TypeError(
            f"advise(): unknown candidate {spec!r}: expected a policy name such as 'int8' or "
            "'mixed_bfloat16', a torch dtype, or a DTypePolicy."
        )
    if policy.is_map:
        raise ValueError(f"advise(): candidate {spec!r} is a DTypePolicyMap, not one policy.")
    compute = policy.compute_dtype
    if policy.quantization_mode is None and (
        not is_float_dtype(compute) or compute.startswith("float8")
    ):
        raise ValueError(
            f"advise(): unknown candidate {spec!r}: it computes in {compute}, which "
            f"no module can compute in; accepted: {ACCEPTED}."
        )
    return policy


def _named(name: str) -> DTypePolicy:
    """The policy a candidate's name stands for (see `parse_candidate`)."""
    if name == "int4":
        return Int4DTypePolicy("int4/128", DEFAULT_SOURCE)
    if name in ("int8", "float8"):
        return QuantizedDTypePolicy(name, DEFAULT_SOURCE)
    if name.startswith("int4/") and "_from_" not in name:
        return Int4DTypePolicy(name, DEFAULT_SOURCE)
    if name in CALIBRATED_DEFAULTS or (
        name.split("/")[0] in CALIBRATED_DEFAULTS and "_from_" not in name
    ):
        return get(f"{CALIBRATED_DEFAULTS.get(name, name)}_from_{DEFAULT_SOURCE}")
    return get(name)


def parse_candidates(specs: Iterable[object] | str) -> list[Candidate]:
    """The candidates, most aggressive first, float32 last (always there).

    Duplicates (by policy) are dropped, keeping the first.
    """
    if isinstance(specs, (str, DTypePolicy)):
        specs = (specs,)
    try:
        specs = list(specs)
    except TypeError:
        raise TypeError(
            f"advise(): `candidates` must be a sequence of policy names. Received: {specs!r}"
        ) from None
    if not specs:
        raise ValueError(
            "advise(): `candidates` is empty; give at least one, e.g. ('int8', 'mixed_bfloat16')."
        )
    policies: list[tuple[str, DTypePolicy]] = []
    for spec in specs:
        policy = parse_candidate(spec)
        if policy != FLOAT32 and all(policy != seen for _, seen in policies):
            label = spec.strip() if isinstance(spec, str) else policy.name
            policies.append((label, policy))
    ordered = [("float32", FLOAT32), *reversed(policies)]  # least aggressive first
    return [Candidate(label, policy, rank) for rank, (label, policy) in enumerate(ordered)]
