"""The schema set of `tokenmill bench structured` and the scorer of its outputs.

The set (structured_schemas.json, next to this file) holds JSON schemas of different shapes,
each with a prompt. Every schema stays within what both xgrammar and llama.cpp's
json-schema-to-grammar enforce, and every output it allows is bounded, so an output that did not
run out of tokens must parse and validate: a failure is the grammar engine's, not the model's.
No torch here: the unit tests and the HTTP side import this module alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:  # the regex parser, for a pattern's widest match (renamed in Python 3.11)
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse  # type: ignore[no-redef]

SCHEMAS_PATH = Path(__file__).with_name("structured_schemas.json")

# Bytes of the `format`s in the set, quotes included: "YYYY-MM-DD" and a canonical UUID.
_FORMAT_CHARS = {"date": 12, "uuid": 38}


@dataclass(frozen=True)
class SchemaCase:
    """One entry of the set: a name, the shapes it exercises, the prompt and the schema."""

    name: str
    shapes: tuple[str, ...]
    prompt: str
    schema: dict[str, Any]


@dataclass(frozen=True)
class Verdict:
    """How one output fared: did it parse as JSON, did it validate, and the first error."""

    parsed: bool
    valid: bool
    error: str | None = None


def load_schema_set(path: str | Path = SCHEMAS_PATH) -> list[SchemaCase]:
    """The cases of a schema-set file (a JSON object with a ``schemas`` list)."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    cases = [SchemaCase(c["name"], tuple(c.get("shapes", ())), c["prompt"], c["schema"])
             for c in doc["schemas"]]
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: schema names must be unique")
    return cases


