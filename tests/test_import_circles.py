"""No import circle anywhere in dlrover/: the module graph is a one-way picture.

An arrow is every import statement of a module, wherever it is: at module level, inside a
function (a lazy import only hides a circle until the call) and under ``if TYPE_CHECKING:``
(a type that needs the other module is a dependency all the same); importing ``a.b.c`` also
draws arrows to the packages ``a`` and ``a.b`` whose ``__init__`` it runs (tests/test_layers.py
reads the statements). Not an arrow: a module to a package that contains it. Python runs
``a/b/__init__`` before ``a.b.c`` whatever ``a.b.c`` imports, so a package ``__init__`` that
re-exports its own modules is a facade above them, not a circle.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tests.test_layers import MODULES, direct_imports


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan's
    algorithm, iterative: the graph has hundreds of modules), each sorted, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, sorted(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, todo = work[-1]
            if todo:
                nxt = todo.pop()
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_the_detector_finds_a_circle_and_its_members() -> None:
    graph = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": [], "e": ["e2"], "e2": ["e"]}
    assert circles(graph) == [["a", "b", "c"], ["e", "e2"]]
    assert circles({"a": ["b"], "b": ["c"], "c": []}) == []


def test_no_import_circle_in_dlrover() -> None:
    graph = {
        m: [n for n in direct_imports(m) if n in MODULES and not m.startswith(n + ".")]
        for m in MODULES
    }
    found = circles(graph)
    assert not found, "import circles (break each with a protocol or a lower module):\n" + (
        "\n".join(" <-> ".join(c) for c in found)
    )
