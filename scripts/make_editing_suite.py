"""Builds specdec/assets/bench_editing.json: a bench suite where the answer mostly copies the
prompt, as in "apply this change and return the whole function". Each prompt is a function from
the standard library, an instruction to rename one of its local variables, and the start of the
rewritten function. Deterministic (the functions come from this Python's standard library).

    python scripts/make_editing_suite.py [--count 16] [--out specdec/assets/bench_editing.json]
"""

import argparse
import ast
import importlib
import inspect
import json
import re
import textwrap
from pathlib import Path

MODULES = ("textwrap", "shlex", "string", "difflib", "fnmatch", "glob", "ntpath", "posixpath", "csv", "calendar",
           "colorsys", "heapq", "bisect", "base64", "quopri", "uu", "gettext", "locale", "tokenize", "ftplib",
           "email.utils", "urllib.parse", "http.cookies", "json.encoder", "pprint", "dis", "inspect", "argparse")


def local_names(function: ast.FunctionDef) -> list[str]:
    """Local variables assigned in the function, used at least three times, longest first."""
    assigned = {target.id for node in ast.walk(function) if isinstance(node, ast.Assign)
                for target in node.targets if isinstance(target, ast.Name)}
    uses = [node.id for node in ast.walk(function) if isinstance(node, ast.Name)]
    return sorted((name for name in assigned if len(name) >= 3 and uses.count(name) >= 3), key=lambda n: (-len(n), n))


def rename(source: str, old: str, new: str) -> str:
    """The source with the word ``old`` replaced by ``new``."""
    return re.sub(rf"\b{re.escape(old)}\b", new, source)


def functions(count: int) -> list[dict]:
    prompts = []
    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
            tree = ast.parse(inspect.getsource(module))
        except (ImportError, OSError, TypeError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or not 8 <= node.end_lineno - node.lineno <= 30:
                continue
            names = local_names(node)
            if not names:
                continue
            source = textwrap.dedent(ast.get_source_segment(inspect.getsource(module), node))
            old, new = names[0], names[0] + "_value"
            prompt = (f"# Original:\n{source}\n\n# The same function, with the variable `{old}` renamed to "
                      f"`{new}`:\n{rename(source, old, new).splitlines()[0]}\n")
            prompts.append({"category": "editing", "id": f"editing-{len(prompts) + 1:02d}",
                            "source": f"{module_name}.{node.name}", "prompt": prompt})
            break  # one function per module: variety
        if len(prompts) == count:
            break
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=16)
    parser.add_argument("--out", default=str(Path(__file__).parent.parent / "specdec/assets/bench_editing.json"))
    args = parser.parse_args()
    prompts = functions(args.count)
    if len(prompts) < args.count:
        raise SystemExit(f"found {len(prompts)} functions, fewer than {args.count}")
    Path(args.out).write_text(json.dumps(prompts, indent=1) + "\n")
    print(f"{len(prompts)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
