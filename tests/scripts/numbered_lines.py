"""Print numbered lines; on attempts 0 and 1 one rank prints a last line and SIGKILLs itself.

Env: LINES (per rank and attempt), SYNC_DIR (a directory for the ranks' hand-shakes) and
CONSOLE_FILE (where dlrover-run's output goes: attempt 0 waits there for the agent's "zygote N
ready" line, so that both restarts are forked). Lines: ``line attempt=A rank=R i=I`` on stdout,
``err attempt=A rank=R`` on stderr, ``last attempt=A rank=R`` right before the kill.
"""

import os
import re
import signal
import sys
import time

DEADLINE_S = 120.0


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            sys.exit(f"numbered_lines: no {what} within {DEADLINE_S:.0f}s")
        time.sleep(0.05)  # polling files another process writes; bounded by the deadline


def zygote_ready() -> bool:
    with open(os.environ["CONSOLE_FILE"], errors="replace") as f:
        return re.search(r"zygote \d+ ready", f.read()) is not None


attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])
sync = os.environ["SYNC_DIR"]
if attempt == 0:
    wait_until(zygote_ready, "'zygote N ready' line from the agent")
for i in range(int(os.environ["LINES"])):
    # One write per line (print under -u writes the text and its newline separately, and the
    # other rank's line may land between them: the test counts whole lines, not that race).
    sys.stdout.write(f"line attempt={attempt} rank={rank} i={i}\n")
sys.stderr.write(f"err attempt={attempt} rank={rank}\n")
if attempt >= 2:
    sys.exit(0)
killer = 1 - attempt % 2
if rank != killer:
    open(os.path.join(sync, f"printed.{attempt}.{rank}"), "w").close()
    time.sleep(600)  # stopped by the agent once the killer is gone
wait_until(
    lambda: os.path.exists(os.path.join(sync, f"printed.{attempt}.{1 - rank}")), "peer's lines"
)
sys.stdout.write(f"last attempt={attempt} rank={rank}\n")  # no flush: seen only if unbuffered
os.kill(os.getpid(), signal.SIGKILL)