def score_output(text: str, schema: dict[str, Any]) -> Verdict:
    """Parse ``text`` with ``json.loads`` and validate it against ``schema`` with `jsonschema`,
    checking the ``format``s it knows (date, uuid, ...) as well."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError as e:
        return Verdict(parsed=False, valid=False, error=f"not JSON: {e}")
    cls = jsonschema.validators.validator_for(schema)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        return Verdict(parsed=True, valid=False, error=f"{where}: {error.message}")
    return Verdict(parsed=True, valid=True)


def max_output_chars(schema: dict[str, Any], root: dict[str, Any] | None = None) -> int:
    """The longest compact JSON text (``", "`` and ``": "`` separators, as xgrammar writes it
    without free whitespace) that ``schema`` allows; ValueError where it allows no bound.

    A token holds at least one character of ASCII text, so this bounds the tokens an output of
    ASCII characters needs.
    Objects are closed: both grammar engines allow no property beyond ``properties`` unless
    ``additionalProperties`` says so, and the set never does.
    """
    root = schema if root is None else root
    if "$ref" in schema:
        return max_output_chars(_resolve(schema["$ref"], root), root)
    if "anyOf" in schema:
        return max(max_output_chars(s, root) for s in schema["anyOf"])
    if "const" in schema:
        return len(json.dumps(schema["const"]))
    if "enum" in schema:
        return max(len(json.dumps(v)) for v in schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return max(max_output_chars({**schema, "type": k}, root) for k in kind)
    bound = _BOUNDS.get(kind)
    if bound is None:
        raise ValueError(f"no length bound for a schema of type {kind!r}: {schema}")
    return bound(schema, root)


def _resolve(ref: str, root: dict[str, Any]) -> dict[str, Any]:
    if not ref.startswith("#/"):
        raise ValueError(f"only local $refs are bounded, got {ref}")
    node: Any = root
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def _object_chars(schema: dict[str, Any], root: dict[str, Any]) -> int:
    if schema.get("additionalProperties") not in (None, False):
        raise ValueError("objects with additionalProperties are unbounded")
    props = schema.get("properties", {})
    fields = [len(json.dumps(k)) + 2 + max_output_chars(v, root) for k, v in props.items()]
    return 2 + sum(fields) + 2 * max(len(fields) - 1, 0)


def _array_chars(schema: dict[str, Any], root: dict[str, Any]) -> int:
    if "maxItems" not in schema:
        raise ValueError(f"arrays need maxItems to be bounded: {schema}")
    n = schema["maxItems"]
    prefix = schema.get("prefixItems", [])
    items = [max_output_chars(s, root) for s in prefix[:n]]
    if n > len(prefix):
        items += [max_output_chars(schema["items"], root)] * (n - len(prefix))
    return 2 + sum(items) + 2 * max(n - 1, 0)


def _string_chars(schema: dict[str, Any], root: dict[str, Any]) -> int:
    if "format" in schema:
        if schema["format"] not in _FORMAT_CHARS:
            raise ValueError(f"format {schema['format']!r} is not in the bounded set")
        return _FORMAT_CHARS[schema["format"]]
    if "pattern" in schema:
        # The regex's widest match; sre reports an unbounded repeat as a huge width.
        width = sre_parse.parse(schema["pattern"]).getwidth()[1]
        if width > 10_000:
            raise ValueError(f"pattern {schema['pattern']!r} has no length bound")
        return width + 2
    if "maxLength" not in schema:
        raise ValueError(f"strings need maxLength, a pattern or a format: {schema}")
    return schema["maxLength"] + 2


def _integer_chars(schema: dict[str, Any], root: dict[str, Any]) -> int:
    if "minimum" not in schema or "maximum" not in schema:
        raise ValueError(f"integers need minimum and maximum to be bounded: {schema}")
    return max(len(str(schema["minimum"])), len(str(schema["maximum"])))


_BOUNDS = {
    "object": _object_chars, "array": _array_chars, "string": _string_chars,
    "integer": _integer_chars, "boolean": lambda s, r: 5, "null": lambda s, r: 4,
}


# What llama.cpp's json-schema-to-grammar enforces (common/json-schema.cpp in its tree): other
# formats, bounds on "number", and patterns it cannot translate are accepted and then silently
# not enforced, so a schema using them would measure the model, not the grammar.
LLAMA_CPP_FORMATS = frozenset({"date", "time", "date-time", "uuid"})
_PATTERN_ESCAPES_OK = frozenset("^$.[]()|{}*+?-\\\"tnr")


def llama_cpp_gaps(schema: Any, path: str = "#") -> list[str]:
    """Where ``schema`` asks for something llama.cpp's converter would not enforce."""
    gaps: list[str] = []
    if isinstance(schema, list):
        for i, s in enumerate(schema):
            gaps += llama_cpp_gaps(s, f"{path}/{i}")
        return gaps
    if not isinstance(schema, dict):
        return gaps
    if "format" in schema and schema["format"] not in LLAMA_CPP_FORMATS:
        gaps.append(f"{path}: format {schema['format']!r}")
    if schema.get("type") == "number" and {"minimum", "maximum", "exclusiveMinimum",
                                           "exclusiveMaximum"} & set(schema):
        gaps.append(f"{path}: bounds on a number (llama.cpp bounds integers only)")
    if "pattern" in schema:
        gaps += [f"{path}: pattern {schema['pattern']!r}: {g}"
                 for g in _pattern_gaps(schema["pattern"])]
    if "items" in schema and "prefixItems" in schema:
        gaps.append(f"{path}: items beside prefixItems (llama.cpp reads items only)")
    for key in ("uniqueItems", "multipleOf", "minProperties", "maxProperties", "not",
                "if", "contains", "patternProperties", "propertyNames", "dependentRequired"):
        if key in schema:
            gaps.append(f"{path}: {key}")
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions"):
            for name, sub in value.items():
                gaps += llama_cpp_gaps(sub, f"{path}/{key}/{name}")
        elif key in ("items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties"):
            gaps += llama_cpp_gaps(value, f"{path}/{key}")
    return gaps


def _pattern_gaps(pattern: str) -> list[str]:
    gaps = []
    if not (pattern.startswith("^") and pattern.endswith("$")):
        gaps.append("not anchored with ^ and $")
    i = 0
    while i < len(pattern) - 1:
        if pattern[i] == "\\":
            if pattern[i + 1] not in _PATTERN_ESCAPES_OK:
                gaps.append(f"escape \\{pattern[i + 1]} (write a class such as [0-9])")
            i += 2
        else:
            i += 1
    if "(?" in pattern:
        gaps.append("group syntax (?...)")
    return gaps
