"""The package's modules depend on each other in one direction: no import cycles.

Every import counts, also those inside functions (a lazy import hides a cycle, it does not break
it). The packages' __init__ files are left out: they only gather public names."""

import ast
from pathlib import Path

import lmcache_mp

ROOT = Path(lmcache_mp.__file__).parent


def module_graph() -> dict[str, set[str]]:
    files = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for name, f in files.items():
        if f.name == "__init__.py":
            continue
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                deps.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                            for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in files and d != name and files[d].name != "__init__.py"}
    return graph


def cycle_from(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path start -> ... -> start, if there is one."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for dep in sorted(graph[node]):
            if dep == start:
                return path + [start]
            if dep not in seen:
                seen.add(dep)
                stack.append((dep, path + [dep]))
    return None




def test_no_module_imports_one_that_imports_it_back():
    graph = module_graph()
    assert "lmcache_mp.loadgen.mix" in graph and "lmcache_mp.errors" in graph  # the walk found the modules
    assert not graph["lmcache_mp.errors"]  # the errors every module may raise depend on nothing
    cycles = [c for c in (cycle_from(graph, m) for m in sorted(graph)) if c]
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles)


def test_the_walk_sees_a_cycle_made_of_lazy_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycle_from(graph, "a") == ["a", "b", "c", "a"] and cycle_from(graph, "d") is None
