"""`specdec bench --suite predicted-edits`: edits of whole files, each with the file as the
request's prediction (OpenAI's predicted outputs), as an editor's "apply this edit" sends them.

The files are modules of packages specdec itself installs (so every machine that runs it has
them), 60 to 400 lines each, from several domains (HTTP, terminal rendering, web routing and
configuration, async, metrics, file systems, packaging, syntax highlighting, markdown, YAML,
command lines); not the Python standard library (the default retrieval datastore indexes it) and
not the bundled suites'. Each gets an instruction of the usual kinds, made from its own syntax
tree so that it names what is there: rename a symbol used several times, add type hints, add a
parameter and pass it at the calls, convert a class to a dataclass, fix an off-by-one (one
comparison of the file flipped first: the prediction is the file with the bug, as the client has
it), add docstrings, delete a function, move a method. The kinds go round the files; a file takes
the first kind from its turn on that fits it. Categories are the kinds; ids name the module.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections import Counter
from collections.abc import Callable

from specdec.bench.runner import Prompt
from specdec.suite_sources import EDIT_SOURCES as SOURCES

KINDS = ("rename", "type-hints", "add-parameter", "dataclass", "off-by-one", "docstrings", "delete", "reorder")
ANSWER = "Answer with the whole file, changed, in one ```python code block, and nothing else."


def predicted_edits_suite() -> list[Prompt]:
    """One prompt a module (SOURCES), its prediction the file as the client has it."""
    prompts = []
    for turn, name in enumerate(SOURCES):
        try:
            source = inspect.getsource(importlib.import_module(name))
        except (ImportError, OSError, TypeError):
            continue
        kind, instruction, file = edit_for(source, turn)
        path = f"{name.replace('.', '/')}.py"
        text = f"Here is the Python file `{path}`:\n\n```python\n{file}```\n\n{instruction} {ANSWER}"
        prompts.append(Prompt(kind, text, name, prediction=file))
    return prompts


def edit_for(source: str, turn: int) -> tuple[str, str, str]:
    """(kind, instruction, the file as sent) of the first kind from ``turn`` on that fits."""
    tree = ast.parse(source)
    for offset in range(len(KINDS)):
        kind = KINDS[(turn + offset) % len(KINDS)]
        made = MAKERS[kind](source, tree)
        if made is not None:
            return kind, *made
    raise ValueError("no edit fits this file")


def functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]


def rename(source: str, tree: ast.Module) -> tuple[str, str] | None:
    defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.ClassDef)
               and not node.name.startswith("__") and len(node.name) >= 4}
    uses = Counter(node.id if isinstance(node, ast.Name) else node.attr for node in ast.walk(tree)
                   if isinstance(node, ast.Name | ast.Attribute))
    counts = {name: uses[name] for name in defined if uses[name] >= 2}
    if not counts:
        return None
    name = max(sorted(counts), key=lambda candidate: counts[candidate])
    return (f"Rename `{name}` to `{name}_renamed` everywhere in the file: its definition and every use.",
            source)


def type_hints(source: str, tree: ast.Module) -> tuple[str, str] | None:
    bare = [node for node in functions(tree) if node.returns is None or any(
        argument.annotation is None and argument.arg not in ("self", "cls") for argument in node.args.args)]
    if len(bare) < 2:
        return None
    return "Add type hints to every function and method of this file that has none: parameters and return type.", source


def add_parameter(source: str, tree: ast.Module) -> tuple[str, str] | None:
    called = Counter(node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                     for node in ast.walk(tree) if isinstance(node, ast.Call)
                     and isinstance(node.func, ast.Name | ast.Attribute))
    candidates = sorted(node.name for node in functions(tree) if called[node.name] and not node.name.startswith("__"))
    if not candidates:
        return None
    name = max(candidates, key=lambda candidate: called[candidate])
    return (f"Add a keyword parameter `strict: bool = False` to `{name}`, and pass `strict=True` at each call of "
            f"`{name}` in this file.", source)


def dataclass(source: str, tree: ast.Module) -> tuple[str, str] | None:
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        init = next((item for item in node.body if isinstance(item, ast.FunctionDef) and item.name == "__init__"),
                    None)
        if init is None or len(init.args.args) < 3:
            continue
        assigned = [statement for statement in init.body if isinstance(statement, ast.Assign | ast.AnnAssign)]
        if len(assigned) >= 2:
            return f"Convert the class `{node.name}` to a dataclass, keeping what it does.", source
    return None


def off_by_one(source: str, tree: ast.Module) -> tuple[str, str] | None:
    lines = source.splitlines(keepends=True)
    for function in functions(tree):
        for node in ast.walk(function):
            if not (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Lt | ast.LtE)):
                continue
            line = lines[node.lineno - 1]
            flipped = re.sub(r"<=", "<", line, count=1) if isinstance(node.ops[0], ast.LtE) else \
                re.sub(r"<(?![<=])", "<=", line, count=1)
            if flipped == line:
                continue
            file = "".join(lines[: node.lineno - 1] + [flipped] + lines[node.lineno :])
            return (f"`{function.name}` has an off-by-one error in a comparison (line {node.lineno}); fix it.", file)
    return None


def docstrings(source: str, tree: ast.Module) -> tuple[str, str] | None:
    bare = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and ast.get_docstring(node) is None]
    if len(bare) < 2:
        return None
    return "Add a one-line docstring to every function, method and class of this file that has none.", source


def delete(source: str, tree: ast.Module) -> tuple[str, str] | None:
    candidates = [node for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                  and (node.end_lineno or node.lineno) - node.lineno >= 4]
    if not candidates:
        return None
    return f"Delete the function `{candidates[-1].name}` and nothing else.", source


def reorder(source: str, tree: ast.Module) -> tuple[str, str] | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            methods = [item for item in node.body if isinstance(item, ast.FunctionDef)]
            if len(methods) >= 3:
                return (f"Move the method `{methods[-1].name}` of `{node.name}` so that it is the class's first "
                        "method; change nothing else.", source)
    return None


MAKERS: dict[str, Callable[[str, ast.Module], tuple[str, str] | None]] = {
    "rename": rename, "type-hints": type_hints, "add-parameter": add_parameter, "dataclass": dataclass,
    "off-by-one": off_by_one, "docstrings": docstrings, "delete": delete, "reorder": reorder,
}
