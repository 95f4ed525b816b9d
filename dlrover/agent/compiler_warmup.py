"""Warm restarts for compiled models: the zygote takes on what every new process pays before its
first compiled step, once it knows the node's workers compile.

A process that calls ``torch.compile`` (inductor) pays, before it traces a single frame, for work
that does not depend on the model: importing inductor's compiler (about 0.6 s here) and its probes
of the machine, each answered by subprocesses (the C++ compiler's version, twice; which vector
instruction sets load, one Python subprocess each): about 0.8 s with a warm cache; then, at its
first graph, the hash of torch's sources that keys the caches (about 0.2 s), the tokenizer's
patterns and inductor's pattern passes (about 0.2 s more). torch keeps each for the life of
the process. A worker forked from a zygote that did this work inherits it, so a restarted
worker's first compiled step costs its tracing and cache loads only.

Two halves:
- in a worker forked by the zygote, `watch_compiler_use` leaves a marker file (the path in
  ``DLROVER_COMPILE_MARKER``) as the script imports inductor's compiler, which ``torch.compile``
  does; the agent sees it and asks its zygote to warm up;
- in the zygote, `warm_compiler` imports the compiler and asks the probes, on the zygote's main
  thread, between requests: no thread is left behind, so forking stays safe.

Only the standard library is imported here: the zygote and every worker import this module
before torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

from dlrover import constants as c

COMPILER_MODULE = "torch._inductor.compile_fx"
"""What ``torch.compile`` with the default backend imports as it is called (and what a script
that never compiles never imports)."""


def compiler_in_use_marker(run_dir: str) -> str:
    """The marker file of a node's workers: it exists once one of them imported the compiler."""
    return os.path.join(run_dir, "compiles")


class _CompilerUseWatch(importlib.abc.MetaPathFinder):
    """Touches the marker when the compiler module is first imported; finds nothing itself."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == COMPILER_MODULE:
            sys.meta_path.remove(self)
            try:
                os.close(os.open(self.marker, os.O_WRONLY | os.O_CREAT, 0o600))
            except OSError:  # the agent's folder is gone: nobody to tell
                pass
        return None


def watch_compiler_use() -> None:
    """In a worker forked by the zygote: leave the marker as the script imports the compiler.
    Nothing happens where the agent gave no marker or the compiler is imported already."""
    marker = os.environ.get(c.ENV_COMPILE_MARKER, "")
    if not marker or COMPILER_MODULE in sys.modules:
        return
    if not any(isinstance(f, _CompilerUseWatch) for f in sys.meta_path):
        sys.meta_path.insert(0, _CompilerUseWatch(marker))


@dataclass(frozen=True)
class WarmupResult:
    """What `warm_compiler` did."""

    seconds: float
    skipped: list[str]
    """Probes this torch does not have or that failed (by name); the rest were warmed."""


def _probes() -> list[tuple[str, Callable[[], object]]]:
    """Inductor's per-process set-up that no model changes, each kept by torch for the process's
    life: its probes of the machine, the hash of torch's sources that keys its caches, the
    tokenizer's patterns (dynamo names the functions it traces by tokenizing their files), and
    the pattern passes it registers before its first graph (private functions: a torch without
    one skips it, losing only its share of the saving)."""
    import torch
    from torch._inductor import codecache, cpp_builder, cpu_vec_isa
    from torch._inductor.fx_passes import joint_graph, post_grad

    def compiler_version() -> object:
        return cpp_builder.get_compiler_version_info(cpp_builder.get_cpp_compiler())

    def tokenizer() -> object:
        import io
        import tokenize

        return list(tokenize.generate_tokens(io.StringIO("def f():\n    pass\n").readline))

    probes: list[tuple[str, Callable[[], object]]] = [
        ("vector instruction sets", cpu_vec_isa.valid_vec_isa_list),
        ("C++ compiler", cpp_builder.get_cpp_compiler),
        ("is gcc", cpp_builder.is_gcc),
        ("is clang", cpp_builder.is_clang),
        ("compiler version", compiler_version),
        ("torch's source hash", codecache.torch_key),
        ("tokenizer", tokenizer),
        ("post-grad patterns", post_grad.lazy_init),
    ]
    if _cpu_only(torch):
        # The joint-graph patterns are registered per device of a graph's inputs (as
        # ``lazy_init(device)``, cached by that argument): with no accelerator in this torch
        # every graph's is the CPU, so the worker's call finds them registered. (On a GPU node
        # each rank's device differs, and another device's patterns would be registered beside
        # its own: left to the worker.)
        probes.append(("joint-graph patterns", lambda: joint_graph.lazy_init(torch.device("cpu"))))
    return probes


def _cpu_only(torch: ModuleType) -> bool:
    """Whether this torch was built without CUDA, ROCm and XPU (asked without touching a
    device: the zygote must stay free to fork)."""
    xpu = getattr(torch, "xpu", None)
    xpu_built = bool(xpu is not None and getattr(xpu, "_is_compiled", lambda: False)())
    return torch.version.cuda is None and torch.version.hip is None and not xpu_built


def warm_compiler() -> WarmupResult:
    """Import the compiler and ask its probes (raises ImportError where the compiler cannot be
    imported: a torch without inductor)."""
    started = time.perf_counter()
    importlib.import_module(COMPILER_MODULE)
    skipped: list[str] = []
    try:
        probes = _probes()
    except (ImportError, AttributeError):
        probes = []
        skipped.append("probes")
    monitor = _progress_monitor()
    try:
        for name, probe in probes:
            try:
                probe()
            except Exception:  # a probe torch would run again in the worker, and fail there alike
                skipped.append(name)
    finally:
        _stop_progress_monitor_started_since(monitor)
    return WarmupResult(round(time.perf_counter() - started, 4), skipped)


def _progress_monitor() -> object | None:
    """tqdm's monitor thread, where tqdm is imported and has one running."""
    std = sys.modules.get("tqdm.std")
    return None if std is None else getattr(std.tqdm, "monitor", None)


def _stop_progress_monitor_started_since(before: object | None) -> None:
    """Stop the monitor thread tqdm started during the warm-up, if it did. torch.fx's
    interpreter opens a (disabled) progress bar for each graph it runs, as the joint-graph
    patterns are traced, and where tqdm is installed (beside Hugging Face, datasets and most
    training stacks) its first bar starts a monitor thread that lives as long as the process: a
    zygote with a second thread refuses to fork, so every worker after the warm-up was started
    cold instead. A worker's own first bar starts its own monitor."""
    monitor = _progress_monitor()
    if monitor is None or monitor is before:
        return
    # Not under tqdm's lock: the monitor takes it each time it wakes. exit() sets the event it
    # sleeps on and joins it, so it ends within that turn of its loop.
    monitor.exit()  # type: ignore[attr-defined]
    sys.modules["tqdm.std"].tqdm.monitor = None
