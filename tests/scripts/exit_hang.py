"""Rank 1 never exits. ``after_return``: its script returns, but a non-daemon thread that never
ends keeps the interpreter from exiting; ``in_script``: the script itself never returns."""

import os
import sys
import threading
import time

if int(os.environ["RANK"]) == 1:
    if sys.argv[1] == "after_return":

        def blocks_interpreter_exit() -> None:
            threading.Event().wait()

        threading.Thread(target=blocks_interpreter_exit).start()
    else:

        def never_returns() -> None:
            time.sleep(3600)

        never_returns()
