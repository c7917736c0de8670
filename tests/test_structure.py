"""The code's shape, read from its syntax (no imports run, no services): client libraries only at the
edges (infra/), and no import cycle between the top-level folders."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = ("kafka", "confluent_kafka", "redis", "tensorstore")
FOLDERS = ("learners", "syncer", "pipelines", "flows", "infra")  # installed as diloco.<folder>
CODE = ("diloco", "bench", "examples", *FOLDERS)                 # tests/ may talk to the services directly


def imports(path: Path) -> Iterator[tuple[str, int]]:
    """(module, line) of every import in the file, at any depth (a function's too), relative ones
    resolved against the package the folder installs as; `from m import n` gives m and m.n."""
    folders = path.relative_to(ROOT).parent.parts
    package = ["diloco", *folders] if folders[0] in FOLDERS else list(folders)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            yield module, node.lineno
            yield from ((f"{module}.{a.name}", node.lineno) for a in node.names)


def python_files(folders) -> Iterator[Path]:
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py"))


def folder_of(module: str) -> str | None:
    """The card's folder a module lives in (diloco.syncer.state -> syncer), or None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "diloco" and len(parts) > 1 and parts[1] in FOLDERS else None


def folder_graph() -> dict[str, dict[str, str]]:
    """folder -> {folder it imports: the first place it does so, as path:line}."""
    graph: dict[str, dict[str, str]] = {f: {} for f in FOLDERS}
    for folder in FOLDERS:
        for path in python_files([folder]):
            for module, line in imports(path):
                if (to := folder_of(module)) not in (None, folder):
                    graph[folder].setdefault(to, f"{path.relative_to(ROOT)}:{line}")
    return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """A cycle of the graph as the nodes on it (first repeated last), or None: depth first, a node
    met again while on the current path closes one."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, {})):
            if cycle := visit(nxt, path + [node]):
                return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        if cycle := visit(start, []):
            return cycle
    return None


def test_client_libraries_are_imported_only_in_infra():
    leaks = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in python_files(f for f in CODE if f != "infra")
             for module, line in imports(path) if module.split(".")[0] in CLIENTS]
    assert not leaks, "client libraries outside infra/:\n" + "\n".join(leaks)


def test_the_folders_import_each_other_without_a_cycle():
    graph = folder_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between folders: " + " -> ".join(
        f"{a} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_the_cycle_finder_finds_a_cycle_and_accepts_a_tree():
    """The check above could pass by finding nothing anywhere: it must name a cycle where there is one."""
    assert find_cycle({"a": {"b": ""}, "b": {"c": ""}, "c": {"a": ""}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": "", "c": ""}, "b": {"c": ""}, "c": {}}) is None
    assert folder_of("diloco.syncer.state") == "syncer" and folder_of("diloco.messages") is None
