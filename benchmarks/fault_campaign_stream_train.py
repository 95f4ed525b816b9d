"""The fault campaign's stream job: online learning from a Kafka topic with an exact order-free oracle.

Every record's value is ``{"id": i}``. As in fault_campaign_train.py the "model" is one int64
counter per record id: each step every rank adds one per record it trained, the counts are
summed with an all_reduce and added to the model every rank holds. A job that trained every
record exactly once, whatever rank read whatever range and whatever restarted, ends with every
counter at 1 (the failure-free model's hash); a 0 is a lost record, a 2 a duplicate.

Data: ElasticStreamDataset (the master leases offset ranges; the position is in the checkpoint).
Ranks step in lockstep; a rank with no batch adds zeros until every rank is out. Checkpoint:
DdpCheckpointer, memory after every step that every rank trained, storage every
``--disk-every`` such steps and at the end. Faults come from DLROVER_FAULTS. Rank 0 writes its
step to ``<out>.progress`` after each step (the campaign times broker outages by it) and the
final counts to ``<out>.final`` as JSON: {"hash", "lost", "duplicated", "steps"}.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from dlrover.testing.digest import tensors_digest
from dlrover.testing.faults import FaultInjector
from dlrover.trainer import StepReporter
from dlrover.trainer.torch.elastic.stream import ElasticStreamDataset, KafkaRecord
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType


def record_id(record: KafkaRecord) -> int:
    """The id a record carries."""
    assert record.value is not None
    return int(json.loads(record.value)["id"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--records", type=int, required=True, help="ids are 0 .. records - 1")
    p.add_argument("--partitions", type=int, default=3)
    p.add_argument("--batch", type=int, default=2, help="records per rank per step")
    p.add_argument("--records-per-shard", type=int, default=5)
    p.add_argument("--disk-every", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.05, help="simulated compute per step")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.zeros(a.records, dtype=torch.int64)
    # Record i is in partition i % partitions: every partition ends at the same offset.
    end = a.records // a.partitions
    dataset = ElasticStreamDataset(
        a.topic,
        a.bootstrap,
        records_per_shard=a.records_per_shard,
        decode=record_id,
        end_offsets={p: end for p in range(a.partitions)},
    )
    ckpt = DdpCheckpointer(a.ckpt)
    state = ckpt.load_checkpoint()
    step = 0
    if state:
        model.copy_(state["model"])
        dataset.load_state_dict(state["stream"])
        step = int(state["step"])
    faults, progress = FaultInjector.from_env(), StepReporter()
    batches = iter(DataLoader(dataset, batch_size=a.batch, num_workers=0))
    while True:
        began = time.monotonic()
        ids = next(batches, None)
        have = torch.tensor([0 if ids is None else 1])
        dist.all_reduce(have)
        if int(have.item()) == 0:
            break
        step += 1
        faults.maybe_inject(step)
        counts = torch.zeros(a.records, dtype=torch.int64)
        if ids is not None:
            counts += torch.bincount(ids, minlength=a.records)
        time.sleep(a.step_time)
        busy = time.monotonic() - began
        dist.all_reduce(counts)
        model += counts
        # A rank that is out holds no position of its own to save: only whole steps are saved.
        if int(have.item()) == world:
            storage = StorageType.DISK if step % a.disk_every == 0 else StorageType.MEMORY
            state = {"model": model, "stream": dataset.state_dict(), "step": step}
            assert ckpt.save_checkpoint(step, state, storage_type=storage) is True
        progress.report(step, busy)
        if rank == 0:
            with open(a.out + ".progress", "w") as f:
                f.write(f"{step}\n")
    # Every record is trained: the final model and the stream's end go to storage.
    state = {"model": model, "stream": dataset.state_dict(), "step": step}
    ckpt.save_checkpoint(step, state, storage_type=StorageType.DISK)
    ckpt.wait_latest_checkpoint(60)
    if rank == 0:
        with open(a.out + ".final", "w") as f:
            json.dump(
                {
                    "hash": tensors_digest([model]),
                    "lost": int((model == 0).sum()),
                    "duplicated": int((model - 1).clamp(min=0).sum()),
                    "steps": step,
                },
                f,
            )
    dataset.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
