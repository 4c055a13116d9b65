"""Data-parallel training under a dtype policy map: FSDP2 or DDP, launched by torchrun.

Trains a small residual MLP on scikit-learn's digits (offline) under
`mixed_bfloat16` with one float32 block, each process on its share of every
global batch; evaluates; saves a checkpoint with the policies (rank 0 writes
it) and checks that it loads into a fresh model in this process.

On one machine, CPU (gloo), 2 processes:

    torchrun --standalone --nproc-per-node 2 examples/distributed_training.py --mode fsdp

GPUs use nccl, one process per GPU. Options: --mode fsdp|ddp, --policy
mixed_bfloat16|mixed_float16 (float16 adds a LossScaleOptimizer), --epochs,
--checkpoint DIR.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

from dtype_policies import DTypePolicyMap, apply_policy, saving
from dtype_policies.distributed import describe_plan, fully_shard, shard_plan
from dtype_policies.optimizers import LossScaleOptimizer, maybe_wrap


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.norm = nn.LayerNorm(2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.norm(self.up(x))))


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(64, 128), Block(128), Block(128), Block(128), nn.Linear(128, 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["fsdp", "ddp"], default="fsdp")
    parser.add_argument("--policy", choices=["mixed_bfloat16", "mixed_float16"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--checkpoint", default=None, help="a directory (default: a temporary one)")
    args = parser.parse_args()
    policy_name = args.policy or "mixed_bfloat16"

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]

    # One float32 block; normalization layers are float32 islands anyway.
    policy = DTypePolicyMap(policy_name, {"2(/.*)?": "float32"})
    model = make_model().to(device)
    if args.mode == "fsdp":
        apply_policy(model, policy)
        if rank == 0:
            print(describe_plan(shard_plan(model)))
        fully_shard(model, None)  # the policies just applied; or fully_shard(model, policy)
        trained = model
    else:
        apply_policy(model, policy)
        trained = nn.parallel.DistributedDataParallel(model)
    optimizer = maybe_wrap(torch.optim.AdamW(trained.parameters(), lr=3e-3), policy)

    batch = 100  # global batch; each rank takes its share
    generator = torch.Generator().manual_seed(0)  # the same order on every rank
    skipped = 0
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_train), generator=generator)
        for start in range(0, len(order) - batch + 1, batch):
            index = order[start : start + batch].chunk(world)[rank]
            inputs, labels = x_train[index].to(device), y_train[index].to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(trained(inputs).float(), labels)
            if isinstance(optimizer, LossScaleOptimizer):
                loss = optimizer.scale_loss(loss)
            loss.backward()
            optimizer.step()  # under loss scaling, every rank skips together
            skipped += getattr(optimizer, "last_step_skipped", False)
        with torch.no_grad():
            correct = (trained(x_test.to(device)).argmax(1).cpu() == y_test).sum()
        if rank == 0:
            print(f"epoch {epoch}: test accuracy {correct.item() / len(y_test):.3f}")

    parameter = next(model.parameters())
    with torch.no_grad():  # every rank: an FSDP2 forward is a collective
        outputs = trained(x_test.to(device))
    if rank == 0:
        print(
            f"{args.mode}: parameters {type(parameter).__name__} {parameter.dtype}, "
            f"{skipped} skipped steps"
        )

    # A sharded model is saved by every rank (rank 0 writes); a DDP replica by rank 0.
    directory = args.checkpoint or os.path.join(tempfile.gettempdir(), "dtype_policies_demo")
    if args.mode == "fsdp" or rank == 0:
        path = saving.save(model, directory)
    dist.barrier()
    if rank == 0:
        fresh = saving.load(make_model(), path).to(device)
        with torch.no_grad():
            same = torch.equal(fresh(x_test.to(device)), outputs)
        print(f"saved to {path}; reloaded in one process, same outputs: {same}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
