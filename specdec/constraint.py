"""What a constrained request's output must match: a JSON schema, a regular expression or a grammar.

The constraint is only a description (no torch, so a command line checks it before any model
loads); specdec.grammar turns it into token masks with llguidance, and docs/structured.md says
what the constrained law is and why speculation keeps it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar")

# JSON written as Python's json.dumps writes it: one space after ":" and ",", no other whitespace.
# Free whitespace lets a model pad forever, and fixed separators leave more tokens forced.
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


# The deepest JSON schema taken: llguidance reads schemas with serde_json, whose recursion limit
# (128) refuses deeper ones anyway, and a schema nested thousands deep would overflow Python's own
# stack (json.dumps) before the engine could say so.
MAX_SCHEMA_DEPTH = 128


class ConstraintError(ValueError):
    """A schema, regex or grammar the grammar engine refuses (the server answers 400)."""


def engine_message(text: str) -> str:
    """The grammar engine's error on one line, fit for a client: its words (a regex error spans
    lines: the pattern, a caret, the reason), cut where the parser's state or a backtrace begins,
    and never a panic's text, which names the engine's insides."""
    for marker in ("<state>", "<non-verbose/>", "<backtrace>", "stack backtrace:"):
        text = text.split(marker)[0]
    words = " ".join(text.split())
    if not words or words.lower().startswith("panic"):
        return "the grammar engine failed on it (one of its internal limits); simplify it"
    return words if len(words) <= 300 else words[:300] + "..."


def json_depth(value: Any) -> int:
    """How deeply ``value`` nests lists and dicts (a scalar: 0), without recursion: the value may be
    deeper than Python's stack."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def check_depth(schema: Any) -> Any:
    """``schema`` if it nests at most MAX_SCHEMA_DEPTH deep, else a ConstraintError."""
    if json_depth(schema) > MAX_SCHEMA_DEPTH:
        raise ConstraintError(f"the JSON schema nests {json_depth(schema)} levels deep; at most {MAX_SCHEMA_DEPTH} "
                              "are taken")
    return schema


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match: ``kind`` (CONSTRAINT_KINDS) and its text (a JSON
    schema, a regex, a Lark or GBNF grammar; empty for json_object)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ConstraintError(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}")

    @staticmethod
    def json_schema(schema: dict | str) -> Constraint:
        return Constraint("json_schema", schema if isinstance(schema, str) else json.dumps(check_depth(schema)))

    @staticmethod
    def json_object() -> Constraint:
        return Constraint("json_object")

    @staticmethod
    def regex(pattern: str) -> Constraint:
        return Constraint("regex", pattern)

    @staticmethod
    def grammar(text: str) -> Constraint:
        """A Lark grammar, or a GBNF one (llama.cpp's; recognised by its ``::=``)."""
        return Constraint("grammar", text)

    def describe(self) -> str:
        """In words, on one line (a long or multi-line regex is shortened: error messages quote this)."""
        pattern = "".join(char if char.isprintable() else repr(char)[1:-1] for char in self.source[:60])
        pattern += "..." if len(self.source) > 60 else ""
        return {"json_schema": "JSON matching a schema", "json_object": "a JSON object",
                "regex": f"text matching /{pattern}/", "grammar": "text in a grammar"}[self.kind]

    def check(self) -> Constraint:
        """ConstraintError naming the problem if the grammar engine refuses it (no tokenizer needed)."""
        import llguidance

        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            self.llguidance_grammar(), limits=llguidance.LLParserLimits(verbose_errors=False))
        if failed:
            raise ConstraintError(f"{self.describe()}: {engine_message(messages[0] if messages else '')}")
        return self

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's serialised form."""
        import llguidance

        if self.kind in ("json_schema", "json_object"):
            try:
                schema = json.loads(self.source) if self.kind == "json_schema" else {"type": "object"}
            except json.JSONDecodeError as error:
                raise ConstraintError(f"the JSON schema is not valid JSON: {error}") from None
            except RecursionError:  # nested deeper than Python's stack
                raise ConstraintError(f"the JSON schema nests over {MAX_SCHEMA_DEPTH} levels deep") from None
            if not isinstance(schema, dict):
                raise ConstraintError(f"a JSON schema must be an object, got {type(schema).__name__}")
            if not isinstance(schema.get("x-guidance", {}), dict):
                raise ConstraintError("a JSON schema's x-guidance must be an object (llguidance's settings)")
            schema = {**check_depth(schema), "x-guidance": {**JSON_LAYOUT, **schema.get("x-guidance", {})}}
            return llguidance.grammar_from("json_schema", json.dumps(schema))
        try:  # a GBNF grammar is converted to Lark here, and its errors are the user's
            return llguidance.grammar_from("regex" if self.kind == "regex" else "grammar", self.source)
        except ValueError as error:
            raise ConstraintError(f"{self.describe()}: {engine_message(str(error))}") from None


def constraint_from_args(args: Any) -> Constraint | None:
    """The constraint a command line asks for (--json-schema FILE, --json-object, --regex R,
    --grammar FILE), files read and checked to be JSON where JSON is expected; None: free text."""
    if getattr(args, "json_schema", None):
        text = read_text(args.json_schema, "--json-schema")
        try:
            json.loads(text)
        except json.JSONDecodeError as error:
            raise ConstraintError(f"--json-schema {args.json_schema} is not valid JSON: {error}") from None
        return Constraint("json_schema", text).check()
    if getattr(args, "json_object", False):
        return Constraint.json_object()
    if getattr(args, "regex", None):
        return Constraint.regex(args.regex).check()
    if getattr(args, "grammar", None):
        return Constraint.grammar(read_text(args.grammar, "--grammar")).check()
    return None


def read_text(path: str, option: str) -> str:
    file = Path(path)
    if not file.is_file():
        raise ConstraintError(f"{option}: no such file: {path}")
    return file.read_text(encoding="utf-8")
