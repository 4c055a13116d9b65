"""What the 2-process tests of test_distributed.py run in each process.

Not a test module: spawned processes import it by name (multiprocessing
passes the test process's `sys.path` on). Each scenario runs on every rank in
the same order and returns plain tensors; an exception is returned as text,
so that one failing scenario fails its test and not the others.
"""

from __future__ import annotations

import io
import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dtype_policies
from dtype_policies import DTypePolicyMap, apply_policy, layers, saving
from dtype_policies import distributed as dp_distributed
from dtype_policies.optimizers import LossScaleOptimizer

WORLD = 2
STEPS = 5
POLICY = DTypePolicyMap("mixed_bfloat16", {"blocks.1(/.*)?": "float32"})  # one float32 block


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.norm = nn.LayerNorm(2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.norm(self.up(x))))


class Classifier(nn.Module):
    """Token ids (batch, 8) -> 4 classes: an embedding, three blocks, a head."""

    def __init__(self, vocabulary: int = 50, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.head = nn.Linear(width, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


def make_model() -> Classifier:
    torch.manual_seed(0)
    return Classifier()


def global_batch(size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (size, 8), generator=generator)
    return ids, ids[:, 0] % 4


def shard(tensor: torch.Tensor, rank: int, world: int = WORLD) -> torch.Tensor:
    return tensor.chunk(world)[rank]


def train(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, lr: float = 0.2):
    """SGD on one batch (a rank's share of the global batch); the loss is the
    batch mean, so averaging the ranks' gradients gives the global one."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(ids).float(), labels).backward()
        optimizer.step()
    return model


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the state dict, gathered whole (a collective when sharded)."""
    state = {}
    for key, value in model.state_dict().items():
        full = getattr(value, "full_tensor", None)
        state[key] = (full() if full is not None else value).detach().clone()
    return state


def record_dtypes(model: nn.Module) -> dict[str, tuple]:
    """Per module with a weight: (the weight's type and dtype as the forward
    sees it, the input's dtype), filled by the next forward."""
    seen: dict[str, tuple] = {}
    for name, module in model.named_modules():
        if "weight" in module._parameters:

            def hook(module, args, name=name):
                weight = module._parameters["weight"]
                seen[name] = (type(weight).__name__, weight.dtype, args[0].dtype)

            module.register_forward_pre_hook(hook)
    return seen


def single_process_run(policy=POLICY, make=None, lr: float = 0.2) -> dict[str, torch.Tensor]:
    model = (make or make_model)()
    apply_policy(model, policy)
    ids, labels = global_batch()
    return full_state(train(model, ids, labels, lr))


KERAS_POLICY = DTypePolicyMap("mixed_bfloat16", {"3": "float32"})
KERAS_LR = 0.02  # this model moves far at 0.2: small differences grow


def make_keras_model() -> nn.Module:
    """This library's layers (weights `kernel`, `gamma`, ...), built."""
    torch.manual_seed(0)
    model = nn.Sequential(
        layers.Embedding(50, 16),
        layers.Dense(32, activation="gelu"),
        layers.LayerNormalization(),
        layers.Dense(16),
        nn.Flatten(),
        layers.Dense(4),
    )
    model(global_batch(1)[0])
    return model


# ---------------------------------------------------------------- scenarios


def fsdp_training(rank: int, tmp: str) -> dict:
    model = make_model()
    dp_distributed.fully_shard(model, POLICY)
    seen = record_dtypes(model)
    ids, labels = global_batch()
    train(model, shard(ids, rank), shard(labels, rank))
    sharded = {
        name: (type(p).__name__, p.dtype, type(p.grad).__name__, p.grad.dtype)
        for name, p in model.named_parameters()
    }
    probe = global_batch(4)[0]
    with torch.no_grad():
        output = model(probe)
    saving.save(model, os.path.join(tmp, "fsdp"))
    return {
        "state": full_state(model),
        "seen": dict(seen),
        "sharded": sharded,
        "classes": {n: type(m).__name__ for n, m in model.named_modules()},
        "fsdp_module": isinstance(model, torch.distributed.fsdp.FSDPModule),
        "output": output,
        "probe": probe,
    }


def fsdp_keras_layers(rank: int, tmp: str) -> dict:
    model = make_keras_model()
    dp_distributed.fully_shard(model, KERAS_POLICY)
    ids, labels = global_batch()
    train(model, shard(ids, rank), shard(labels, rank), KERAS_LR)
    return {
        "state": full_state(model),
        "sharded": {(type(p).__name__, p.dtype) for p in model.parameters()},
        "plan": [(u.name, u.param_dtype) for u in dp_distributed.shard_plan(model)],
    }


def fsdp_float32_training(rank: int, tmp: str) -> dict:
    model = make_model()
    dp_distributed.fully_shard(model, "float32")
    ids, labels = global_batch()
    train(model, shard(ids, rank), shard(labels, rank))
    return {"state": full_state(model)}


def torch_fully_shard_training(rank: int, tmp: str) -> dict:
    """apply_policy, then torch's own fully_shard with no mixed precision policy."""
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    apply_policy(model, POLICY)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    ids, labels = global_batch()
    train(model, shard(ids, rank), shard(labels, rank))
    model.float()  # `_apply` on sharded, policied modules keeps both classes
    return {
        "state": full_state(model),
        "dtypes": {p.dtype for p in model.parameters()},
        "fsdp_module": isinstance(model.blocks[0], torch.distributed.fsdp.FSDPModule),
        "policy": model.blocks[0].up.dtype_policy.name,
    }


def ddp_training(rank: int, tmp: str) -> dict:
    model = make_model()
    apply_policy(model, POLICY)
    seen = record_dtypes(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    ids, labels = global_batch()
    train(ddp, shard(ids, rank), shard(labels, rank))
    return {
        "state": full_state(model),
        "seen": dict(seen),
        "grads": {p.grad.dtype for p in model.parameters()},
    }


def _count_syncs():
    """Counts `Tensor.item()` calls and all-reduces while active."""
    counts = {"item": 0, "all_reduce": 0}
    item, all_reduce = torch.Tensor.item, dist.all_reduce

    def counted_item(self):
        counts["item"] += 1
        return item(self)

    def counted_all_reduce(*args, **kwargs):
        counts["all_reduce"] += 1
        return all_reduce(*args, **kwargs)

    def patch(on: bool) -> None:
        torch.Tensor.item = counted_item if on else item
        dist.all_reduce = counted_all_reduce if on else all_reduce

    return counts, patch


def _loss_scale_run(rank: int, model: nn.Module, wrap_grad) -> dict:
    """Two steps: in the first, rank 1 alone gets an inf in its gradient."""
    optimizer = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), initial_scale=8)
    ids, labels = global_batch()
    results = []
    for step in range(2):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(shard(ids, rank)).float(), shard(labels, rank))
        optimizer.scale_loss(loss).backward()
        if step == 0 and rank == 1:
            wrap_grad(next(iter(model.parameters())).grad)[0] = float("inf")
        before = full_state(model)
        counts, patch = _count_syncs()
        patch(True)
        try:
            optimizer.step()
        finally:
            patch(False)
        after = full_state(model)
        results.append(
            {
                "skipped": optimizer.last_step_skipped,
                "scale": optimizer.dynamic_scale,
                "changed": any(not torch.equal(before[k], after[k]) for k in before),
                **counts,
            }
        )
    return {"steps": results}


