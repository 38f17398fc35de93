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


class ConstraintError(ValueError):
    """A schema, regex or grammar the grammar engine refuses (the server answers 400)."""


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
        return Constraint("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

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
        return {"json_schema": "JSON matching a schema", "json_object": "a JSON object",
                "regex": f"text matching /{self.source}/", "grammar": "text in a grammar"}[self.kind]

    def check(self) -> Constraint:
        """ConstraintError naming the problem if the grammar engine refuses it (no tokenizer needed)."""
        import llguidance

        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(self.llguidance_grammar())
        if failed:
            raise ConstraintError(f"{self.describe()}: {' '.join(messages[0].split()) if messages else 'refused'}")
        return self

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's serialised form."""
        import llguidance

        if self.kind in ("json_schema", "json_object"):
            try:
                schema = json.loads(self.source) if self.kind == "json_schema" else {"type": "object"}
            except json.JSONDecodeError as error:
                raise ConstraintError(f"the JSON schema is not valid JSON: {error}") from None
            if not isinstance(schema, dict):
                raise ConstraintError(f"a JSON schema must be an object, got {type(schema).__name__}")
            if not isinstance(schema.get("x-guidance", {}), dict):
                raise ConstraintError("a JSON schema's x-guidance must be an object (llguidance's settings)")
            schema = {**schema, "x-guidance": {**JSON_LAYOUT, **schema.get("x-guidance", {})}}
            return llguidance.grammar_from("json_schema", json.dumps(schema))
        if self.kind == "regex":
            return llguidance.grammar_from("regex", self.source)
        return llguidance.grammar_from("grammar", self.source)


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
