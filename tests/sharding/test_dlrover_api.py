"""DLRover's trainer API as DLRover's scripts call it: ElasticTrainer.prepare/step, the static
ElasticDistributedSampler's state, ElasticDataLoader's batch size, the checkpointers' arguments."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from dlrover.trainer.torch.elastic.dataloader import ElasticDataLoader
from dlrover.trainer.torch.elastic.sampler import ElasticDistributedSampler
from dlrover.trainer.torch.elastic.trainer import ElasticTrainer, max_world_accumulation


def _data(n: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)


def test_prepare_and_step_apply_once_per_global_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """WORKER_NUM=4 nodes x 1 local rank, world 1: four micro-batches per global batch; the
    prepared optimizer and scheduler act on the fourth only, as one step over the four."""
    monkeypatch.setenv("WORKER_NUM", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    x, y = _data()
    reference, model = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    model.load_state_dict(reference.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for start in (0, 12):  # two global batches of 12 = 4 micro-batches of 3
        for k in range(4):
            rows = slice(start + 3 * k, start + 3 * k + 3)
            torch.nn.functional.mse_loss(reference(x[rows]), y[rows]).backward()
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()

    trainer = ElasticTrainer(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    optimizer, scheduler = trainer.prepare(optimizer, scheduler)
    assert trainer.gradient_accumulation_steps == 4
    for start in range(0, 24, 3):
        with trainer.step(fix_total_batch_size=True):
            loss = torch.nn.functional.mse_loss(model(x[start : start + 3]), y[start : start + 3])
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    assert trainer.num_steps == 2
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs)
    assert scheduler.get_last_lr() == ref_sched.get_last_lr()
    # Checkpoints of the wrapped optimizer load into a plain one and back.
    plain = torch.optim.SGD(torch.nn.Linear(3, 1).parameters(), lr=0.1)
    plain.load_state_dict(optimizer.state_dict())
    optimizer.load_state_dict(plain.state_dict())
    trainer.reset()
    assert trainer.num_steps == 0


def test_step_without_fixed_batch_applies_every_micro_batch() -> None:
    model = torch.nn.Linear(3, 1)
    trainer = ElasticTrainer(model, dataloader=None)
    optimizer = trainer.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(6)
    before = model.weight.detach().clone()
    for start in (0, 3):
        with trainer.step():
            torch.nn.functional.mse_loss(
                model(x[start : start + 3]), y[start : start + 3]
            ).backward()
            optimizer.step()
            optimizer.zero_grad()
            assert not torch.equal(model.weight, before)
            before = model.weight.detach().clone()
    assert trainer.num_steps == 2


def test_a_failed_micro_batch_does_not_count_and_leaves_no_gradients() -> None:
    """A step cut by a peer's failure (its all-reduce raised) is run again after an in-process
    recovery: its partial gradients must not add to the next attempt's, nor its count."""
    model = torch.nn.Linear(3, 1)
    x, y = _data(3)
    dlrovers = ElasticTrainer(model, dataloader=None)
    dlrovers.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    ours = ElasticTrainer(model, optimizer=sgd, global_batch_size=6, micro_batch_size=3)
    for step in (dlrovers.step(fix_total_batch_size=True), ours.micro_step()):
        with pytest.raises(RuntimeError, match="peer"), step:
            torch.nn.functional.mse_loss(model(x), y).backward()
            raise RuntimeError("Connection closed by peer")
        assert all(p.grad is None for p in model.parameters())
    assert dlrovers.gradient_state.num_backward_steps == 0 and ours.micro_steps == 0
    # Mid global batch: the batch starts over (its first micro-batch's gradients go too).
    dlrovers.gradient_accumulation_steps = 2
    with dlrovers.step(fix_total_batch_size=True):
        torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError), dlrovers.step(fix_total_batch_size=True):
        raise RuntimeError("Connection reset by peer")
    assert dlrovers.gradient_state.num_backward_steps == 0
    assert all(p.grad is None for p in model.parameters())


def test_accumulation_follows_the_largest_world() -> None:
    assert max_world_accumulation(8, 2) == 4
    assert max_world_accumulation(6, 4) == 2  # rounded up alike: DDP ranks stay in step
    assert max_world_accumulation(2, 4) == 1


def test_our_trainer_form_still_works() -> None:
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    positional = ElasticTrainer(model, optimizer, 12, 3, 1)
    keyword = ElasticTrainer(
        model, optimizer=optimizer, global_batch_size=12, micro_batch_size=3, world_size=1
    )
    assert positional.gradient_accumulation_steps == keyword.gradient_accumulation_steps == 4
    with pytest.raises(ValueError, match="together"):
        ElasticTrainer(model, global_batch_size=12)


