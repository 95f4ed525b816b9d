"""Report steps 1..3; on the first attempt then hang, on later attempts finish."""

import os
import sys
import time

from dlrover.trainer import report_step

for step in range(1, 4):
    report_step(step)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    time.sleep(600)
with open(os.path.join(sys.argv[1], f"done.{os.environ['RANK']}"), "w") as f:
    f.write(os.environ["TORCHELASTIC_RESTART_COUNT"])
