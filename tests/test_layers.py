"""The import contract of docs/architecture.md, checked on the source (every import statement,
at module level or inside a function, and the packages each import runs)."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dlrover"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _parents(name: str) -> list[str]:
    """Importing a.b.c runs a/__init__ and a/b/__init__ first."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@cache
def direct_imports(module: str, in_functions: bool = True) -> frozenset[str]:
    """What `module` imports; without `in_functions` only what importing it runs."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    nodes = ast.walk(tree) if in_functions else _module_level(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                origin = ".".join([*base, node.module] if node.module else base)
            else:
                origin = node.module or ""
            found.add(origin)
            # `from pkg import sub` imports the submodule pkg.sub
            found.update(
                f"{origin}.{alias.name}"
                for alias in node.names
                if f"{origin}.{alias.name}" in MODULES
            )
    with_parents = set(found)
    for name in found:
        with_parents.update(_parents(name))
    with_parents.discard(module)
    return frozenset(with_parents)


def _module_level(tree: ast.Module) -> list[ast.stmt]:
    """Statements that run on import (functions' bodies excluded, if/try/with blocks included)."""
    out: list[ast.stmt] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if isinstance(node, ast.ClassDef):
                todo.extend(s for s in node.body if not isinstance(s, ast.FunctionDef))
            continue
        for field in ("body", "orelse", "finalbody"):
            todo.extend(getattr(node, field, []))
        for handler in getattr(node, "handlers", []):
            todo.extend(handler.body)
    return out


@cache
def reachable(module: str, in_functions: bool = True) -> frozenset[str]:
    """Every module that importing `module` may import (dlrover modules followed); without
    `in_functions`, what importing it actually runs."""
    seen: set[str] = set()
    todo = [module, *_parents(module)]
    while todo:
        current = todo.pop()
        for name in direct_imports(current, in_functions) if current in MODULES else ():
            if name not in seen:
                seen.add(name)
                if name in MODULES:
                    todo.append(name)
    return frozenset(seen)


def _in(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _modules_of(prefix: str) -> list[str]:
    return sorted(m for m in MODULES if _in(m, (prefix,)))


LAYERED = (
    "dlrover.agent",
    "dlrover.api",
    "dlrover.checkpoint",
    "dlrover.cli",
    "dlrover.client",
    "dlrover.embedding",
    "dlrover.engines",
    "dlrover.master",
    "dlrover.operator",
    "dlrover.proto",
    "dlrover.runner",
    "dlrover.sharding",
    "dlrover.testing",
    "dlrover.trainer",
)
"""Packages with a rule below (proto: generated code; testing: may import anything but the CLI,
and nothing imports it)."""
FOUNDATION = (
    "dlrover.backoff",
    "dlrover.constants",
    "dlrover.coordination",
    "dlrover.collectives",
    "dlrover.decisions",
    "dlrover.elasticjob",
    "dlrover.envvars",
    "dlrover.faults",
    "dlrover.hang_spec",
    "dlrover.jobspec",
    "dlrover.json_messages",
    "dlrover.log",
    "dlrover.processes",
    "dlrover.recovery_channel",
    "dlrover.worker_context",
)
"""Top-level modules everybody may import: they reach no side."""


@pytest.mark.parametrize("module", _modules_of("dlrover.master"))
def test_master_needs_no_ml_framework_nor_the_node_side(module: str) -> None:
    forbidden = ("torch", "dlrover.agent", "dlrover.trainer", "dlrover.client", "dlrover.cli")
    bad = sorted(name for name in reachable(module) if _in(name, forbidden))
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize(
    "module",
    [
        *_modules_of("dlrover.agent"),
        *_modules_of("dlrover.trainer"),
        *_modules_of("dlrover.checkpoint"),
        *_modules_of("dlrover.client"),
    ],
)
def test_node_side_reaches_the_master_only_through_the_client(module: str) -> None:
    bad = sorted(name for name in reachable(module) if _in(name, ("dlrover.master",)))
    assert not bad, f"{module} imports {bad}; talk to the master through dlrover.client"


@pytest.mark.parametrize(
    "module",
    [
        *_modules_of("dlrover.sharding"),
        *_modules_of("dlrover.api"),
        *_modules_of("dlrover.proto"),
        "dlrover.checkpoint.coordinator",
    ],
)
def test_shared_code_belongs_to_neither_side(module: str) -> None:
    sides = ("dlrover.master", "dlrover.client", "dlrover.trainer", "dlrover.agent", "torch")
    bad = sorted(name for name in reachable(module) if _in(name, sides))
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module", _modules_of("dlrover.agent"))
def test_importing_the_agent_imports_no_torch(module: str) -> None:
    # Function-level imports are allowed here (catalog's trainer-side loader imports torch);
    # tests/checkpoint/test_ckpt_agent_torch_free.py checks that a running agent never does.
    bad = sorted(name for name in reachable(module, False) if _in(name, ("torch",)))
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize(
    "module",
    [
        *_modules_of("dlrover.embedding"),
        *_modules_of("dlrover.engines"),
        *_modules_of("dlrover.operator"),
        *FOUNDATION,
    ],
)
def test_engines_embedding_operator_and_the_foundation_reach_no_side(module: str) -> None:
    # Engines know nothing of policies; the embedding server is shared by the trainer and the
    # master; the operator only turns custom resources into job specs.
    sides = (
        "dlrover.master",
        "dlrover.runner",
        "dlrover.client",
        "dlrover.trainer",
        "dlrover.agent",
        "dlrover.testing",
        "torch",
    )
    bad = sorted(name for name in reachable(module) if _in(name, sides))
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module", _modules_of("dlrover.runner"))
def test_the_job_runner_is_master_side(module: str) -> None:
    forbidden = ("torch", "dlrover.agent", "dlrover.trainer", "dlrover.client", "dlrover.cli")
    bad = sorted(name for name in reachable(module) if _in(name, forbidden))
    assert not bad, f"{module} imports {bad}"


def test_the_product_never_imports_the_test_helpers() -> None:
    bad = {
        module: sorted(n for n in direct_imports(module) if _in(n, ("dlrover.testing",)))
        for module in MODULES
        if not _in(module, ("dlrover.testing",))
    }
    assert not {m: names for m, names in bad.items() if names}, (
        "fault specs the product reads live in dlrover.faults"
    )


def test_every_module_has_a_layer() -> None:
    """A new package gets a rule here before it lands (docs/architecture.md lists them)."""
    placed = (*LAYERED, *FOUNDATION)
    assert sorted(m for m in MODULES if not _in(m, placed) and m != "dlrover") == []


def test_packages_import_each_other_one_way() -> None:
    """No circle between dlrover's packages (and top-level modules), counting imports inside
    functions too."""
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        here = _package(module)
        for name in direct_imports(module):
            if name in MODULES and _package(name) not in (here, "dlrover"):
                graph.setdefault(here, set()).add(_package(name))
    circles = []
    for start in sorted(graph):
        todo, seen = list(graph[start]), set()
        while todo:
            current = todo.pop()
            if current == start:
                circles.append(start)
                break
            if current not in seen:
                seen.add(current)
                todo.extend(graph.get(current, ()))
    assert circles == [], f"these packages reach themselves through another: {circles}"


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_nothing_imports_the_cli() -> None:
    bad = {
        module: sorted(name for name in direct_imports(module) if _in(name, ("dlrover.cli",)))
        for module in MODULES
        if not _in(module, ("dlrover.cli",))
    }
    assert not {m: names for m, names in bad.items() if names}


def test_the_job_master_only_assembles_its_parts() -> None:
    """`JobMaster` builds the parts and wires their listeners (docs/architecture.md): at most
    15 methods, and nothing outside the master package sets an attribute on it."""
    tree = ast.parse((PACKAGE / "master" / "job.py").read_text())
    job = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "JobMaster")
    methods = [n.name for n in job.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    assert len(methods) <= 15, methods
    for module, path in MODULES.items():
        if module.startswith("dlrover.master"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in node.targets if isinstance(node, ast.Assign) else ():
                base = target.value if isinstance(target, ast.Attribute) else None
                assert not (isinstance(base, ast.Name) and base.id == "job"), (
                    f"{module}:{node.lineno} sets an attribute on the job"
                )
