"""Online learning from a Kafka topic, exactly once across failures (see docs/streaming.md).

    dlrover-run --standalone --nproc-per-node=2 --max-restarts=3 examples/kafka_online.py \\
        --bootstrap 127.0.0.1:9092 --topic clicks --ckpt /tmp/kafka-ckpt --steps 200

Each record's value is JSON ``{"x": [8 floats], "y": float}`` (``--produce N`` writes N such
records first, for a try-out). The two ranks share the topic through the job master, train a
linear model with DDP, and save a flash checkpoint every step (to storage every 20) that holds
the stream position with the model: a restarted worker resumes from it, so no record is
trained twice or skipped. A rank waits for new records when it has read everything; the job
ends after ``--steps`` steps.
"""

from __future__ import annotations

import argparse
import json
import random

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from dlrover.trainer import StepReporter
from dlrover.trainer.torch.elastic.stream import ElasticStreamDataset, KafkaRecord
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType


def decode(record: KafkaRecord) -> tuple[torch.Tensor, torch.Tensor]:
    assert record.value is not None
    sample = json.loads(record.value)
    return torch.tensor(sample["x"]), torch.tensor([sample["y"]])


def produce(bootstrap: str, topic: str, count: int) -> None:
    """Write ``count`` records of y = sum(x) + noise to ``topic``."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap})
    rng = random.Random(0)
    for _ in range(count):
        x = [rng.uniform(-1, 1) for _ in range(8)]
        value = json.dumps({"x": x, "y": sum(x) + rng.gauss(0, 0.01)})
        producer.produce(topic, value=value.encode())
    producer.flush(30)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bootstrap", required=True, help="Kafka bootstrap servers")
    p.add_argument("--topic", required=True)
    p.add_argument("--ckpt", required=True, help="checkpoint directory")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--produce", type=int, default=0, help="rank 0 first writes this many records")
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0 and a.produce:
        produce(a.bootstrap, a.topic, a.produce)
    dist.barrier()
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = ElasticStreamDataset(a.topic, a.bootstrap, decode=decode)
    ckpt = DdpCheckpointer(a.ckpt)
    step = 0
    state = ckpt.load_checkpoint()
    if state:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        dataset.load_state_dict(state["stream"])
        step = int(state["step"])
    progress = StepReporter()
    for x, y in DataLoader(dataset, batch_size=a.batch, num_workers=0):
        if step >= a.steps:
            break
        step += 1
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        to_storage = step % 20 == 0
        ckpt.save_checkpoint(
            step,
            {
                "model": model.module.state_dict(),
                "optimizer": opt.state_dict(),
                "stream": dataset.state_dict(),  # the offsets this step has trained
                "step": step,
            },
            storage_type=StorageType.DISK if to_storage else StorageType.MEMORY,
        )
        if to_storage:
            ckpt.wait_latest_checkpoint(60)  # so the next steps' memory saves are not skipped
        progress.report(step)
        if rank == 0 and step % 20 == 0:
            print(f"step {step}/{a.steps} loss {loss.item():.4f}", flush=True)
    ckpt.wait_latest_checkpoint(60)
    dataset.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
