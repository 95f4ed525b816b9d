"""Worker entry point: arms stack dumps and error files, then runs the user's script as __main__.

Usage: ``python -m dlrover.agent.bootstrap script.py args...`` or
``python -m dlrover.agent.bootstrap -m package.module args...``. The script sees the same
``sys.argv``, ``sys.path[0]``, ``__name__ == "__main__"`` and exit codes as under
``python script.py``; in addition

- ``SIGUSR1`` (STACK_DUMP_SIGNAL) writes every thread's Python stack to ``$DLROVER_STACK_FILE``
  (stderr when unset) and the worker keeps running: the agent logs it for a worker that makes
  no progress, and before killing a hung one;
- fatal signals (SIGSEGV, SIGABRT, ...) print the Python stack before the process dies;
- an exception escaping the script is written to ``$TORCHELASTIC_ERROR_FILE`` (see error_file).
"""

from __future__ import annotations

import builtins
import ctypes
import faulthandler
import importlib.abc
import importlib.machinery
import importlib.util
import io
import os
import signal
import sys
import types
from collections.abc import Sequence

from dlrover.agent.collectives import start_dump_thread
from dlrover.agent.error_file import ErrorRecorder
from dlrover.agent.group_teardown import GroupKeeper
from dlrover.constants import ENV_DONE_FILE, ENV_PARENT_DEATH_PID, ENV_STACK_FILE
from dlrover.trainer.progress import watch_optimizer_steps

STACK_DUMP_SIGNAL = signal.SIGUSR1
"""Signal that makes a bootstrapped worker dump all thread stacks to stderr (and go on)."""


_PR_SET_PDEATHSIG = 1

USAGE = "usage: python -m dlrover.agent.bootstrap (script.py | -m module) [args...]"


class BootstrapError(Exception):
    """The worker command line names nothing runnable."""


def enable_stack_dumps() -> None:
    """Dump stacks on fatal signals to stderr, and on STACK_DUMP_SIGNAL to $DLROVER_STACK_FILE
    (where the agent reads them) or, when that is unset, to stderr."""
    faulthandler.enable(file=sys.stderr, all_threads=True)
    path = os.environ.get(ENV_STACK_FILE, "")
    target: object = sys.stderr
    if path:
        try:
            # faulthandler keeps writing to this descriptor from its signal handler.
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:
            target = sys.stderr
    faulthandler.register(STACK_DUMP_SIGNAL, file=target, all_threads=True, chain=False)  # type: ignore[arg-type]


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent exits (Linux prctl).

    Exits at once when the parent is already gone (we were re-parented before the prctl).
    Elsewhere than Linux this does nothing: the agent's process-group kill remains.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(128 + int(sig))


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

    Like the interpreter (and unlike runpy.run_path, which discards its temporary module),
    the code runs in a real ``__main__`` module left in sys.modules afterwards, so the
    script's objects live until interpreter shutdown: destroying a process group or a DDP
    model halfway through an exit can hang. Exceptions (SystemExit included) propagate, so
    the interpreter prints them and picks the exit code exactly as for ``python script.py``.
    """
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise BootstrapError(f"no script or module given; {USAGE}")
    groups = GroupKeeper()  # see group_teardown: what keeps a rank from hanging at exit
    groups.install()
    try:
        with ErrorRecorder():
            if argv[0] == "-m":
                _run_module(argv[1], list(argv[2:]))
            else:
                _run_script(argv[0], list(argv[1:]))
    except SystemExit as exc:
        _mark_done(_exit_code(exc.code))
        groups.release_groups()
        raise
    except BaseException:
        _mark_done(1)  # the interpreter prints the traceback and exits 1
        groups.release_groups()
        raise
    _mark_done(0)
    groups.release_groups()


def _exit_code(code: object) -> int:
    """The process exit code ``SystemExit(code)`` leads to (as the interpreter computes it)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1  # a message: printed to stderr, exit 1


def read_script_result(path: str) -> int | None:
    """The exit code the script ended with, from its done file; None while it has not ended
    (or when the file is unreadable)."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "done":  # written by an older bootstrap: success
        return 0
    return int(text) if text.lstrip("-").isdigit() else None


def _mark_done(code: int) -> None:
    """The script has ended with `code`: say so before interpreter shutdown begins.

    With torch 2.13 + gloo a rank sometimes aborts (SIGABRT) or hangs while the interpreter shuts
    down, after all its work is done; the agent counts such a rank as what the script returned.
    The fatal-signal stack dump is turned off after a success: a page of "Fatal Python error:
    Aborted" after a successful run would only alarm (the agent says in one line what happened).
    """
    if code == 0:
        faulthandler.disable()
    path = os.environ.get(ENV_DONE_FILE, "")
    if path:
        try:
            with open(path + ".tmp", "w") as f:
                f.write(f"{code}\n")
            os.replace(path + ".tmp", path)  # complete or absent, never half-written
        except OSError:
            pass


def _run_script(script: str, args: list[str]) -> None:
    try:
        with io.open_code(script) as source_file:
            source = source_file.read()
    except OSError as exc:
        raise BootstrapError(f"can't open file {script!r}: {exc.strerror}") from exc
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    module = _fresh_main(script, importlib.machinery.SourceFileLoader("__main__", script), None)
    exec(compile(source, script, "exec"), module.__dict__)


def _run_module(name: str, args: list[str]) -> None:
    # Like `python -m`: the working directory comes first on the path.
    sys.path[0] = os.getcwd()
    sys.argv = ["-m", *args]
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            name = f"{name}.__main__"  # a package runs its __main__ submodule
            spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:
        raise BootstrapError(f"error finding module {name!r}: {exc}") from exc
    if spec is None or spec.loader is None or not hasattr(spec.loader, "get_code"):
        raise BootstrapError(f"no module named {name!r}")
    code = spec.loader.get_code(name)
    if code is None:
        raise BootstrapError(f"module {name!r} has no code to run")
    sys.argv[0] = spec.origin or name
    module = _fresh_main(spec.origin, spec.loader, spec)
    exec(code, module.__dict__)


def _fresh_main(
    origin: str | None, loader: importlib.abc.Loader, spec: importlib.machinery.ModuleSpec | None
) -> types.ModuleType:
    module = types.ModuleType("__main__")
    module.__file__ = origin
    module.__loader__ = loader
    module.__spec__ = spec
    module.__package__ = spec.parent if spec is not None else None
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = module
    return module


def main() -> None:
    """Entry point of ``python -m dlrover.agent.bootstrap``: die with the parent if the spawner
    asked, arm stack dumps, run the target; exit code 2 when the target cannot be found (as
    ``python`` does)."""
    parent = os.environ.pop(ENV_PARENT_DEATH_PID, "")
    if parent.isdigit():
        die_with_parent(int(parent))
    enable_stack_dumps()
    start_dump_thread()
    watch_optimizer_steps()
    try:
        run_target(sys.argv[1:])
    except BootstrapError as exc:
        print(f"dlrover.agent.bootstrap: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
