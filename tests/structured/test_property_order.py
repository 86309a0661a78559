"""Structured outputs keep a JSON schema's property order ("reason first, then answer"), and a
``$ref`` to another document is refused by name instead of being read as "anything"."""

from __future__ import annotations

import json

import pytest

from tokenmill.model_loader.gguf import embedded_model_path, load_gguf
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.compiler import GrammarCompiler, GrammarError
from tokenmill.structured.matcher import GrammarState

VOCAB = 49152
REASON_FIRST = {"type": "object",
                "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
                "required": ["reasoning", "answer"], "additionalProperties": False}
ANSWER_FIRST = {**REASON_FIRST, "properties": {"answer": {"type": "integer"},
                                               "reasoning": {"type": "string"}}}


@pytest.fixture(scope="module")
def tokenizer():
    return load_gguf(embedded_model_path()).tokenizer


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB)


def matches(compiler: GrammarCompiler, tokenizer, schema: dict, text: str) -> bool:
    """Whether the schema's grammar takes every token of ``text``."""
    state = GrammarState(compiler.compile(StructuredOutputsParams(json=schema)))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return state.accept(ids) == len(ids)


def test_the_source_keeps_the_schemas_order() -> None:
    source = json.loads(StructuredOutputsParams(json=REASON_FIRST).source)
    assert list(source) == ["type", "properties", "required", "additionalProperties"]
    assert list(source["properties"]) == ["reasoning", "answer"]


def test_properties_come_out_in_the_schemas_order(compiler: GrammarCompiler, tokenizer) -> None:
    reason_first = '{"reasoning": "2+3", "answer": 5}'
    answer_first = '{"answer": 5, "reasoning": "2+3"}'
    assert matches(compiler, tokenizer, REASON_FIRST, reason_first)
    assert not matches(compiler, tokenizer, REASON_FIRST, answer_first)
    # The same schema in the other order is another grammar, not the cached one.
    assert matches(compiler, tokenizer, ANSWER_FIRST, answer_first)
    assert not matches(compiler, tokenizer, ANSWER_FIRST, reason_first)
    # And the first one is still served as it was.
    assert matches(compiler, tokenizer, REASON_FIRST, reason_first)


@pytest.mark.parametrize("ref", ["https://example.com/schemas/city.json", "file:///etc/passwd",
                                 "city.json#/properties/name", "#city"])
def test_a_ref_outside_the_schema_is_refused_by_name(compiler: GrammarCompiler,
                                                    ref: str) -> None:
    schema = {"type": "object", "properties": {"city": {"$ref": ref}}, "required": ["city"]}
    with pytest.raises(GrammarError, match=r"structured_outputs\.json\.properties\.city\.\$ref"
                                           ".*" + json.dumps(ref)[1:-1].replace(".", r"\.")):
        compiler.compile(StructuredOutputsParams(json=schema))


def test_refs_inside_the_schema_still_compile(compiler: GrammarCompiler, tokenizer) -> None:
    schema = {"type": "object", "$defs": {"city": {"type": "string", "maxLength": 10}},
              "properties": {"city": {"$ref": "#/$defs/city"}}, "required": ["city"],
              # "$ref" as a property's name and inside a default are data, not references
              "additionalProperties": False}
    assert matches(compiler, tokenizer, schema, '{"city": "Paris"}')
    data = {"type": "object", "properties": {"$ref": {"type": "string",
                                                      "default": {"$ref": "http://x"}}}}
    compiler.compile(StructuredOutputsParams(json=data))


def test_a_property_named_like_a_data_keyword_is_still_checked(compiler) -> None:
    schema = {"type": "object", "properties": {"default": {"type": "string",
                                                           "maxLength": 10**9}}}
    with pytest.raises(GrammarError, match=r"properties\.default\.maxLength"):
        compiler.compile(StructuredOutputsParams(json=schema))
