"""`save` and `load`: a model with its policies and quantization, in safetensors.

A checkpoint is one `.safetensors` file (or a directory holding
`model.safetensors` and, for review, `dtype_policies.json`): every tensor of
the model (float weights, int8 and packed int4 data, scales, zero points,
float8 scales and histories, non-persistent buffers), nothing pickled, and in
the file's header the manifest (see `manifest.py`). Kernel-specific packed
layouts are never stored; they are rebuilt on first use after loading.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dtype_policies._core.checkpoints import guard_loading
from dtype_policies._core.listeners import model_changed
from dtype_policies._core.sharded import (
    DATA_PARALLEL_WRAPPERS,
    is_sharded_tensor,
    refuse_replicated,
)
from dtype_policies._core.slots import (
    non_persistent_buffer_names,
    replace_buffer,
    replace_parameter,
    stored_buffer,
    stored_parameter,
)
from dtype_policies._core.tensor_identity import has_strides
from dtype_policies._modes import stored_suffixes
from dtype_policies._paths import join, root_path_of
from dtype_policies._version import __version__
from dtype_policies.apply.apply import (
    Step,
    applications_on,
    commit_application,
    entry_without,
    lift_applications,
    policy_without,
)
from dtype_policies.layers.layer import Layer, LayerApplication
from dtype_policies.policies import DTypePolicy, DTypePolicyMap
from dtype_policies.quantization import attach
from dtype_policies.quantization.experts import ExpertsExpansion, experts_layout
from dtype_policies.quantization.kinds import kind_of
from dtype_policies.quantization.modules import own_options
from dtype_policies.quantization.schemes import scheme_for
from dtype_policies.quantization.schemes.base import invalid_stored_values
from dtype_policies.saving.atomic import write_atomically
from dtype_policies.saving.manifest import (
    CheckpointError,
    Manifest,
    QuantizedRecord,
    class_name,
    describe,
    layer_policy,
)

MODEL_FILE = "model.safetensors"
MANIFEST_FILE = "dtype_policies.json"
METADATA_KEY = "dtype_policies"


def model_file(path: str | os.PathLike) -> Path:
    """The checkpoint file `path` names: itself if it ends in `.safetensors`
    or is an existing file (read as one: a foreign file is refused by its
    header), else the `model.safetensors` of the directory `path`."""
    path = Path(path)
    return path if path.suffix == ".safetensors" or path.is_file() else path / MODEL_FILE


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The model a data-parallel wrapper holds (its keys carry `module.`, its
    class is the wrapper's), or `module`."""
    while isinstance(module, DATA_PARALLEL_WRAPPERS):
        module = module.module
    return module


