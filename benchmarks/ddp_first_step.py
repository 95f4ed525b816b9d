"""A 2-rank gloo DDP worker that prints when each start-up phase finished (used by spawn.py)."""

import time

started = time.time()

import json  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

imported = time.time()
dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
grouped = time.time()
torch.manual_seed(0)
model = DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
constructed = time.time()
loss = model(torch.randn(8, 16)).pow(2).mean()
loss.backward()
optimizer.step()
stepped = time.time()
phases = {
    "start": started,
    "import": imported,
    "process_group": grouped,
    "ddp_optimizer": constructed,
    "first_step": stepped,
}
print(json.dumps({"rank": int(os.environ["RANK"]), "phases": phases}), flush=True)
dist.destroy_process_group()
# Skip interpreter shutdown: with torch 2.13 + gloo it aborts now and then ("terminate called
# without an active exception"; 4 of 25 plain `python` runs here), whatever the launcher.
os._exit(0)
