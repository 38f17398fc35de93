"""The longest functions of the package, by lines (a function's own lines, nested ones included):
where a god function hides.

    python scripts/longest_functions.py [PACKAGE_DIR] [--top N]
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def function_lengths(root: Path) -> list[tuple[int, str]]:
    """(lines, "path:line name") of every function and method under ``root``, longest first."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                found.append((lines, f"{path.relative_to(root.parent)}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parent.parent / "specdec"))
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    for lines, where in function_lengths(Path(args.root))[: args.top]:
        print(f"{lines:5d}  {where}")


if __name__ == "__main__":
    main()
