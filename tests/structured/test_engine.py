"""Structured outputs through the whole engine on the embedded SmolLM2: every kind of
constraint yields matching text, also with n > 1, beside free requests, under preemption, with
prefix caching and with speculative decoding."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tokenmill.engine.llm import LLM
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.structured.compiler import GrammarError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
QUEUES = ["billing", "technical support", "sales", "other"]
YES_NO = 'root ::= ("yes" | "no") "." '

PROMPTS = [
    "Describe a person as JSON.",
    "Write a phone number.",
    "Which queue handles 'my invoice is wrong'?",
    "Is the sky blue? Answer yes or no.",
    "Give me a JSON object about a city.",
    "Tell me a short story about a dragon.",
]


def params(kind: str, **kw) -> SamplingParams:
    spec = {
        "json": StructuredOutputsParams(json=PERSON),
        "regex": StructuredOutputsParams(regex=PHONE),
        "choice": StructuredOutputsParams(choice=QUEUES),
        "grammar": StructuredOutputsParams(grammar=YES_NO),
        "json_object": StructuredOutputsParams(json_object=True),
        "free": None,
    }[kind]
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 64)
    return SamplingParams(structured_outputs=spec, **kw)


KINDS = ["json", "regex", "choice", "grammar", "json_object", "free"]


def check(kind: str, text: str) -> None:
    """The text matches the kind's constraint."""
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "json_object":
        # A small model may write an object that goes on past max_tokens: check the shape.
        assert text.startswith("{")
    elif kind == "regex":
        assert re.fullmatch(PHONE, text), text
    elif kind == "choice":
        assert text in QUEUES
    elif kind == "grammar":
        assert text in ("yes.", "no.")


@pytest.fixture(scope="module")
def det() -> LLM:
    # Batch-invariant greedy decoding: equal outputs in any batch, so runs can be compared.
    return LLM(deterministic=True, max_model_len=1024, kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="module")
def llm(det: LLM) -> LLM:
    return det


def run(llm: LLM, kinds: list[str], **kw) -> list:
    outs = llm.generate(PROMPTS[:len(kinds)], [params(k, **kw) for k in kinds])
    return [o.outputs for o in outs]


def test_every_kind_matches_and_ends_with_stop(llm: LLM) -> None:
    for kind, outputs in zip(KINDS, run(llm, KINDS), strict=True):
        out = outputs[0]
        check(kind, out.text)
        if kind != "free":
            assert out.finish_reason == "stop", (kind, out.text)


def test_sampled_n_gt_1_each_sample_matches(llm: LLM) -> None:
    for kind in ("json", "choice"):
        outs = llm.generate(PROMPTS[0], params(kind, temperature=1.0, seed=7, n=3))[0].outputs
        assert len(outs) == 3
        for out in outs:
            check(kind, out.text)
            assert out.finish_reason == "stop"


def test_grammar_ends_the_request_even_with_ignore_eos(llm: LLM) -> None:
    out = llm.generate(PROMPTS[2], params("choice", ignore_eos=True))[0].outputs[0]
    check("choice", out.text)
    assert out.finish_reason == "stop"


def test_max_tokens_cuts_a_constrained_output(llm: LLM) -> None:
    out = llm.generate(PROMPTS[0], params("json", max_tokens=3))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.text.startswith("{")


def test_a_constraint_does_not_change_its_batch_mates(det: LLM) -> None:
    alone = run(det, ["free"])[0][0]
    together = run(det, ["free", "json", "regex", "choice"])
    assert together[0][0].token_ids == alone.token_ids


def test_preemption_keeps_the_grammar_state(det: LLM) -> None:
    kinds = ["json", "regex", "choice", "json"]
    expected = [o[0].token_ids for o in run(det, kinds)]
    # 6 blocks of 16 tokens hold about two of the four requests at once.
    small = LLM(deterministic=True, max_model_len=128, num_kv_blocks=6,
                max_num_batched_tokens=64)
    got = run(small, kinds)
    assert small.engine.core.scheduler.num_preemptions_total > 0
    assert [o[0].token_ids for o in got] == expected
    for kind, outputs in zip(kinds, got, strict=True):
        check(kind, outputs[0].text)


def test_speculative_decoding_gives_the_same_constrained_text(det: LLM) -> None:
    kinds = ["json", "regex", "choice", "json_object"]
    expected = [o[0].token_ids for o in run(det, kinds)]
    spec = LLM(deterministic=True, max_model_len=1024, kv_cache_memory_bytes=64 << 20,
               speculative="ngram", num_speculative_tokens=4)
    # The prompts repeat the output's shape, so n-gram drafts are proposed (and some refused).
    got = run(spec, kinds)
    assert spec.engine.stats().spec_decoding.num_draft_tokens > 0
    assert [o[0].token_ids for o in got] == expected


def test_prefix_cache_hits_do_not_change_the_output(det: LLM) -> None:
    # Longer than two KV blocks, so that the second run finds whole blocks cached.
    prompt = "You are a careful assistant that answers in JSON. " * 4 + PROMPTS[0]
    first = det.generate(prompt, params("json"))[0].outputs[0]
    hits_before = det.engine.stats().prefix_cache_hits_total
    again = det.generate(prompt, params("json"))[0].outputs[0]
    assert det.engine.stats().prefix_cache_hits_total > hits_before
    assert again.token_ids == first.token_ids


def test_bad_constraints_are_refused_and_the_engine_goes_on(llm: LLM) -> None:
    bad = [
        (StructuredOutputsParams(regex="(ab"), "regex"),
        (StructuredOutputsParams(json={"type": "objec"}), "json"),
        (StructuredOutputsParams(json="{not json"), "not valid JSON"),
        (StructuredOutputsParams(grammar="root ::= "), "grammar"),
    ]
    for spec, words in bad:
        with pytest.raises(GrammarError, match=re.escape(words)):
            llm.generate("Hi", SamplingParams(max_tokens=4, structured_outputs=spec))
    assert not llm.engine.has_unfinished_requests()
    check("regex", llm.generate(PROMPTS[1], params("regex"))[0].outputs[0].text)


def test_constraint_shapes_are_checked_on_construction() -> None:
    for fields in ({}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"choice": ["a", ""]},
                   {"json": 3}, {"regex": ""}):
        with pytest.raises(ValueError, match="structured_outputs"):
            StructuredOutputsParams(**fields)
