"""pytorch/examples' DDP tutorial (multinode.py) on gloo: a `Trainer` with `_run_epoch`, a
snapshot every epoch, `destroy_process_group()` at the end (unless --no-destroy).

Fault: on the first attempt rank $KILL_RANK SIGKILLs itself before global step $KILL_STEP, once
the agent has logged "zygote N ready" to $CONSOLE_FILE (so that the restart forks).
"""

import argparse
import os
import re
import signal
import time

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class RandomDataset(Dataset):
    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.data = [
            (torch.rand(20, generator=generator), torch.rand(1, generator=generator))
            for _ in range(size)
        ]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        return self.data[index]


def _wait_for_zygote() -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with open(os.environ["CONSOLE_FILE"], errors="replace") as f:
            if re.search(r"zygote \d+ ready", f.read()):
                return
        time.sleep(0.05)  # polling the agent's log; bounded by the deadline


class Trainer:
    def __init__(self, model, train_data, optimizer, snapshot_path: str) -> None:
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            snapshot = torch.load(snapshot_path)
            self.model.load_state_dict(snapshot["MODEL_STATE"])
            self.epochs_run = snapshot["EPOCHS_RUN"]
        self.model = DDP(self.model)
        self.step = self.epochs_run * len(train_data)

    def _run_batch(self, source, targets) -> None:
        if (
            os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
            and self.global_rank == int(os.environ["KILL_RANK"])
            and self.step == int(os.environ["KILL_STEP"])
        ):
            _wait_for_zygote()
            os.kill(os.getpid(), signal.SIGKILL)
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        self.step += 1

    def _run_epoch(self, epoch: int) -> None:
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1}
        torch.save(snapshot, self.snapshot_path + ".tmp")
        os.replace(self.snapshot_path + ".tmp", self.snapshot_path)

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0:
                self._save_snapshot(epoch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--snapshot", required=True)
    parser.add_argument("--no-destroy", action="store_true")
    args = parser.parse_args()
    init_process_group(backend="gloo")
    dataset = RandomDataset(64)
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    loader = DataLoader(dataset, batch_size=8, shuffle=False, sampler=DistributedSampler(dataset))
    trainer = Trainer(model, loader, optimizer, args.snapshot)
    trainer.train(args.epochs)
    if not args.no_destroy:
        destroy_process_group()


if __name__ == "__main__":
    main()
