"""Read a dataset of N sample ids through DynamicShardSampler under dlrover-run.

Every sample a worker trains on is appended to <out>/seen.<attempt>.<rank>. On the first attempt
rank 1 SIGKILLs itself in the middle of a shard, after `kill_after` samples.
"""

import os
import signal
import sys
import time

from dlrover.trainer.torch.elastic.dynamic_sampler import DynamicShardSampler

out, n, kill_after = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rank, attempt = int(os.environ["RANK"]), os.environ["TORCHELASTIC_RESTART_COUNT"]
sampler = DynamicShardSampler(range(n), shuffle=True, seed=7, dataset_name="ids", shard_size=10)
with open(os.path.join(out, f"seen.{attempt}.{rank}"), "a", buffering=1) as f:
    for count, index in enumerate(sampler, start=1):
        f.write(f"{index}\n")
        time.sleep(0.005)  # the simulated training step
        if attempt == "0" and rank == 1 and count == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
