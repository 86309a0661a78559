"""The schema set of `tokenmill bench structured` stays usable (valid JSON schemas that xgrammar
compiles, within what llama.cpp enforces, bounded in length, covering the shapes the issue
names), and the bench's validity scorer and length bound judge outputs right."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tokenmill.bench.structured import DEFAULT_MAX_TOKENS, per_schema_table, validity_table
from tokenmill.bench.structured_set import (
    SchemaCase,
    llama_cpp_gaps,
    load_schema_set,
    max_output_chars,
    score_output,
)
from tokenmill.bench.structured_validity import CaseResult, chat_body, summarize
from tokenmill.cli import build_parser
from tokenmill.model_loader.gguf import embedded_model_path, load_gguf
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.compiler import GrammarCompiler

CASES = load_schema_set()


def _keywords(schema: Any) -> set[str]:
    """Every key used anywhere in a schema (property names included, which is harmless)."""
    if isinstance(schema, dict):
        return set(schema) | {k for v in schema.values() for k in _keywords(v)}
    if isinstance(schema, list):
        return {k for v in schema for k in _keywords(v)}
    return set()


def _types(schema: Any) -> set[str]:
    if isinstance(schema, dict):
        own = schema.get("type")
        found = set(own) if isinstance(own, list) else {own} if isinstance(own, str) else set()
        return found | {t for v in schema.values() for t in _types(v)}
    if isinstance(schema, list):
        return {t for v in schema for t in _types(v)}
    return set()


def test_the_set_has_at_least_twenty_named_cases_with_prompts():
    assert len(CASES) >= 20
    assert len({c.name for c in CASES}) == len(CASES)
    assert all(c.prompt.strip() and c.shapes for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_schema_is_a_valid_json_schema(case: SchemaCase):
    jsonschema.validators.validator_for(case.schema).check_schema(case.schema)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    """The engine's grammar compiler (xgrammar) on the embedded model's vocabulary."""
    tokenizer = load_gguf(embedded_model_path()).tokenizer
    return GrammarCompiler(tokenizer, tokenizer.vocab_size)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_schema_compiles_with_xgrammar(compiler: GrammarCompiler, case: SchemaCase):
    compiled = compiler.compile(StructuredOutputsParams(json=case.schema))
    assert compiled.memory_size_bytes > 0


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_schema_is_enforced_by_llama_cpp_and_bounded(case: SchemaCase):
    assert llama_cpp_gaps(case.schema) == []
    # Room to spare under max_tokens: llama.cpp's grammar allows some free whitespace.
    assert max_output_chars(case.schema) <= DEFAULT_MAX_TOKENS * 3 // 4


def test_the_set_covers_the_shapes_the_issue_names():
    used = _keywords([c.schema for c in CASES])
    for keyword in ("properties", "required", "enum", "const", "anyOf", "minItems", "maxItems",
                    "minimum", "maximum", "pattern", "format", "additionalProperties",
                    "prefixItems", "$ref", "minLength", "maxLength"):
        assert keyword in used, keyword
    assert {"object", "array", "string", "integer", "boolean", "null"} <= _types(
        [c.schema for c in CASES])
    # Nested objects, and objects with optional properties (required is a strict subset).
    assert any(len(c.schema.get("required", [])) < len(c.schema.get("properties", {}))
               for c in CASES)
    nested = [c for c in CASES if any(p.get("type") == "object"
                                      for p in c.schema.get("properties", {}).values())]
    assert nested


SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 1, "maximum": 5},
    "day": {"type": "string", "format": "date"},
    "id": {"type": "string", "format": "uuid"},
    "code": {"type": "string", "pattern": "^[A-Z]{2}$"}},
    "required": ["n"], "additionalProperties": False}


def test_scorer_accepts_a_valid_output():
    text = ('{"n": 3, "day": "2025-03-14", "id": "123e4567-e89b-12d3-a456-426614174000", '
            '"code": "AB"}')
    assert score_output(text, SCHEMA).valid


@pytest.mark.parametrize("text, error", [
    ('{"n": 3', "not JSON"),
    ("", "not JSON"),
    ('{"n": 9}', "n: 9 is greater than the maximum of 5"),
    ('{"day": "2025-03-14"}', "'n' is a required property"),
    ('{"n": 1, "extra": true}', "Additional properties"),
    ('{"n": 1, "code": "abc"}', "code: 'abc' does not match"),
    ('{"n": 1, "day": "2025-02-30"}', "day: '2025-02-30' is not a 'date'"),
    ('{"n": 1, "id": "not-a-uuid"}', "id: 'not-a-uuid' is not a 'uuid'"),
])
def test_scorer_rejects_invalid_outputs_and_says_why(text: str, error: str):
    verdict = score_output(text, SCHEMA)
    assert not verdict.valid
    assert verdict.parsed == (not error.startswith("not JSON"))
    assert error in verdict.error


def test_length_bound_adds_up_compact_json():
    schema = {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -50, "maximum": 7},
        "b": {"type": "array", "maxItems": 2, "items": {"enum": ["x", "yy"]}},
        "c": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}]}}}
    longest = {"a": -50, "b": ["yy", "yy"], "c": "zzz"}
    assert max_output_chars(schema) == len(json.dumps(longest))


@pytest.mark.parametrize("schema", [
    {"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "number"},
    {"type": "array", "items": {"type": "boolean"}},
    {"type": "string", "pattern": "^[a-z]+$"},
    {"type": "object", "properties": {}, "additionalProperties": True},
])
def test_length_bound_refuses_unbounded_schemas(schema: dict):
    with pytest.raises(ValueError):
        max_output_chars(schema)


def test_llama_cpp_gaps_name_what_it_would_not_enforce():
    gaps = llama_cpp_gaps({"type": "object", "properties": {
        "a": {"type": "string", "pattern": "^\\d{3}$"},
        "b": {"type": "number", "minimum": 0},
        "c": {"type": "string", "format": "email"},
        "d": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}})
    assert len(gaps) == 4
    assert any("\\d" in g for g in gaps) and any("email" in g for g in gaps)


def test_validity_summary_and_tables():
    case = CASES[0]
    body = chat_body(case, "m", 100)
    assert body["response_format"]["json_schema"]["schema"] == case.schema
    results = [CaseResult("a", True, True, None, "stop", 10, 20, 0.5, "{}"),
               CaseResult("b", False, False, "not JSON", "length", 30, 20, 1.5, "{")]
    summary = summarize(results, None)
    assert (summary["valid"], summary["parsed"], summary["length_cut"]) == (1, 1, 1)
    assert summary["mean_latency_ms"] == pytest.approx(1000)
    assert summary["tokens_per_s"] == pytest.approx(20)
    table = validity_table({"tokenmill": summary})
    assert "1/2 (50%)" in table
    assert "INVALID, 30 tok" in per_schema_table({"tokenmill": summary})


def _small_set(tmp_path: Path) -> Path:
    """The set's shortest case alone, so an end-to-end run stays small."""
    path = tmp_path / "schemas.json"
    keep = [c for c in CASES if c.name == "sentiment"]
    path.write_text(json.dumps({"schemas": [
        {"name": c.name, "shapes": list(c.shapes), "prompt": c.prompt, "schema": c.schema}
        for c in keep]}))
    return path


