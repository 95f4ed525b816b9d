"""Report steps 1..3 and return, except rank 1 on its first attempt: it hangs after its last
step (its script never returns) while the other ranks return and their nodes succeed.

Rank 1 hangs only once the master says another node succeeded: until then it keeps making
progress (a new step every 0.2 s), so a busy machine on which rank 0 takes long to exit cannot
turn the scenario around (the hang found first, both nodes restarted)."""

import os
import time

from dlrover.client.master_client import MasterClient
from dlrover.trainer import report_step

for step in range(1, 4):
    report_step(step)
if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    master = MasterClient.from_env()
    step = 3
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        nodes = master.get_job_status().nodes
        if any(n.state == "succeeded" for n in nodes):
            break
        step += 1
        report_step(step)
        time.sleep(0.2)
    while True:  # until the agent's hang detection kills it
        time.sleep(3600)
