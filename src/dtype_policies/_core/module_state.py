"""`ModuleState`: everything this library keeps on one module, in one object
behind one accessor, `state_of(module)` (as FSDP2's `fully_shard.state(module)`).

A `Layer` has one from construction; a torch module gets one when
`apply_policy` or `quantize()` prepares it, and loses it when the last
application is removed (unless it stays quantized). Deep copies and pickles
of a module carry its state, except the kept casts (a copy starts with none).

Both kinds of module keep their policy applications on the same stack,
`ModuleState.applications`, of `(token, entry)` pairs: the top entry is in
force, `push_application` puts one on and `pop_application` takes the one of
a token out wherever it is (so nested applications compose: the most recent
wins, and removing it brings back the one below). What an entry holds and
what the top means is the module kind's business: a torch module's entries
are `ModuleOptions` (`policy_module`), a `Layer`'s are `LayerApplication`s,
its own policy at the bottom. Both kinds re-derive themselves from the stack
in `_refresh_policy_state()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch

from dtype_policies._core.listeners import weights_written
from dtype_policies._core.state import CallState
from dtype_policies._core.weight_casts import WeightCasts

STATE_KEY = "_dtype_policies_state"
"""The key of a module's `ModuleState` in its `__dict__` (read it with `state_of`)."""


class Token:
    """A named application token, one per name, that deep copies and pickles
    as itself (`quantize()`'s permanent entry, a layer's own policy).

    >>> Token("LAYER_OWN") is Token("LAYER_OWN")
    True
    """

    __slots__ = ("name",)
    name: str
    _by_name: dict[str, Token] = {}

    def __new__(cls, name: str) -> Token:
        token = cls._by_name.get(name)
        if token is None:
            token = cls._by_name[name] = super().__new__(cls)
            token.name = name
        return token

    def __reduce__(self) -> tuple:
        return (Token, (self.name,))

    def __deepcopy__(self, memo: dict) -> Token:
        return self

    def __repr__(self) -> str:
        return f"<token {self.name}>"


class ModuleState:
    """What this library keeps on one module.

    Attributes:
        call: The frozen `CallState` its calls run by (`None` until derived).
        casts: Its kept graph-free weight casts (see `weight_casts`).
        applications: The policy applications, `(token, entry)`, top in force.
        quantization: Its `QuantizedWeight` when quantized, else `None`.
        handle: The `PolicyHandle` of the application rooted at this module.
    """

    __slots__ = ("applications", "call", "casts", "handle", "quantization")

    def __init__(self, applications: list[tuple[object, Any]] | None = None) -> None:
        self.call: CallState | None = None
        self.casts = WeightCasts()
        self.applications: list[tuple[object, Any]] = applications or []
        self.quantization: Any = None
        self.handle: Any = None

    @property
    def top(self) -> Any:
        """The entry in force, `None` without applications."""
        applications = self.applications
        return applications[-1][1] if applications else None

    def is_empty(self) -> bool:
        """Whether nothing of this library is left on the module."""
        return not self.applications and self.quantization is None and self.handle is None

    def __repr__(self) -> str:
        tokens = [token for token, _ in self.applications]
        policy = None if self.call is None else self.call.policy.name
        return (
            f"ModuleState(policy={policy!r}, applications={tokens}, "
            f"quantized={self.quantization is not None}, casts={self.casts!r})"
        )


def state_of(module: torch.nn.Module) -> ModuleState | None:
    """The module's `ModuleState`, `None` for a module this library never prepared.

    >>> import torch
    >>> import dtype_policies
    >>> model = torch.nn.Linear(2, 2)
    >>> state_of(model) is None
    True
    >>> _ = dtype_policies.apply_policy(model, "mixed_bfloat16")
    >>> state_of(model).call.compute
    torch.bfloat16
    """
    return module.__dict__.get(STATE_KEY)


def ensure_state(module: torch.nn.Module) -> ModuleState:
    """The module's `ModuleState`, created empty if it has none."""
    state = module.__dict__.get(STATE_KEY)
    if state is None:
        state = module.__dict__[STATE_KEY] = ModuleState()
    return state


def drop_state_if_empty(module: torch.nn.Module) -> None:
    """Removes the module's state once nothing is left in it."""
    state = module.__dict__.get(STATE_KEY)
    if state is not None and state.is_empty():
        del module.__dict__[STATE_KEY]


