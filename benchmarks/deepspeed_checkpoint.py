"""DeepSpeedCheckpointer vs DeepSpeed's own engine.save_checkpoint: time the training waits, and
time until the step is on storage (ours: committed after fsync; DeepSpeed's: its save, then an
fsync of its files). Dirty pages are synced before each timed save, so neither side pays for
the other's writes."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29561")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from framework_checkpoint import fsync_tree, print_table, warm_memory  # noqa: E402

from dlrover.checkpoint.config import ENV_CHECKPOINT_SOCKET  # noqa: E402
from dlrover.checkpoint.saver import CheckpointSaver  # noqa: E402
from dlrover.trainer.torch.flash_checkpoint.deepspeed import (  # noqa: E402
    DeepSpeedCheckpointer,
    StorageType,
)


def build_engine(size_mb: int, stage: int) -> Any:
    """A stack of square linear layers holding ``size_mb`` MiB of float32 parameters."""
    width = 1024
    layers = max(1, size_mb * 2**20 // (4 * width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    loss = engine(torch.randn(2, width)).pow(2).mean()
    engine.backward(loss)
    engine.step()  # Adam's moments exist: a save holds the full optimizer state
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mb", type=int, default=256, help="parameters, MiB")
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--warm-memory-gib", type=float, default=8.0, help="memory to touch once first (see "
        "framework_checkpoint.warm_memory; 0: none)"
    )  # fmt: skip
    args = parser.parse_args()
    warm_memory(args.warm_memory_gib)
    deepspeed.init_distributed(dist_backend="gloo")
    engine = build_engine(args.size_mb, args.stage)
    root = Path(tempfile.mkdtemp(prefix="ds-bench-", dir=os.environ.get("BENCH_DIR")))
    # The saver an agent runs (here in this process): its memory is what a restart loads from.
    saver = CheckpointSaver(str(root / "saver.sock"), shm_prefix=f"dsbench-{os.getpid()}")
    saver.start()
    os.environ[ENV_CHECKPOINT_SOCKET] = saver.socket_path
    ckpt = DeepSpeedCheckpointer(engine, str(root / "flash"))
    rows: dict[str, list[float]] = {"ours: save to memory": [], "ours: DISK save, blocked": [],
                                    "ours: DISK save until on storage": [],
                                    "DeepSpeed's save_checkpoint": [],
                                    "DeepSpeed's save_checkpoint + fsync": [],
                                    "ours: load (from memory)": [],
                                    "DeepSpeed's load_checkpoint": []}  # fmt: skip
    try:
        # Each save is a new step (a step already on storage is not persisted again).
        ckpt.save_checkpoint(tag="global_step1", storage_type=StorageType.MEMORY)  # allocates
        for i in range(args.repeats):
            t = time.perf_counter()
            ckpt.save_checkpoint(tag=f"global_step{2 * i + 2}", storage_type=StorageType.MEMORY)
            rows["ours: save to memory"].append(time.perf_counter() - t)
            os.sync()  # neither side pays for the other's dirty pages
            t = time.perf_counter()
            ckpt.save_checkpoint(tag=f"global_step{2 * i + 3}", storage_type=StorageType.DISK)
            rows["ours: DISK save, blocked"].append(time.perf_counter() - t)
            assert ckpt.wait_latest_checkpoint(600)
            rows["ours: DISK save until on storage"].append(time.perf_counter() - t)
            os.sync()
            t = time.perf_counter()
            engine.save_checkpoint(str(root / "own"))
            rows["DeepSpeed's save_checkpoint"].append(time.perf_counter() - t)
            fsync_tree(root / "own")  # on storage: what our persist waits for
            rows["DeepSpeed's save_checkpoint + fsync"].append(time.perf_counter() - t)
            # A restart's load: ours finds the newest step in memory; DeepSpeed's reads files
            # (from the page cache: the best case for it).
            os.environ["TORCHELASTIC_RESTART_COUNT"] = str(i + 1)  # each load: a restart's
            t = time.perf_counter()
            ckpt.load_checkpoint()
            rows["ours: load (from memory)"].append(time.perf_counter() - t)
            assert ckpt.last_load_source == "memory"
            t = time.perf_counter()
            engine.load_checkpoint(str(root / "own"))
            rows["DeepSpeed's load_checkpoint"].append(time.perf_counter() - t)
    finally:
        ckpt.close()
        saver.close(unlink=True)
        shutil.rmtree(root, ignore_errors=True)
    print(f"ZeRO-{args.stage}, {args.size_mb} MiB of parameters + Adam, 1 rank, "
          f"medians of {args.repeats} (min-max); saves / DeepSpeed's save, loads / its load")  # fmt: skip
    print_table(rows, "DeepSpeed", "DeepSpeed's save_checkpoint", "DeepSpeed's load_checkpoint")


if __name__ == "__main__":
    main()
