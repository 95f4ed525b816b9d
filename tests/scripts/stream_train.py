"""gloo training on a Kafka topic: ElasticStreamDataset + DdpCheckpointer (flash checkpoint).

Every record's value is ``{"id": i}``. With ``--ray-address`` the stream is instead the rows of
a Ray Data pipeline on that cluster (``range(records)``, preprocessed by ``map_batches`` into
``{"id", "x"}``; each batch's ids appended to <out>/pipeline) read through RayDataSource. The checkpointed state holds the model, the stream
position and ``seen``: how often each id was trained, summed over the ranks every step (so
every rank holds the job's count). Ranks step in lockstep; a rank with no batch contributes
zeros until every rank is out. A checkpoint (memory; storage every 5 steps) follows each step
every rank trained, and only rank 0 computes the stream position when ``--rank0-position``.
At the end rank 0 writes ``seen`` to <out>/seen.json and the records the master counts lost
(at-most-once, DLROVER_DELIVERY_MODE) to <out>/lost; every rank appends "<rank> <restart>
<first step>" to <out>/loads and rank 0 writes its step to <out>/progress after each step.
Exactly once holds iff every count is 1. Faults come from DLROVER_FAULTS.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from dlrover.testing.faults import FaultInjector
from dlrover.trainer import StepReporter
from dlrover.trainer.torch.elastic.stream import ElasticStreamDataset, KafkaRecord
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType


def record_id(record: KafkaRecord) -> int:
    assert record.value is not None
    return int(json.loads(record.value)["id"])


def _ray_stream(a: argparse.Namespace) -> ElasticStreamDataset[int]:
    import ray
    import ray.data

    from dlrover.trainer.torch.elastic.ray_source import RayDataSource

    ray.init(address=a.ray_address, log_to_driver=False, logging_level="ERROR")
    ray.data.DataContext.get_current().enable_progress_bars = False
    records, log = a.records, os.path.join(a.out, "pipeline")

    def preprocess(batch: dict[str, Any]) -> dict[str, Any]:
        with open(log, "a") as f:  # which ids the pipeline produced: it runs once per job
            f.write(" ".join(str(i) for i in batch["id"]) + "\n")
        return {"id": batch["id"], "x": batch["id"] / records}

    ds = ray.data.range(records, override_num_blocks=7).map_batches(preprocess)
    return ElasticStreamDataset(
        RayDataSource(ds, name="ids"),
        records_per_shard=a.records_per_shard,
        decode=lambda row: int(row["id"]),
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bootstrap", default="")
    p.add_argument("--topic", default="")
    p.add_argument("--ray-address", default="")
    p.add_argument("--records", type=int, required=True, help="ids are 0 .. records - 1")
    p.add_argument("--end", type=int, required=True, help="end offset of every partition")
    p.add_argument("--partitions", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--records-per-shard", type=int, default=5)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rank0-position", action="store_true")
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    seen = torch.zeros(a.records, dtype=torch.int64)
    if a.ray_address:
        dataset = _ray_stream(a)
    else:
        dataset = ElasticStreamDataset(
            a.topic,
            a.bootstrap,
            records_per_shard=a.records_per_shard,
            decode=record_id,
            end_offsets={p: a.end for p in range(a.partitions)},
        )
    ckpt = DdpCheckpointer(a.ckpt)
    state = ckpt.load_checkpoint()
    step = 0
    if state:
        model.load_state_dict(state["model"])
        seen.copy_(state["seen"])
        dataset.load_state_dict(state["stream"])
        step = int(state["step"])
    with open(os.path.join(a.out, "loads"), "a") as f:
        f.write(f"{rank} {restart} {step + 1}\n")
    faults, progress = FaultInjector.from_env(), StepReporter()
    batches = iter(DataLoader(dataset, batch_size=a.batch, num_workers=0))
    while True:
        ids = next(batches, None)
        have = torch.tensor([0 if ids is None else 1])
        dist.all_reduce(have)
        if int(have.item()) == 0:
            break
        step += 1
        faults.maybe_inject(step)
        counts = torch.zeros(a.records, dtype=torch.int64)
        opt.zero_grad()
        if ids is not None:
            counts += torch.bincount(ids, minlength=a.records)
            x = ids.float().unsqueeze(1) / a.records
            model(x).pow(2).mean().backward()
        for param in model.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad)
        opt.step()
        dist.all_reduce(counts)
        seen += counts
        progress.report(step)
        if int(have.item()) == dist.get_world_size():  # every rank trained this step
            position = (
                dataset.state_dict() if rank == 0 or not a.rank0_position else {"unused": True}
            )
            storage = StorageType.DISK if step % 5 == 0 else StorageType.MEMORY
            ckpt.save_checkpoint(
                step,
                {"model": model.state_dict(), "seen": seen, "stream": position, "step": step},
                storage_type=storage,
            )
            if storage == StorageType.DISK:
                ckpt.wait_latest_checkpoint(60)
        if rank == 0:
            with open(os.path.join(a.out, "progress"), "w") as f:
                f.write(f"{step}\n")
    ckpt.wait_latest_checkpoint(60)
    if rank == 0:
        with open(os.path.join(a.out, "seen.json"), "w") as f:
            json.dump(seen.tolist(), f)
        with open(os.path.join(a.out, "lost"), "w") as f:
            f.write(f"{dataset.client.progress().lost_records}\n")
    dataset.close()
    if a.ray_address:
        dist.barrier()  # every rank has read the stream: the dataset's holder may go
        if rank == 0:
            dataset.source.release()  # type: ignore[attr-defined]
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
