"""The import graph of specdec/: no cycles, counting every import (inside functions too: a lazy
import is still a dependency; and under `if TYPE_CHECKING:`: an annotation that names another
module's type ties the two modules as surely), production code (every module but the commands
and the tools) never imports the bench or the training code, and the model's forward
(transformer.py) depends on no precision: the quantizers and the compiled layer swap themselves in."""

import ast
from pathlib import Path

import specdec

ROOT = Path(specdec.__file__).parent
TOOLS = ("specdec.bench", "specdec.training")
# The CLI dispatches to every command, tools included; corpus_index (behind `specdec index` and
# the commands' --index) builds datastores from files by training's rule for which files count.
COMMANDS = ("specdec.cli", "specdec.__main__", "specdec.index_command", "specdec.corpus_index")
PRECISIONS = ("specdec.models.precisions", "specdec.models.fused_layer", "specdec.models.int4",
              "specdec.models.w8a32", "specdec.models.quantize", "specdec.models.int8_kernels")


def module_names() -> dict[str, Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def production_modules(modules: dict[str, Path]) -> list[str]:
    """Every module but the tools and the commands that run them."""
    return sorted(name for name in modules if not within(name, TOOLS + COMMANDS))


def imported(path: Path, modules: dict[str, Path]) -> set[str]:
    """The specdec modules a file imports anywhere: at the top, in functions, under TYPE_CHECKING."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
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


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_package_has_no_import_cycles():
    assert cycles(import_graph()) == []


def test_production_code_never_imports_the_bench_or_training():
    graph = import_graph()
    wrong = sorted((module, dependency) for module in production_modules(module_names())
                   for dependency in graph[module] if within(dependency, TOOLS))
    assert wrong == []


def test_the_model_forward_knows_no_precision():
    """transformer.py and all it imports name no quantizer and not the compiled layer (mutation: an
    `import specdec.models.int4` in transformer.py, even under `if False:`, fails this)."""
    assert sorted(name for name in reachable(import_graph(), "specdec.models.transformer")
                  if within(name, PRECISIONS)) == []


def test_production_is_every_module_but_the_commands_and_tools():
    """The list is derived, so a new module is checked from its first commit (the hand-written
    list this replaced had left out estimates, grammar, constraint, explain, acceptance, request)."""
    production = production_modules(module_names())
    assert {"specdec.estimates", "specdec.grammar", "specdec.constraint", "specdec.explain.view",
            "specdec.acceptance", "specdec.request", "specdec.models.fused_layer"} <= set(production)
    assert not any(within(name, TOOLS + COMMANDS) for name in production)


def test_the_checks_see_a_cycle_a_type_only_import_and_a_layer_breach(tmp_path):
    """The checks themselves can fail: a graph with a cycle, an import under TYPE_CHECKING (it
    counts), one deep in a function, and a production module that imports the bench."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) != []
    assert cycles({"a": {"b"}, "b": set()}) == []
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import specdec.bench\n"
                      "def f():\n    if True:\n        from specdec.training import trainer\n")
    modules = {"specdec.bench": Path(), "specdec.training": Path(), "specdec.training.trainer": Path()}
    assert imported(source, modules) == {"specdec.bench", "specdec.training", "specdec.training.trainer"}
    assert reachable({"a": {"b"}, "b": {"c"}, "c": set()}, "a") == {"b", "c"}
    assert not within("specdec.benchmarks", TOOLS) and within("specdec.bench.suite", TOOLS)