def save(module: torch.nn.Module, path: str | os.PathLike) -> Path:
    """Saves `module` with its policies and quantization.

    `path` ending in `.safetensors` is written as that one file; any other
    path is a directory holding `model.safetensors` and `dtype_policies.json`
    (the manifest, for review). Files are written atomically: an interrupted
    save never leaves a partial file under the final name. Returns the
    `.safetensors` path.

    >>> import tempfile, torch
    >>> import dtype_policies
    >>> from dtype_policies import saving
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    >>> _ = dtype_policies.apply_policy(model, "mixed_bfloat16")
    >>> _ = dtype_policies.quantize(model, "int8")
    >>> path = saving.save(model, tempfile.mkdtemp())
    >>> fresh = saving.load(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)), path)
    >>> x = torch.randn(2, 8)
    >>> torch.equal(fresh(x), model(x)), fresh[0].dtype_policy.name
    (True, 'int8_from_mixed_bfloat16')

    A model sharded with FSDP2 (its parameters are DTensors) is saved whole:
    call `save` on every rank; each tensor is all-gathered in turn, rank 0
    alone writes the file, at the path rank 0 was given, and every rank
    returns that path once it is written (a rank given another path is told
    so by a warning). Load the file into the unsharded model (`load`, then
    shard it again). A `DistributedDataParallel` (or `DataParallel`) wrapper
    saves the model it wraps, and `load` loads into the model it wraps: the
    file is the model's, whatever wraps it.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"save() expects a torch.nn.Module. Received: {type(module).__name__}")
    module = _unwrapped(module)
    if Path(path).suffix != ".safetensors" and Path(path).is_file():
        raise ValueError(
            f"save(): '{path}' is an existing file, not a '.safetensors' one: save() writes "
            "a '<name>.safetensors' file, or a directory holding model.safetensors and "
            "dtype_policies.json, and overwrites no other file. Nothing was written."
        )
    file = model_file(path)
    with attach.committing(()):  # no quantization commits between the two (another thread's)
        manifest = describe(module, __version__)
        tensors, sharded = _collect_tensors(module, manifest)
    if not sharded:
        _write(file, path, tensors, manifest)
        return file
    failure: list[Any] = [None, str(file)]
    cause = None
    if _rank() == 0:
        try:
            _write(file, path, tensors, manifest)
        except Exception as error:  # every rank raises it, none waits for the file
            cause, failure[0] = error, f"{type(error).__name__}: {error}"
    # the file exists on return, on every rank; or every rank raises
    torch.distributed.broadcast_object_list(failure, src=0)
    written = Path(failure[1])
    if failure[0] is not None:
        raise CheckpointError(
            f"save(): rank 0 could not write '{written}': {failure[0]}"
        ) from cause
    if written != file:
        warnings.warn(
            f"save(): this rank ({_rank()}) was given '{file}', and rank 0, which writes the "
            f"file, '{written}': returning the path rank 0 wrote. Pass the same path on every "
            "rank (a directory made on rank 0 and broadcast, or a fixed one).",
            UserWarning,
            stacklevel=2,
        )
    return written


def _write(file: Path, path: str | os.PathLike, tensors: dict, manifest: Manifest) -> None:
    _check_writable(tensors)
    metadata = {METADATA_KEY: manifest.to_json()}
    review = file.name == MODEL_FILE and file.parent == Path(path)

    # The file and its review copy as one write among this process's threads.
    # Two renames cannot be one: the review copy goes first and comes back
    # after the file, so that a save that fails or dies between them leaves
    # no review copy rather than one describing another model.
    with _lock_for(file):
        if file.name == MODEL_FILE:  # a review copy beside it describes the old file
            with contextlib.suppress(FileNotFoundError):
                os.unlink(file.parent / MANIFEST_FILE)
        write_atomically(file, lambda tmp: save_file(tensors, tmp, metadata=metadata))
        if review:
            text = manifest.to_json(indent=2) + "\n"
            write_atomically(file.parent / MANIFEST_FILE, lambda tmp: Path(tmp).write_text(text))


_write_locks: dict[str, threading.Lock] = {}
_write_locks_guard = threading.Lock()


def _lock_for(file: Path) -> threading.Lock:
    key = os.path.realpath(file)  # one lock per file, whatever the path (symlinks)
    with _write_locks_guard:
        return _write_locks.setdefault(key, threading.Lock())


def _rank() -> int:
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank()
    return 0


def _collect_tensors(
    module: torch.nn.Module, manifest: Manifest
) -> tuple[dict[str, torch.Tensor], bool]:
    """The tensors to write, and whether the module is sharded (then every
    rank gathers each DTensor, in state-dict order, and only rank 0 keeps it)."""
    state = dict(module.state_dict(keep_vars=True))
    sharded = any(is_sharded_tensor(tensor) for tensor in state.values())
    keep = not sharded or _rank() == 0
    for key in manifest.non_persistent:
        state[key] = stored_buffer(module, key)
    tensors: dict[str, torch.Tensor] = {}
    first_key: dict[tuple, str] = {}
    storages: set[tuple] = set()
    for key, value in state.items():
        tensor = value.detach()
        gather = is_sharded_tensor(tensor)
        local = tensor.to_local() if gather else tensor
        if local.device.type == "meta":
            raise CheckpointError(
                f"save(): '{key}' is on the meta device (it has no values to save)."
            )
        if not has_strides(local):
            kind = "a nested tensor" if local.is_nested else f"of layout {local.layout}"
            raise CheckpointError(
                f"save(): '{key}' is {kind}; safetensors holds dense tensors only "
                "(non-persistent buffers are saved too). Hold it as dense tensors (a "
                "sparse tensor's `.to_dense()`, or its indices and values) to save the model."
            )
        if gather:  # the same object on every rank (a local shard may be empty)
            identity: tuple = ("sharded", id(value))
        else:
            identity = (
                tensor.device,
                tensor.untyped_storage().data_ptr(),
                tensor.storage_offset(),
                tuple(tensor.shape),
                tuple(tensor.stride()),
                tensor.dtype,
            )
        if tensor.numel() and identity in first_key:  # the same tensor twice: tied weights
            manifest.aliases[key] = first_key[identity]
            continue
        first_key[identity] = key
        if gather:
            tensor = tensor.full_tensor()  # a collective: every rank, in this order
            storage = None
        else:
            storage = (tensor.device, tensor.untyped_storage().data_ptr())
        if not keep:
            continue
        tensor = tensor.to("cpu")
        if storage is not None:
            if tensor.numel() and storage in storages:  # another view of a saved storage
                tensor = tensor.clone()
            storages.add(storage)
        tensors[key] = tensor.contiguous()
    return tensors, sharded


def load(module: torch.nn.Module, path: str | os.PathLike) -> torch.nn.Module:
    """Loads a checkpoint written by `save` into `module` and returns it.

    `module` is a freshly built float model of the same architecture; it may
    be built on the `meta` device (`with torch.device("meta"): model = ...`),
    so that a large model never needs twice its memory. Its policies are
    re-applied (replacing any `apply_policy` in force on `module`: a module
    saved without a policy is loaded without one), what was quantized is
    quantized again (with the saved tensors, not from the float weights), and
    every tensor is loaded: outputs are bit-identical to the saved model's.
    Float tensors load in the target's dtype (a target converted by `.half()`
    before loading ends as the loaded model converted after); the stored
    tensors of quantized weights keep the file's dtypes.

    Raises `CheckpointError` (a `ValueError`) naming each path that differs
    (a missing or extra module or tensor, another shape, dtype or mode), or
    saying what is wrong with a corrupted file, and then `module` is exactly
    as it was. A missing file raises `FileNotFoundError`. A sharded `module`
    (FSDP2's DTensor parameters) raises `CheckpointError`: load into the
    unsharded model, then shard it.

    >>> import pathlib, tempfile, torch
    >>> from dtype_policies import apply_policy, quantize, saving
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    >>> _ = apply_policy(model, "mixed_bfloat16"); _ = quantize(model, "int8")
    >>> path = saving.save(model, pathlib.Path(tempfile.mkdtemp()) / "model")
    >>> with torch.device("meta"):
    ...     target = torch.nn.Sequential(torch.nn.Linear(64, 32))
    >>> x = torch.randn(2, 64)
    >>> torch.equal(saving.load(target, path)(x), model(x))
    True
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"load() expects a torch.nn.Module. Received: {type(module).__name__}")
    target = _unwrapped(module)
    _refuse_sharded(target)
    file = model_file(path)
    if not file.is_file():
        raise FileNotFoundError(f"No dtype_policies checkpoint at '{file}'.")
    # Under `inference_mode` the file's tensors (and what is built from them)
    # would be inference tensors, which no later training or grad-enabled
    # call could use: the model loads as it does outside.
    with torch.inference_mode(False):
        _load(target, file, module)
    return module


