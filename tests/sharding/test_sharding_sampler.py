"""ElasticDistributedSampler (static), DynamicShardSampler, ElasticDataLoader and ElasticTrainer."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from dlrover.sharding import DeliveryMode, InvalidPositionError, ShardManager
from dlrover.testing.sharding import InProcessTransport
from dlrover.trainer.torch.elastic.dataloader import ElasticDataLoader
from dlrover.trainer.torch.elastic.dynamic_sampler import DynamicShardSampler
from dlrover.trainer.torch.elastic.sampler import ElasticDistributedSampler
from dlrover.trainer.torch.elastic.trainer import ElasticTrainer, accumulation_steps

DEADLINE_S = 30.0


class IndexDataset(Dataset):
    """Sample i is the float i, so a batch tells which samples were trained."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index)])


def ids(batch: torch.Tensor) -> list[int]:
    return [int(x) for x in batch.flatten().tolist()]


def test_static_mode_resumes_with_a_different_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DLROVER_MASTER_ADDR", raising=False)
    dataset = IndexDataset(60)
    trained: Counter[int] = Counter()
    samplers = [ElasticDistributedSampler(dataset, 4, rank, seed=3) for rank in range(4)]
    for sampler in samplers:
        trained.update(list(sampler)[:6])  # 3 steps of micro-batch 2
    state = samplers[0].state_dict(step=3, micro_batch_size=2)
    assert state["completed_num"] == 24
    resumed = [ElasticDistributedSampler(dataset, 3, rank, seed=3) for rank in range(3)]
    for sampler in resumed:
        sampler.load_state_dict(state)
        assert len(sampler) == 12
        trained.update(sampler)
    assert trained == Counter({i: 1 for i in range(60)})


def test_dynamic_sampler_with_plain_dataloader_covers_the_dataset() -> None:
    """Without set_epoch each completed iteration moves on to the next epoch."""
    transport = InProcessTransport(ShardManager())
    dataset = IndexDataset(300)
    sampler = DynamicShardSampler(
        dataset, 1, 0, transport=transport, dataset_name="d", shard_size=16, num_epochs=2
    )
    seen: Counter[int] = Counter()
    for _ in range(2):
        for batch in DataLoader(dataset, batch_size=5, sampler=sampler):
            seen.update(ids(batch))
    with pytest.raises(ValueError, match="num_epochs=2"):  # all epochs done
        list(DataLoader(dataset, batch_size=5, sampler=sampler))
    sampler.close()
    assert seen == Counter({i: 2 for i in range(300)})
    assert transport.dataset_progress("d/epoch-0").finished
    assert transport.dataset_progress("d/epoch-1").finished


def test_exactly_once_through_sampler_state_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    manager = ShardManager()
    transport = InProcessTransport(manager)
    dataset = IndexDataset(200)

    def loader() -> ElasticDataLoader:
        sampler = DynamicShardSampler(
            dataset,
            1,
            0,
            transport=transport,
            dataset_name="d",
            shard_size=12,
            mode=DeliveryMode.EXACTLY_ONCE,
        )
        return ElasticDataLoader(dataset, batch_size=5, sampler=sampler)

    model: Counter[int] = Counter()
    first = loader()
    batches = iter(first)
    for _ in range(9):
        model.update(ids(next(batches)))
    next(batches)  # requesting batch 10 marks batch 9 trained
    state = first.state_dict()
    checkpointed = Counter(model)
    first.sampler.close()  # type: ignore[attr-defined]  # crash; what batch 10 and later trained is lost
    model = checkpointed
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the job restarted
    second = loader()
    second.load_state_dict(state)
    for batch in second:
        model.update(ids(batch))
    second.sampler.close()  # type: ignore[attr-defined]
    assert model == Counter({i: 1 for i in range(200)})


