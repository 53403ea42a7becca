"""No import circle anywhere in the tree (issue 41): a module that imports another, directly or
through others, is never imported back by it. Every import counts: module level, inside a function,
and under TYPE_CHECKING (as .importlinter counts them). A circle is reported as its chain of modules."""

from __future__ import annotations

import grimp
import pytest

PACKAGES = ("engine", "policies", "server", "bench")


def import_circles(*packages: str) -> list[list[str]]:
    """One circle per strongly connected group of modules, as a chain a -> b -> ... -> a."""
    graph = grimp.build_graph(
        *packages,
        include_external_packages=False,
        exclude_type_checking_imports=False,
        cache_dir=None,
    )
    imports = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    circles = []
    for group in _strongly_connected(imports):
        first = min(group)
        if len(group) == 1 and first not in imports[first]:
            continue
        nxt = min(m for m in imports[first] if m in group)
        back = graph.find_shortest_chain(importer=nxt, imported=first) or (first,)
        circles.append([first, *back] if nxt != first else [first, first])
    return sorted(circles)


def _strongly_connected(imports: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative (the module graph is deep enough to matter for recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    for root in sorted(imports):
        if root in index:
            continue
        work = [(root, iter(sorted(imports[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(imports[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = set()
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    group.add(m)
                    if m == v:
                        break
                groups.append(group)
    return groups


def test_the_tree_has_no_import_circle() -> None:
    circles = import_circles(*PACKAGES)
    assert circles == [], "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


@pytest.fixture
def synthetic(tmp_path, monkeypatch):
    """A package `circ` where a -> b -> (under TYPE_CHECKING) a, c -> d -> e -> c inside a function,
    and f imports a without being part of any circle."""
    pkg = tmp_path / "circ"
    pkg.mkdir()
    files = {
        "__init__.py": "",
        "a.py": "from circ import b\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from circ.a import x\n",
        "c.py": "import circ.d\n",
        "d.py": "def f():\n    from circ import e\n",
        "e.py": "from circ.c import y\n",
        "f.py": "import circ.a\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "circ"


def test_a_circle_is_found_and_named(synthetic: str) -> None:
    assert import_circles(synthetic) == [
        ["circ.a", "circ.b", "circ.a"],
        ["circ.c", "circ.d", "circ.e", "circ.c"],
    ]
