"""Report steps 1..3 and return, except rank 1 on its first attempt: it hangs after its last
step (its script never returns) while the other ranks return and their nodes succeed."""

import os
import time

from dlrover.trainer import report_step

for step in range(1, 4):
    report_step(step)
if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    while True:  # until the agent's hang detection kills it
        time.sleep(3600)
