"""Worker entry point: arms stack dumps and error files, then runs the user's script as __main__.

Usage: ``python -m dlrover.agent.bootstrap script.py args...`` or
``python -m dlrover.agent.bootstrap -m package.module args...``. The script sees the same
``sys.argv``, ``sys.path[0]``, ``__name__ == "__main__"`` and exit codes as under
``python script.py``; in addition

- ``SIGUSR1`` (STACK_DUMP_SIGNAL) prints every thread's Python stack to stderr and the
  worker keeps running: the agent uses it on a hung worker before killing it;
- fatal signals (SIGSEGV, SIGABRT, ...) print the Python stack before the process dies;
- an exception escaping the script is written to ``$TORCHELASTIC_ERROR_FILE`` (see error_file).
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import sys
from collections.abc import Sequence

from dlrover.agent.error_file import ErrorRecorder

STACK_DUMP_SIGNAL = signal.SIGUSR1
"""Signal that makes a bootstrapped worker dump all thread stacks to stderr (and go on)."""

USAGE = "usage: python -m dlrover.agent.bootstrap (script.py | -m module) [args...]"


class BootstrapError(Exception):
    """The worker command line names nothing runnable."""


def enable_stack_dumps() -> None:
    """Dump stacks on STACK_DUMP_SIGNAL and on fatal signals, to the current stderr."""
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


def request_stack_dump(pid: int) -> bool:
    """Ask a bootstrapped worker to dump its stacks; False when the process is already gone.

    Send it to the worker's pid only, never its process group: children the worker started
    (data loader workers) have no handler, and SIGUSR1's default action ends a process.
    """
    try:
        os.kill(pid, STACK_DUMP_SIGNAL)
    except ProcessLookupError:
        return False
    return True


def run_target(argv: Sequence[str]) -> None:
    """Run `argv` (``[script, args...]`` or ``["-m", module, args...]``) as ``__main__``.

    Returns when the target returns; exceptions (SystemExit included) propagate so that the
    interpreter prints them and picks the exit code exactly as for ``python script.py``.
    """
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise BootstrapError(f"no script or module given; {USAGE}")
    with ErrorRecorder():
        if argv[0] == "-m":
            module = argv[1]
            # Like `python -m`: the working directory comes first on the path; run_module
            # replaces argv[0] with the module's file name.
            sys.argv = [module, *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            script = argv[0]
            if not os.path.exists(script):
                raise BootstrapError(f"can't open file {script!r}: no such file")
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.realpath(script))
            runpy.run_path(script, run_name="__main__")


def main() -> None:
    enable_stack_dumps()
    try:
        run_target(sys.argv[1:])
    except BootstrapError as exc:
        print(f"dlrover.agent.bootstrap: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