def test_static_checkpoint_into_dynamic_sampler_is_refused() -> None:
    dataset = IndexDataset(10)
    sampler = DynamicShardSampler(
        dataset, 1, 0, transport=InProcessTransport(ShardManager()), shard_size=2
    )
    with pytest.raises(InvalidPositionError, match="static sharding"):
        sampler.load_state_dict({"mode": "static", "epoch": 0, "completed_num": 0})
    with pytest.raises(InvalidPositionError, match="ElasticDistributedSampler"):
        sampler.load_state_dict({"epoch": 0, "completed_num": 4, "num_replicas": 1})


def test_accumulation_matches_one_full_global_batch() -> None:
    torch.manual_seed(0)
    data, target = torch.randn(24, 3), torch.randn(24, 1)
    reference = torch.nn.Linear(3, 1)
    elastic = torch.nn.Linear(3, 1)
    elastic.load_state_dict(reference.state_dict())
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for start in (0, 12):
        loss = torch.nn.functional.mse_loss(
            reference(data[start : start + 12]), target[start : start + 12]
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    trainer = ElasticTrainer(
        elastic, torch.optim.SGD(elastic.parameters(), lr=0.1), 12, 3, world_size=1
    )
    assert trainer.gradient_accumulation_steps == 4
    for start in range(0, 24, 3):
        with trainer.micro_step():
            loss = torch.nn.functional.mse_loss(
                elastic(data[start : start + 3]), target[start : start + 3]
            )
            trainer.backward(loss)
    assert trainer.optimizer_steps == 2
    for ours, theirs in zip(elastic.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_global_batch_must_divide() -> None:
    assert accumulation_steps(12, 2, 3) == 2 and accumulation_steps(12, 2, 2) == 3
    with pytest.raises(ValueError, match="not a multiple"):
        accumulation_steps(12, 2, 4)


def test_workers_3_to_2_to_3_lose_no_sample_and_keep_the_global_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three phases of one epoch; at each change a worker leaves mid-shard (its leases are
    recovered) or joins. Each worker runs ElasticDataLoader + ElasticTrainer. Each phase is a
    restart of the job (its own restart count), so each has its own lockstep quota."""
    size, micro, global_batch = 3_000, 2, 12
    transport = InProcessTransport(ShardManager())
    dataset = IndexDataset(size)
    trained: Counter[int] = Counter()
    per_step_samples: list[int] = []
    lock = threading.Lock()

    def worker(worker_id: str, world: int, max_steps: int | None) -> None:
        sampler = DynamicShardSampler(
            dataset,
            world,
            0,
            transport=transport,
            dataset_name="d",
            shard_size=10,
            worker_id=worker_id,
        )
        loader = ElasticDataLoader(dataset, batch_size=micro, sampler=sampler)
        model = torch.nn.Linear(1, 1)
        trainer = ElasticTrainer(
            model, torch.optim.SGD(model.parameters(), lr=0.0), global_batch, micro, world
        )
        in_step = 0
        for batch in loader:
            with trainer.micro_step() as last:
                trainer.backward(model(batch).sum())
            in_step += len(batch)
            with lock:
                trained.update(ids(batch))
                if last:
                    per_step_samples.append(in_step * world)
                    in_step = 0
            if max_steps is not None and trainer.optimizer_steps >= max_steps and not last:
                break  # leave mid-step: also mid-shard, with prefetched shards leased
            if max_steps is not None and trainer.optimizer_steps >= max_steps:
                break
        sampler.close()

    def phase(world: int, max_steps: int | None, names: list[str]) -> None:
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", names[0].split("/")[1])
        threads = [threading.Thread(target=worker, args=(n, world, max_steps)) for n in names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(DEADLINE_S)
            assert not thread.is_alive()
        for name in names:
            transport.recover_worker(name)  # the job re-forms: the master recovers leavers

    phase(3, 20, ["a/0", "b/0", "c/0"])
    phase(2, 25, ["a/1", "b/1"])
    phase(3, None, ["a/2", "b/2", "c/2"])
    assert set(trained) == set(range(size)), "a sample was lost"
    full_steps = per_step_samples
    assert full_steps and set(full_steps) == {global_batch}
    assert transport.dataset_progress("d/epoch-0").finished
