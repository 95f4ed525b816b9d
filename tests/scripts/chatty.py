"""Print one numbered line per step on stdout; write this worker's pid to <out>/pid.<rank>.

Args: OUT STEPS STEP_TIME [KILL_RANK KILL_STEP]. Lines: ``chatty rank=R attempt=A step=S``.
With KILL_RANK, that rank SIGKILLs itself at KILL_STEP of its first attempt (a failure the
agent restarts in place). No torch: the logs and process ids are what it is for.
"""

import os
import signal
import sys
import time

out, steps, step_time = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
kill_rank, kill_step = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (-1, -1)
rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
os.makedirs(out, exist_ok=True)
tmp = os.path.join(out, f".pid.{rank}.tmp")
with open(tmp, "w") as f:
    f.write(f"{os.getpid()} {attempt}\n")
os.replace(tmp, os.path.join(out, f"pid.{rank}"))
print(f"chatty rank={rank} starts attempt {attempt}", file=sys.stderr, flush=True)
for step in range(steps):
    print(f"chatty rank={rank} attempt={attempt} step={step}", flush=True)
    if rank == kill_rank and step == kill_step and attempt == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(step_time)
