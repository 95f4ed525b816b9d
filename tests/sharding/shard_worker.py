"""A worker process for tests: trains (records) the samples of every shard it gets."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dlrover.client.sharding import connect
from dlrover.client.sharding_client import ShardingClient
from dlrover.sharding import DatasetSpec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--master", required=True)
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--spec", required=True, help="DatasetSpec as JSON")
    parser.add_argument("--out", required=True, help="one trained sample id per line")
    parser.add_argument("--sample-s", type=float, default=0.0)
    parser.add_argument("--hang-after", type=int, default=-1, help="stop (hang) after N samples")
    parser.add_argument(
        "--report-progress", action="store_true", help="report each sample trained to the master"
    )
    args = parser.parse_args()
    spec = DatasetSpec.from_dict(json.loads(args.spec))
    trained = 0
    with (
        open(args.out, "w") as out,
        ShardingClient(connect(args.master), spec, args.worker_id, poll_interval_s=0.01) as client,
    ):
        while (shard := client.next_shard(30.0)) is not None:
            for consumed, index in enumerate(shard.indices(), start=shard.offset + 1):
                if trained == args.hang_after:
                    Path(args.out + ".hung").write_text("mid-shard\n")
                    time.sleep(3600)  # the test SIGKILLs us here, mid-shard
                out.write(f"{index}\n")
                out.flush()
                trained += 1
                if args.report_progress:
                    client.report_progress(shard, consumed)
                if args.sample_s:
                    time.sleep(args.sample_s)
            client.report_done(shard)


if __name__ == "__main__":
    main()
