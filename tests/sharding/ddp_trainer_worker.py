"""One process of a real gloo DDP job that trains with ElasticTrainer through world-size changes.

It takes part in every phase whose world size exceeds its rank; phase i starts from the
parameters phase i-1 ended with (params<i>.json) and trains on data<i>.json.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dlrover.trainer.torch.elastic.trainer import ElasticTrainer


def wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s}s for {path}")
        time.sleep(0.01)


def train_phase(
    directory: Path, phase: int, rank: int, world: int, micro: int, global_batch: int
) -> list[object]:
    wait_for(directory / f"params{phase}.json", 60.0)
    # A fresh TCPStore per phase; rank 0 hosts it on a free port and publishes the port.
    port_file = directory / f"store{phase}.port"
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        port_file.with_suffix(".tmp").write_text(str(store.port))
        os.replace(port_file.with_suffix(".tmp"), port_file)
    else:
        wait_for(port_file, 60.0)
        store = dist.TCPStore("127.0.0.1", int(port_file.read_text()), world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    params = json.loads((directory / f"params{phase}.json").read_text())
    model = torch.nn.Linear(3, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor(params["weight"]))
        model.bias.copy_(torch.tensor(params["bias"]))
    ddp = DistributedDataParallel(model)
    trainer = ElasticTrainer(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), global_batch, micro)
    data = json.loads((directory / f"data{phase}.json").read_text())
    inputs, targets = torch.tensor(data["x"]), torch.tensor(data["y"])
    share = global_batch // world
    for start in range(0, len(inputs), global_batch):
        # This rank's slice of the global batch, in micro-batches.
        mine = slice(start + rank * share, start + (rank + 1) * share)
        x, y = inputs[mine], targets[mine]
        for offset in range(0, share, micro):
            with trainer.micro_step():
                batch = slice(offset, offset + micro)
                trainer.backward(torch.nn.functional.mse_loss(ddp(x[batch]), y[batch]))
    result = {
        "weight": model.weight.tolist(),
        "bias": model.bias.tolist(),
        "accumulation": trainer.gradient_accumulation_steps,
        "optimizer_steps": trainer.optimizer_steps,
    }
    (directory / f"phase{phase}_rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        temporary = directory / f"params{phase + 1}.json.tmp"
        temporary.write_text(json.dumps({"weight": result["weight"], "bias": result["bias"]}))
        os.replace(temporary, directory / f"params{phase + 1}.json")
    dist.destroy_process_group()
    # Returned so their destructors do not run while the next phase forms: tearing down a
    # gloo DDP + TCPStore mid-run hung now and then on this machine (inside torch's C++).
    return [store, ddp, trainer]


def main() -> None:
    # A hang shows where it hangs (the test waits 90 s for the process).
    faulthandler.dump_traceback_later(80, exit=True, file=sys.stderr)
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--phases", required=True, help="comma-separated WORLDxMICRO")
    parser.add_argument("--global-batch", type=int, required=True)
    args = parser.parse_args()
    kept: list[object] = []
    for phase, text in enumerate(args.phases.split(",")):
        world, micro = (int(part) for part in text.split("x"))
        if args.rank < world:
            kept += train_phase(Path(args.dir), phase, args.rank, world, micro, args.global_batch)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # results are on disk; skip the same teardown at interpreter exit


if __name__ == "__main__":
    main()