def fsdp_loss_scale(rank: int, tmp: str) -> dict:
    model = make_model()
    dp_distributed.fully_shard(model, "mixed_float16")
    return _loss_scale_run(rank, model, lambda grad: grad.to_local().view(-1))


def ddp_loss_scale(rank: int, tmp: str) -> dict:
    model = make_model()
    apply_policy(model, "mixed_float16")
    ddp = nn.parallel.DistributedDataParallel(model)
    # After backward the gradients are all-reduced already: the inf is put on
    # rank 1 afterwards, so that the ranks disagree unless `step()` agrees.
    return _loss_scale_run(rank, ddp, lambda grad: grad.view(-1))


def load_then_shard(rank: int, tmp: str) -> dict:
    """The FSDP checkpoint loaded into a fresh model, which is then sharded
    keeping the policies the checkpoint applied."""
    model = saving.load(make_model(), os.path.join(tmp, "fsdp"))
    dp_distributed.fully_shard(model, None)
    probe = global_batch(4)[0]
    with torch.no_grad():
        output = model(probe)
    return {"output": output, "policy": model.blocks[1].up.dtype_policy.name}


def mismatched_policies(rank: int, tmp: str) -> dict:
    """Rank 1 forgets the map's float32 block; both ranks must refuse to shard."""
    model = make_model()
    before = full_state(model)
    try:
        dp_distributed.fully_shard(model, POLICY if rank == 0 else "mixed_bfloat16")
    except dp_distributed.PolicyMismatchError as error:
        message = str(error)
    else:
        message = None
    state = full_state(model)
    return {
        "message": message,
        "unchanged": all(torch.equal(state[k], before[k]) for k in before),
        "policied": [n for n, m in model.named_modules() if hasattr(m, "dtype_policy")],
        "sharded": [n for n, m in model.named_modules() if "FSDP" in type(m).__name__],
    }


