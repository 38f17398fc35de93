"""The map of the specdec package: its rooms (each subpackage, and each module at the top level),
the modules in each and the rooms each imports, counting every import (inside functions too: a lazy
import is still a dependency; and under `if TYPE_CHECKING:`: an annotation that names another
module's type ties the two modules as surely). tests/test_layers.py holds the package to zero
cycles, between modules and between rooms, and docs/design.md to this map.

    python scripts/package_map.py            # print the map (markdown)
    python scripts/package_map.py --write    # write it into docs/design.md, between its markers
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent
PACKAGE = REPOSITORY / "specdec"
DESIGN = REPOSITORY / "docs" / "design.md"
BEGIN = "<!-- package map: written by scripts/package_map.py --write; do not edit by hand -->"
END = "<!-- end of the package map -->"


def module_names(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__)."""
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules a file imports anywhere: at the top, in functions, under TYPE_CHECKING."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in modules}


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    modules = module_names(root)
    return {name: imported(path, modules) - {name} for name, path in modules.items()}


def room_of(module: str, packages: set[str]) -> str:
    """A module's room: the subpackage it is in (specdec.core), or itself at the top level."""
    parts = module.split(".")
    room = ".".join(parts[:2])
    return room if room in packages else module


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The rooms each room imports (the package's own __init__ is a room of its own)."""
    packages = {name for name in graph if name.count(".") == 1 and (PACKAGE / name.split(".")[1]).is_dir()}
    rooms: dict[str, set[str]] = {}
    for module, dependencies in graph.items():
        room = room_of(module, packages)
        rooms.setdefault(room, set()).update(room_of(d, packages) for d in dependencies)
        rooms[room].discard(room)
    return rooms


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk meets (empty: none)."""
    found, state = [], {}  # state: 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def package_map(graph: dict[str, set[str]] | None = None) -> str:
    """The map as a markdown table: each room, its modules, the rooms it imports."""
    graph = graph if graph is not None else import_graph()
    rooms = room_graph(graph)
    lines = ["| room | its modules | imports |", "|---|---|---|"]
    for room in sorted(rooms):
        members = sorted(name.removeprefix(room + ".") for name in graph
                         if name.startswith(room + ".") and room_of(name, set(rooms)) == room)
        short = [name.removeprefix("specdec.") for name in sorted(rooms[room])]
        what = "__init__: the public names, loaded on first use" if room == "specdec" else "(one module)"
        lines.append(f"| `{room.removeprefix('specdec.')}` | {', '.join(members) or what} | "
                     f"{', '.join(short) or '(nothing of specdec)'} |")
    return "\n".join(lines)


def section(text: str) -> str:
    """The map's section of a design document (between the markers)."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="write the map into docs/design.md")
    args = parser.parse_args()
    text = package_map()
    if not args.write:
        print(text)
        return 0
    design = DESIGN.read_text()
    start, end = design.index(BEGIN) + len(BEGIN), design.index(END)
    DESIGN.write_text(f"{design[:start]}\n{text}\n{design[end:]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