def push_application(
    module: torch.nn.Module, token: object, entry: Any, bottom: bool = False
) -> None:
    """Puts `(token, entry)` on the module's stack (at the bottom with
    `bottom`, for permanent entries) and lets the module re-derive itself."""
    applications = ensure_state(module).applications
    if bottom:
        applications.insert(0, (token, entry))
    else:
        applications.append((token, entry))
    cast(Any, module)._refresh_policy_state()  # `Layer`'s and `PolicyModule`'s


def pop_application(module: torch.nn.Module, token: object) -> bool:
    """Takes the application `token` off the module's stack, wherever it is,
    and lets the module re-derive itself; returns whether it had one."""
    state = module.__dict__.get(STATE_KEY)
    if state is None:
        return False
    remaining = [entry for entry in state.applications if entry[0] is not token]
    if len(remaining) == len(state.applications):
        return False
    state.applications = remaining
    refresh = getattr(module, "_refresh_policy_state", None)
    if refresh is not None:  # None: its own code gave it another class (a lazy module's)
        refresh()
    return True


def replace_top(module: torch.nn.Module, entry: Any) -> None:
    """Replaces the entry in force (its token stays)."""
    applications = module.__dict__[STATE_KEY].applications
    applications[-1] = (applications[-1][0], entry)


def quantization_of(module: torch.nn.Module) -> Any:
    """The module's `QuantizedWeight` when it is quantized, else `None`."""
    state = module.__dict__.get(STATE_KEY)
    return None if state is None else state.quantization


@contextlib.contextmanager
def casts_not_kept(model: torch.nn.Module) -> Iterator[None]:
    """Inside, `model`'s calls keep no compute-dtype casts between calls (each
    call casts what it reads, once per call); the casts kept before are
    dropped on entry, and casts are kept again after. For runs over data that
    visit every weight once or a few times (calibration), where kept casts
    would only hold a second copy of the model.

    >>> import torch
    >>> import dtype_policies
    >>> model = torch.nn.Linear(4, 4)
    >>> _ = dtype_policies.apply_policy(model, "mixed_bfloat16")
    >>> with torch.no_grad(), casts_not_kept(model):
    ...     _ = model(torch.ones(1, 4))
    ...     state_of(model).casts.pair is None
    True
    """
    saved = []
    for module in model.modules():
        state = module.__dict__.get(STATE_KEY)
        if state is not None:
            state.casts.clear()
            saved.append((state, state.casts))
            state.casts = WeightCasts(enabled=False)
    try:
        yield
    finally:
        for state, casts in saved:
            state.casts = casts


def refresh_kept(model: torch.nn.Module) -> None:
    """Makes what the quantized modules of `model` keep of their stored
    tensors (the kernels' plans) current, eagerly: before a graph with frozen
    weights is traced, which reads choices of those plans."""
    for module in model.modules():
        state = module.__dict__.get(STATE_KEY)
        if state is not None and state.quantization is not None:
            state.quantization.refresh_kept(module)


def forget_kept_after_load(module: torch.nn.Module) -> None:
    """Drops what the kernels keep of a quantized module's stored tensors
    after a load into them: a load under `inference_mode` into inference
    tensors (stored tensors loaded there with `assign=True`) writes them
    without moving a version counter."""
    quantization = quantization_of(module)
    if quantization is not None:
        quantization.forget_kept()


def clear_cast_caches(model: torch.nn.Module) -> None:
    """Drops the compute-dtype casts kept by `model` and its submodules, and
    makes graphs compiled from it with frozen weights (`compile_for_inference`,
    `compile_for_generation`) run eagerly until compiled again.

    Needed only in the one case neither can see (docs/apply_policy.md,
    "What a kept cast cannot see"): a write that bypasses torch's version
    counter (`p.data.copy_(...)`, a `torch.distributed` collective into a
    tensor) between two calls. It also drops what quantized modules keep of
    their stored tensors (the kernels' packed layouts).

    >>> import torch
    >>> import dtype_policies
    >>> model = torch.nn.Linear(4, 4)
    >>> _ = dtype_policies.apply_policy(model, "mixed_bfloat16")
    >>> with torch.no_grad():
    ...     _ = model(torch.ones(1, 4))
    ...     _ = model.weight.data.zero_()  # invisible to torch's version counter
    ...     dtype_policies.clear_cast_caches(model)
    ...     bool((model(torch.ones(1, 4)) == model.bias.bfloat16()).all())
    True
    """
    for module in model.modules():
        state = module.__dict__.get(STATE_KEY)
        if state is not None:
            state.casts.clear()
            if state.quantization is not None:
                state.quantization.forget_kept()  # packed layouts of the stored tensors
    weights_written(model)  # and graphs compiled with frozen weights run eagerly
