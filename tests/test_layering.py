"""kvbench's subpackages import one another without cycles (issue #31 item 2).

The graph is read from the source with ``ast`` (nothing is imported): an edge ``a -> b`` is any ``import`` in a module
of subpackage ``a`` (at module level or inside a function) of a module of subpackage ``b``. The science packages are
layered (utils < data < models < kernels < train < compress, reuse < beyond < eval < lmms < bench < plan < report < gpu);
a shared piece goes to the lowest package that needs it rather than closing a cycle.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
#: Strongly connected components tolerated for now (each as a set of subpackages).
ALLOWED: list[set[str]] = []


def package_edges(src: Path = SRC) -> dict[tuple[str, str], list[str]]:
    """``(a, b) -> ["module -> imported", ...]`` for every import from subpackage ``a`` into subpackage ``b != a``."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted((src / "kvbench").rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if len(parts) < 3:          # kvbench/__init__.py, kvbench/cli.py: not a subpackage
            continue
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = ".".join(parts[:-1])
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [base]
            else:
                continue
            for target in targets:
                t = target.split(".")
                if t[0] == "kvbench" and len(t) > 1 and (src / "kvbench" / t[1]).is_dir() and t[1] != parts[1]:
                    edges[(parts[1], t[1])].append(f"{module} -> {target}")
    return edges


def cycles(edges) -> list[set[str]]:
    """Strongly connected components of more than one package (Tarjan)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(set(graph) | {b for bs in graph.values() for b in bs}):
        if v not in index:
            visit(v)
    return out


def test_no_package_level_import_cycle():
    edges = package_edges()
    assert edges, f"no imports found under {SRC}"
    bad = [c for c in cycles(edges) if not any(c <= allowed for allowed in ALLOWED)]
    lines = []
    for comp in bad:
        lines.append("cycle: " + " ".join(sorted(comp)))
        lines += [f"  {a} -> {b}: {', '.join(sorted(set(why))[:4])}"
                  for (a, b), why in sorted(edges.items()) if a in comp and b in comp]
    assert not bad, "package-level import cycles among kvbench's subpackages:\n" + "\n".join(lines)


def test_cycles_are_found():
    """The checker itself: a back-edge closes a cycle, an allowed pair stays allowed."""
    assert cycles({("data", "eval"): [], ("eval", "data"): [], ("eval", "utils"): []}) == [{"data", "eval"}]
    assert cycles({("a", "b"): [], ("b", "c"): [], ("c", "a"): [], ("c", "d"): []}) == [{"a", "b", "c"}]
    assert cycles({("a", "b"): [], ("b", "c"): []}) == []
