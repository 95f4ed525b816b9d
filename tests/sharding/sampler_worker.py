"""A rank of a restarted job for tests: restores a DynamicShardSampler state, reads, records."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dlrover.trainer.torch.elastic import DynamicShardSampler


def wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s}s for {path}")
        time.sleep(0.01)  # the test process creates the file; no event crosses processes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--shard-size", type=int, required=True)
    parser.add_argument("--state", required=True, help="the sampler state to load (JSON)")
    parser.add_argument("--out", required=True, help="JSON: the indices this rank yielded")
    parser.add_argument("--pause-after", type=int, default=0, help="samples read before --go")
    parser.add_argument("--go", default="", help="file to wait for after --pause-after samples")
    args = parser.parse_args()
    sampler = DynamicShardSampler(
        range(args.size),
        shuffle=True,
        seed=3,
        dataset_name="d",
        shard_size=args.shard_size,
        mode="exactly-once",
    )
    sampler.load_state_dict(json.loads(Path(args.state).read_text()))
    out = Path(args.out)
    length = len(sampler)
    indices = iter(sampler)
    yielded = [next(indices) for _ in range(args.pause_after)]
    if args.go:
        Path(str(out) + ".paused").write_text("paused\n")
        wait_for(Path(args.go), 60.0)
    yielded += list(indices)
    sampler.close()
    out.write_text(json.dumps({"indices": yielded, "length": length}))


if __name__ == "__main__":
    main()
