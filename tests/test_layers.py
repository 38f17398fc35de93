"""The import graph of specdec/ (scripts/package_map.py reads it): no cycles between modules nor
between rooms (the subpackages, and each top-level module), counting every import (inside
functions too, and under `if TYPE_CHECKING:`); docs/design.md shows the current map; production
code (every module but the commands and the tools) never imports the bench or the training code;
and the model's forward (transformer.py) depends on no precision: the quantizers and the compiled
layer swap themselves in."""

import sys
from pathlib import Path

import specdec

ROOT = Path(specdec.__file__).parent
sys.path.insert(0, str(ROOT.parent / "scripts"))
from package_map import (  # noqa: E402 - the script's own folder, added just above
    BEGIN,
    DESIGN,
    END,
    cycles,
    import_graph,
    imported,
    module_names,
    package_map,
    room_graph,
    section,
)

TOOLS = ("specdec.bench", "specdec.training")
# The command line's room: it dispatches to every command, tools included.
COMMANDS = ("specdec.commands", "specdec.__main__")
PRECISIONS = ("specdec.models.precisions", "specdec.models.fused_layer", "specdec.models.int4",
              "specdec.models.w8a32", "specdec.models.quantize", "specdec.models.int8_kernels")


def within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def production_modules(modules: dict[str, Path]) -> list[str]:
    """Every module but the tools and the commands that run them."""
    return sorted(name for name in modules if not within(name, TOOLS + COMMANDS))


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_package_has_no_import_cycles():
    assert cycles(import_graph()) == []


def test_no_room_imports_a_room_that_imports_it_back():
    """Rooms (specdec.core, .drafting, .models, .serving, .commands, ...) form no loop: the
    package-level loop bench -> corpus_index -> training -> bench, and core <-> drafting, are gone.
    Mutation, checked: the engine importing specdec.drafting again fails it."""
    rooms = room_graph(import_graph())
    assert {"specdec.core", "specdec.commands", "specdec.drafting"} <= set(rooms)
    assert cycles(rooms) == []
    assert [room for room, dependencies in rooms.items() if "specdec.commands" in dependencies] == ["specdec.__main__"]


def test_the_design_doc_shows_the_current_package_map():
    """docs/design.md's map is the one scripts/package_map.py --write gives for this code."""
    text = DESIGN.read_text()
    assert BEGIN in text and END in text
    assert section(text) == package_map(), "run: python scripts/package_map.py --write"


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
    assert {"specdec.core.estimates", "specdec.grammar", "specdec.constraint", "specdec.explain.view",
            "specdec.core.acceptance", "specdec.core.request", "specdec.models.fused_layer"} <= set(production)
    assert not any(within(name, TOOLS + COMMANDS) for name in production)


def test_the_checks_see_a_cycle_a_type_only_import_and_a_layer_breach(tmp_path):
    """The checks themselves can fail: a graph with a cycle, an import under TYPE_CHECKING (it
    counts), one deep in a function, and a production module that imports the bench."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) != []
    rooms = room_graph({"specdec.core": set(), "specdec.drafting": set(), "specdec.core.a": {"specdec.drafting.b"},
                        "specdec.drafting.b": {"specdec.core.c"}, "specdec.core.c": set()})
    assert cycles(rooms) != []  # a loop of rooms made of modules without a cycle
    assert cycles({"a": {"b"}, "b": set()}) == []
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import specdec.bench\n"
                      "def f():\n    if True:\n        from specdec.training import trainer\n")
    modules = {"specdec.bench": Path(), "specdec.training": Path(), "specdec.training.trainer": Path()}
    assert imported(source, modules) == {"specdec.bench", "specdec.training", "specdec.training.trainer"}
    assert reachable({"a": {"b"}, "b": {"c"}, "c": set()}, "a") == {"b", "c"}
    assert not within("specdec.benchmarks", TOOLS) and within("specdec.bench.suite", TOOLS)
