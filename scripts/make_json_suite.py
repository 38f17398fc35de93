"""Builds specdec/assets/bench_json.json: a JSON-extraction bench suite for structured output.
Each prompt is a function from the standard library and a request to describe it as JSON; each
carries the JSON schema its answer must match (4 schemas of 6, 9, 13 and 18 fields, 4 functions
each). Deterministic (the functions come from this Python's standard library); none is in the
editing suite.

    python scripts/make_json_suite.py [--out specdec/assets/bench_json.json]

Run it with `specdec bench --prompts specdec/assets/bench_json.json --chat ...` (docs/structured.md).
"""

import argparse
import ast
import importlib
import inspect
import json
import textwrap
from pathlib import Path

FUNCTIONS = ("textwrap.indent", "shlex.quote", "string.capwords", "glob.escape", "posixpath.splitext",
             "ntpath.splitdrive", "csv.Sniffer.has_header", "calendar.weekday", "colorsys.hls_to_rgb",
             "heapq.nsmallest", "bisect.insort_right", "base64.b32decode", "email.utils.parseaddr",
             "urllib.parse.urldefrag", "json.encoder.py_encode_basestring", "pprint.pformat")

STRING = {"type": "string", "maxLength": 60}
NAMES = {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 8}


def obj(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


SCHEMAS = {
    "card": obj({"name": STRING, "module": STRING, "parameters": NAMES, "returns_value": {"type": "boolean"},
                 "raises_exceptions": {"type": "boolean"}, "summary": {"type": "string", "maxLength": 120}}),
    "signature": obj({"name": STRING, "parameter_count": {"type": "integer", "minimum": 0, "maximum": 20},
                      "parameters": {"type": "array", "maxItems": 8, "items": obj(
                          {"name": {"type": "string", "maxLength": 30}, "has_default": {"type": "boolean"}})},
                      "has_varargs": {"type": "boolean"}, "has_kwargs": {"type": "boolean"},
                      "keyword_only_count": {"type": "integer", "minimum": 0, "maximum": 20},
                      "has_docstring": {"type": "boolean"}, "returns": STRING, "is_pure": {"type": "boolean"}}),
    "review": obj({"name": STRING, "purpose": {"type": "string", "maxLength": 100},
                   "complexity": {"enum": ["low", "medium", "high"]},
                   "line_count": {"type": "integer", "minimum": 1, "maximum": 200},
                   "uses_loops": {"type": "boolean"}, "uses_recursion": {"type": "boolean"}, "calls": NAMES,
                   "side_effects": {"type": "boolean"}, "thread_safe": {"enum": ["yes", "no", "unknown"]},
                   "test_names": {"type": "array", "items": STRING, "maxItems": 3},
                   "risk": {"enum": ["low", "medium", "high"]}, "edge_cases": NAMES,
                   "notes": {"type": "string", "maxLength": 80}}),
    "ticket": obj({"title": {"type": "string", "maxLength": 80}, "function": STRING, "module": STRING,
                   "severity": {"enum": ["trivial", "minor", "major", "critical"]},
                   "category": {"enum": ["bug", "docs", "performance", "refactor", "test"]},
                   "line_count": {"type": "integer", "minimum": 1, "maximum": 200},
                   "has_docstring": {"type": "boolean"}, "parameter_names": NAMES, "returns": STRING,
                   "raises": NAMES, "deprecated": {"type": "boolean"},
                   "tags": {"type": "array", "items": {"enum": ["io", "text", "math", "parsing", "encoding",
                                                                 "paths", "dates", "collections"]},
                            "maxItems": 3},
                   "estimate_hours": {"type": "integer", "minimum": 0, "maximum": 40}, "owner": STRING,
                   "status": {"enum": ["open", "triaged", "in_progress"]}, "reviewed": {"type": "boolean"},
                   "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                   "summary": {"type": "string", "maxLength": 120}}),
}


def source_of(qualified: str) -> str:
    """A function's source, found by walking the module's syntax tree (classes too)."""
    module_name, _, path = qualified.rpartition(".")
    try:
        module = importlib.import_module(module_name)
        parts = [path]
    except ImportError:  # a method: module.Class.method
        module_name, _, owner = module_name.rpartition(".")
        module, parts = importlib.import_module(module_name), [owner, path]
    text = inspect.getsource(module)
    nodes = ast.parse(text).body
    for part in parts:
        node = next(n for n in nodes if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
        nodes = node.body
    return textwrap.dedent(ast.get_source_segment(text, node))


def suite() -> list[dict]:
    prompts = []
    for index, qualified in enumerate(FUNCTIONS):
        kind = list(SCHEMAS)[index % len(SCHEMAS)]
        schema = SCHEMAS[kind]
        fields = ", ".join(schema["properties"])
        prompts.append({
            "category": "json", "id": f"json-{index + 1:02d}-{kind}", "source": qualified, "json_schema": schema,
            "prompt": f"Describe this function from Python's `{qualified.rpartition('.')[0]}` module as a JSON "
                      f"object with the fields {fields}.\n\n```python\n{source_of(qualified)}\n```",
        })
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="specdec/assets/bench_json.json")
    args = parser.parse_args()
    prompts = suite()
    Path(args.out).write_text(json.dumps(prompts, indent=1) + "\n")
    print(f"{len(prompts)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
