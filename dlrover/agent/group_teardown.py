"""Process groups destroyed by a worker's script are freed after the script, with the GIL free.

Why (issue 33): `torch.distributed.destroy_process_group()` drops the Python references to a
group, but DDP's `Reducer` still holds the C++ one. When the script then frees its DDP model
(its `main()` returns), the Reducer's destructor runs with the GIL held and drops the last
reference: `~ProcessGroupGloo` joins its `pt_gloo_runloop` threads. A runloop thread may at that
moment be freeing the last allreduce of the last backward, whose captured thread-local state
holds a Python object (the context autograd stashes for each backward); freeing it needs the
GIL, which the joining main thread holds: the rank never exits. A freshly spawned worker has the
same race; a forked one only loses it more often (measured in docs/fault_tolerance.md).

The fix keeps a Python reference to every group the script destroys and drops it only after
the script has returned (`release_groups`), in a fully alive interpreter. The last reference is
then the group's Python object, whose destructor torch runs with the GIL released, so the
runloop threads can finish and the join returns. Nothing else changes: the group is destroyed
for the script exactly as before (it leaves torch's world at once), it is only freed later.

torch is never imported here: the wrap is applied when the script imports `torch.distributed`
(or at once where it is already imported, as in a worker forked from the zygote).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

_MODULE = "torch.distributed"
_WRAPPED = "_dlrover_keeps_destroyed_groups"


class GroupKeeper:
    """Holds the destroyed process groups of one worker process until `release_groups`."""

    def __init__(self) -> None:
        self.kept: list[Any] = []
        self._finder: _WrapOnImport | None = None

    def install(self) -> None:
        """Wrap `destroy_process_group` now if `torch.distributed` is imported, else when it is."""
        module = sys.modules.get(_MODULE)
        if module is not None:
            self.wrap(module)
            return
        self._finder = _WrapOnImport(self)
        sys.meta_path.insert(0, self._finder)

    def wrap(self, module: types.ModuleType) -> None:
        """Replace `destroy_process_group` in `torch.distributed` and its c10d module."""
        self.uninstall_finder()
        c10d = sys.modules.get(f"{_MODULE}.distributed_c10d")
        original = getattr(module, "destroy_process_group", None)
        if c10d is None or original is None or getattr(original, _WRAPPED, False):
            return  # torch without distributed support, or wrapped already

        @functools.wraps(original)
        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            self._keep(c10d, args[0] if args else kwargs.get("group"))
            return original(*args, **kwargs)

        setattr(destroy_process_group, _WRAPPED, True)
        module.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]
        c10d.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]

    def _keep(self, c10d: types.ModuleType, group: Any) -> None:
        if group is not None:
            self.kept.append(group)
            return
        try:  # every group: torch's own table of them (an internal name, hence the guard)
            self.kept.extend(list(c10d._world.pg_map))  # type: ignore[attr-defined]
        except (AttributeError, TypeError):
            log.debug("torch's table of process groups is not where expected; keeping none")

    def release_groups(self) -> None:
        """Drop the kept groups (call once the script has returned, before interpreter exit)."""
        self.uninstall_finder()
        self.kept.clear()

    def uninstall_finder(self) -> None:
        """Stop watching for the import of `torch.distributed` (done, or no longer wanted)."""
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        self._finder = None


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: lets the other finders find `torch.distributed`, then has its
    loader wrap `destroy_process_group` once the module has run."""

    def __init__(self, keeper: GroupKeeper) -> None:
        self.keeper = keeper

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module: Callable[[types.ModuleType], None] | None = getattr(
            loader, "exec_module", None
        )
        if loader is None or exec_module is None:
            return spec

        def exec_then_wrap(module: types.ModuleType) -> None:
            exec_module(module)
            self.keeper.wrap(module)

        loader.exec_module = exec_then_wrap  # type: ignore[method-assign]
        return spec
