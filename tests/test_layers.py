"""The import graph of specdec/: no cycles (counting the imports inside functions too: a lazy import
is still a dependency), and production code below the commands never imports the bench or the
training code. Imports under `if TYPE_CHECKING:` are annotations only and do not count."""

import ast
from pathlib import Path

import specdec

ROOT = Path(specdec.__file__).parent
PRODUCTION = ("specdec.serving", "specdec.models", "specdec.drafting", "specdec.engine", "specdec.decoder",
              "specdec.text", "specdec.sampling", "specdec.rules", "specdec.verify", "specdec.policy",
              "specdec.metrics", "specdec.defaults", "specdec.machine", "specdec.names", "specdec.progress")
TOOLS = ("specdec.bench", "specdec.training")


def module_names() -> dict[str, Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported(path: Path, modules: dict[str, Path]) -> set[str]:
    """The specdec modules a file imports anywhere but under TYPE_CHECKING."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if is_type_checking(node):
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imported(path, modules) - {name} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}  # state: 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_the_package_has_no_import_cycles():
    assert cycles(import_graph()) == []


def test_production_code_never_imports_the_bench_or_training():
    graph = import_graph()
    wrong = sorted((module, dependency) for module, dependencies in graph.items() if module.startswith(PRODUCTION)
                   for dependency in dependencies if dependency.startswith(TOOLS))
    assert wrong == []


def test_the_checks_see_a_cycle_and_a_layer_breach():
    """The checks themselves can fail (a graph with a cycle, one with a breach)."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) != []
    assert cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import specdec.bench\n")
    assert is_type_checking(tree.body[1])
