"""No module-level mutable state in engine/: state lives on an owner (the engine core, the model, a
store) that a test or a process makes and drops, so nothing one run does carries into the next.

An AST scan of engine/: a module-level name may not be a counter, lock or other state object, nor a
container that any engine module changes (item assignment, a mutating method, `global`). Constant
tables (dicts and lists written once, at import) are fine. What remains is ALLOWED, each with why."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine"

# Calls whose result, bound at module level, is state however it is used.
STATE_CALLS = {
    "count",
    "ContextVar",
    "Lock",
    "RLock",
    "Condition",
    "Event",
    "Semaphore",
    "local",
    "Queue",
    "SimpleQueue",
    "deque",
    "defaultdict",
    "Counter",
    "OrderedDict",
    "WeakValueDictionary",
    "WeakKeyDictionary",
    "WeakSet",
}
CACHES = {"cache", "lru_cache"}
MUTATORS = {
    "append",
    "extend",
    "insert",
    "update",
    "setdefault",
    "pop",
    "popitem",
    "clear",
    "add",
    "discard",
    "remove",
    "__setitem__",
}

# (file under engine/, module-level name) -> why it is acceptable.
ALLOWED = {
    ("native/loaded.py", "_ACTIVE"): (
        "ContextVar, not a module flag: the native kernels of the model whose forward runs, which ops deep "
        "inside transformers' modules read (no parameter reaches them); `active()` sets it around each "
        "forward and resets it by token, so it never outlives the block, and another thread or context "
        "never sees it"
    ),
    ("native/row_kernels.py", "_NATIVE_ROWS"): (
        "ContextVar: `native_rows(False)` runs one block on torch's kernels (tests, benchmarks); reset "
        "by token on exit, per thread, so it cannot leak into the next test"
    ),
    ("native/loaded.py", "load_build"): (
        "cache: compiles and loads a build of the C kernels once per process; a pure function of the "
        "build's name on this CPU (the same library every call)"
    ),
    ("native/loaded.py", "widest"): (
        "cache: the widest build this CPU runs, resolved once; it never changes within a process"
    ),
    ("huge_pages.py", "_madvise"): "cache: libc's madvise function, looked up once",
    ("experts/formats/native_quant.py", "_mxfp4_tables"): (
        "cache: the MXFP4 decode tables per (dtype, device), constants of the format; no result "
        "depends on whether they were made before"
    ),
}


def _module_names(tree: ast.Module) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}
    for node in tree.body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign) and node.value is not None
            else []
        )
        for t in targets:
            if isinstance(t, ast.Name):
                out[t.id] = node.value  # type: ignore[union-attr]
    return out


def _call_name(node: ast.AST) -> str | None:
    if not isinstance(node, ast.Call):
        return None
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _local_names(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> set[str]:
    """Names a function binds itself (parameters, assignments), which shadow module-level ones."""
    a = fn.args
    names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    names |= {x.arg for x in (a.vararg, a.kwarg) if x is not None}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


class _Mutations(ast.NodeVisitor):
    """Names changed in place or rebound through `global`, where no enclosing function binds them."""

    def __init__(self) -> None:
        self.found: set[str] = set()
        self.local: list[set[str]] = []

    def _function(self, fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self.local.append(_local_names(fn))
        self.generic_visit(fn)
        self.local.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _target(self, node: ast.AST) -> None:
        if isinstance(node, ast.Name) and not any(node.id in s for s in self.local):
            self.found.add(node.id)

    def visit_Global(self, node: ast.Global) -> None:
        self.found.update(node.names)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, ast.Store | ast.Del):
            self._target(node.value)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            self._target(node.func.value)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._target(node.target)
        self.generic_visit(node)


def _mutated(tree: ast.Module) -> set[str]:
    v = _Mutations()
    v.visit(tree)
    return v.found


def _imported(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """local name -> (engine module file, its name) for `from engine.x import name`."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engine."):
            rel = node.module.removeprefix("engine.").replace(".", "/")  # type: ignore[union-attr]
            for a in node.names:
                out[a.asname or a.name] = (f"{rel}.py", a.name)
    return out


def _findings() -> set[tuple[str, str]]:
    trees = {
        str(p.relative_to(ENGINE)): ast.parse(p.read_text()) for p in sorted(ENGINE.rglob("*.py"))
    }
    names = {f: _module_names(t) for f, t in trees.items()}
    found: set[tuple[str, str]] = set()
    for f, tree in trees.items():
        for name, value in names[f].items():
            if _call_name(value) in STATE_CALLS:
                found.add((f, name))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any(
                (_call_name(d) or getattr(d, "attr", None) or getattr(d, "id", None)) in CACHES
                for d in node.decorator_list
            ):
                found.add((f, node.name))
        imported = _imported(tree)
        for name in _mutated(tree):
            if name in names[f]:
                found.add((f, name))
            elif name in imported and imported[name][1] in names.get(imported[name][0], {}):
                found.add(imported[name])
    return found


def test_engine_keeps_no_module_level_mutable_state() -> None:
    unexplained = _findings() - set(ALLOWED)
    assert unexplained == set(), (
        "module-level state in engine/: give it an owner (the core, the model, a store), or if it is a "
        "pure cache or a scoped ContextVar add it to ALLOWED with why"
    )


def test_every_allowance_is_still_needed() -> None:
    assert set(ALLOWED) - _findings() == set()


def test_the_scan_sees_what_it_forbids() -> None:
    tree = ast.parse(
        "import itertools\n_ids = itertools.count()\n_TABLES = {}\nSEEN = []\nCONST = {1: 2}\n"
        "def f(k):\n    _TABLES[k] = 1\n    SEEN.append(k)\n"
        "def g(SEEN):\n    SEEN.append(1)\n"
    )
    names = _module_names(tree)
    assert _call_name(names["_ids"]) in STATE_CALLS
    assert _mutated(tree) & set(names) == {"_TABLES", "SEEN"}
