"""Benchmark worker: init the process group, build DDP + optimizer, run one step, record the time."""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loss = model(torch.randn(8, 32)).sum()
loss.backward()
opt.step()
dist.barrier()
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        f.write(repr(time.time()))
dist.destroy_process_group()
os._exit(0)
