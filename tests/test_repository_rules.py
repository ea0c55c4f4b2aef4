"""Repository-wide rules of graphdraft/ and capture/, read from the source (no import):

* the module import graph, imports inside functions included, has no cycle;
* the layers: `graphdraft/kernels/` imports nothing of `runtime/`, `serving/`, `startup/` or
  `ops`; `graphdraft/startup/` nothing of `serving/`; `capture/` nothing of `graphdraft`;
* no function (def / async def, methods and nested functions included) is over 80 lines,
  except the bodies of `@triton.jit` kernels;
* `graphdraft/serving/engine.py` (the host loop) stays under 900 lines.

Each test names every offender (module, line, what), so a failure says where to look.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("graphdraft", "capture")
MAX_FUNCTION_LINES = 80

FORBIDDEN = {
    "graphdraft.kernels": ("graphdraft.runtime", "graphdraft.serving", "graphdraft.startup",
                           "graphdraft.ops"),
    "graphdraft.startup": ("graphdraft.serving",),
    "capture": ("graphdraft",),
}
"""Module prefix -> the module prefixes it must never import (a layer never imports one above)."""


def _modules() -> dict[str, Path]:
    """Every module of the packages by dotted name (a package by its own name: its __init__)."""
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = p.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


MODULES = _modules()


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    is_pkg = MODULES[module].name == "__init__.py"
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_pkg else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, source: str | None = None) -> list[tuple[str, int]]:
    """(imported project module, line) of every import statement in `module` (its file, or
    `source`), at any depth. `from a import b` is an import of `a.b` where that is a module,
    else of `a`."""
    tree = ast.parse(source if source is not None else MODULES[module].read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES and "." in t:  # `import a.b.c` of a name inside
                t = t.rsplit(".", 1)[0]
            if t in MODULES and t != module:
                out.append((t, node.lineno))
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def _cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth: the module count (well under the limit)
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w, _ in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _describe(comp: list[str]) -> str:
    edges = [f"{a}:{line} -> {b}" for a in comp for b, line in GRAPH[a] if b in comp]
    return " | ".join(sorted(edges))


def test_the_import_graph_sees_imports_inside_functions():
    """Every import statement is an edge, one inside a function (or a method) too, and a
    cycle through one is found."""
    source = ("import torch\n"
              "def f():\n    from graphdraft.kernels import gemv\n"
              "class A:\n    def g(self):\n        import graphdraft.ops\n"
              "        from . import config\n")
    assert _imports("graphdraft.checks", source) == [
        ("graphdraft.kernels.gemv", 3), ("graphdraft.ops", 6), ("graphdraft.config", 7)]
    assert _cycles({"a": [("b", 1)], "b": [("a", 2)], "c": [("a", 3)]}) == [["a", "b"]]


def test_no_import_cycle_between_modules():
    """No cycle in the module import graph of graphdraft/ and capture/, imports inside
    functions included (a function-local import hides a cycle from the interpreter's first
    import, not from the design)."""
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles (module:line -> module):\n" + "\n".join(
        _describe(c) for c in cycles)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_never_imports_one_above(layer):
    bad = [f"{m}:{line} imports {t}" for m in MODULES if _within(m, layer)
           for t, line in GRAPH[m] if any(_within(t, f) for f in FORBIDDEN[layer])]
    assert not bad, "\n".join(bad)


_JIT = ("triton.jit", "jit", "triton.autotune")


def _is_jit(node: ast.AST) -> bool:
    """`triton.jit` or `triton.jit(...)` (a decorator or a call's function)."""
    target = node.func if isinstance(node, ast.Call) else node
    return ast.unparse(target) in _JIT


def _jitted_names(tree: ast.AST) -> set[str]:
    """Functions a module compiles with a call: `triton.jit(fn)`, `triton.jit(...)(fn)`."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_jit(node.func):
            out |= {a.id for a in node.args if isinstance(a, ast.Name)}
    return out


def _is_triton_kernel(fn: ast.AST, jitted: set[str]) -> bool:
    return fn.name in jitted or any(_is_jit(d) for d in fn.decorator_list)


def long_functions(limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, str, int]]:
    """(path, line, qualified name, lines) of every function over `limit` lines, decorators
    excluded, docstring included, `@triton.jit` kernels left out."""
    out = []

    def walk(node: ast.AST, prefix: str, path: str, jitted: set[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if isinstance(child, ast.ClassDef):
                    walk(child, name + ".", path, jitted)
                    continue
                n = child.end_lineno - child.lineno + 1
                if n > limit and not _is_triton_kernel(child, jitted):
                    out.append((path, child.lineno, name, n))
                walk(child, name + ".", path, jitted)
            else:
                walk(child, prefix, path, jitted)

    for p in MODULES.values():
        rel = str(p.relative_to(ROOT))
        tree = ast.parse(p.read_text(), filename=rel)
        walk(tree, "", rel, _jitted_names(tree))
    return sorted(out)


def test_the_length_check_can_fail():
    assert long_functions(limit=3), "every function is 3 lines or less?"
    assert all(n > 3 for *_, n in long_functions(limit=3))


def test_no_function_over_80_lines():
    """No function in graphdraft/ or capture/ is over 80 lines (Triton kernel bodies aside)."""
    bad = long_functions()
    assert not bad, "functions over 80 lines:\n" + "\n".join(
        f"{path}:{line} {name} ({n} lines)" for path, line, name, n in bad)


MAX_ENGINE_LINES = 900
"""The Engine is the host loop only (issue #39): what grows goes to the modules beside it."""


def test_the_engine_module_stays_a_host_loop():
    n = len((ROOT / "graphdraft" / "serving" / "engine.py").read_text().splitlines())
    assert n < MAX_ENGINE_LINES, f"graphdraft/serving/engine.py has {n} lines (limit {MAX_ENGINE_LINES})"