def _load(
    module: torch.nn.Module, file: Path, given: torch.nn.Module | None = None
) -> torch.nn.Module:
    """Loads `file` into `module` (`given`: the module `load` was given, a
    data-parallel wrapper of it or itself)."""
    manifest, header = read_header(file)
    with safe_open(str(file), framework="pt") as reader:
        state = _read_state(reader, header, manifest, f"'{file}'")
    # a tensor written once for keys the target keeps apart: one copy per key;
    # the file's tensors become the target's where it has no storage (meta)
    assign = any(t.device.type == "meta" for t in _module_tensors(module))
    state = _untied_copies(state, module, assign)
    steps, plans, expansions, problems, unfit = _plan(module, manifest, _saved_tensors(state))
    if plans:  # float modules the file quantizes: not under DDP's gradient buckets
        refuse_replicated(
            given if given is not None else module,
            "load() of a checkpoint that quantizes modules of the model",
            "Load into the module before wrapping it: saving.load(module, path), then wrap it",
        )
    # persistent or not as the target's class says (its buffers, not the file's)
    non_persistent = non_persistent_keys(module)
    fit = _state_fit(module, manifest, header, plans, expansions, unfit, non_persistent)
    problems += fit.problems + _invalid_stored(manifest, state)
    if problems:
        raise_unfit(str(file), problems)
    if assign:  # the file's tensors become the target's: in the target's float dtypes
        state = _in_target_dtypes(state, fit.dtypes)
    # Nothing above changed `module`; nothing below can fail on a checked file.
    if not assign:
        _renew_inference_tensors(module)
    for expansion in expansions.values():
        expansion.attach()
    # the saved policies replace every application made on the target, as planned
    lift_applications(module)
    if steps:
        commit_application(module, steps, [])
    for plan in plans:
        attach.commit(plan)
    # the ties as quantization leaves them (one side of a tied table quantized
    # leaves the other side's parameter alone)
    tied = _tied_parameters(module)
    persistent = {k: v for k, v in state.items() if k not in non_persistent}
    module.load_state_dict(persistent, strict=True, assign=assign)
    for key in sorted(non_persistent & state.keys()):
        if assign:
            replace_buffer(module, key, state[key])
        else:
            # (a non-persistent key names a buffer that holds a tensor)
            cast(torch.Tensor, stored_buffer(module, key)).copy_(state[key])
    if assign:
        _retie(module, tied)
    if plans:
        guard_loading(module)
    model_changed(module)
    return module


def _renew_inference_tensors(module: torch.nn.Module) -> None:
    """Each inference tensor of `module` (made under `torch.inference_mode()`,
    which no copy outside that mode may write) replaced by a normal copy,
    ties kept, for the load to copy into (what the file does not hold keeps
    its values); the other parameters stay the objects an optimizer holds."""
    renewed: dict[int, torch.Tensor] = {}
    for submodule in module.modules():
        own = [
            *submodule.named_parameters(recurse=False, remove_duplicate=False),
            *submodule.named_buffers(recurse=False, remove_duplicate=False),
        ]
        for name, tensor in own:
            if not tensor.is_inference():
                continue
            fresh = renewed.get(id(tensor))
            if fresh is None:  # its values, for what the file does not hold
                fresh = tensor.clone()
                if isinstance(tensor, torch.nn.Parameter):
                    fresh = torch.nn.Parameter(fresh, requires_grad=tensor.requires_grad)
                renewed[id(tensor)] = fresh
            setattr(submodule, name, fresh)


