"""The fault campaign's training job: dynamic shards, a flash checkpoint every step, an exact oracle.

The "model" is one int64 counter per sample of the dataset: each step, every rank adds one for
each sample it trained, the counts are summed with an all_reduce and added to the model, which
every rank holds alike. Integer sums do not depend on order, so whichever rank trains whichever
shard, in whatever order and after whatever restarts, a job that trained every sample exactly
once ends with every counter at 1: the same parameters (hash) as a failure-free run. A lost
sample leaves a 0, a duplicate a 2.

Data: DynamicShardSampler (exactly-once, position in the checkpoint) under dlrover-run;
ElasticDistributedSampler under torchrun (no master to lease from). Checkpoint: DdpCheckpointer,
memory every step, storage every ``--disk-every`` steps and at the end. Faults come from
DLROVER_FAULTS (dlrover.testing.faults, counted in steps of the whole run). Rank 0 writes the
final counts to ``<out>.final`` as JSON: {"hash", "lost", "duplicated", "steps"}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from dlrover.testing.digest import tensors_digest
from dlrover.testing.faults import FaultInjector
from dlrover.trainer import StepReporter
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType


class Samples:
    """A dataset of sample ids (the sampler only needs its length)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


def make_sampler(size: int, shard_size: int) -> object:
    """Dynamic shards from the master under dlrover-run, else the static elastic sampler."""
    if os.environ.get("DLROVER_MASTER_ADDR"):
        from dlrover.trainer.torch.elastic import DynamicShardSampler

        return DynamicShardSampler(
            Samples(size),
            shuffle=True,
            seed=3,
            dataset_name="campaign",
            shard_size=shard_size,
            mode="exactly-once",
        )
    from dlrover.trainer.torch.elastic.sampler import ElasticDistributedSampler

    return ElasticDistributedSampler(Samples(size), shuffle=True, seed=3)  # type: ignore[arg-type]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=384)
    p.add_argument("--batch", type=int, default=4, help="samples per rank per step")
    p.add_argument("--shard-size", type=int, default=8)
    p.add_argument("--disk-every", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.05, help="simulated compute per step")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.zeros(a.samples, dtype=torch.int64)
    sampler = make_sampler(a.samples, a.shard_size)
    # DynamicShardSampler counts a pass's steps since the restore, the static one since the
    # epoch began (this job's whole run: it trains one epoch).
    dynamic = bool(os.environ.get("DLROVER_MASTER_ADDR"))
    ckpt = DdpCheckpointer(a.ckpt)
    state = ckpt.load_checkpoint()
    done = 0  # steps trained before this attempt (the step count of the whole run)
    if state:
        model.copy_(state["model"])
        done = int(state["step"])
        sampler.load_state_dict(state["sampler"])  # type: ignore[attr-defined]
    print(f"rank {rank}: resuming after step {done} ({ckpt.last_load_source})", file=sys.stderr)
    faults, progress = FaultInjector.from_env(), StepReporter()
    indices = iter(sampler)  # type: ignore[call-overload]
    seen: set[int] = set()  # this rank's samples of this pass: a repeat is lockstep padding
    per_rank = len(sampler)  # type: ignore[arg-type]
    in_pass = 0
    step = done
    while in_pass * a.batch < per_rank:
        step += 1
        in_pass += 1
        began = time.monotonic()
        faults.maybe_inject(step)
        counts = torch.zeros(a.samples, dtype=torch.int64)
        for _ in range(min(a.batch, per_rank - (in_pass - 1) * a.batch)):
            index = next(indices)
            if index not in seen:
                seen.add(index)
                counts[index] += 1
        time.sleep(a.step_time)
        busy = time.monotonic() - began
        dist.all_reduce(counts)
        model += counts
        storage = StorageType.DISK if step % a.disk_every == 0 else StorageType.MEMORY
        saving = time.monotonic()
        state = {
            "model": model,
            "step": step,
            "sampler": sampler.state_dict(  # type: ignore[attr-defined]
                in_pass if dynamic else step, a.batch
            ),
        }
        assert ckpt.save_checkpoint(step, state, storage_type=storage) is True
        progress.report(step, busy, checkpoint_s=time.monotonic() - saving)
    ckpt.save_checkpoint(step, state, storage_type=StorageType.DISK)
    ckpt.wait_latest_checkpoint(60)
    if rank == 0:
        lost = int((model == 0).sum())
        duplicated = int((model - 1).clamp(min=0).sum())
        with open(a.out + ".final", "w") as f:
            json.dump(
                {
                    "hash": tensors_digest([model]),
                    "lost": lost,
                    "duplicated": duplicated,
                    "steps": step,
                },
                f,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
