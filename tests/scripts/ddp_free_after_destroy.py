"""A DDP script whose model is freed right after destroy_process_group(), the tightest form of
the teardown in pytorch/examples' DDP tutorial: the last backward's allreduces may still be
being freed by gloo's threads when DDP's Reducer drops the last C++ reference to the group.

Writes $DONE_MARK once training is done, so a test can tell a hang at exit from slow work.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(8)]
    model = DDP(torch.nn.Sequential(*layers), bucket_cap_mb=0.01)  # one allreduce per layer
    x = torch.rand(8, 64)
    for _ in range(5):
        F.mse_loss(model(x), x).backward()
    with open(os.environ["DONE_MARK"], "w"):
        pass
    dist.destroy_process_group()
    del model


if __name__ == "__main__":
    main()