def _raised(call) -> str | None:
    try:
        call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def refused_on_one_rank(rank: int, tmp: str) -> dict:
    """A quantized policy only rank 0 is given: refused on every rank (the
    other waited in the agreement's collective until the timeout)."""
    policy = "int8_from_mixed_bfloat16" if rank == 0 else POLICY
    return {"raised": _raised(lambda: dp_distributed.fully_shard(make_model(), policy))}


def refused_before_planning_on_one_rank(rank: int, tmp: str) -> dict:
    """Refusals that came before the agreement's exchange on rank 0 alone
    (float32_modules without a policy; a `units` rule of the user's raising
    KeyError), and a `reshard_after_forward` of its own: each raised on rank 0
    while rank 1 waited until the timeout (or, resharding, hung in backward)."""

    def rule(name, module):
        if rank == 0:
            raise KeyError("a rule of the user's")
        return False

    def float32_modules_without_policy():
        model = make_model()
        apply_policy(model, POLICY)
        modules = [nn.Linear] if rank == 0 else None
        dp_distributed.fully_shard(model, None, float32_modules=modules)

    return {
        "float32_modules": _raised(float32_modules_without_policy),
        "rule": _raised(lambda: dp_distributed.fully_shard(make_model(), POLICY, units=[rule])),
        "reshard": _raised(
            lambda: dp_distributed.fully_shard(
                make_model(), POLICY, reshard_after_forward=rank == 0
            )
        ),
    }


def unwritable_save_on_rank_zero(rank: int, tmp: str) -> dict:
    """A sharded save rank 0 cannot write: every rank raises (the others
    waited for the file until the timeout)."""
    model = make_model()
    dp_distributed.fully_shard(model, POLICY)
    blocker = os.path.join(tmp, "a-file")
    if rank == 0:
        open(blocker, "w").close()
    dist.barrier()
    return {"raised": _raised(lambda: saving.save(model, os.path.join(blocker, "checkpoint")))}


def save_to_a_directory_per_rank(rank: int, tmp: str) -> dict:
    """Each rank passes its own directory (`tempfile.mkdtemp()` on every
    rank): rank 1 returned a path to a file never written."""
    import warnings

    model = make_model()
    dp_distributed.fully_shard(model, POLICY)
    mine = os.path.join(tmp, f"per-rank-{rank}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = saving.save(model, mine)
    dist.barrier()
    return {
        "path": str(path),
        "exists": os.path.exists(path),
        "warned": [str(w.message) for w in caught if "rank 0" in str(w.message)],
    }


def step_without_gradients_on_one_rank(rank: int, tmp: str) -> dict:
    """Rank 1 had an empty micro-batch (no backward), rank 0 overflowed:
    both skip (rank 1 stepped alone and left rank 0 in the collective)."""
    model = make_model()
    apply_policy(model, "mixed_float16")
    optimizer = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    if rank == 0:
        for parameter in model.parameters():
            parameter.grad = torch.full_like(parameter, float("inf"))
    optimizer.step()
    return {"skipped": optimizer.last_step_skipped, "scale": float(optimizer.dynamic_scale)}


_COLLECTIVES = ("all_gather_into_tensor", "all_gather_object", "all_gather", "all_reduce") + (
    ("all_gather_single",) if hasattr(dist, "all_gather_single") else ()
)


def fsdp_setup_collectives(rank: int, tmp: str) -> dict:
    """The collectives fully_shard makes before the first forward."""
    model = make_model()
    counts = dict.fromkeys(_COLLECTIVES, 0)
    originals = {name: getattr(dist, name) for name in _COLLECTIVES}

    def counted(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in _COLLECTIVES:
        setattr(dist, name, counted(name))
    try:
        dp_distributed.fully_shard(model, POLICY)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return {"counts": counts}


SCENARIOS = (
    fsdp_training,
    fsdp_float32_training,
    fsdp_keras_layers,
    torch_fully_shard_training,
    ddp_training,
    fsdp_loss_scale,
    ddp_loss_scale,
    load_then_shard,
    mismatched_policies,
    fsdp_setup_collectives,
    refused_on_one_rank,
    refused_before_planning_on_one_rank,
    unwritable_save_on_rank_zero,
    save_to_a_directory_per_rank,
    step_without_gradients_on_one_rank,
)


def run_all(rank: int, init_file: str, tmp: str, results) -> None:
    """A spawned process: every scenario in order, each result (or its
    traceback) put on `results` as bytes."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    try:
        for scenario in SCENARIOS:
            try:
                outcome = scenario(rank, tmp)
            except Exception:
                outcome = traceback.format_exc()
            buffer = io.BytesIO()
            torch.save(outcome, buffer)
            results.put((scenario.__name__, rank, buffer.getvalue()))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def decode(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


__all__ = ["dtype_policies"]