def test_sampler_is_a_distributed_sampler_with_even_ranks() -> None:
    dataset = list(range(103))
    for world in (1, 2, 3, 4):
        samplers = [ElasticDistributedSampler(dataset, world, r, seed=1) for r in range(world)]
        assert isinstance(samplers[0], DistributedSampler)
        lists = [list(s) for s in samplers]
        # What torch's DistributedSampler gives: the same split, the same padding.
        torch_lists = [list(DistributedSampler(dataset, world, r, seed=1)) for r in range(world)]  # type: ignore[arg-type]
        assert lists == torch_lists
        assert {len(x) for x in lists} == {len(samplers[0])}


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world_after", [2, 3])
def test_resume_trains_the_rest_of_the_epoch_at_any_world_size(
    drop_last: bool, world_after: int
) -> None:
    dataset = list(range(101))
    before = [ElasticDistributedSampler(dataset, 2, r, drop_last=drop_last) for r in range(2)]
    for s in before:
        s.set_epoch(1)
    trained = Counter(i for s in before for i in list(s)[: 5 * 4])  # 5 steps of 4 per rank
    state = before[0].state_dict(5, 4)
    assert (state["completed_num"], state["epoch"]) == (40, 1)
    after = [
        ElasticDistributedSampler(dataset, world_after, r, drop_last=drop_last)
        for r in range(world_after)
    ]
    for s in after:
        s.load_state_dict(json.loads(json.dumps(state)))  # a checkpoint holds plain values
        s.set_epoch(1)  # the loop sets the epoch it resumes: the place is kept
    lengths = {len(s) for s in after}
    rest = [list(s) for s in after]
    assert lengths == {len(x) for x in rest} and len(lengths) == 1  # lockstep
    trained.update(i for x in rest for i in x)
    first_part = Counter(i for s in before for i in list(s)[: 5 * 4])
    assert all(trained[i] == 1 for i in first_part if i not in set().union(*map(set, rest)))
    assert sum(trained.values()) <= 101 + world_after, "the trained part was trained again"
    missing = set(range(101)) - set(trained)
    # drop_last cuts the epoch to a multiple of the world size, as DistributedSampler does.
    assert len(missing) <= (world_after - 1 if drop_last else 0), missing
    for s in after:
        s.set_epoch(2)  # the next epoch is whole again
        assert (
            len(s) == len(list(s)) == (101 // world_after if drop_last else -(-101 // world_after))
        )


def test_same_world_resume_is_the_failure_free_order() -> None:
    dataset = list(range(50))
    full = [list(ElasticDistributedSampler(dataset, 4, r)) for r in range(4)]
    state = ElasticDistributedSampler(dataset, 4, 0).state_dict(3, 2)
    for r in range(4):
        s = ElasticDistributedSampler(dataset, 4, r)
        s.load_state_dict(state)
        assert list(s) == full[r][6:]  # padding included


def test_steps_counted_since_training_began_as_dlrover_examples_do() -> None:
    dataset = list(range(96))  # 12 steps of 4 x 2 ranks per epoch
    sampler = ElasticDistributedSampler(dataset, 2, 0)
    sampler.set_epoch(2)
    resumed = ElasticDistributedSampler(dataset, 2, 0)
    resumed.load_state_dict(sampler.state_dict(2 * 12 + 5, 4))
    resumed.set_epoch(2)
    fresh = ElasticDistributedSampler(dataset, 2, 0)
    fresh.set_epoch(2)
    assert list(resumed) == list(fresh)[20:]
    done = ElasticDistributedSampler(dataset, 2, 0)
    done.load_state_dict(sampler.state_dict(3 * 12, 4))  # epoch 2 finished: nothing left
    done.set_epoch(2)
    assert len(done) == 0 and list(done) == []


def test_dlrover_checkpoint_state_loads() -> None:
    """DLRover's sampler state has only completed_num and epoch."""
    sampler = ElasticDistributedSampler(list(range(10)), 1, 0, shuffle=False)
    sampler.load_state_dict({"completed_num": 4, "epoch": 0})
    assert list(sampler) == [4, 5, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="dataset of 99 samples"):
        sampler.load_state_dict({"completed_num": 4, "epoch": 0, "dataset_size": 99})
    with pytest.raises(ValueError, match="DynamicShardSampler"):
        sampler.load_state_dict({"mode": "dynamic", "position": {}})


def test_sampler_takes_rank_and_world_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    sampler = ElasticDistributedSampler(list(range(9)), shuffle=False)
    assert (sampler.rank, sampler.num_replicas, list(sampler)) == (2, 3, [2, 5, 8])


def test_data_loader_batch_size_changes_at_run_time(tmp_path: Path) -> None:
    dataset = list(range(40))
    config = tmp_path / "paral.json"
    loader = ElasticDataLoader(dataset, batch_size=4, config_file=str(config))
    assert isinstance(loader, DataLoader) and loader.get_batch_size() == 4
    loader.update_batch_size(8)
    assert len(next(iter(loader))) == 8
    config.write_text(json.dumps({"dataloader": {"batch_size": 5, "version": 1}}))
    loader.update_batch_size()
    assert loader.get_batch_size() == 5
    config.write_text(json.dumps({"dataloader": {"batch_size": 2, "version": 1}}))
    loader.update_batch_size()  # the same version: already applied
    assert loader.get_batch_size() == 5
    config.write_text("{not json")
    loader.update_batch_size()  # logged, nothing changes
    assert loader.get_batch_size() == 5


def test_checkpointers_take_dlrovers_arguments(tmp_path: Path) -> None:
    from dlrover.trainer.torch.flash_checkpoint.checkpointer import KeepLatestStepStrategy
    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer
    from dlrover.trainer.torch.flash_checkpoint.fsdp import FsdpShardCheckpointer

    ckpt = DdpCheckpointer(
        str(tmp_path / "a"),
        comm_backend="gloo",
        deletion_strategy=KeepLatestStepStrategy(max_to_keep=2, checkpoint_dir=str(tmp_path)),
        save_timeout=60,
        replica_count=0,
    )
    assert ckpt.keep_last == 2
    ckpt.close()
    sharded = FsdpShardCheckpointer(str(tmp_path / "b"), "gloo")
    assert sharded.keep_last == 3
    sharded.close()
    with pytest.raises(ValueError, match="FsdpShardCheckpointer"):
        DdpCheckpointer(str(tmp_path / "c"), local_shard_num=2, global_shard_num=4)


def test_a_dlrover_file_path_saves_under_the_checkpoint_dir(tmp_path: Path) -> None:
    """DLRover's docs pass ``path=f"/ckpt/checkpoint-{step}.pt"``: one engine, the usual place."""
    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

    ckpt = DdpCheckpointer(str(tmp_path / "ckpt"))
    for step in (1, 2):
        state = {"w": torch.full((3,), float(step)), "step": step}
        path = str(tmp_path / f"checkpoint-{step}.pt")
        assert ckpt.save_checkpoint(step, state, path, storage_type=StorageType.DISK)
    assert ckpt.wait_latest_checkpoint(60)
    assert len(ckpt._engines) == 1
    loaded = ckpt.load_checkpoint(str(tmp_path / "ckpt"))
    assert loaded["step"] == 2 and torch.equal(loaded["w"], torch.full((3,), 2.0))
    ckpt.close()


def test_a_second_resume_in_one_epoch_counts_steps_once() -> None:
    """Steps counted since training began, across two resumes of the same epoch."""
    dataset = list(range(160))
    first = ElasticDistributedSampler(dataset, 2, 0)
    second = ElasticDistributedSampler(dataset, 2, 0)
    second.load_state_dict(first.state_dict(5, 8))
    third = ElasticDistributedSampler(dataset, 2, 0)
    third.load_state_dict(second.state_dict(8, 8))  # 3 more steps after the resume at 5
    assert list(third) == list(ElasticDistributedSampler(dataset, 2, 0))[64:]


def test_a_save_at_an_epochs_short_last_batch_ends_the_epoch() -> None:
    dataset = list(range(101))  # 51 per rank: 13 batches of 4, the last of 3
    sampler = ElasticDistributedSampler(dataset, 2, 0)
    done = ElasticDistributedSampler(dataset, 2, 0)
    done.load_state_dict(sampler.state_dict(13, 4))
    assert len(done) == 0 and list(done) == []
    sampler.set_epoch(1)  # three steps into epoch 1, counted since training began
    resumed = ElasticDistributedSampler(dataset, 2, 0)
    resumed.load_state_dict(sampler.state_dict(13 + 3, 4))
    resumed.set_epoch(1)
    fresh = ElasticDistributedSampler(dataset, 2, 0)
    fresh.set_epoch(1)
    assert list(resumed) == list(fresh)[12:]


def test_the_resumed_place_survives_len_and_other_epochs_and_is_used_once() -> None:
    sampler = ElasticDistributedSampler(list(range(40)), 2, 0)
    sampler.load_state_dict({"completed_num": 12, "epoch": 1})
    sampler.set_epoch(0)
    assert len(sampler) == 20
    sampler.set_epoch(1)
    assert len(sampler) == 14
    assert [len(list(sampler)) for _ in range(3)] == [14, 20, 20]  # then whole epochs


def test_data_loader_state_counts_from_the_resumed_place() -> None:
    dataset = list(range(40))
    sampler = ElasticDistributedSampler(dataset, 2, 0, shuffle=False)
    sampler.load_state_dict({"completed_num": 8, "epoch": 0})
    loader = ElasticDataLoader(dataset, batch_size=2, sampler=sampler)
    batches = iter(loader)
    next(batches), next(batches), next(batches)  # two trained, the third being trained
    assert loader.state_dict()["completed_num"] == 8 + 2 * 2 * 2


def test_a_scheduler_stepped_outside_step_always_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """DLRover's cnn_train.py calls scheduler.step() once per epoch, outside trainer.step()."""
    monkeypatch.setenv("WORKER_NUM", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    model = torch.nn.Linear(3, 1)
    trainer = ElasticTrainer(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    optimizer, scheduler = trainer.prepare(optimizer, scheduler)
    rates = []
    for _ in range(3):
        trainer.reset()
        scheduler.step()
        rates.append(scheduler.get_last_lr()[0])
        for _ in range(3):  # an odd number of micro-batches: the last is not a sync step
            with trainer.step(True):
                model(torch.ones(1, 3)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    assert rates == [0.5, 0.25, 0.125]