def tensor_headers(reader: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """`{key: (shape, dtype code)}` of an open safetensors file (headers only)."""
    headers = {}
    for key in reader.keys():  # noqa: SIM118 (not a dict)
        piece = reader.get_slice(key)
        headers[key] = (tuple(piece.get_shape()), piece.get_dtype())
    return headers


def read_pretrained_header(
    directory: Path,
) -> tuple[Manifest, dict[str, tuple[tuple[int, ...], str]]] | None:
    """The manifest and tensor headers of a directory written by a Hugging
    Face model's `save_pretrained` (its manifest in `config.json`'s
    `quantization_config`, its tensors in one or more safetensors shards),
    or `None` where `directory` holds no such checkpoint."""
    config_file = directory / "config.json"
    shards = sorted(directory.glob("*.safetensors"))
    if not config_file.is_file() or not shards:
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"'{config_file}' is not readable JSON: {e}") from None
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "dtype_policies":
        return None
    where = f"'{config_file}'"
    manifest = Manifest.from_json(json.dumps(quantization.get("manifest")), where)
    return manifest, shard_headers(shards)


def shard_headers(files: list[str] | list[Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """`{key: (shape, dtype code)}` of a checkpoint's safetensors shards,
    from their headers alone."""
    header: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as reader:
                header.update(tensor_headers(reader))
        except (SafetensorError, OSError) as error:
            raise CheckpointError(
                f"'{file}' is not a readable safetensors file ({error}): the checkpoint's "
                "shard is damaged or incomplete."
            ) from error
    return header


def read_header(file: Path) -> tuple[Manifest, dict[str, tuple[tuple[int, ...], str]]]:
    try:
        with safe_open(str(file), framework="pt") as reader:
            metadata = reader.metadata() or {}
            header = tensor_headers(reader)
    except SafetensorError as e:
        raise CheckpointError(f"'{file}' is not a readable safetensors file: {e}") from None
    if METADATA_KEY not in metadata:
        raise CheckpointError(
            f"'{file}' is a safetensors file without a dtype_policies manifest (not written "
            "by dtype_policies.saving.save)."
        )
    return Manifest.from_json(metadata[METADATA_KEY], f"'{file}'"), header


_DTYPE_CODES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
for _name, _code in (
    ("complex64", "C64"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("float8_e8m0fnu", "F8_E8M0"),
):  # the safetensors format's other codes, where this torch has the dtype
    if isinstance(getattr(torch, _name, None), torch.dtype):
        _DTYPE_CODES[getattr(torch, _name)] = _code


_DTYPES_BY_CODE = {code: dtype for dtype, code in _DTYPE_CODES.items()}


@functools.cache
def _writable_dtypes() -> frozenset[torch.dtype]:
    """The dtypes the installed safetensors writes (older releases write
    fewer than the format names), found once by writing an empty tensor of
    each."""
    from safetensors.torch import save

    writable = set()
    for dtype in _DTYPE_CODES:
        try:
            save({"x": torch.empty(0, dtype=dtype)})
        except Exception:
            continue
        writable.add(dtype)
    return frozenset(writable)


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors header's name for `dtype` (`"F32"`, `"I8"`, ...)."""
    return _DTYPE_CODES.get(dtype, str(dtype))


def dtype_of_code(code: str) -> torch.dtype | None:
    """The torch dtype a safetensors header names (`None` if unknown here)."""
    return _DTYPES_BY_CODE.get(code)


def _check_writable(tensors: dict[str, torch.Tensor]) -> None:
    """Raises, before anything is written, naming each tensor of a dtype the
    checkpoint cannot hold."""
    writable = _writable_dtypes()
    refused = {key: t.dtype for key, t in tensors.items() if t.dtype not in writable}
    if refused:
        named = ", ".join(f"'{key}' ({dtype})" for key, dtype in list(refused.items())[:5])
        more = f" and {len(refused) - 5} more" if len(refused) > 5 else ""
        accepted = ", ".join(sorted(str(d).removeprefix("torch.") for d in writable))
        raise CheckpointError(
            f"save(): safetensors cannot store {named}{more}. The dtypes it stores: {accepted}."
        )


TensorFor = Callable[[str, tuple, torch.dtype], torch.Tensor]
"""`(key, shape, dtype) -> tensor`: the tensor a planned quantized buffer gets
(raises `CheckpointError` when there is none that fits)."""


def plan_from_manifest(
    module: torch.nn.Module,
    manifest: Manifest,
    tensor_for: TensorFor,
    source: str,
) -> tuple[list[Step], list[attach.Plan], dict[str, ExpertsExpansion]]:
    """The application steps (policies), quantization plans and experts
    expansions by module name (`quantization.experts`; a plan of one of its
    linears attaches its expansion, the caller attaches them first) that make
    `module` what `manifest` describes, without changing `module`.

    Each quantized buffer's tensor comes from `tensor_for`: the saved tensor
    (`load`), or an empty one on the meta device that a loader fills later
    (the Hugging Face route). Raises `CheckpointError` listing every module
    that does not fit.
    """
    steps, plans, expansions, problems, _ = _plan(module, manifest, tensor_for)
    if problems:
        raise_unfit(source, problems)
    return steps, plans, expansions


def raise_unfit(source: str, problems: list[str]) -> None:
    """Raises the `CheckpointError` listing every way `source` does not fit."""
    shown = problems[:25]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    raise CheckpointError(
        f"{source} does not fit the target module:\n  " + "\n  ".join(shown) + more
    )


def _plan(
    module: torch.nn.Module, manifest: Manifest, tensor_for: TensorFor
) -> tuple[list[Step], list[attach.Plan], dict[str, ExpertsExpansion], list[str], set[str]]:
    """`plan_from_manifest`'s steps, plans and expansions, with every problem
    found and the names of the quantized modules that could not be planned."""
    modules = dict(module.named_modules())
    problems: list[str] = []
    unfit: set[str] = set()
    # planned against the target without the applications made on it
    # (`apply_policy`, an earlier load), which the load replaces: a module
    # the manifest gives no policy keeps none of the target's
    replaced = applications_on(module)
    expansions = _expansions(modules, manifest.experts, problems)
    steps: list[Step] = []
    saved_policies: dict[str, DTypePolicy] = {}  # the steps' policies, resolved, by name
    for name, record in manifest.modules.items():
        target = modules.get(name)
        if target is None or isinstance(target, Layer):
            problems.append(f"'{name or '(root)'}': no such torch module in the target")
            continue
        try:
            options = record.options()
        except (ValueError, TypeError, AttributeError) as e:  # a manifest edited by hand
            problems.append(f"'{name or '(root)'}': its saved policy cannot be read: {e}")
            continue
        steps.append(Step(name.replace(".", "/"), target, options.policy, options.island, options))
        saved_policies[name] = options.policy
    maps = _saved_maps(manifest, problems)
    root_path = root_path_of(module)
    for name, layer_record in manifest.layers.items():
        target = modules.get(name)
        if not isinstance(target, Layer):
            problems.append(f"'{name or '(root)'}': no such dtype_policies layer in the target")
            continue
        try:
            policy = layer_policy(layer_record)
        except (ValueError, TypeError) as e:
            problems.append(f"'{name or '(root)'}': its saved policy cannot be read: {e}")
            continue
        step = _layer_step(name, target, policy, manifest, maps, root_path, replaced, problems)
        if step is not None:
            steps.append(step)
            saved_policies[name] = policy
    plans = []
    for name, quantized_record in manifest.quantized.items():
        target = modules.get(name)
        try:
            saved = saved_policies.get(name)
            kept = None if target is None or saved is not None else policy_without(target, replaced)
            plans.extend(_plan_quantized(name, target, quantized_record, tensor_for, saved, kept))
        except (CheckpointError, NotImplementedError, ValueError, TypeError, AttributeError) as e:
            problems.append(f"'{name or '(root)'}': {e}")  # a record that does not fit its mode
            unfit.add(name)
    ExpertsExpansion.claim_all(plans, list(expansions.values()))
    return steps, plans, expansions, problems, unfit


def _saved_maps(manifest: Manifest, problems: list[str]) -> list[DTypePolicyMap | None]:
    """The manifest's policy maps, one object each (layers that shared a map
    share it again); `None` for one that cannot be read."""
    maps: list[DTypePolicyMap | None] = []
    for index, record in enumerate(manifest.policy_maps):
        try:
            saved = layer_policy(record)
        except (ValueError, TypeError) as e:
            problems.append(f"saved policy map {index} cannot be read: {e}")
            saved = None
        if saved is not None and not isinstance(saved, DTypePolicyMap):
            problems.append(f"saved policy map {index} is not a DTypePolicyMap: {saved!r}")
            saved = None
        maps.append(saved)
    return maps


def _layer_step(
    name: str,
    target: Layer,
    policy: DTypePolicy,
    manifest: Manifest,
    maps: list[DTypePolicyMap | None],
    root_path: str,
    replaced: frozenset[object],
    problems: list[str],
) -> Step | None:
    """The step that makes `target` compute by its saved `policy`: the saved
    map resolved at the saved path when the layer had one, else the policy
    itself; `None` when the target is that already without `replaced`."""
    saved_map = manifest.layer_maps.get(name)
    if saved_map is None:
        if policy_without(target, replaced) == policy:
            return None
        return Step(join(root_path, name.replace(".", "/")), target, policy)
    if not 0 <= saved_map.map < len(maps):
        problems.append(f"'{name or '(root)'}': its saved policy map {saved_map.map} is not saved")
        return None
    policy_map = maps[saved_map.map]
    if policy_map is None:
        return None  # its problem is listed
    resolved: DTypePolicy | ValueError
    try:
        resolved = policy_map[saved_map.path]
    except ValueError as e:
        resolved = e
    if resolved != policy:
        problems.append(
            f"'{name or '(root)'}': its saved policy map resolves '{saved_map.path}' to "
            f"{resolved!r}, not to its saved policy {policy!r}"
        )
        return None
    entry = entry_without(target, replaced)
    if isinstance(entry, LayerApplication) and (entry.policy, entry.path) == (
        policy_map,
        saved_map.path,
    ):
        return None
    return Step(saved_map.path, target, policy_map)


def _expansions(
    modules: dict[str, torch.nn.Module], names: list[str], problems: list[str]
) -> dict[str, ExpertsExpansion]:
    """The planned expansions of the experts modules named in `names` (the
    manifest's `experts`), by name; their linears are added to `modules`."""
    found: dict[str, ExpertsExpansion] = {}
    for name in names:
        target = modules.get(name)
        layout = None if target is None else experts_layout(target)
        if target is None or layout is None:
            what = "no such module" if target is None else type(target).__name__
            problems.append(
                f"'{name}': saved as a mixture-of-experts module with one linear per expert, "
                f"but the target holds {what} (not transformers experts with 3-D weights)"
            )
            continue
        found[name] = ExpertsExpansion(target, layout)
        modules.update(found[name].linears(under=name, separator="."))
    return found


def _saved_tensors(state: dict[str, torch.Tensor]) -> TensorFor:
    def tensor_for(key: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        tensor = state.get(key)
        if tensor is None:
            raise CheckpointError(f"the checkpoint lacks '{key}'")
        if (tuple(tensor.shape), tensor.dtype) != (tuple(shape), dtype):
            raise CheckpointError(
                f"'{key}' is {(tuple(tensor.shape), dtype_code(tensor.dtype))} in the checkpoint, "
                f"{(tuple(shape), dtype_code(dtype))} expected"
            )
        return tensor

    return tensor_for


def _plan_quantized(
    name: str,
    target: torch.nn.Module | None,
    record: QuantizedRecord,
    tensor_for: TensorFor,
    saved_policy: DTypePolicy | None = None,
    kept_policy: DTypePolicy | None = None,
) -> list[attach.Plan]:
    """The plan of one saved quantized module. It computes from the policy
    saved for it (`saved_policy`, which loading applies) whatever policy the
    target has now; without one, from the policy the target keeps through the
    load (`kept_policy`: one applied to a part of it), else (quantized on a
    float model, no policy) in the dtype of the target's weight, as a dtype
    conversion would."""
    if target is None:
        raise CheckpointError("no such module in the target")
    if getattr(target, "built", True) is False:  # one of this library's layers, not built
        raise CheckpointError(
            f"the target {type(target).__name__} is not built, so it has no weights to "
            "quantize: call it on an input (or build(input_shape)) before loading"
        )
    try:
        config = record.checked_config()
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    kind = kind_of(target)
    if kind is None or not kind.supports(record.mode):
        raise CheckpointError(
            f"{type(target).__name__} cannot be quantized in mode '{record.mode}'"
        )
    existing = attach.quantization_of(target)
    if existing is not None:
        if existing.mode == record.mode and existing.config == config:
            return []  # already quantized the same way: only the tensors load
        raise CheckpointError(
            f"the target is quantized in mode '{existing.mode}' ({existing.config}); the "
            f"checkpoint holds it in mode '{record.mode}' ({config}). Load into a model that "
            "is not quantized, or quantized the same way"
        )
    spec = kind.spec(target, record.mode)
    saved = (record.weight, record.layout, record.role, tuple(record.float_shape))
    found = (spec.weight, spec.layout, spec.role, tuple(spec.float_shape))
    if saved != found:
        raise CheckpointError(
            f"saved weight (name, layout, role, shape) {saved} but the target has {found}"
        )
    scheme = scheme_for(record.mode)
    tensors = {}
    for buffer, (shape, dtype) in scheme.stored_shapes(spec, config).items():
        key = f"{name}.{buffer}" if name else buffer
        tensors[buffer] = tensor_for(key, tuple(shape), dtype)
    source = saved_policy or kept_policy
    if source is not None:
        source = getattr(source, "source_policy", None) or source
    elif (weight := stored_parameter(target, spec.weight)) is not None:
        # what quantize()'s own application computes by for a weight of this
        # dtype (int8 under float16: float32), as after the model's `.half()`
        source = own_options(record.mode, weight.dtype).policy  # not the replaced policy's
    try:
        plan = attach.plan(
            target, config, path=name, type_check=False, kind=kind, tensors=tensors, source=source
        )
    except ValueError as e:
        described = "no policy" if saved_policy is None else f"policy '{saved_policy.name}'"
        now = getattr(getattr(target, "dtype_policy", None), "name", None)
        raise CheckpointError(
            f"saved in mode '{record.mode}' with {described}, from {record.float_dtype} weights; "
            f"the target{f' computes by {now!r} and' if now else ''} cannot take it: {e}"
        ) from None
    return [plan]


def _read_state(
    reader: Any, header: dict, manifest: Manifest, source: str
) -> dict[str, torch.Tensor]:
    """Every tensor, read once; aliases are the same tensor objects (tied weights)."""
    try:
        state = {key: reader.get_tensor(key) for key in header}
    except SafetensorError as e:
        raise CheckpointError(f"{source}: cannot read the checkpoint's tensors: {e}") from None
    for alias, key in manifest.aliases.items():
        if key not in header:
            raise CheckpointError(
                f"{source}: the alias '{alias}' names '{key}', which is not in the file"
            )
        if alias in header:
            raise CheckpointError(
                f"{source}: the alias '{alias}' (of '{key}') is also a tensor of its own in "
                "the file"
            )
        state[alias] = state[key]
    return state


def _untied_copies(
    state: dict[str, torch.Tensor], target: torch.nn.Module, assign: bool
) -> dict[str, torch.Tensor]:
    """`state` where one tensor stands for several keys (a tied pair written
    once) with a copy for each key the target does not tie to the first and
    that would take the file's tensor itself: every key when the target is
    on the meta device (`assign`), else the quantized tensors loading
    installs (the others are copied into the target's own tensors). A key
    the target does not have yet belongs to the weight it was stored for
    (the key less its mode's suffix)."""
    # every name the target has, with the group of names of its tensor
    group_of = {
        name: index for index, names in enumerate(_names_by_tensor(target)) for name in names
    }
    suffixes = stored_suffixes()

    def owner(key: str) -> str:
        if key in group_of:
            return key
        for suffix in suffixes:
            if key.endswith(suffix):
                return key[: -len(suffix)]
        return key

    first: dict[int, str] = {}
    copied = dict(state)
    for key, tensor in state.items():
        seen = first.setdefault(id(tensor), key)
        if seen == key or (key in group_of and not assign):
            continue
        mine, theirs = owner(key), owner(seen)
        if mine not in group_of or group_of.get(theirs) != group_of[mine]:
            copied[key] = tensor.clone()
    return copied


def _names_by_tensor(module: torch.nn.Module, buffers: bool = True) -> list[list[str]]:
    """The names of each parameter (and buffer) of `module`, grouped by the
    tensor they name: a group of several is one tensor (tied weights, the
    quantized tensors of a tied table)."""
    named: Iterator[tuple[str, torch.Tensor]] = module.named_parameters(remove_duplicate=False)
    if buffers:
        named = itertools.chain(named, module.named_buffers(remove_duplicate=False))
    groups: dict[int, list[str]] = {}
    for name, tensor in named:
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def _tied_parameters(module: torch.nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one `Parameter` (tied weights)."""
    return [names for names in _names_by_tensor(module, buffers=False) if len(names) > 1]


def _retie(module: torch.nn.Module, tied: list[list[str]]) -> None:
    """After `load_state_dict(assign=True)`, makes tied parameters one object again."""
    for names in tied:
        first = stored_parameter(module, names[0])
        for name in names[1:]:
            replace_parameter(module, name, first)


def _refuse_sharded(module: torch.nn.Module) -> None:
    """Raises if `module` holds sharded tensors: a load would re-apply the
    saved policies under FSDP2 units planned for other dtypes, and the file's
    full tensors do not go into shards."""
    named_tensors = [*module.named_parameters(), *module.named_buffers()]
    sharded = [name for name, tensor in named_tensors if is_sharded_tensor(tensor)]
    if sharded:
        shown = ", ".join(repr(name) for name in sharded[:3]) + (" ..." if len(sharded) > 3 else "")
        raise CheckpointError(
            f"load(): the target is sharded ({len(sharded)} sharded tensor(s): {shown}). "
            "saving.load restores policies and full tensors into an unsharded model: load into "
            "a freshly built model on every rank, then "
            "dtype_policies.distributed.fully_shard(model, None) to shard it with the loaded "
            "policies."
        )


def non_persistent_keys(module: torch.nn.Module) -> set[str]:
    """The keys of `module`'s non-persistent buffers, as `state_dict` would
    name them (under every name of a module registered twice)."""
    keys = set()
    for name, submodule in module.named_modules(remove_duplicate=False):
        for buffer_name in non_persistent_buffer_names(submodule):
            keys.add(f"{name}.{buffer_name}" if name else buffer_name)
    return keys


def _module_tensors(module: torch.nn.Module):
    yield from module.parameters()
    yield from module.buffers()


@dataclass
class StateFit:
    """How the checkpoint's tensors fit the target once the plans are committed."""

    problems: list[str]
    # the dtype each float tensor of the file loads in, where the target's
    # differs (a target converted by `.half()`, `.to(dtype)`, `.float()`)
    dtypes: dict[str, torch.dtype]


CONVERTIBLE_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
"""The float dtypes a tensor loads into another of (as `load_state_dict` and
`.to(dtype)` convert them); every other dtype, and a quantized module's stored
tensors (int8 data, float32 scales), must be the file's."""


def _invalid_stored(manifest: Manifest, state: dict[str, torch.Tensor]) -> list[str]:
    """The quantized weights' stored tensors (and a float weight float8
    keeps) holding inf or NaN, or group indices out of range, which loading
    refuses (`QuantizedWeight.check_checkpoint`): found here, before the
    target changes, as that check runs only once the target is quantized."""
    problems = []
    for path, record in manifest.quantized.items():
        prefix = f"{path}." if path else ""
        for name in (*record.stored, record.weight):
            tensor = state.get(prefix + name)
            if isinstance(tensor, torch.Tensor):
                found = invalid_stored_values(name, tensor, state, prefix, record.layout)
                if found is not None:
                    problems.append(f"'{prefix + name}' holds {found}: a corrupted checkpoint?")
    return problems


def _state_fit(
    module: torch.nn.Module,
    manifest: Manifest,
    header: dict,
    plans: list[attach.Plan],
    expansions: dict[str, ExpertsExpansion],
    unfit: set[str],
    non_persistent: set[str],
) -> StateFit:
    """How the target's tensors, once the plans are committed, differ from
    the checkpoint's keys, shapes and dtypes (the tensors of the quantized
    modules in `unfit`, which could not be planned and are reported, left out),
    and which float tensors load converted to the target's dtype.
    `non_persistent`: the keys of the target's non-persistent buffers."""
    expected: dict[str, tuple[tuple[int, ...], str]] = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        expected[key] = (tuple(tensor.shape), dtype_code(tensor.dtype))
    stored: set[str] = set()  # quantized modules' stored tensors: the file's dtypes
    # every name of each module: a module registered twice has its keys under both
    names_of: dict[int, list[str]] = {}
    for name, submodule in module.named_modules(remove_duplicate=False):
        names_of.setdefault(id(submodule), []).append(name)
    for name, submodule in module.named_modules(remove_duplicate=False):
        quantized = attach.quantization_of(submodule)
        if quantized is not None:
            prefix = f"{name}." if name else ""
            stored.update(prefix + buffer for buffer in quantized.stored_names)
    unmatched = []
    # non-persistent in the saved model, or in the target (a class whose
    # buffer changed persistence): its tensor is in the file either way
    target_only = sorted((non_persistent & header.keys()) - set(manifest.non_persistent))
    for key in [*manifest.non_persistent, *target_only]:
        try:
            buffer = stored_buffer(module, key)
        except AttributeError:
            buffer = None
        if buffer is not None:
            expected[key] = (tuple(buffer.shape), dtype_code(buffer.dtype))
        elif key not in header:  # neither side has it: nothing else would name it
            unmatched.append(
                f"the manifest's non-persistent buffer '{key}' is in neither file nor target"
            )
    for name, expansion in expansions.items():
        prefix = f"{name}." if name else ""
        for weight in expansion.lists:
            expected.pop(prefix + weight, None)
            expected.pop(f"{prefix}{weight}_bias", None)
        for path, linear in expansion.linears(under=name, separator="."):
            for key, tensor in linear.state_dict(keep_vars=True).items():
                expected[f"{path}.{key}"] = (tuple(tensor.shape), dtype_code(tensor.dtype))
    for plan in plans:
        for name in names_of.get(id(plan.module), [plan.path]):
            prefix = f"{name}." if name else ""
            if not plan.scheme.keeps_float_weight:
                expected.pop(prefix + plan.spec.weight, None)
            for stored_name, tensor in plan.tensors.items():
                expected[prefix + stored_name] = (tuple(tensor.shape), dtype_code(tensor.dtype))
                stored.add(prefix + stored_name)
    saved = dict(header)
    for alias, key in manifest.aliases.items():
        saved[alias] = header.get(key, ("?", "?"))
    modules = dict(module.named_modules())
    for name in unfit:  # its quantized weight's keys: reported already
        record = manifest.quantized[name]
        prefix = f"{name}." if name else ""
        expected.pop(prefix + record.weight, None)
        for stored_name in record.stored:
            expected.pop(prefix + stored_name, None)
            saved.pop(prefix + stored_name, None)
        target = modules.get(name)
        quantized = None if target is None else attach.quantization_of(target)
        for stored_name in () if quantized is None else quantized.stored_names:
            expected.pop(prefix + stored_name, None)
    problems = [f"'{key}' is missing from the checkpoint" for key in expected if key not in saved]
    problems += unmatched
    problems += [
        f"'{key}' is in the checkpoint but not in the target"
        for key in saved
        if key not in expected
    ]
    dtypes: dict[str, torch.dtype] = {}
    for key, (shape, code) in expected.items():
        if key not in saved or saved[key] == (shape, code):
            continue
        saved_shape, saved_code = saved[key]
        convertible = {saved_code, code} <= CONVERTIBLE_DTYPES and key not in stored
        if saved_shape == shape and convertible:
            dtypes[key] = _DTYPES_BY_CODE[code]
        else:
            problems.append(
                f"'{key}': checkpoint {saved[key]}, target {(shape, code)} (shape, dtype)"
            )
    for name, submodule in module.named_modules():  # a weight's layout comes with its class
        recorded = manifest.classes.get(name)
        holds_weights = next(submodule.parameters(recurse=False), None) is not None
        if recorded is not None and holds_weights and class_name(submodule) != recorded:
            problems.append(
                f"'{name or '(root)'}' is a {recorded} in the checkpoint and a "
                f"{class_name(submodule)} in the target"
            )
    for names in _tied_parameters(module):  # one tensor here must be one there
        # the weight itself, or each tensor a mode stored for it
        for suffix in ("", *stored_suffixes()):
            held = [name + suffix for name in names if name + suffix in saved]
            if suffix == "":
                held = [name for name in held if name in expected]
            if len({manifest.aliases.get(name, name) for name in held}) > 1:
                problems.append(
                    f"{', '.join(repr(name) for name in held)} are one tensor (tied) in the "
                    "target and separate tensors in the checkpoint"
                )
    return StateFit(problems, dtypes)


def _in_target_dtypes(
    state: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]
) -> dict[str, torch.Tensor]:
    """`state` with the tensors named in `dtypes` converted (each tensor once:
    tied keys stay one tensor)."""
    converted: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    state = dict(state)
    for key, dtype in dtypes.items():
        tensor = state[key]
        identity = (id(tensor), dtype)
        if identity not in converted:
            converted[identity] = tensor.to(dtype)
        state[key] = converted[identity]
    return state
