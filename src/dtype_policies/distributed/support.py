"""Whether this torch's FSDP2 runs on a device type: a feature probe, read by
`fully_shard` before it shards and by the tests that need FSDP2 on CPU."""

from __future__ import annotations

from typing import Any

import torch

# FSDP2 orders its all-gathers and reduce-scatters through the device's
# streams and events; on CPU through `torch.cpu.Stream`, a stand-in whose
# no-op `record_event` and `wait_event` torch 2.7 added (torch 2.6's FSDP2
# fails inside its first forward on CPU).
_CPU_STREAM_METHODS = ("record_event", "wait_event", "wait_stream")


def fsdp_refusal(device_type: str) -> str | None:
    """Why this torch's FSDP2 cannot run on `device_type` (`"cpu"`,
    `"cuda"`, ...), or `None` where it can.

    >>> fsdp_refusal("cuda") is None  # decided by torch's CUDA build itself
    True
    >>> fsdp_refusal("cpu") is None or "torch>=2.7" in fsdp_refusal("cpu")
    True
    """
    if device_type != "cpu":
        return None
    stream = getattr(torch.cpu, "Stream", None)
    missing = [name for name in _CPU_STREAM_METHODS if not callable(getattr(stream, name, None))]
    if not missing:
        return None
    return (
        f"torch {torch.__version__}'s FSDP2 cannot run on CPU: its CPU stream stand-in "
        f"(torch.cpu.Stream) has no {'/'.join(missing)}, which FSDP2 calls in every "
        "all-gather. FSDP2 on CPU (gloo) needs torch>=2.7; on this torch shard over a "
        "CUDA mesh, or train with DDP (DistributedDataParallel over an apply_policy model)."
    )


def fsdp_runs_on(device_type: str) -> bool:
    """Whether this torch's FSDP2 runs on `device_type` (see `fsdp_refusal`).

    >>> fsdp_runs_on("cuda")
    True
    """
    return fsdp_refusal(device_type) is None


def sharding_device_type(mesh: Any) -> str:
    """The device type FSDP2 shards on: the mesh's, else that of the mesh
    FSDP2 makes by default (the accelerator torch finds, else CPU).

    >>> import torch
    >>> torch.cuda.is_available() or sharding_device_type(None) == "cpu"
    True
    """
    if mesh is not None:
        return str(mesh.device_type)
    return torch._C._get_accelerator().type
