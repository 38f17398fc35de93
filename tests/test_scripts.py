"""Scripts that cannot rot (issue 80): every import of every script under benchmarks/ and scripts/
resolves. Each file is parsed, not run: ``import X`` and ``from X import a, b`` (at any depth: in
functions too) are imported with importlib and each name is checked to be an attribute of X or a
submodule of it. A module of the script's own folder (``from long_context import library``: a
script's folder comes first on its path) is read with ast instead of run, and must define the
names. A third-party module that does not import here must be in OPTIONAL, with the reason."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(path for folder in ("benchmarks", "scripts") for path in (ROOT / folder).rglob("*.py"))
FIRST_PARTY = "specdec"

# Third-party modules a script may import that need not be installed where the tests run
# (pyproject.toml's extras beyond [test], present on benchmark machines only). Their names are
# still checked wherever they do import.
OPTIONAL = {
    "llama_cpp": "the [llama-cpp] extra: llama-cpp-python is built from source on benchmark machines only",
    "ray": "the [ray] extra: ray[serve], for the Ray Serve replicas",
}


def local_module(script: Path, module: str | None, level: int) -> Path | None:
    """The file a script's own-folder import names (``from sibling import x``, or a relative
    import), or None when the import is not of the script's folder."""
    folder = script.parent
    for _ in range(max(0, level - 1)):
        folder = folder.parent
    if level == 0 and module is None:
        return None
    parts = module.split(".") if module else []
    base = folder.joinpath(*parts)
    for candidate in (base.with_suffix(".py") if parts else None, base / "__init__.py"):
        if candidate is not None and candidate.is_file():
            return candidate
    if level > 0:  # a relative import of a file that is not there: report it as missing
        return base.with_suffix(".py")
    return None


def defined_names(path: Path) -> set[str]:
    """What a module file defines at its top level (including under top-level if / try blocks),
    and for a package its submodules, read with ast (a script is not run)."""
    names: set[str] = set()
    if path.name == "__init__.py":
        names |= {child.stem for child in path.parent.iterdir() if child.suffix == ".py" or
                  (child / "__init__.py").is_file()}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for block in ("body", "orelse", "finalbody"):
                    visit(getattr(node, block, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(path.read_text(), filename=str(path)).body)
    return names


def guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether an import sits in a ``try`` whose handlers catch ImportError (the script copes)."""
    while node in parents:
        child, node = node, parents[node]
        if isinstance(node, ast.Try) and child in node.body:
            for handler in node.handlers:
                caught = handler.type
                kinds = caught.elts if isinstance(caught, ast.Tuple) else [caught]
                if caught is None or any(isinstance(kind, ast.Name) and kind.id in (
                        "ImportError", "ModuleNotFoundError", "Exception") for kind in kinds):
                    return True
    return False


def has_name(module: object, name: str) -> bool:
    """Whether ``module`` has the attribute ``name`` (a lazy one too) or a submodule of that name."""
    try:
        if hasattr(module, name):
            return True
    except ImportError:  # a lazy attribute (a package's __getattr__) whose module fails to import
        return False
    try:
        importlib.import_module(f"{getattr(module, '__name__', '')}.{name}")
    except ImportError:
        return False
    return True


def stale_imports(script: Path) -> list[str]:
    """Every import of ``script`` that does not resolve, as "file:line: what: why" (none: [])."""
    tree = ast.parse(script.read_text(), filename=str(script))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    try:
        shown = script.relative_to(ROOT)
    except ValueError:
        shown = script
    problems: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            wanted = [(alias.name, None) for alias in node.names]
            level = 0
        elif isinstance(node, ast.ImportFrom):
            wanted = [(node.module, [alias.name for alias in node.names])]
            level = node.level
        else:
            continue
        statement = ast.unparse(node)
        for module, names in wanted:
            where = f"{shown}:{node.lineno}: `{statement}`"
            local = local_module(script, module, level)
            if local is not None:
                if not local.is_file():
                    problems.append(f"{where}: no file {local}")
                    continue
                if names is None:
                    continue
                defined = defined_names(local)
                problems += [f"{where}: {local.name} defines no {name}" for name in names
                             if name != "*" and name not in defined]
                continue
            assert module is not None  # a relative import is local
            top = module.split(".")[0]
            try:
                imported = importlib.import_module(module)
            except ImportError as error:
                if top != FIRST_PARTY and (top in OPTIONAL or guarded(node, parents)):
                    continue
                problems.append(f"{where}: {module} does not import ({type(error).__name__}: {error})")
                continue
            for name in names or []:
                if name != "*" and not has_name(imported, name):
                    problems.append(f"{where}: {module} has no {name}")
    return problems


@pytest.mark.parametrize("script", SCRIPTS, ids=[str(path.relative_to(ROOT)) for path in SCRIPTS])
def test_every_import_of_a_script_resolves(script: Path) -> None:
    problems = stale_imports(script)
    assert not problems, "stale imports:\n" + "\n".join(problems)


def test_the_scripts_are_found() -> None:
    found = {str(path.relative_to(ROOT)) for path in SCRIPTS}
    assert {"benchmarks/report.py", "benchmarks/cpu/step_costs.py", "scripts/package_map.py"} <= found


@pytest.mark.parametrize(("planted", "expected"), [
    ("from specdec.models.int4 import no_such_function\n", "specdec.models.int4 has no no_such_function"),
    ("import specdec.no_such_module\n", "specdec.no_such_module does not import"),
    ("def main():\n    from specdec.core.verify import greedy_walk, gone\n", "specdec.core.verify has no gone"),
    ("import no_such_package_for_specdec\n", "no_such_package_for_specdec does not import"),
    ("from sibling import missing\n", "sibling.py defines no missing"),
    ("from .nowhere import thing\n", "no file"),
])
def test_the_checker_reports_a_stale_import(tmp_path: Path, planted: str, expected: str) -> None:
    (tmp_path / "sibling.py").write_text("def present():\n    pass\n")
    script = tmp_path / "stale.py"
    script.write_text("from __future__ import annotations\n\nimport json\n\nfrom sibling import present\n" + planted)
    problems = stale_imports(script)
    assert len(problems) == 1 and expected in problems[0], problems
    assert problems[0].startswith(f"{script}:")


def test_the_checker_accepts_optional_and_guarded_imports(tmp_path: Path) -> None:
    script = tmp_path / "optional.py"
    script.write_text("try:\n    import no_such_package_for_specdec\nexcept ImportError:\n    pass\n"
                      "from specdec.models import int4\nimport specdec.core.verify as verify\n")
    assert stale_imports(script) == []