@pytest.mark.slow
def test_bench_structured_overhead_end_to_end(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "structured.json"
    args = build_parser().parse_args([
        "bench", "structured", "--skip-validity", "--schemas", str(_small_set(tmp_path)),
        "--batch-sizes", "1,2", "--rounds", "2", "--batch1-requests", "1", "--max-tokens", "32",
        "--max-model-len", "512", "--num-kv-blocks", "64", "--result-file", str(out)])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["num_schemas"] == 1 and "validity" not in result
    b1, b2 = result["overhead"]["batches"]
    assert (b1["batch_size"], b1["requests"], b2["batch_size"], b2["requests"]) == (1, 1, 2, 2)
    for b in (b1, b2):
        # The unconstrained runs produce exactly the constrained runs' lengths, every round.
        assert b["length_mismatches"] == 0
        assert b["constrained"]["output_tokens"] == [sum(b["output_lengths"])] * 2
        assert b["unconstrained"]["output_tokens"] == b["constrained"]["output_tokens"]
        assert len(b["overhead_paired_pct"]) == 2
        # The grammar held: every constrained output parsed and validated, and ended by itself.
        assert b["valid"] == b["requests"] and set(b["finish_reasons"]) == {"stop"}
    assert "| 2 | 2 |" in capsys.readouterr().out
